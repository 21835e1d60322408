"""The output head and its cross-entropy in vocabulary chunks: the logits never exist whole.

A causal LM's last linear layer makes ``[tokens, vocabulary]`` logits (Llama-3.1-8B at
1 x 1024 tokens: 0.245 GiB in bf16), and cross-entropy's backward turns them into a
gradient of the same size. Both are alive at the start of the backward, the step's peak.
``passes/chunk_head_loss`` replaces ``cross_entropy(linear(hidden, weight).float())`` in
the traced step by :func:`linear_cross_entropy`, which computes the loss over column
chunks of the vocabulary with a running log-sum-exp, and whose backward computes each
chunk's logits again (one more head matmul, 1.1 TFLOP at 8B) to form that chunk's
gradient. When forge fuses the head's optimizer update, ``passes/fuse_linear_update``
replaces the backward and the update by :func:`linear_cross_entropy_backward_update_`,
which updates the weight's rows of each chunk with ``forge::fused_linear_update_`` as soon
as that chunk's gradient exists: neither the logits, their gradient, nor the weight's
gradient is ever stored whole.

What the step's buffers peak at with and without it, in torch 2.11's Triton code for an
8-layer Llama-3.1-8B-wide step at 1 x 1024 tokens: ``benchmarks/step_buffers.py``
(``results/step_buffers_cpu.json``). Unchunked, the peak is at the loss; chunked, it moves
to the last layer's SwiGLU backward. The chunked op's own temporaries (below) are not in
those figures.

The math is cross-entropy's: ``loss = mean or sum over rows whose label is not
ignore_index of (logsumexp(logits) - logits[label])``; the logits are rounded to the
weight's dtype before the fp32 math, as ``linear(...).float()`` does, and the logits'
gradient ``(softmax - one_hot) * scale`` is rounded to it before the matmuls, as autograd
does.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .config import config
from .ops import _use_triton

# Columns of the vocabulary in a chunk, whatever the number of tokens T. A chunk has fixed
# costs beside its four matmuls (8 x T x width x columns FLOPs): it reads and writes the
# hidden gradient's fp32 sum (T x width x 8 bytes), about 233 / columns of the matmuls' time
# on an H100 (~3 TB/s, ~700 TFLOP/s), and a few launches from Python. Neither depends on
# T, so the columns do not either. What was measured (benchmarks/head_loss.py,
# results/head_loss_h100.json), with chunks of 16 MiB of fp32 logits, at least 1024 columns:
# the loss and its gradients took 9.2 ms at 1 x 1024 tokens (32 chunks of 4096 columns)
# against 5.0 ms for the whole logits compiled, and 36.7 against 18.9 ms at 4 x 1024 tokens
# (126 chunks of 1024): about 1.9x at both, where the one extra head matmul accounts for
# 1.33x; what the rest is was not measured, nor these 4096 columns at 4 x 1024 tokens.
# The chunk's temporaries are what the step holds in place of the whole logits (1/32 of them
# at a 128256 vocabulary): on a GPU (kernels/head_loss.py) its logits in bf16, which their
# gradient overwrites, beside the hidden gradient's fp32 sum, 24 MiB at 1 x 1024 tokens; the
# torch ops of the CPU path also hold the chunk in fp32 and each chunk's share of the hidden
# gradient, about 40 MiB there.
_CHUNK_COLUMNS = 4096


def chunk_columns(vocabulary: int) -> int:
    """Columns of the vocabulary in one chunk: ``config.head_chunk_columns`` where set, else
    4096 (a multiple of 128 too, so that a chunk of weight rows starts on an aligned address)."""
    return min(vocabulary, config.head_chunk_columns or _CHUNK_COLUMNS)


def _check(hidden: Tensor, weight: Tensor, labels: Tensor, reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"forge: linear_cross_entropy's reduction must be 'mean' or 'sum', got {reduction!r}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"forge: linear_cross_entropy needs hidden [..., {weight.shape[-1]}] and weight [V, D], "
                         f"got {tuple(hidden.shape)} and {tuple(weight.shape)}")  # fmt: skip
    if labels.numel() * hidden.shape[-1] != hidden.numel():
        raise ValueError(f"forge: linear_cross_entropy needs one label per row of hidden, got {labels.numel()} labels "
                         f"for {hidden.numel() // max(1, hidden.shape[-1])} rows")  # fmt: skip


def _chunks(vocabulary: int):
    step = chunk_columns(vocabulary)
    for first in range(0, vocabulary, step):
        yield first, min(first + step, vocabulary)


@torch.library.custom_op("forge::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int,
                         reduction: str) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(loss, lse)``: ``F.cross_entropy(F.linear(hidden, weight).float().view(-1, V),
    labels.view(-1), ignore_index=ignore_index, reduction=reduction)`` and each row's fp32
    log-sum-exp, which the backward reads."""
    _check(hidden, weight, labels, reduction)
    rows = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1).contiguous()  # the chunk kernels read it by row
    valid = labels != ignore_index
    # What cross-entropy's kernels assert, asynchronously on a GPU (no wait for the host).
    torch._assert_async((~valid | ((labels >= 0) & (labels < weight.shape[0]))).all(),
                        f"forge: a label is neither a class in [0, {weight.shape[0]}) nor ignore_index={ignore_index}")  # fmt: skip
    running_max = torch.full((rows.shape[0],), float("-inf"), device=rows.device)
    running_sum = torch.zeros(rows.shape[0], device=rows.device)
    target = torch.zeros(rows.shape[0], device=rows.device)
    in_one_pass = _use_triton(weight)
    if in_one_pass:
        from .kernels.head_loss import fold_chunk_
    for first, last in _chunks(weight.shape[0]):
        if in_one_pass:
            fold_chunk_(rows @ weight[first:last].t(), labels, running_max, running_sum, target, first, ignore_index)
            continue
        logits = (rows @ weight[first:last].t()).float()
        here = valid & (labels >= first) & (labels < last)
        column = (labels - first).clamp(0, last - first - 1)
        target = torch.where(here, logits.gather(1, column[:, None]).squeeze(1), target)
        new_max = torch.maximum(running_max, logits.amax(dim=1))
        # Shifted by 0 while a row's maximum is -inf (nothing summed yet, nothing to add):
        # never -inf - -inf. In place: the chunk's fp32 logits stay its only fp32 chunk.
        shift = torch.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * torch.exp(running_max - shift) + logits.sub_(shift[:, None]).exp_().sum(dim=1)
        running_max = new_max
    lse = running_max + torch.log(running_sum)
    losses = torch.where(valid, lse - target, 0.0)
    loss = losses.sum() if reduction == "sum" else losses.sum() / valid.sum()
    return loss, lse


