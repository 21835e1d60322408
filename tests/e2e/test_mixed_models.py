"""Models people train, compiled with forge, against the same model trained eagerly by torch.optim.

Each model is a tiny random-weight config built locally (no downloads), trained in fp32
for ``STEPS`` steps by ``torch.compile(train_step, backend="forge")`` with
``forge_compile.optim.AdamW`` and, from the same weights on the same batches, by eager
``torch.optim.AdamW``. Besides the weights, each test checks explain's table: every
trained, untied matmul weight fused, and every other weight rejected for its own reason.

Hugging Face Llama, Qwen3 and GPT-2 (tied embeddings, also through its own ``labels=``
loss, which graph-breaks) and ViT come from transformers; LoRA from peft over a frozen
Llama; the MLP-Mixer is written here as timm's MixerBlock is, so that CPU CI covers it
without timm; timm's own ViT and Mixer run where timm imports (it needs torchvision).
"""

import collections

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_matches_torch_optim, twin
from torch import nn

import forge_compile

transformers = pytest.importorskip("transformers")

STEPS = 3
LR = 1e-2


def _train_step(model, optimizer, loss_fn):
    def train_step(*batch):
        loss = loss_fn(model, *batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return train_step


def _train_against_torch_optim(model, loss_fn, batches):
    """forge on ``model``, torch.optim on a copy; the weights compared; explain's report of step 1."""
    reference = twin(model)
    # All parameters, frozen ones too, as users pass them: both optimizers skip those without a gradient.
    opt = forge_compile.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    step = torch.compile(_train_step(model, opt, loss_fn), backend="forge")
    reference_step = _train_step(reference, reference_opt, loss_fn)
    report = forge_compile.explain(step, *batches[0])
    reference_step(*batches[0])
    for batch in batches[1:]:
        torch.testing.assert_close(step(*batch), reference_step(*batch), rtol=1e-5, atol=1e-5)
    assert_matches_torch_optim(model, reference, lr=LR, steps=len(batches))
    return report


def _matmul_weights(model):
    """Names (as explain gives them) of the trained weights of nn.Linear and transformers' Conv1D
    (GPT-2's linear layers, weight stored transposed), except weights tied to another module."""
    from transformers.pytorch_utils import Conv1D

    owners = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return {
        f"model.{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, Conv1D)) and module.weight.requires_grad and owners[id(module.weight)] == 1
    }


def _token_batches(vocab, batch=2, length=12):
    return [(torch.randint(0, vocab, (batch, length)),) for _ in range(STEPS)]


def _image_batches(size, classes, batch=2):
    return [(torch.randn(batch, 3, size, size), torch.randint(0, classes, (batch,))) for _ in range(STEPS)]


def _causal_lm_loss(model, input_ids):
    # The shifted cross-entropy HF's labels= computes, outside the model (see the GPT-2 labels= test for why).
    logits = model(input_ids=input_ids).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())


def _hf_labels_loss(model, input_ids):
    return model(input_ids=input_ids, labels=input_ids).loss


def _classification_loss(model, images, labels):
    out = model(images)
    return F.cross_entropy(getattr(out, "logits", out), labels)


def _matrix_rejections(report):
    return {d.name: d for d in report.rejected if len(d.shape) == 2}


def _llama_config(**overrides):
    return transformers.LlamaConfig(**{**dict(vocab_size=96, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                              tie_word_embeddings=False), **overrides})  # fmt: skip


def _assert_decoder_report(report, model):
    # q/k/v/o, gate/up/down and the untied lm_head fuse; the embedding's gradient is a scatter.
    assert {d.name for d in report.fused} == _matmul_weights(model) and len(report.fused) == 8
    assert len(report.graphs) == 1, report.graph_breaks
    rejected = _matrix_rejections(report)
    assert set(rejected) == {"model.model.embed_tokens.weight"}
    assert rejected["model.model.embed_tokens.weight"].code == "not_a_matmul"
    assert "embedding" in rejected["model.model.embed_tokens.weight"].reason


def test_hf_llama_matches_torch_optim():
    model = transformers.LlamaForCausalLM(_llama_config())
    report = _train_against_torch_optim(model, _hf_labels_loss, _token_batches(96))
    _assert_decoder_report(report, model)


def test_hf_qwen3_matches_torch_optim():
    # Qwen3 adds RMSNorms on q and k per head (1-D weights, left to Inductor).
    cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(cfg)
    report = _train_against_torch_optim(model, _hf_labels_loss, _token_batches(96))
    _assert_decoder_report(report, model)
    assert {"model.model.layers.0.self_attn.q_norm.weight", "model.model.layers.0.self_attn.k_norm.weight"} <= {
        d.name for d in report.rejected if d.code == "not_a_matrix"
    }


def _gpt2(**overrides):
    # Dropout off: the two runs would draw different masks.
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=4, n_positions=16,
                                  tie_word_embeddings=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  **overrides)  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def test_hf_gpt2_tied_embeddings_match_torch_optim():
    model = _gpt2()
    report = _train_against_torch_optim(model, _causal_lm_loss, _token_batches(96))
    # c_attn, c_proj, c_fc, mlp.c_proj: Conv1D computes x @ W, and its dW = x^T dY fuses like a Linear's.
    assert {d.name for d in report.fused} == _matmul_weights(model) and len(report.fused) == 4
    assert len(report.graphs) == 1, report.graph_breaks
    rejected = _matrix_rejections(report)
    assert set(rejected) == {"model.transformer.wte.weight", "model.transformer.wpe.weight"}
    tied = rejected["model.transformer.wte.weight"]
    # The tied weight's gradient is the lm_head matmul's plus the embedding's scatter.
    assert tied.code == "summed_gradient" and "tied or shared weights" in tied.reason and "2 ops" in tied.reason
    assert "aten.mm" in tied.reason
    assert rejected["model.transformer.wpe.weight"].code == "not_a_matmul"
    assert not any("lm_head" in d.name for d in report.decisions)  # one parameter, one decision


