"""Mixed models, fused by forge, train as torch.optim's eager AdamW trains them.

Each model (random weights from a config, nothing downloaded) trains ``STEPS`` steps
three ways on the same batches and starting weights:

* float64 eager with ``torch.optim.AdamW``, the reference;
* fp32 eager with ``torch.optim.AdamW``: the rounding any fp32 run has;
* fp32 ``torch.compile(train_step, backend="forge")`` with ``forge_compile.optim.AdamW``.

Models: Hugging Face Llama, Qwen3, GPT-2 with tied embeddings and ViT (transformers);
timm's ViT and MLP-Mixer; peft LoRA adapters on a frozen Llama. Passes when, for every
model, every trained Linear (or GPT-2 Conv1D) weight that is not tied is fused, in one
graph, the tied and frozen weights are handled as they must be (GPT-2's embedding
rejected as a summed gradient; LoRA's frozen base no optimizer candidate at all), and
forge's weights are as close to the float64 run as fp32 eager's: relative L2 error within
1.5x of eager's, plus fp32's machine epsilon (1.2e-7), over the elements whose float64
gradient is not zero (attention's key bias has none; there Adam steps on rounding noise in
any fp32 run; the error over all weights is reported beside it).

    PYTHONPATH=. python benchmarks/mixed_models_check.py                         # on the GPU
    PYTHONPATH=. python benchmarks/mixed_models_check.py --tiny --device cpu     # a smoke run (timm may skip)
"""

from __future__ import annotations

import argparse
import collections
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.utils import write_result  # noqa: E402

STEPS = 6
SETTINGS = dict(lr=1e-3, weight_decay=0.1)
MODELS = ["llama", "qwen3", "gpt2-tied", "hf-vit", "timm-vit", "timm-mixer", "peft-lora-llama"]


class Skip(Exception):
    """The model's library is not importable here (timm needs torchvision)."""


def _llama_config(tiny: bool):
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)  # fmt: skip
    return LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                       tie_word_embeddings=False)  # fmt: skip


def _build(name: str, tiny: bool):
    """(model, kind, vocab or classes): ``kind`` picks the batches and the loss."""
    import transformers

    if name == "llama":
        cfg = _llama_config(tiny)
        return transformers.LlamaForCausalLM(cfg), "lm-labels", cfg.vocab_size
    if name == "qwen3":
        dims = (dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16) if tiny else
                dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=256))
        cfg = transformers.Qwen3Config(tie_word_embeddings=False, **dims)  # fmt: skip
        return transformers.Qwen3ForCausalLM(cfg), "lm-labels", cfg.vocab_size
    if name == "gpt2-tied":
        dims = (dict(vocab_size=256, n_embd=32, n_layer=1, n_head=2, n_positions=64) if tiny else
                dict(vocab_size=4096, n_embd=512, n_layer=2, n_head=8, n_positions=256))  # fmt: skip
        # Dropout off: the three runs would draw different masks.
        cfg = transformers.GPT2Config(tie_word_embeddings=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **dims)
        # Loss outside the model: GPT2LMHeadModel(labels=...) graph-breaks on a transformers warning_once.
        return transformers.GPT2LMHeadModel(cfg), "lm-logits", cfg.vocab_size
    if name == "hf-vit":
        dims = (dict(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64) if tiny else
                dict(image_size=64, patch_size=8, hidden_size=384, num_hidden_layers=2, num_attention_heads=6,
                     intermediate_size=1536))  # fmt: skip
        return transformers.ViTForImageClassification(transformers.ViTConfig(num_labels=10, **dims)), "image", 10
    if name in ("timm-vit", "timm-mixer"):
        try:
            from timm.models.mlp_mixer import MlpMixer
            from timm.models.vision_transformer import VisionTransformer
        except ImportError as error:
            raise Skip(f"timm not importable: {error}") from error
        if name == "timm-vit":  # ViT-Tiny's width and heads, 2 blocks
            dims = dict(embed_dim=32, depth=1, num_heads=2) if tiny else dict(embed_dim=192, depth=2, num_heads=3)
            return VisionTransformer(img_size=_image_size(tiny), patch_size=_patch(tiny), num_classes=10, **dims), \
                "image", 10  # fmt: skip
        dims = dict(embed_dim=32, num_blocks=1) if tiny else dict(embed_dim=512, num_blocks=2)  # Mixer-S width
        return MlpMixer(img_size=_image_size(tiny), patch_size=_patch(tiny), num_classes=10, **dims), "image", 10
    if name == "peft-lora-llama":
        try:
            import peft
        except ImportError as error:
            raise Skip(f"peft not importable: {error}") from error
        cfg = _llama_config(tiny)
        lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])  # fmt: skip
        return peft.get_peft_model(transformers.LlamaForCausalLM(cfg), lora), "lm-labels", cfg.vocab_size
    raise ValueError(name)