@linear_cross_entropy.register_fake
def _linear_cross_entropy_fake(hidden, weight, labels, ignore_index, reduction):
    _check(hidden, weight, labels, reduction)
    rows = hidden.numel() // hidden.shape[-1]
    return hidden.new_empty((), dtype=torch.float32), hidden.new_empty((rows,), dtype=torch.float32)


def _logits_gradient(rows: Tensor, weight_rows: Tensor, labels: Tensor, lse: Tensor, first: int,
                     row_scale: Tensor) -> Tensor:  # fmt: skip
    """``(softmax - one_hot) * row_scale`` over the columns ``first:first + len(weight_rows)``,
    in the weight's dtype."""
    if _use_triton(weight_rows):
        from .kernels.head_loss import logits_gradient_

        return logits_gradient_(rows @ weight_rows.t(), labels, lse, row_scale, first)
    columns = weight_rows.shape[0]
    gradient = (rows @ weight_rows.t()).float().sub_(lse[:, None]).exp_()  # in place: one fp32 chunk alive
    here = (labels >= first) & (labels < first + columns)
    column = (labels - first).clamp(0, columns - 1)
    gradient.scatter_add_(1, column[:, None], -here.to(gradient.dtype)[:, None])
    return gradient.mul_(row_scale[:, None]).to(weight_rows.dtype)