def test_hf_gpt2_labels_loss_graph_break_still_trains_right():
    # GPT2LMHeadModel(labels=...) calls transformers' logger.warning_once in its loss (loss_type is not
    # set): Dynamo graph-breaks there, and loss.backward() resumes in a frame that has seen no
    # parameter. Dynamo's in-graph backward then used to drop the backward silently (no weight moved);
    # forge's guard makes it run eagerly, so nothing fuses and every update is still right.
    model = _gpt2()
    report = _train_against_torch_optim(model, _hf_labels_loss, _token_batches(96))
    assert report.graph_breaks
    assert not report.fused
    # The step's graph reaches the weights through the optimizer (names like optimizer.param_groups.0.params.6).
    matrices = [d for d in report.rejected if len(d.shape) == 2]
    assert len(matrices) == sum(p.dim() == 2 for p in model.parameters()) == 6, matrices
    assert all(d.code == "gradient_from_outside" for d in matrices), matrices
    assert any("graph break in the forward" in note for note in report.notes), (report.notes, report.graph_breaks)


def test_hf_vit_matches_torch_optim():
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=1,
                                 num_attention_heads=4, intermediate_size=64, num_labels=5)  # fmt: skip
    model = transformers.ViTForImageClassification(cfg)
    report = _train_against_torch_optim(model, _classification_loss, _image_batches(16, 5))
    # q, k, v, o, fc1, fc2 and the classifier; the patch embedding is a convolution (a 4-D weight).
    assert {d.name for d in report.fused} == _matmul_weights(model) and len(report.fused) == 7
    assert len(report.graphs) == 1, report.graph_breaks
    assert not _matrix_rejections(report)
    patch = [d for d in report.rejected if d.name.endswith("patch_embeddings.projection.weight")]
    assert len(patch) == 1 and patch[0].code == "not_a_matrix"


class MixerBlock(nn.Module):
    """timm's MixerBlock (token-mixing MLP over the transposed tokens, then a channel MLP)."""

    def __init__(self, dim, tokens, token_hidden, channel_hidden):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp_tokens = nn.Sequential(nn.Linear(tokens, token_hidden), nn.GELU(), nn.Linear(token_hidden, tokens))
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp_channels = nn.Sequential(nn.Linear(dim, channel_hidden), nn.GELU(), nn.Linear(channel_hidden, dim))

    def forward(self, x):
        x = x + self.mlp_tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.mlp_channels(self.norm2(x))


class MLPMixer(nn.Module):
    """MLP-Mixer (arXiv 2105.01601) with the paper's per-patch fully-connected stem."""

    def __init__(self, image=16, patch=4, dim=32, blocks=1, classes=5):
        super().__init__()
        self.patch = patch
        tokens = (image // patch) ** 2
        self.stem = nn.Linear(3 * patch * patch, dim)
        self.blocks = nn.Sequential(*[MixerBlock(dim, tokens, dim // 2, 4 * dim) for _ in range(blocks)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, classes)

    def forward(self, images):
        p = self.patch
        patches = F.unfold(images, kernel_size=p, stride=p).transpose(1, 2)  # (batch, tokens, 3 * p * p)
        x = self.blocks(self.stem(patches))
        return self.head(self.norm(x).mean(dim=1))


def test_mlp_mixer_matches_torch_optim():
    model = MLPMixer()
    report = _train_against_torch_optim(model, _classification_loss, _image_batches(16, 5))
    # The token MLP's input is a transposed view: its dW = dY^T X still reaches forge as one matmul.
    assert {d.name for d in report.fused} == _matmul_weights(model) and len(report.fused) == 6
    assert len(report.graphs) == 1, report.graph_breaks
    assert not _matrix_rejections(report)


def test_peft_lora_on_a_frozen_llama_matches_torch_optim():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(_llama_config())
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    model = peft.get_peft_model(base, lora)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trained = {f"model.{n}" for n, p in model.named_parameters() if p.requires_grad}
    assert len(trained) == 6 and all(".lora_A." in n or ".lora_B." in n for n in trained)

    report = _train_against_torch_optim(model, _hf_labels_loss, _token_batches(96))
    # The frozen base gets no gradient, so the optimizer has no update for it: not even a candidate.
    assert {d.name for d in report.decisions} == trained
    assert {d.name for d in report.fused} == trained == _matmul_weights(model)
    assert len(report.graphs) == 1, report.graph_breaks
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), f"{name}: a frozen weight moved"


def _timm_model(kind):
    pytest.importorskip("timm")  # timm imports torchvision; where that is missing these two skip
    from timm.models.mlp_mixer import MlpMixer
    from timm.models.vision_transformer import VisionTransformer

    if kind == "vit":
        return VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=4, num_classes=5)
    return MlpMixer(img_size=16, patch_size=4, embed_dim=32, num_blocks=1, num_classes=5)


@pytest.mark.parametrize("kind,fused", [("vit", 5), ("mixer", 5)], ids=["timm-vit", "timm-mixer"])
def test_timm_models_match_torch_optim(kind, fused):
    model = _timm_model(kind)
    report = _train_against_torch_optim(model, _classification_loss, _image_batches(16, 5))
    # ViT: qkv, proj, fc1, fc2, head. Mixer: token fc1/fc2, channel fc1/fc2, head. Both stems are convolutions.
    assert {d.name for d in report.fused} == _matmul_weights(model) and len(report.fused) == fused
    assert len(report.graphs) == 1, report.graph_breaks
    assert not _matrix_rejections(report)