def _image_size(tiny: bool) -> int:
    return 16 if tiny else 64


def _patch(tiny: bool) -> int:
    return 4 if tiny else 8


def _batches(kind: str, size: int, tiny: bool, device: str):
    generator = torch.Generator().manual_seed(1)
    if kind.startswith("lm"):
        shape = (2, 16) if tiny else (4, 128)
        return [(torch.randint(0, size, shape, generator=generator).to(device),) for _ in range(STEPS)]
    n, side = (2, 16) if tiny else (8, 64)
    return [(torch.randn(n, 3, side, side, generator=generator).to(device),
             torch.randint(0, size, (n,), generator=generator).to(device)) for _ in range(STEPS)]  # fmt: skip


def _loss(kind: str, model, *batch):
    if kind == "lm-labels":
        return model(input_ids=batch[0], labels=batch[0]).loss
    if kind == "lm-logits":
        logits = model(input_ids=batch[0]).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[0][:, 1:].flatten())
    out = model(batch[0])
    return F.cross_entropy(getattr(out, "logits", out), batch[1])


def _train(model, optimizer, kind, batches, dtype, compile_with=None, gradient_max=None):
    import forge_compile

    def train_step(*batch):
        loss = _loss(kind, model, *batch)
        loss.backward()
        if gradient_max is not None:  # eager only: the largest |gradient| each element saw
            for n, p in model.named_parameters():
                if p.grad is not None:
                    gradient_max[n] = torch.maximum(gradient_max.get(n, torch.zeros_like(p)), p.grad.abs())
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    batches = [tuple(t.to(dtype) if t.is_floating_point() else t for t in b) for b in batches]
    step = torch.compile(train_step, backend=compile_with) if compile_with else train_step
    report = forge_compile.explain(step, *batches[0]) if compile_with == "forge" else step(*batches[0])
    losses = [step(*batch).item() for batch in batches[1:]]
    return report, losses


def _matmul_weights(model) -> list[str]:
    """The trained weights of nn.Linear and transformers' Conv1D, tied ones excluded, named as explain names them."""
    from transformers.pytorch_utils import Conv1D

    owners = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return sorted(f"model.{n}.weight" for n, m in model.named_modules()
                  if isinstance(m, (torch.nn.Linear, Conv1D)) and m.weight.requires_grad
                  and owners[id(m.weight)] == 1)  # fmt: skip


