"""How forge's graphs trace an embedding's gradient: by the rows the tokens read.

Inductor's stock decomposition of ``aten.embedding_dense_backward`` zero-fills an fp32
``[vocabulary, width]`` buffer, scatter-adds each token's gradient row into it and casts
the result to the weight's dtype. For Llama-3.1-8B's 128256 x 4096 embedding that buffer
is 2.0 GiB, written whole by the fill and read whole by the update, to carry at most one
row per token (1024 at micro-batch 1 x 1024). In the step profile of the 8B shape cut to
4 layers on an H100 (``benchmarks/results/step_profile_h100.json``) the fill took
0.64 ms and the update that reads the buffer 2.72 ms, where the weight and its two
states alone (6 GiB read and written) need about 2.1 ms at the card's copy bandwidth.

:func:`embedding_dense_backward_by_rows` sums the gradient rows into a ``[tokens + 1,
width]`` buffer instead (one slot per token, the last token that reads a row standing
for it) and returns the dense gradient as a gather from it: ``where(row is read,
summed[slot of row], 0)``. That is a point-wise expression, so Inductor computes it
inside whatever reads the gradient (the optimizer's update kernel) and the dense
gradient is never stored. The sums are the same fp32 sums of the same rows, cast to the
result dtype as before. A reader that needs the gradient as a tensor (a grad norm, a
returned ``.grad``) makes Inductor store it, in the weight's dtype rather than fp32.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch._decomp import decompositions as torch_decompositions
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

aten = torch.ops.aten


def embedding_dense_backward_by_rows(grad_output: Tensor, indices: Tensor, num_weights: int, padding_idx: int,
                                     scale_grad_by_freq: bool) -> Tensor:  # fmt: skip
    """``aten.embedding_dense_backward`` without a dense fp32 buffer (module docstring)."""
    if scale_grad_by_freq:  # rare; torch's form counts the tokens per row in a buffer anyway
        return torch_decompositions.embedding_dense_backward(
            grad_output, indices, num_weights, padding_idx, scale_grad_by_freq
        )
    computation_dtype, result_dtype = elementwise_dtypes(
        grad_output, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT
    )
    width = grad_output.shape[indices.ndim :]
    tokens = indices.numel()
    token_rows = indices.reshape(-1).to(torch.long)
    gradients = grad_output.reshape(tokens, math.prod(width)).to(computation_dtype)  # not -1: tokens may be 0
    counted = (token_rows >= 0) & (token_rows < num_weights) & (token_rows != padding_idx)
    row = torch.where(counted, token_rows, 0)
    position = torch.arange(tokens, device=indices.device, dtype=torch.long)
    # Each row's slot: the last token that reads it (amax: the same slot on every run), -1 if none.
    slot_of_row = token_rows.new_full((num_weights,), -1).scatter_reduce(
        0, row, torch.where(counted, position, -1), "amax"
    )
    # Tokens that do not count (padding) add into a spare slot that no row reads.
    slot_of_token = torch.where(counted, slot_of_row[row], tokens)
    summed = gradients.new_zeros((tokens + 1, gradients.shape[1])).index_put((slot_of_token,), gradients, accumulate=True)
    read = (slot_of_row >= 0).unsqueeze(1)
    dense = torch.where(read, summed[slot_of_row.clamp(min=0)], 0)
    return dense.to(result_dtype).reshape((num_weights, *width))


def select_decomp_table() -> dict:
    """Inductor's decomposition table with forge's embedding gradient in it.

    The backend puts this function in place of Inductor's ``select_decomp_table`` while it
    compiles a graph. Passing the table to ``compile_fx`` instead would make the graph
    uncacheable: Inductor's cache key pickles a given table, and some of its entries are
    C++ functions (the FX cache then bypasses with "unpicklable type")."""
    from torch._inductor.decomposition import select_decomp_table as inductor_table

    return {**inductor_table(), aten.embedding_dense_backward.default: embedding_dense_backward_by_rows}
