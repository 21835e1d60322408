"""Buffers a compiled step writes over: the logits' gradient goes over the logits.

The fused update of the output head is ordered after the matmul that read its old weight
through a dependency on that matmul's output, the logits (forge_compile.scheduling). The
cross-entropy backward must still write the logits' gradient in place: a second
[tokens, vocabulary] buffer is 0.245 GiB at 8B. Torch 2.11's Triton code needs two more
adjustments, each checked on its own below: a fusion refused and a cast stored."""

import re
import sys
import unittest.mock

import pytest
import torch
import torch.nn.functional as F
from helpers import (last_line_outside_the_interpreter, max_param_error, sgd_at_lr_1_side_by_side,
                     triton_wrapper_written_for_the_cpu)
from torch import nn
from torch._inductor.utils import run_and_get_code

from forge_compile import scheduling
from forge_compile.config import config

VOCAB, WIDTH, TOKENS = 1000, 64, 128


class _TinyCausalLM(nn.Module):
    """Embedding, a tanh, an untied head and the causal-LM loss as transformers computes it:
    logits cast to fp32, labels padded by one and shifted (the logits are not sliced)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens):
        logits = self.head(torch.tanh(self.embed(tokens))).float()
        labels = F.pad(tokens, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


def _allocations_of(code: str, elements: int) -> int:
    """How many buffers of ``elements`` elements the generated wrapper allocates."""
    count = 0
    for shape in re.findall(r"empty_strided_\w+\(\(([\d, ]+)\),", code):
        sizes = [int(s) for s in shape.split(",") if s.strip()]
        count += torch.Size(sizes).numel() == elements
    return count


def _train(ordering_users_dropped: bool, monkeypatch) -> tuple[int, float]:
    """(buffers of the logits' size in the step's code, largest weight difference from
    torch.optim's SGD at lr 1 in eager after 3 steps)."""
    # Unchunked: forge computes this loss in vocabulary chunks (head_loss.py), with no logits
    # to write over; the rule holds where it does not (the logits read elsewhere, say).
    monkeypatch.setattr(config, "chunk_head_loss", False)
    if not ordering_users_dropped:
        monkeypatch.setattr(scheduling, "_drop_ordering_only_users", lambda scheduler: 0)
    torch.manual_seed(0)
    model = _TinyCausalLM()
    tokens = torch.randint(0, VOCAB, (1, TOKENS))
    (report, reference), codes = run_and_get_code(sgd_at_lr_1_side_by_side, model, tokens)
    assert len(report.fused) == 1  # the head; the embedding is updated by rows
    return sum(_allocations_of(code, TOKENS * VOCAB) for code in codes), max_param_error(model, reference)


@pytest.mark.parametrize("dropped", [True, False], ids=["forge", "ordering-users-kept"])
def test_the_logits_gradient_is_written_over_the_logits(dropped, monkeypatch, no_inductor_cache):
    buffers, error = _train(dropped, monkeypatch)
    # At lr 1 a weight moves by its whole gradient: a gradient read after it was overwritten
    # would show far above rounding.
    assert error < 1e-5
    # With the ordering-only users kept, Inductor allocates the gradient beside the logits
    # (the behaviour before forge_compile.scheduling): the check below can tell the two apart.
    assert buffers == (1 if dropped else 2)


# --- torch 2.11's Triton code needs two more adjustments (forge_compile.scheduling) ---------
ROWS, COLUMNS = 64, 512


def _cross_entropy_like(hidden, weight, labels, back):
    """A head's logits, their log-sum-exp, a loss that gathers them at the labels and a
    bf16 gradient the shape of the logits, used by a matmul."""
    logits = hidden @ weight
    x = logits.float()
    top = x.amax(1, keepdim=True)
    lse = (x - top).exp().sum(1, keepdim=True).log()
    loss = -(x.gather(1, labels[:, None]) - top - lse).mean()
    gradient = ((x - top - lse).exp() - F.one_hot(labels, COLUMNS)).div(ROWS).to(torch.bfloat16)
    return loss, gradient @ back


def _cross_entropy_inputs():
    torch.manual_seed(0)
    return (torch.randn(ROWS, 32, dtype=torch.bfloat16), torch.randn(32, COLUMNS, dtype=torch.bfloat16),
            torch.randint(0, COLUMNS, (ROWS,)), torch.randn(COLUMNS, 32, dtype=torch.bfloat16))  # fmt: skip


def _triton_wrapper_code(refuse_fusions: bool) -> str:
    """Inductor's wrapper for :func:`_cross_entropy_like` with Triton kernels for the CPU,
    under forge's adjustments."""
    patches = [scheduling.reuse_buffers_past_ordering_deps(), scheduling.reuse_buffers_read_by_a_later_gather()]
    if not refuse_fusions:
        patches.insert(0, unittest.mock.patch.object(scheduling, "_fusion_keeps_a_buffer_from_reuse", lambda *a: False))
    return triton_wrapper_written_for_the_cpu(lambda: torch.compile(_cross_entropy_like)(*_cross_entropy_inputs()),
                                              *patches)  # fmt: skip


@pytest.mark.parametrize("refused", [True, False], ids=["forge", "fusion-kept"])
def test_the_gradient_goes_over_logits_that_the_loss_gathers_from_triton_code(refused):
    buffers = int(last_line_outside_the_interpreter(__file__, "triton", str(int(refused))))
    # Fused with the log-sum-exp reduction, the gradient is computed before the loss gathers
    # from the logits, and gets a buffer of its own (torch 2.11 and 2.13 alike).
    assert buffers == (1 if refused else 2)


def test_the_refused_fusion_computes_the_same_values(no_inductor_cache):
    inputs = _cross_entropy_inputs()
    torch._dynamo.reset()
    with scheduling.reuse_buffers_past_ordering_deps(), scheduling.reuse_buffers_read_by_a_later_gather():
        loss, product = torch.compile(_cross_entropy_like)(*inputs)
    expected_loss, expected_product = _cross_entropy_like(*inputs)
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(product, expected_product, rtol=2e-2, atol=2e-2)  # bf16 matmuls


def _two_branches_then_a_cast(a, b, c, d):
    """A pointwise value of more than 30 operations (two branches of 15, joined at the end)
    whose only use is a cast to bf16."""
    x = (a @ b).float()
    p, q = x, d
    for _ in range(5):
        p = torch.sin(p) * 0.5 + p
        q = torch.cos(q) * 0.5 - q
    return (p + q).to(torch.bfloat16) @ c


@pytest.mark.parametrize("rule", [True, False], ids=["forge", "without-the-cast-rule"])
def test_a_large_value_used_only_by_its_cast_is_stored_as_the_cast(rule, monkeypatch, no_inductor_cache):
    from torch._inductor.graph import GraphLowering

    if not rule:
        monkeypatch.setattr(scheduling, "_only_a_cast_follows", lambda node: False)
    buffers = []
    original = GraphLowering.codegen

    def codegen(self, *args, **kwargs):
        buffers.extend((b.get_dtype(), tuple(b.get_size())) for b in self.buffers)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GraphLowering, "codegen", codegen)
    torch.manual_seed(0)
    inputs = (torch.randn(ROWS, 32, dtype=torch.bfloat16), torch.randn(32, COLUMNS, dtype=torch.bfloat16),
              torch.randn(COLUMNS, 32, dtype=torch.bfloat16), torch.randn(ROWS, 1))  # fmt: skip
    torch._dynamo.reset()
    # The GPU's threshold (a CPU's is 50 with torch 2.13).
    with scheduling.reuse_buffers_read_by_a_later_gather(), torch._inductor.config.patch(realize_opcount_threshold=30):
        result = torch.compile(_two_branches_then_a_cast)(*inputs)
    torch.testing.assert_close(result, _two_branches_then_a_cast(*inputs), rtol=2e-2, atol=5e-2)
    fp32_values = [shape for dtype, shape in buffers if dtype == torch.float32 and shape == (ROWS, COLUMNS)]
    assert len(fp32_values) == (0 if rule else 1)


