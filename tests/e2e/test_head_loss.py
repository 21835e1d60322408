"""The head and its cross-entropy in vocabulary chunks (forge_compile/head_loss.py).

The op is checked against ``F.cross_entropy(F.linear(...).float())`` and autograd; the
compiled step against torch.optim in eager, with its code checked for the buffers the
chunking exists to avoid: ``[tokens, vocabulary]`` logits or gradients, and the head
weight's gradient.
"""

import re

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    assert_matches_torch_optim,
    causal_lm_step,
    max_param_error,
    needs_triton,
    sgd_at_lr_1_side_by_side,
    twin,
)
from torch import nn
from torch._inductor.utils import run_and_get_code

import forge_compile
from forge_compile.config import config

VOCAB, WIDTH, TOKENS = 600, 48, 40
# 3 chunks of 256 columns, the last one short: what a chunk boundary can break is covered.
CHUNK = 256


@pytest.fixture
def chunks_of_256(monkeypatch):
    monkeypatch.setattr(config, "head_chunk_columns", CHUNK)


def _reference_loss(hidden, weight, labels, ignore_index, reduction):
    return F.cross_entropy(F.linear(hidden, weight).float().view(-1, weight.shape[0]), labels.view(-1),
                           ignore_index=ignore_index, reduction=reduction)  # fmt: skip


# The chunk's point-wise work as torch ops, or as forge's one-pass Triton kernels
# (kernels/head_loss.py: no tl.dot, so bf16 runs right under the interpreter too).
KERNELS = ["torch", pytest.param("triton", marks=needs_triton)]