def check_model(name: str, tiny: bool, device: str) -> dict:
    import forge_compile

    torch.manual_seed(0)
    initial, kind, size = _build(name, tiny)
    initial.train()
    batches = _batches(kind, size, tiny, device)
    weights, losses, trained, gradient_max = {}, {}, None, {}
    started = time.perf_counter()
    for mode, dtype in (("eager-fp64", torch.float64), ("eager-fp32", torch.float32), ("forge", torch.float32)):
        torch._dynamo.reset()
        model = copy.deepcopy(initial).to(device=device, dtype=dtype)  # deepcopy keeps GPT-2's tie
        if mode == "forge":
            optimizer = forge_compile.optim.AdamW(model.parameters(), **SETTINGS)
            report, losses[mode] = _train(model, optimizer, kind, batches, dtype, compile_with="forge")
            trained = model
        else:
            optimizer = torch.optim.AdamW(model.parameters(), **SETTINGS)
            _, losses[mode] = _train(model, optimizer, kind, batches, dtype,
                                     gradient_max=gradient_max if mode == "eager-fp64" else None)  # fmt: skip
        weights[mode] = {n: p.detach().double() for n, p in model.named_parameters()}
    reference = weights["eager-fp64"]
    norm = sum(r.square().sum() for r in reference.values()).sqrt()

    # Elements whose float64 gradient was zero up to float64 rounding at every step: attention's key
    # bias (softmax ignores a shift shared by all keys; HF ViT's k_proj.bias, the key third of GPT-2's
    # c_attn.bias and timm's qkv.bias). Adam turns any fp32 run's rounding noise there into lr-sized
    # steps, so they measure noise, not the update; the check leaves them out (all_weights keeps them).
    largest = max(g.max() for g in gradient_max.values())
    carries = {n: gradient_max[n] > 1e-12 * largest if n in gradient_max else torch.zeros_like(r, dtype=torch.bool)
               for n, r in reference.items()}  # fmt: skip

    def relative(mode, masks=None):
        diff = [(weights[mode][n] - r) * (masks[n] if masks else 1) for n, r in reference.items()]
        scale = norm if masks is None else sum((r * masks[n]).square().sum() for n, r in reference.items()).sqrt()
        return (sum(d.square().sum() for d in diff).sqrt() / scale).item(), max(d.abs().max().item() for d in diff)

    def error(mode):
        (rel, max_abs), (rel_all, max_abs_all) = relative(mode, carries), relative(mode)
        return {"relative_l2": rel, "max_abs": max_abs, "all_weights": {"relative_l2": rel_all, "max_abs": max_abs_all}}

    linear = _matmul_weights(trained)
    errors = {mode: error(mode) for mode in ("eager-fp32", "forge")}
    fused = sorted(d.name for d in report.fused)
    checks = {
        "every_trained_untied_linear_weight_fused": fused == linear,
        "one_graph": len(report.graphs) == 1,
        "forge_as_close_to_float64_as_eager_fp32": errors["forge"]["relative_l2"]
        <= 1.5 * errors["eager-fp32"]["relative_l2"] + torch.finfo(torch.float32).eps,
    }
    if name == "gpt2-tied":
        tied = [d for d in report.decisions if d.name == "model.transformer.wte.weight"]
        one_decision = not any("lm_head" in d.name for d in report.decisions)  # lm_head is the same Parameter
        checks["tied_embedding_rejected_as_summed_gradient"] = (
            len(tied) == 1 and tied[0].code == "summed_gradient" and one_decision
        )
    if name == "peft-lora-llama":
        frozen = {n for n, p in trained.named_parameters() if not p.requires_grad}
        candidates = {d.name.removeprefix("model.") for d in report.decisions}
        checks["frozen_base_not_a_candidate"] = not candidates & frozen
        checks["frozen_base_unchanged"] = all(torch.equal(weights["forge"][n], reference[n]) for n in frozen)
    vectors = [d for d in report.rejected if d.code == "not_a_matrix"]
    return {
        "model": name,
        "parameters": sum(p.numel() for p in trained.parameters()),
        "trainable_parameters": sum(p.numel() for p in trained.parameters() if p.requires_grad),
        "linear_weights": len(linear),
        "fused": len(fused),
        "fused_weights": fused,
        "rejected": {d.name: f"{d.code}: {d.reason}" for d in report.rejected if d.code != "not_a_matrix"},
        "rejected_non_matrix": len(vectors),
        "zero_gradient_elements_left_out": sum(int((~c).sum()) for c in carries.values()),
        "graph_breaks": report.graph_breaks,
        "gradient_bytes_eliminated": report.gradient_bytes_eliminated,
        "weight_error_vs_float64": errors,
        "losses": losses,
        "seconds": round(time.perf_counter() - started, 1),
        "checks": checks,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny configs, for a smoke run")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=MODELS)
    args = parser.parse_args()
    results, skipped = {}, {}
    for name in args.models:
        try:
            results[name] = r = check_model(name, args.tiny, args.device)
        except Skip as why:
            skipped[name] = str(why)
            print(f"{name:>16}: skipped ({why})", flush=True)
            continue
        e = r["weight_error_vs_float64"]
        status = "PASS" if all(r["checks"].values()) else "FAIL " + ",".join(k for k, v in r["checks"].items() if not v)
        print(f"{name:>16}: fused {r['fused']}/{r['linear_weights']}  |w - w64|/|w64|: eager fp32 "
              f"{e['eager-fp32']['relative_l2']:.2e}  forge {e['forge']['relative_l2']:.2e}  (all weights: "
              f"{e['eager-fp32']['all_weights']['relative_l2']:.2e} / {e['forge']['all_weights']['relative_l2']:.2e})  "
              f"({r['seconds']} s)  {status}", flush=True)  # fmt: skip
        for weight, reason in r["rejected"].items():
            print(f"{'':>18}not fused: {weight}: {reason}", flush=True)
    # A full run must cover every model; the smoke run may lack timm (it needs torchvision).
    passed = bool(results) and all(all(r["checks"].values()) for r in results.values()) and (args.tiny or not skipped)
    name = "mixed_models_check" if not args.tiny else "mixed_models_check_tiny_" + args.device.split(":")[0]
    write_result(name, {"passed": passed, "steps": STEPS, "optimizer": "AdamW", "settings": SETTINGS,
                        "models": results, "skipped": skipped})  # fmt: skip
    print("passed" if passed else "FAILED", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