# --- a pointwise kernel of several fused nodes writes over the inputs only it still reads ---


def _swiglu_backward_like(a, gate_weight, up_weight, grad_output, down_weight):
    """A SwiGLU MLP's backward as forge's step computes it: from the gate and up matmuls'
    outputs and the down projection's input gradient, one fused pointwise kernel makes the
    product (the down projection's update reads it), the up gradient and the gate gradient,
    each read by a matmul."""
    gate, up = a @ gate_weight, a @ up_weight
    grad_product = grad_output @ down_weight
    silu = F.silu(gate)
    product = silu * up
    grad_up = grad_product * silu
    sigmoid = torch.sigmoid(gate.float())
    grad_gate = (grad_product * up).float() * sigmoid * (1 + gate.float() * (1 - sigmoid))
    return product.t() @ a, grad_up @ up_weight.t(), grad_gate.to(a.dtype) @ gate_weight.t()


def _swiglu_inputs(device="cpu"):
    torch.manual_seed(0)
    a, gate_weight, up_weight = (torch.randn(ROWS, 32, device=device, dtype=torch.bfloat16),
                                 torch.randn(32, COLUMNS, device=device, dtype=torch.bfloat16) / 6,
                                 torch.randn(32, COLUMNS, device=device, dtype=torch.bfloat16) / 6)  # fmt: skip
    grad_output, down_weight = (torch.randn(ROWS, 32, device=device, dtype=torch.bfloat16),
                                torch.randn(32, COLUMNS, device=device, dtype=torch.bfloat16) / 6)  # fmt: skip
    return a, gate_weight, up_weight, grad_output, down_weight


def _triton_swiglu_code(rule: bool) -> str:
    patches = [scheduling.write_over_inputs_a_pointwise_kernel_reads_last()] if rule else []
    return triton_wrapper_written_for_the_cpu(lambda: torch.compile(_swiglu_backward_like)(*_swiglu_inputs()),
                                              *patches)  # fmt: skip


@pytest.mark.parametrize("rule", [True, False], ids=["forge", "without-the-rule"])
def test_a_fused_pointwise_kernel_writes_its_outputs_over_inputs_it_reads_last(rule):
    buffers = int(last_line_outside_the_interpreter(__file__, "swiglu", str(int(rule))))
    # The three matmul outputs, and without the rule the kernel's three outputs beside them.
    assert buffers == (3 if rule else 6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the rule applies to Triton kernels, which run on a GPU")
def test_the_pointwise_kernel_writing_over_its_inputs_computes_eagers_values(no_inductor_cache):
    inputs = _swiglu_inputs("cuda")
    torch._dynamo.reset()
    with scheduling.write_over_inputs_a_pointwise_kernel_reads_last():
        results = torch.compile(_swiglu_backward_like)(*inputs)
    for result, expected in zip(results, _swiglu_backward_like(*inputs)):
        torch.testing.assert_close(result, expected, rtol=2e-2, atol=2e-1)


if __name__ == "__main__" and sys.argv[1:2] == ["triton"]:
    print(_allocations_of(_triton_wrapper_code(bool(int(sys.argv[2]))), ROWS * COLUMNS))
if __name__ == "__main__" and sys.argv[1:2] == ["swiglu"]:
    print(_allocations_of(_triton_swiglu_code(bool(int(sys.argv[2]))), ROWS * COLUMNS))