@functools.cache
def _adds_half_precision_products_in_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch's cuBLAS matmul adds a bf16/fp16 product into an fp32 tensor (addmm
    with out_dtype=float32 and an fp32 ``self``, which recent torch versions allow): tried
    once per device and dtype on a 1 x 1 product."""
    total = torch.zeros(1, 1, device=device)
    factor = torch.ones(1, 1, device=device, dtype=dtype)
    try:
        torch.ops.aten.addmm.dtype_out(total, factor, factor, torch.float32, out=total)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _add_product_(total: Tensor, a: Tensor, b: Tensor) -> None:
    """``total += a @ b`` for an fp32 ``total``. On a GPU cuBLAS adds the bf16/fp16 product
    into ``total`` in fp32 (addmm's out_dtype): no product rounded to bf16, no temporary.
    Elsewhere the product is rounded to the operands' dtype and then summed in fp32."""
    if (
        total.is_cuda
        and a.dtype in (torch.bfloat16, torch.float16)
        and _adds_half_precision_products_in_fp32(total.device, a.dtype)
    ):
        torch.ops.aten.addmm.dtype_out(total, a, b, torch.float32, out=total)
        return
    total.add_(a @ b)


def _row_scale(grad_loss: Tensor, labels: Tensor, ignore_index: int, reduction: str) -> Tensor:
    valid = labels != ignore_index
    scale = grad_loss.float() if reduction == "sum" else grad_loss.float() / valid.sum()
    return torch.where(valid, scale, 0.0)


@torch.library.custom_op("forge::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(grad_loss: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor, lse: Tensor,
                                  ignore_index: int, reduction: str) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(grad_hidden, grad_weight)`` of :func:`linear_cross_entropy`'s loss. The weight's
    gradient is whole here: this is the backward of a head whose update forge does not fuse."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1).contiguous()  # the chunk kernels read it by row
    row_scale = _row_scale(grad_loss, labels, ignore_index, reduction)
    grad_rows = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
    grad_weight = torch.empty_like(weight)
    for first, last in _chunks(weight.shape[0]):
        gradient = _logits_gradient(rows, weight[first:last], labels, lse, first, row_scale)
        _add_product_(grad_rows, gradient, weight[first:last])
        torch.mm(gradient.t(), rows.to(weight.dtype), out=grad_weight[first:last])
    return grad_rows.to(hidden.dtype).reshape(hidden.shape), grad_weight


@linear_cross_entropy_backward.register_fake
def _linear_cross_entropy_backward_fake(grad_loss, hidden, weight, labels, lse, ignore_index, reduction):
    return torch.empty_like(hidden), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    hidden, weight, labels, ignore_index, reduction = inputs
    ctx.save_for_backward(hidden, weight, labels, output[1])
    ctx.ignore_index, ctx.reduction = ignore_index, reduction


def _backward(ctx, grad_loss, grad_lse):
    hidden, weight, labels, lse = ctx.saved_tensors
    grad_hidden, grad_weight = torch.ops.forge.linear_cross_entropy_backward(
        grad_loss, hidden, weight, labels, lse, ctx.ignore_index, ctx.reduction)  # fmt: skip
    return grad_hidden, grad_weight, None, None, None


linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("forge::linear_cross_entropy_backward_update_", mutates_args=("weight", "states"))
def linear_cross_entropy_backward_update_(
    grad_loss: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor, lse: Tensor, ignore_index: int, reduction: str,
    states: list[Tensor], step: Tensor, hyperparameters: list[Tensor], rule: str, options: list[int],
    grad_min: float | None = None, grad_max: float | None = None, quantized_states: bool = False,
    rounding_seed: int | None = None,
) -> Tensor:  # fmt: skip
    """:func:`linear_cross_entropy_backward` with the weight's update fused: each chunk's
    weight rows and states are updated by ``forge::fused_linear_update_`` from that chunk's
    logits gradient, after the chunk's rows of the hidden gradient are computed from the old
    weight (8-bit states and stochastic rounding as for the whole weight: both are laid out
    by rows, and the rounding draws by the parameter's row). Returns the hidden gradient."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1).contiguous()  # the chunk kernels read it by row
    row_scale = _row_scale(grad_loss, labels, ignore_index, reduction)
    grad_rows = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
    for first, last in _chunks(weight.shape[0]):
        gradient = _logits_gradient(rows, weight[first:last], labels, lse, first, row_scale)
        _add_product_(grad_rows, gradient, weight[first:last])
        torch.ops.forge.fused_linear_update_(
            weight[first:last], gradient.t(), rows, [state[first:last] for state in states], step, hyperparameters,
            rule, options, grad_min, grad_max, quantized_states, rounding_seed, first)  # fmt: skip
    return grad_rows.to(hidden.dtype).reshape(hidden.shape)


@linear_cross_entropy_backward_update_.register_fake
def _linear_cross_entropy_backward_update_fake(grad_loss, hidden, weight, labels, lse, ignore_index, reduction,
                                               states, step, hyperparameters, rule, options, grad_min=None,
                                               grad_max=None, quantized_states=False, rounding_seed=None):  # fmt: skip
    return torch.empty_like(hidden)
