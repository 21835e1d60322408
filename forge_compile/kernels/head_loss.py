"""The chunked head loss's point-wise work on one chunk of logits, one pass each way.

:mod:`forge_compile.head_loss` multiplies a chunk of the head's logits with cuBLAS and then
reduces it (forward) or turns it into its gradient (backward). As torch ops each of those
is six or so kernels over the chunk, with the chunk's fp32 copy in between: at Llama-3.1-8B
and 1 x 1024 tokens, 32 chunks of [1024, 4096], about 120 MB of traffic a chunk forward
and 150 MB backward, some 3 ms a step at an H100's copy bandwidth. Here the forward reads
the chunk's bf16 logits once and the backward reads them and writes their gradient over
them, 8 and 16 MB a chunk, and neither stores an fp32 copy.

The math is the torch path's, in the same order: the logits as stored (the weight's
dtype) are taken to fp32; the forward folds the chunk into each row's running maximum and
sum of exponentials and picks the label's logit; the backward forms
``(exp(logit - lse) - [column is the label]) * row_scale`` and rounds it to the logits'
dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns a program reads at a time: 1024 bf16 values, 2 KiB, over 4 warps.
_BLOCK_COLUMNS = 1024


@triton.jit
def _fold_chunk_kernel(logits_ptr, stride_row, labels_ptr, running_max_ptr, running_sum_ptr, target_ptr, first,
                       columns, ignore_index, BLOCK: tl.constexpr):  # fmt: skip
    """One row: fold its chunk of logits (columns ``first:first + columns`` of the
    vocabulary) into its running maximum and sum of exponentials, and take its label's logit
    if the label falls in the chunk."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    running_max = tl.load(running_max_ptr + row)
    running_sum = tl.load(running_sum_ptr + row)
    for start in range(0, columns, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        x = tl.load(base + offsets, mask=offsets < columns, other=float("-inf")).to(tl.float32)
        # tl.max passes over a NaN logit, but the sum below does not: the row's lse and loss
        # are NaN, as torch's are.
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        # Shifted by 0 while the maximum is -inf (nothing summed yet, nothing to add): never -inf - -inf.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
        running_max = new_max
    tl.store(running_max_ptr + row, running_max)
    tl.store(running_sum_ptr + row, running_sum)
    label = tl.load(labels_ptr + row)
    if (label != ignore_index) & (label >= first) & (label < first + columns):
        tl.store(target_ptr + row, tl.load(base + (label - first)).to(tl.float32))


@triton.jit
def _logits_gradient_kernel(logits_ptr, stride_row, labels_ptr, lse_ptr, row_scale_ptr, first, columns,
                            BLOCK: tl.constexpr):  # fmt: skip
    """A block of one row: its logits' gradient, written over them."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < columns
    pointers = logits_ptr + row * stride_row + offsets
    x = tl.load(pointers, mask=inside, other=0.0)
    gradient = tl.exp(x.to(tl.float32) - tl.load(lse_ptr + row))
    gradient = tl.where(offsets == tl.load(labels_ptr + row) - first, gradient - 1.0, gradient)
    gradient = gradient * tl.load(row_scale_ptr + row)
    tl.store(pointers, gradient.to(x.dtype), mask=inside)


def _check_layout(logits: torch.Tensor, labels: torch.Tensor) -> None:
    """The kernels read a row's logits at unit stride and its label at ``labels[row]``: the
    caller makes ``labels`` contiguous once for all its chunks."""
    if logits.stride(1) != 1:
        raise ValueError(f"forge: a chunk of logits must have contiguous rows, got strides {logits.stride()}")
    if not labels.is_contiguous():
        raise ValueError(f"forge: the labels must be contiguous, got strides {labels.stride()}")


def fold_chunk_(logits: torch.Tensor, labels: torch.Tensor, running_max: torch.Tensor, running_sum: torch.Tensor,
                target: torch.Tensor, first: int, ignore_index: int) -> None:  # fmt: skip
    """Fold ``logits`` ([rows, columns], the vocabulary's columns from ``first``) into the
    fp32 ``running_max`` and ``running_sum`` of each row, and set ``target`` to the label's
    logit where the label is one of these columns and not ``ignore_index``."""
    rows, columns = logits.shape
    if rows == 0:
        return
    _check_layout(logits, labels)
    _fold_chunk_kernel[(rows,)](logits, logits.stride(0), labels, running_max, running_sum, target, first, columns,
                                ignore_index, BLOCK=_BLOCK_COLUMNS)  # fmt: skip


def logits_gradient_(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, row_scale: torch.Tensor,
                     first: int) -> torch.Tensor:  # fmt: skip
    """``logits`` ([rows, columns], the vocabulary's columns from ``first``), overwritten
    with ``(softmax - one_hot(labels)) * row_scale`` in their dtype, and returned."""
    rows, columns = logits.shape
    if rows and columns:
        _check_layout(logits, labels)
        grid = (rows, triton.cdiv(columns, _BLOCK_COLUMNS))
        _logits_gradient_kernel[grid](logits, logits.stride(0), labels, lse, row_scale, first, columns,
                                      BLOCK=_BLOCK_COLUMNS)  # fmt: skip
    return logits