@pytest.fixture(params=KERNELS)
def chunk_kernels(request, monkeypatch):
    """The device the chunk kernels run on: Triton's on a GPU where there is one."""
    monkeypatch.setattr(config, "kernel", request.param)
    return "cuda" if request.param == "triton" and torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_loss_and_its_gradients_are_cross_entropys(reduction, dtype, chunks_of_256, chunk_kernels):
    device = chunk_kernels
    hidden = torch.randn(2, TOKENS // 2, WIDTH, dtype=dtype, device=device, requires_grad=True)
    weight = (torch.randn(VOCAB, WIDTH, device=device) / WIDTH**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (TOKENS,), device=device)
    labels[[0, 7, 31]] = -100
    labels[1], labels[2] = CHUNK - 1, CHUNK  # either side of a boundary
    loss, _ = torch.ops.forge.linear_cross_entropy(hidden, weight, labels, -100, reduction)
    expected = _reference_loss(hidden, weight, labels, -100, reduction)
    grads = torch.autograd.grad(loss * 3.0, [hidden, weight])
    expected_grads = torch.autograd.grad(expected * 3.0, [hidden, weight])
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for grad, expected_grad in zip(grads, expected_grads):
        _assert_close_to_autograd(grad, expected_grad)


def _assert_close_to_autograd(grad, expected_grad):
    """fp32: rounding only. bf16: the hidden gradient sums the chunks' products in fp32 (on
    the CPU each product rounded to bf16 first), where autograd rounds one whole product;
    the tolerance is a share of the gradient's largest value, so that a wrong term shows."""
    if grad.dtype == torch.float32:
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(grad, expected_grad, rtol=2e-2, atol=1e-2 * expected_grad.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_wider_than_a_kernel_block_are_cross_entropys(dtype, monkeypatch, chunk_kernels):
    """Chunks of 2500 columns: the Triton kernels read each in blocks of 1024, the last one
    short, with labels either side of each block boundary and of the chunk boundary."""
    vocabulary, device = 5000, chunk_kernels
    monkeypatch.setattr(config, "head_chunk_columns", 2500)
    hidden = torch.randn(TOKENS, WIDTH, dtype=dtype, device=device, requires_grad=True)
    weight = (torch.randn(vocabulary, WIDTH, device=device) / WIDTH**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocabulary, (TOKENS,), device=device)
    labels[:10] = torch.tensor([1023, 1024, 2047, 2048, 2499, 2500, 3523, 3524, 4999, 0])
    loss, _ = torch.ops.forge.linear_cross_entropy(hidden, weight, labels, -100, "mean")
    expected = _reference_loss(hidden, weight, labels, -100, "mean")
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for grad, expected_grad in zip(torch.autograd.grad(loss, [hidden, weight]),
                                   torch.autograd.grad(expected, [hidden, weight])):  # fmt: skip
        _assert_close_to_autograd(grad, expected_grad)


def test_a_chunk_of_minus_infinite_logits_adds_nothing(chunks_of_256, chunk_kernels):
    """Rows whose logits are -inf over a whole chunk (here the first): the chunk adds no
    exponential, and the loss is cross-entropy's over the other chunks."""
    hidden = torch.ones(4, WIDTH, device=chunk_kernels)
    weight = torch.randn(VOCAB, WIDTH, device=chunk_kernels).abs()
    weight[:CHUNK] = float("-inf")
    labels = torch.tensor([CHUNK, CHUNK + 7, VOCAB - 1, -100], device=chunk_kernels)
    loss, _ = torch.ops.forge.linear_cross_entropy(hidden, weight, labels, -100, "mean")
    expected = _reference_loss(hidden, weight, labels, -100, "mean")
    assert torch.isfinite(expected)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)


def test_every_label_ignored_gives_torchs_nan(chunk_kernels):
    hidden, weight = torch.randn(4, WIDTH, device=chunk_kernels), torch.randn(VOCAB, WIDTH, device=chunk_kernels)
    labels = torch.full((4,), -100, device=chunk_kernels)
    loss, _ = torch.ops.forge.linear_cross_entropy(hidden, weight, labels, -100, "mean")
    assert torch.isnan(loss) and torch.isnan(_reference_loss(hidden, weight, labels, -100, "mean"))


def test_a_label_outside_the_vocabulary_is_an_error_as_in_torch():
    labels = torch.tensor([0, VOCAB + 3, -100, 5])
    with pytest.raises(RuntimeError, match=f"a label is neither a class in \\[0, {VOCAB}\\) nor ignore_index=-100"):
        torch.ops.forge.linear_cross_entropy(torch.randn(4, WIDTH), torch.randn(VOCAB, WIDTH), labels, -100, "mean")
    with pytest.raises(IndexError):
        _reference_loss(torch.randn(4, WIDTH), torch.randn(VOCAB, WIDTH), labels, -100, "mean")


def test_bad_arguments_say_what_is_expected():
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        torch.ops.forge.linear_cross_entropy(torch.randn(4, WIDTH), torch.randn(VOCAB, WIDTH), torch.zeros(4, dtype=torch.long),
                                             -100, "none")  # fmt: skip
    with pytest.raises(ValueError, match="one label per row"):
        torch.ops.forge.linear_cross_entropy(torch.randn(4, WIDTH), torch.randn(VOCAB, WIDTH), torch.zeros(5, dtype=torch.long),
                                             -100, "mean")  # fmt: skip


class _TinyCausalLM(nn.Module):
    """Embedding, a tanh, an untied head and transformers' causal-LM loss: logits cast to
    fp32, labels padded by one and shifted. ``variant`` makes a loss the chunks do not
    compute: ``"label_smoothing"``, or ``"logits_read"`` (the logits also feed the result)."""

    def __init__(self, variant: str = ""):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.variant = variant

    def forward(self, tokens):
        logits = self.head(torch.tanh(self.embed(tokens))).float()
        labels = F.pad(tokens, (0, 1), value=-100)[:, 1:]
        loss = F.cross_entropy(logits.view(-1, VOCAB), labels.reshape(-1), ignore_index=-100,
                               label_smoothing=0.1 if self.variant == "label_smoothing" else 0.0)  # fmt: skip
        return loss + 1e-3 * logits.amax() if self.variant == "logits_read" else loss


def _vocabulary_buffers(code: str) -> list[tuple[int, ...]]:
    """Shapes of the wrapper's buffers with as many elements as the logits or the head's weight."""
    shapes = []
    for shape in re.findall(r"empty_strided_\w+\(\(([\d, ]+)\),", code):
        sizes = tuple(int(s) for s in shape.split(",") if s.strip())
        if torch.Size(sizes).numel() in (TOKENS * VOCAB, VOCAB * WIDTH):
            shapes.append(sizes)
    return shapes


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "chunk_head_loss-off"])
def test_the_step_updates_the_head_by_chunks_and_stores_no_logits(chunked, chunks_of_256, monkeypatch,
                                                                  no_inductor_cache):  # fmt: skip
    monkeypatch.setattr(config, "chunk_head_loss", chunked)
    model = _TinyCausalLM()
    tokens = torch.randint(0, VOCAB, (1, TOKENS))
    (report, reference), codes = run_and_get_code(sgd_at_lr_1_side_by_side, model, tokens)
    # At lr 1 a weight moves by its whole gradient: a wrong chunk would show far above rounding.
    assert max_param_error(model, reference) < 1e-5
    assert [d.name for d in report.fused] == ["model.head.weight"]
    code = "\n".join(codes)
    assert ("torch.ops.forge.linear_cross_entropy_backward_update_" in code) == chunked
    # Unchunked, the logits (and the gradient Inductor writes over them) are a buffer of
    # [tokens, vocabulary]; chunked, no buffer of that size nor of the weight's is made.
    assert (not _vocabulary_buffers(code)) == chunked


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_llama_step_with_the_chunked_head_matches_torch_optim_adamw(tied, device, chunks_of_256, no_inductor_cache):
    """Untied, the head is updated chunk by chunk; tied to the embedding (Qwen3-0.6B), its
    gradient is a sum with the embedding's and the update reads it whole. On a GPU the step
    is Inductor's Triton code, with forge's scheduler rules (forge_compile/scheduling.py)."""
    transformers = pytest.importorskip("transformers")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    config_ = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=96, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                                       attn_implementation="sdpa", use_cache=False)  # fmt: skip
    model = transformers.LlamaForCausalLM(config_).to(device)
    reference = twin(model)
    optimizer = forge_compile.optim.AdamW(model.parameters(), lr=1e-3)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)

    step = torch.compile(lambda tokens: causal_lm_step(model, optimizer, tokens), backend="forge")
    tokens = torch.randint(0, VOCAB, (2, TOKENS // 2), device=device)
    report = forge_compile.explain(step, tokens)
    causal_lm_step(reference, reference_optimizer, tokens)
    assert ("lm_head.weight" in [d.name.split(".", 1)[-1] for d in report.fused]) != tied
    for _ in range(2):
        torch.testing.assert_close(step(tokens), causal_lm_step(reference, reference_optimizer, tokens))
    assert_matches_torch_optim(model, reference, lr=1e-3, steps=3)


@pytest.mark.parametrize("variant", ["label_smoothing", "logits_read"])
def test_a_loss_the_chunks_do_not_compute_is_left_to_inductor(variant, chunks_of_256, no_inductor_cache):
    model = _TinyCausalLM(variant)
    tokens = torch.randint(0, VOCAB, (1, TOKENS))
    (report, reference), codes = run_and_get_code(sgd_at_lr_1_side_by_side, model, tokens)
    assert "linear_cross_entropy" not in "\n".join(codes)
    assert [d.name for d in report.fused] == ["model.head.weight"]
    assert max_param_error(model, reference) < 1e-5


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("storage", ["bf16_stochastic_rounding", "int8_states"])
def test_the_update_by_chunks_is_the_rules_update_from_the_whole_gradient(storage, kernel, chunks_of_256,
                                                                           monkeypatch):  # fmt: skip
    """The oracle is ``forge::optimizer_update``, the rule's unfused update (tested against
    torch.optim and float64 elsewhere), from the whole weight gradient. Stochastic rounding
    draws by the element's row of the parameter: a chunk drawing by its own rows would round
    other weights the other way."""
    from forge_compile import ops

    weight_dtype = torch.bfloat16 if storage == "bf16_stochastic_rounding" else torch.float32
    # The Triton kernel runs on a GPU where there is one (without one, under the interpreter,
    # which computes a bf16 tl.dot wrongly: there the bf16 case is skipped).
    device = "cuda" if kernel == "triton" and torch.cuda.is_available() else "cpu"
    if device == "cpu" and kernel == "triton" and weight_dtype == torch.bfloat16:
        pytest.skip("the Triton kernel's bf16 case runs on a GPU")
    monkeypatch.setattr(config, "kernel", kernel)
    hidden = torch.randn(TOKENS, WIDTH, device=device).to(weight_dtype)
    weight = (torch.randn(VOCAB, WIDTH, device=device) / WIDTH**0.5).to(weight_dtype)
    labels = torch.randint(0, VOCAB, (TOKENS,), device=device)
    labels[5] = -100
    moments = [torch.randn(VOCAB, WIDTH, device=device) * 1e-3, torch.rand(VOCAB, WIDTH, device=device) * 1e-5]
    if storage == "int8_states":
        (m_codes, m_scales), (v_codes, v_scales) = ops.quantize_state(moments[0], True), ops.quantize_state(moments[1], False)
        states, quantized, seed = [m_codes, v_codes, m_scales, v_scales], True, None
    else:
        states, quantized, seed = [m.to(torch.bfloat16) for m in moments], False, 1234
    step = torch.tensor(3.0, device=device)
    hyperparameters = [torch.tensor(v, device=device) for v in (1e-3, 0.9, 0.999, 1e-8, 0.01)]
    options = [1, 0, 0, 1]
    grad_loss = torch.tensor(1.0, device=device)
    _, lse = torch.ops.forge.linear_cross_entropy(hidden, weight, labels, -100, "mean")

    # The logits' gradient, whole, from autograd: the oracle for the hidden gradient and the update.
    logits = F.linear(hidden, weight).requires_grad_()
    (whole,) = torch.autograd.grad(F.cross_entropy(logits.float(), labels, ignore_index=-100), [logits])
    expected = torch.ops.forge.optimizer_update(weight, whole.float().t() @ hidden.float(), states, step,
                                                hyperparameters, "adam", options, quantized, seed)  # fmt: skip

    chunked_weight, chunked_states = weight.clone(), [s.clone() for s in states]
    grad_hidden = torch.ops.forge.linear_cross_entropy_backward_update_(
        grad_loss, hidden, chunked_weight, labels, lse, -100, "mean", chunked_states, step, hyperparameters, "adam",
        options, None, None, quantized, seed)  # fmt: skip
    torch.testing.assert_close(grad_hidden.float(), (whole.float() @ weight.float()), rtol=2e-2, atol=1e-4)
    for actual, wanted in zip([chunked_weight, *chunked_states], expected):
        differing = (actual.double() - wanted.double()).abs() > 1e-6 * wanted.double().abs().amax()
        assert differing.double().mean() < 1e-3, f"{differing.sum()} of {differing.numel()} elements differ"
