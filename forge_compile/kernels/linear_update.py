"""The fused weight-gradient GEMM with the optimizer rule in its epilogue.

For a weight tile ``W[rm, rn]`` a program accumulates ``dW = A[rm, :] @ B[:, rn]``
(``A = dY^T`` [out, T], ``B = X`` [T, in]) over the token dimension in fp32 registers,
then loads the weight and state tiles, applies the rule (from forge_compile.rules, the
same text as the CPU and Inductor paths) and stores them. dW is never written.

Programs run in grouped order (GROUP_M row blocks share the B column panels in L2),
and any strides are accepted, so the transposed views the graph hands over need no
copies. Tuning launches the kernel many times on the real weight, so ``restore_value``
puts the weight and states back after each trial.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from .. import rules
from ..config import config
from . import linear_update_hopper as hopper
from .common import grouped_tile_position, launch_compiled, step_coefficients
from ..rules import storage
from ..rules.storage import (
    dequantize_blocks,
    quantize_blocks,
    round_bfloat16_stochastically,
    rounding_key,
)

_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


GPU_TILES = [(128, 128, 64, 16, 4, None), (64, 128, 64, 8, 4, 128), (128, 128, 64, 8, 4, None)]
"""(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, registers a thread or None: ptxas's choice) of
the GPU's candidates, the first the untuned default; see _configs."""
EPILOGUE_SPLITS = [2]
EIGHT_BIT_STATE_TILES = [(64, 128, 64, 4, 4, None)]
"""Candidates for 8-bit states alone (rule on column halves), beside GPU_TILES. Decoding and
re-encoding two moments needs more registers than GPU_TILES leave: for AdamW with stochastic
rounding, ptxas (sm_90, benchmarks/kernel_sass.py's compile) gives 64x128x64 w8 capped at 128
registers a 248-byte spill stack (57 spill loads, 56 stores in the SASS) and 128x128x64 w16
256 bytes; uncapped, 64x128x64 w8 takes 222 registers and 128x128x64 w8 254, one program an
SM. 64x128x64 with 4 warps takes 254 registers without spilling and two programs fit an SM
(192 KiB of shared memory). Chosen for that fit; the first step's tuning times it against
the others on the GPU at hand."""
GIVEN_GRADIENT_TILES = [(4, 256, 16, 4, 1, None), (8, 256, 16, 8, 1, None), (8, 256, 16, 4, 1, None)]
"""The same, for the chunked path's kernel (``GRADIENT_GIVEN``: the rule on an fp32 gradient
block cuBLAS wrote, no matmul; BLOCK_K unused, one stage). Eight or sixteen elements a
thread: with stochastic rounding 64 or 120 registers a thread, many programs an SM, so
that enough loads are in flight to stream the weight and states. On an H100, 14336x4096
at T = 512 in 2^24-element blocks (results/kernel_chunked_tiles.json, GPU time alone):
4x256 w4 and 8x256 w8 0.465 ms, 8x256 w4 0.489, 16x256 w4 (199 registers) 0.564, against
0.491 and 0.512 for the matmul tiles 64x128 w8 and 128x128 w16 that this kernel was
tuned among before."""


def _configs():
    if _INTERPRETING:
        # The interpreter runs every trial on the CPU: one small config (per state
        # format: 8-bit blocks need 64 columns) keeps tests fast.
        return [
            triton.Config({"BLOCK_M": 16, "BLOCK_N": n, "BLOCK_K": 16, "GROUP_M": 2, "EPILOGUE_SPLIT": 1},
                          num_warps=1)  # fmt: skip
            for n in (16, storage.QUANT_BLOCK)
        ]
    # Candidate tiles for Hopper (benchmarks/kernel_configs.py; results/kernel_configs_occupancy.json
    # and the earlier sweep results/kernel_configs_first_sweep.json). Registers decide: with
    # the rule on the tile's column halves in turn (EPILOGUE_SPLIT=2), 64x128 with 8 warps and
    # 128x128 with 16 warps fit in 128 registers a thread without spilling (ptxas for sm_90),
    # so an SM runs 16 warps instead of 8, whose epilogue loads and matmuls overlap. 64x128x64
    # with 8 warps was fastest at T <= 1024 for the large weights (14336x4096, T=512: 0.365 ms
    # against 0.430 for the best 8-warp tile), 128x128x64 with 8 warps from T = 4096 up, and
    # 128x128x64 with 16 warps within 1.21x of the best in every case: the untuned default.
    # The rule on the whole tile at once (EPILOGUE_SPLIT=1) spills registers; in the first
    # sweep it was faster in 1 case of 16, by 0.6%. Stochastic rounding (the default for bf16
    # weights) took 64x128x64 w8 to 182 registers (one program an SM) although it fits in
    # 128 without spilling: ptxas, given no limit, spreads the rounding's hashes over the
    # rule. So that candidate is capped at 128 registers (maxnreg), which keeps two programs
    # an SM with either rounding (benchmarks/kernel_sass.py --resources kernel): on an H100,
    # 14336x4096 at T = 512 with stochastic rounding, 0.575 -> 0.406 ms (baseline 0.453),
    # and with rounding to nearest 0.395 -> 0.394 (results/kernel_configs_registers.json;
    # capped at 80 registers for three programs an SM, it spills and takes 0.494). Column
    # quarters, with or without the next quarter loaded ahead, were at most 1.4% faster
    # than the best of the uncapped candidates in 18 cases on an H100
    # (results/kernel_configs_quarters.json).
    shapes, splits, given = GPU_TILES, EPILOGUE_SPLITS, GIVEN_GRADIENT_TILES
    if not config.autotune:
        return [tile_config(shapes[0], splits[0]), tile_config(given[0], 1)]
    return ([tile_config(tile, split) for tile in shapes for split in splits] + [tile_config(t, 1) for t in given]
            + [tile_config(t, 2) for t in EIGHT_BIT_STATE_TILES])  # fmt: skip


def _for_eight_bit_states_only(kernel_config: triton.Config) -> bool:
    """Whether a candidate is one of EIGHT_BIT_STATE_TILES."""
    k = kernel_config.kwargs
    shape = (k["BLOCK_M"], k["BLOCK_N"], k["BLOCK_K"], kernel_config.num_warps, kernel_config.num_stages)
    return any(shape == tile[:5] for tile in EIGHT_BIT_STATE_TILES)


def _reads_given_gradient(kernel_config: triton.Config) -> bool:
    """Whether a candidate is one of GIVEN_GRADIENT_TILES: one stage, no matmul loop to pipeline."""
    return kernel_config.num_stages == 1


def tile_config(tile: tuple, split: int) -> triton.Config:
    """The triton.Config of a GPU_TILES entry with the rule on ``split`` column slices."""
    m, n, k, warps, stages, registers = tile
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8, "EPILOGUE_SPLIT": split},
                         num_warps=warps, num_stages=stages, maxnreg=registers)  # fmt: skip


def _configs_for_format(configs, named_args, **kwargs):
    """The candidates of the launch's kind (fused or given gradient) and state format:
    8-bit states take tiles (or column halves) of whole 64-column blocks; under the
    interpreter, the smallest. A single config (:func:`only_config`) is used as given."""
    if len(configs) > 1 and not _INTERPRETING:
        configs = [c for c in configs if _reads_given_gradient(c) == bool(kwargs.get("GRADIENT_GIVEN"))]
        if not kwargs.get("QUANTIZED"):
            configs = [c for c in configs if not _for_eight_bit_states_only(c)]
    if kwargs.get("QUANTIZED"):
        return [c for c in configs if c.kwargs["BLOCK_N"] % (storage.QUANT_BLOCK * c.kwargs["EPILOGUE_SPLIT"]) == 0]
    return configs[:1] if _INTERPRETING else configs


def _autotune(**kwargs):
    if "cache_results" in triton.autotune.__code__.co_varnames:
        kwargs["cache_results"] = True
    return triton.autotune(**kwargs)


@_autotune(
    configs=_configs(),
    key=["M", "N", "K", "RULE_KEY", "QUANTIZED", "ROUND_STOCHASTIC", "GRADIENT_GIVEN"],
    restore_value=["w_ptr", "s0_ptr", "s1_ptr", "s2_ptr", "q0_ptr", "q1_ptr", "q2_ptr"],
    prune_configs_by={"early_config_prune": _configs_for_format},
)
@triton.jit(do_not_specialize=["rounding_seed", "first_row"])  # per-parameter values: one compile for all
def _fused_linear_update_kernel(
    w_ptr, a_ptr, b_ptr, s0_ptr, s1_ptr, s2_ptr, q0_ptr, q1_ptr, q2_ptr,
    step_ptr, h0_ptr, h1_ptr, h2_ptr, h3_ptr, h4_ptr, h5_ptr, h6_ptr, h7_ptr,
    M, N, K, grad_min, grad_max, rounding_seed, first_row,
    stride_wm, stride_wn, stride_am, stride_ak, stride_bk, stride_bn,
    stride_s0m, stride_s0n, stride_s1m, stride_s1n, stride_s2m, stride_s2n,
    stride_q0m, stride_q0n, stride_q1m, stride_q1n, stride_q2m, stride_q2n,
    RULE_KEY: tl.constexpr,
    QUANTIZED: tl.constexpr, SIGNED0: tl.constexpr, SIGNED1: tl.constexpr, SIGNED2: tl.constexpr,
    ROUND_STOCHASTIC: tl.constexpr, QUANT_BLOCK: tl.constexpr, GRADIENT_GIVEN: tl.constexpr,
    COEFFICIENTS: tl.constexpr, ELEMENTWISE: tl.constexpr,
    HAS_S0: tl.constexpr, HAS_S1: tl.constexpr, HAS_S2: tl.constexpr,
    O0: tl.constexpr, O1: tl.constexpr, O2: tl.constexpr, O3: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INDEX_64: tl.constexpr, CLAMP_MIN: tl.constexpr, CLAMP_MAX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = grouped_tile_position(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    if INDEX_64:
        rm = rm.to(tl.int64)
        rn = rn.to(tl.int64)
        rk = rk.to(tl.int64)
    mask_m = rm < M
    mask_n = rn < N

    if GRADIENT_GIVEN:
        # The chunked path: ``a`` is an fp32 gradient block [M, N] that cuBLAS just wrote.
        acc = tl.load(a_ptr + rm[:, None] * stride_am + rn[None, :] * stride_ak,
                      mask=mask_m[:, None] & mask_n[None, :], other=0.0).to(tl.float32)  # fmt: skip
    else:
        a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
        b_ptrs = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_remaining = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_m[:, None] & (rk[None, :] < k_remaining), other=0.0)
            b = tl.load(b_ptrs, mask=(rk[:, None] < k_remaining) & mask_n[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

    # clip_grad_value_ folded in: comparisons keep NaN, as torch.clamp does.
    if CLAMP_MIN:
        acc = tl.where(acc < grad_min, grad_min, acc)
    if CLAMP_MAX:
        acc = tl.where(acc > grad_max, grad_max, acc)

    coefficients = step_coefficients(COEFFICIENTS, step_ptr, h0_ptr, h1_ptr, h2_ptr, h3_ptr, h4_ptr, h5_ptr, h6_ptr,
                                     h7_ptr)  # fmt: skip
    step = tl.load(step_ptr)

    # The rule runs on EPILOGUE_SPLIT column slices of the tile in turn: the weight, state
    # and temporary tiles of one slice are live at a time, not of the whole tile.
    tl.static_assert(EPILOGUE_SPLIT == 1 or EPILOGUE_SPLIT == 2 or EPILOGUE_SPLIT == 4, "EPILOGUE_SPLIT is 1, 2 or 4")
    if EPILOGUE_SPLIT == 1:
        _update_columns(
            acc, rm, pid_n * BLOCK_N, mask_m, N, first_row, rounding_seed, step, coefficients,
            w_ptr, s0_ptr, s1_ptr, s2_ptr, q0_ptr, q1_ptr, q2_ptr,
            stride_wm, stride_wn, stride_s0m, stride_s0n, stride_s1m, stride_s1n, stride_s2m, stride_s2n,
            stride_q0m, stride_q0n, stride_q1m, stride_q1n, stride_q2m, stride_q2n,
            QUANTIZED, SIGNED0, SIGNED1, SIGNED2, ROUND_STOCHASTIC, QUANT_BLOCK, ELEMENTWISE,
            HAS_S0, HAS_S1, HAS_S2, O0, O1, O2, O3, INDEX_64, BLOCK_M, BLOCK_N,
        )  # fmt: skip
    elif EPILOGUE_SPLIT == 2:
        _update_column_halves(
            acc, rm, pid_n * BLOCK_N, mask_m, N, first_row, rounding_seed, step, coefficients,
            w_ptr, s0_ptr, s1_ptr, s2_ptr, q0_ptr, q1_ptr, q2_ptr,
            stride_wm, stride_wn, stride_s0m, stride_s0n, stride_s1m, stride_s1n, stride_s2m, stride_s2n,
            stride_q0m, stride_q0n, stride_q1m, stride_q1n, stride_q2m, stride_q2n,
            QUANTIZED, SIGNED0, SIGNED1, SIGNED2, ROUND_STOCHASTIC, QUANT_BLOCK, ELEMENTWISE,
            HAS_S0, HAS_S1, HAS_S2, O0, O1, O2, O3, INDEX_64, BLOCK_M, BLOCK_N,
        )  # fmt: skip
    else:
        HALF: tl.constexpr = BLOCK_N // 2
        left, right = _column_halves(acc, BLOCK_M, BLOCK_N)
        _update_column_halves(
            left, rm, pid_n * BLOCK_N, mask_m, N, first_row, rounding_seed, step, coefficients,
            w_ptr, s0_ptr, s1_ptr, s2_ptr, q0_ptr, q1_ptr, q2_ptr,
            stride_wm, stride_wn, stride_s0m, stride_s0n, stride_s1m, stride_s1n, stride_s2m, stride_s2n,
            stride_q0m, stride_q0n, stride_q1m, stride_q1n, stride_q2m, stride_q2n,
            QUANTIZED, SIGNED0, SIGNED1, SIGNED2, ROUND_STOCHASTIC, QUANT_BLOCK, ELEMENTWISE,
            HAS_S0, HAS_S1, HAS_S2, O0, O1, O2, O3, INDEX_64, BLOCK_M, HALF,
        )  # fmt: skip
        _update_column_halves(
            right, rm, pid_n * BLOCK_N + HALF, mask_m, N, first_row, rounding_seed, step, coefficients,
            w_ptr, s0_ptr, s1_ptr, s2_ptr, q0_ptr, q1_ptr, q2_ptr,
            stride_wm, stride_wn, stride_s0m, stride_s0n, stride_s1m, stride_s1n, stride_s2m, stride_s2n,
            stride_q0m, stride_q0n, stride_q1m, stride_q1n, stride_q2m, stride_q2n,
            QUANTIZED, SIGNED0, SIGNED1, SIGNED2, ROUND_STOCHASTIC, QUANT_BLOCK, ELEMENTWISE,
            HAS_S0, HAS_S1, HAS_S2, O0, O1, O2, O3, INDEX_64, BLOCK_M, HALF,
        )  # fmt: skip


@triton.jit
def _column_halves(x, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    """``x``'s left and right column halves."""
    return tl.split(tl.permute(tl.reshape(x, (ROWS, 2, COLUMNS // 2)), (0, 2, 1)))


@triton.jit
def _update_column_halves(
    acc, rm, column0, mask_m, N, first_row, rounding_seed, step, coefficients,
    w_ptr, s0_ptr, s1_ptr, s2_ptr, q0_ptr, q1_ptr, q2_ptr,
    stride_wm, stride_wn, stride_s0m, stride_s0n, stride_s1m, stride_s1n, stride_s2m, stride_s2n,
    stride_q0m, stride_q0n, stride_q1m, stride_q1n, stride_q2m, stride_q2n,
    QUANTIZED: tl.constexpr, SIGNED0: tl.constexpr, SIGNED1: tl.constexpr, SIGNED2: tl.constexpr,
    ROUND_STOCHASTIC: tl.constexpr, QUANT_BLOCK: tl.constexpr, ELEMENTWISE: tl.constexpr,
    HAS_S0: tl.constexpr, HAS_S1: tl.constexpr, HAS_S2: tl.constexpr,
    O0: tl.constexpr, O1: tl.constexpr, O2: tl.constexpr, O3: tl.constexpr, INDEX_64: tl.constexpr,
    ROWS: tl.constexpr, COLUMNS: tl.constexpr,
):  # fmt: skip
    """:func:`_update_columns` on the left, then the right half of the columns ``column0`` onwards."""
    HALF: tl.constexpr = COLUMNS // 2
    left, right = _column_halves(acc, ROWS, COLUMNS)
    _update_columns(
        left, rm, column0, mask_m, N, first_row, rounding_seed, step, coefficients,
        w_ptr, s0_ptr, s1_ptr, s2_ptr, q0_ptr, q1_ptr, q2_ptr,
        stride_wm, stride_wn, stride_s0m, stride_s0n, stride_s1m, stride_s1n, stride_s2m, stride_s2n,
        stride_q0m, stride_q0n, stride_q1m, stride_q1n, stride_q2m, stride_q2n,
        QUANTIZED, SIGNED0, SIGNED1, SIGNED2, ROUND_STOCHASTIC, QUANT_BLOCK, ELEMENTWISE,
        HAS_S0, HAS_S1, HAS_S2, O0, O1, O2, O3, INDEX_64, ROWS, HALF,
    )  # fmt: skip
    _update_columns(
        right, rm, column0 + HALF, mask_m, N, first_row, rounding_seed, step, coefficients,
        w_ptr, s0_ptr, s1_ptr, s2_ptr, q0_ptr, q1_ptr, q2_ptr,
        stride_wm, stride_wn, stride_s0m, stride_s0n, stride_s1m, stride_s1n, stride_s2m, stride_s2n,
        stride_q0m, stride_q0n, stride_q1m, stride_q1n, stride_q2m, stride_q2n,
        QUANTIZED, SIGNED0, SIGNED1, SIGNED2, ROUND_STOCHASTIC, QUANT_BLOCK, ELEMENTWISE,
        HAS_S0, HAS_S1, HAS_S2, O0, O1, O2, O3, INDEX_64, ROWS, HALF,
    )  # fmt: skip


@triton.jit
def _update_columns(
    acc, rm, column0, mask_m, N, first_row, rounding_seed, step, coefficients,
    w_ptr, s0_ptr, s1_ptr, s2_ptr, q0_ptr, q1_ptr, q2_ptr,
    stride_wm, stride_wn, stride_s0m, stride_s0n, stride_s1m, stride_s1n, stride_s2m, stride_s2n,
    stride_q0m, stride_q0n, stride_q1m, stride_q1n, stride_q2m, stride_q2n,
    QUANTIZED: tl.constexpr, SIGNED0: tl.constexpr, SIGNED1: tl.constexpr, SIGNED2: tl.constexpr,
    ROUND_STOCHASTIC: tl.constexpr, QUANT_BLOCK: tl.constexpr, ELEMENTWISE: tl.constexpr,
    HAS_S0: tl.constexpr, HAS_S1: tl.constexpr, HAS_S2: tl.constexpr,
    O0: tl.constexpr, O1: tl.constexpr, O2: tl.constexpr, O3: tl.constexpr, INDEX_64: tl.constexpr,
    ROWS: tl.constexpr, COLUMNS: tl.constexpr,
):  # fmt: skip
    """The rule on the gradient ``acc`` of the weight's rows ``rm`` and its ``COLUMNS``
    columns from ``column0`` (a whole number of 8-bit blocks when ``QUANTIZED``): load the
    weight and states, update, store."""
    rn = column0 + tl.arange(0, COLUMNS)
    if INDEX_64:
        rn = rn.to(tl.int64)
    mask = mask_m[:, None] & (rn < N)[None, :]
    w_ptrs = w_ptr + rm[:, None] * stride_wm + rn[None, :] * stride_wn
    s0_ptrs = s0_ptr + rm[:, None] * stride_s0m + rn[None, :] * stride_s0n
    s1_ptrs = s1_ptr + rm[:, None] * stride_s1m + rn[None, :] * stride_s1n
    s2_ptrs = s2_ptr + rm[:, None] * stride_s2m + rn[None, :] * stride_s2n
    w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
    s0 = w
    s1 = w
    s2 = w
    if HAS_S0:
        s0 = tl.load(s0_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_S1:
        s1 = tl.load(s1_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_S2:
        s2 = tl.load(s2_ptrs, mask=mask, other=0.0).to(tl.float32)
    if QUANTIZED:
        # 8-bit states: the columns are whole 64-column blocks, so this program owns their scales.
        blocks: tl.constexpr = COLUMNS // QUANT_BLOCK
        rq = column0 // QUANT_BLOCK + tl.arange(0, blocks)
        q_mask = mask_m[:, None] & (rq[None, :] < tl.cdiv(N, QUANT_BLOCK))
        q0_ptrs = q0_ptr + rm[:, None] * stride_q0m + rq[None, :] * stride_q0n
        q1_ptrs = q1_ptr + rm[:, None] * stride_q1m + rq[None, :] * stride_q1n
        q2_ptrs = q2_ptr + rm[:, None] * stride_q2m + rq[None, :] * stride_q2n
        if HAS_S0:
            s0 = dequantize_blocks(s0, tl.load(q0_ptrs, mask=q_mask, other=0.0), ROWS, COLUMNS, QUANT_BLOCK, SIGNED0)
        if HAS_S1:
            s1 = dequantize_blocks(s1, tl.load(q1_ptrs, mask=q_mask, other=0.0), ROWS, COLUMNS, QUANT_BLOCK, SIGNED1)
        if HAS_S2:
            s2 = dequantize_blocks(s2, tl.load(q2_ptrs, mask=q_mask, other=0.0), ROWS, COLUMNS, QUANT_BLOCK, SIGNED2)

    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9 = coefficients
    w, s0, s1, s2 = ELEMENTWISE(w, acc, s0, s1, s2, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, O0, O1, O2, O3)

    if ROUND_STOCHASTIC:
        # Spelled from column0, not rn: rn's registers (one a column) would otherwise be
        # kept alive through the rule to be reused here (182 registers instead of 162).
        element_index = (rm[:, None] + first_row) * N + column0 + tl.arange(0, COLUMNS)[None, :]
        w = round_bfloat16_stochastically(w, element_index, rounding_key(rounding_seed, step))
    tl.store(w_ptrs, w.to(w_ptr.dtype.element_ty), mask=mask)
    if QUANTIZED:
        # Columns past N are zero in the rule's output only if the state was: mask them out
        # of the block maxima.
        if HAS_S0:
            s0, scale0 = quantize_blocks(tl.where(mask, s0, 0.0), ROWS, COLUMNS, QUANT_BLOCK, SIGNED0)
            tl.store(q0_ptrs, scale0, mask=q_mask)
        if HAS_S1:
            s1, scale1 = quantize_blocks(tl.where(mask, s1, 0.0), ROWS, COLUMNS, QUANT_BLOCK, SIGNED1)
            tl.store(q1_ptrs, scale1, mask=q_mask)
        if HAS_S2:
            s2, scale2 = quantize_blocks(tl.where(mask, s2, 0.0), ROWS, COLUMNS, QUANT_BLOCK, SIGNED2)
            tl.store(q2_ptrs, scale2, mask=q_mask)
    if HAS_S0:
        tl.store(s0_ptrs, s0.to(s0_ptr.dtype.element_ty), mask=mask)
    if HAS_S1:
        tl.store(s1_ptrs, s1.to(s1_ptr.dtype.element_ty), mask=mask)
    if HAS_S2:
        tl.store(s2_ptrs, s2.to(s2_ptr.dtype.element_ty), mask=mask)


@contextlib.contextmanager
def only_config(kernel_config: triton.Config):
    """Launch the fused kernel with ``kernel_config`` alone, untuned, inside the block
    (benchmarks/kernel_configs.py times each candidate this way; the tests run each variant)."""
    saved_configs, saved_cache = _fused_linear_update_kernel.configs, dict(_fused_linear_update_kernel.cache)
    saved_tuned, saved_launches = dict(_TUNED), dict(_LAUNCHES)
    _fused_linear_update_kernel.configs = [kernel_config]
    _fused_linear_update_kernel.cache.clear()
    _TUNED.clear()
    _LAUNCHES.clear()
    try:
        yield
    finally:
        _fused_linear_update_kernel.configs = saved_configs
        _fused_linear_update_kernel.cache.clear()
        _fused_linear_update_kernel.cache.update(saved_cache)
        _TUNED.clear()
        _TUNED.update(saved_tuned)
        _LAUNCHES.clear()
        _LAUNCHES.update(saved_launches)


_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _max_offset(t: torch.Tensor) -> int:
    if t.is_contiguous():
        return t.numel() - 1
    return sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))


@functools.cache
def _rule_key(rule_name: str, options: tuple[int, ...]) -> str:
    return f"{rule_name}{list(options)}"


def fused_linear_update(
    rule: rules.Rule,
    weight: torch.Tensor,
    grad_output_t: torch.Tensor,
    input: torch.Tensor,
    states: list[torch.Tensor],
    step: torch.Tensor,
    hyperparameters: list[torch.Tensor],
    options: tuple[int, ...],
    grad_min: float | None = None,
    grad_max: float | None = None,
    quantized_states: bool = False,
    rounding_seed: int | None = None,
    first_row: int = 0,
) -> None:
    """Update ``weight``/``states`` in place with ``grad_output_t @ input``, clamped to
    ``[grad_min, grad_max]`` first where given. With ``quantized_states``, ``states`` are
    8-bit codes followed by their scales; ``rounding_seed`` rounds a bf16 weight
    stochastically (:mod:`forge_compile.rules.storage`), ``weight`` being the rows from
    ``first_row`` on of the parameter.

    Runs the fused kernel, or the chunked path (cuBLAS writes the fp32 gradient of a
    block of rows, the same kernel consumes it), as ``config.linear_update_path`` says;
    "auto" measures both on the first call for a shape (see :func:`_chosen_path`). On
    the H200 the chunked path is within 1-4% of cuBLAS + fused AdamW at T = 16384
    (benchmarks/results/kernel_paths_partial.json) and the fused kernel 0.82-0.93x of
    that baseline there; below T = 4096 the fused kernel is the faster of the two
    (results/kernel_configs_occupancy.json; 14336x4096, T = 512:
    0.365 ms fused, 0.543 ms chunked in 64 MiB blocks, 2.93 ms in 16 MiB blocks, whose
    two host launches a block set the pace).

    Example::

        fused_linear_update(rules.get("adam"), w, dy.t(), x, [m, v], step, [lr, b1, b2, eps, wd], (1, 0, 0, 1))
    """
    M, N = weight.shape
    K = input.shape[0]
    if grad_output_t.shape != (M, K) or input.shape != (K, N):
        raise ValueError(
            f"forge: kernel needs grad_output_t [{M}, T] and input [T, {N}], got "
            f"{tuple(grad_output_t.shape)} and {tuple(input.shape)}"
        )
    n_states = sum(rule.active_states(options))
    codes = states[:n_states] if quantized_states else states
    for name, t in (("weight", weight), ("grad_output_t", grad_output_t), ("input", input), *(("state", s) for s in codes)):
        if t.dtype not in _SUPPORTED_DTYPES and not (quantized_states and t.dtype in (torch.int8, torch.uint8)):
            raise TypeError(f"forge: the fused kernel takes fp32/bf16/fp16 tensors; {name} is {t.dtype}")
        if t.device != weight.device:
            raise ValueError(f"forge: {name} is on {t.device}, the weight on {weight.device}")
    if weight.numel() == 0:
        return
    if grad_output_t.dtype != input.dtype:
        common = torch.promote_types(grad_output_t.dtype, input.dtype)
        grad_output_t, input = grad_output_t.to(common), input.to(common)
    path = config.linear_update_path
    if path == "fused":  # the default, straight through: this runs for every fused weight of every step
        _launch(rule, weight, grad_output_t, input, states=states, step=step, hyperparameters=hyperparameters,
                options=options, grad_min=grad_min, grad_max=grad_max, quantized_states=quantized_states,
                rounding_seed=rounding_seed, first_row=first_row)  # fmt: skip
        return
    update = functools.partial(_launch, rule, weight, states=states, step=step, hyperparameters=hyperparameters,
                               options=options, grad_min=grad_min, grad_max=grad_max,
                               quantized_states=quantized_states, rounding_seed=rounding_seed,
                               first_row=first_row)  # fmt: skip

    def fused():
        update(grad_output_t, input)

    def chunked():
        rows = _chunk_rows(M, N)
        for start in range(0, M, rows):
            block = slice(start, min(M, start + rows))
            update(_fp32_matmul(grad_output_t[block], input), None, block=block)

    if path == "auto":
        key = (M, N, K, weight.dtype, input.dtype, *(s.dtype for s in states), rule.name, options, quantized_states,
               rounding_seed is not None, grad_min is not None, grad_max is not None)  # fmt: skip
        path = _chosen_path(key, weight, {"fused": fused, "chunked": chunked}, [weight, *states])
    (fused if path == "fused" else chunked)()


def _launch(rule, weight, a, b, *, states, step, hyperparameters, options, grad_min, grad_max, quantized_states,
            rounding_seed, first_row=0, block=None):  # fmt: skip
    """One kernel launch. ``b`` None: ``a`` is a given fp32 gradient of the rows ``block``.
    ``first_row``: the parameter's row of ``weight``'s first (stochastic rounding's index)."""
    gradient_given = b is None
    if block is not None:
        first_row += block.start
        weight = weight[block]
        states = [s[block] for s in states]  # codes and scales both start with the rows
    M, N = weight.shape
    K = 1 if gradient_given else a.shape[1]
    if gradient_given:
        b = a
    fp32_operands = a.dtype == torch.float32 or b.dtype == torch.float32
    # fp32 operands: IEEE products as torch's fp32 matmul computes them, unless the user
    # allowed TF32 for matmuls, as torch would then use it too.
    dot_precision = "tf32" if fp32_operands and torch.backends.cuda.matmul.allow_tf32 else "ieee"
    plan = _launch_plan(rule.name, tuple(options), quantized_states,
                        rounding_seed is not None and weight.dtype == torch.bfloat16, gradient_given,
                        grad_min is not None, grad_max is not None, dot_precision)  # fmt: skip
    slots = [weight if i is None else states[i] for i in plan.state_slots]
    scale_slots = [weight if i is None else states[i] for i in plan.scale_slots]
    scalars = [step, *hyperparameters] + [step] * (rules.MAX_HYPERPARAMETERS - len(hyperparameters))
    distinct = {id(t): t for t in (weight, a, b, *slots, *scale_slots)}.values()
    index_64 = max(_max_offset(t) for t in distinct) >= 2**31 - 1
    index_64 = index_64 or (first_row + M) * N >= 2**31 - 1  # the element index of stochastic rounding

    s0, s1, s2 = slots
    q0, q1, q2 = scale_slots
    if not gradient_given and not quantized_states and _warp_specialized_kernel_chosen(weight, M, N, K):
        descriptors = hopper.operand_descriptors(a, b, *HOPPER_TILE[:3])
        if descriptors is not None:
            _launch_warp_specialized(descriptors, weight, s0, s1, s2, scalars, M, N, K, grad_min, grad_max,
                                     rounding_seed, first_row, plan, index_64)  # fmt: skip
            return
    args = (
        weight, a, b, s0, s1, s2, q0, q1, q2,
        *scalars,
        M, N, K, 0.0 if grad_min is None else float(grad_min), 0.0 if grad_max is None else float(grad_max),
        0 if rounding_seed is None else int(rounding_seed), first_row,
        *weight.stride(), *a.stride(), *((0, 0) if gradient_given else b.stride()),
        *s0.stride(), *s1.stride(), *s2.stride(), *q0.stride(), *q1.stride(), *q2.stride(),
    )  # fmt: skip
    constexprs = dict(INDEX_64=index_64, **plan.constexprs)
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    # The autotuner's key arguments, and the dtypes that set the kernel's arithmetic.
    tuning_key = (M, N, K, plan.constexprs["RULE_KEY"], quantized_states, plan.constexprs["ROUND_STOCHASTIC"],
                  gradient_given, weight.dtype, a.dtype, s0.dtype)  # fmt: skip
    # The plan is one cached object per combination of switches: its identity stands for them.
    variant = (*tuning_key, id(plan), index_64)
    if weight.is_cuda and weight.device.index != torch.cuda.current_device():
        with torch.cuda.device(weight.device):
            _run_kernel(grid, args, constexprs, tuning_key, variant)
    else:
        _run_kernel(grid, args, constexprs, tuning_key, variant)


HOPPER_TILE = (128, 128, 64, 4, 16, 8, 112, 2)
"""The warp-specialised kernel's (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, EPILOGUE_ROWS,
EPILOGUE_WARPS, EPILOGUE_REGISTERS, ASYNC_SLICES). With few tokens the update warps are
the bottleneck, and copying the weight and states two slices ahead by cp.async hides
their loads; with many the matmul is, and it wants the fourth ring stage, which a third
cp.async slice would cost in shared memory. H100, bf16 weight and states, GPU time over
14336x4096, 4096x14336, 4096x4096 and 1024x4096 at T = 512..4096
(results/kernel_warp_specialized_tiles_h100.json), against the best of four tiles in each
case: 1.2% behind (geometric mean; 4.6% at worst), where the same tile without cp.async
was 11% behind at T <= 1024 and a three-stage ring with three slices 15% at T >= 2048.
14336x4096: 0.361 against 0.416 ms without cp.async at T = 512, 0.908 against 0.911 at
T = 4096.

Eight update warps: four took 2.2 to 2.8 times as long on 14336x4096
(results/kernel_warp_specialized_h100.json), and sixteen do not compile: with them the
kernel's base is 80 registers a thread (65536 / (24 warps x 32), to a multiple of 8, as if
the one-warp load partition took a warpgroup), and ptxas needs 90 there for the multiply
partition's wgmma (and for the calls into the IEEE div and sqrt slow paths); checked with
ptxas for sm_90a, also with the divisions approximated."""


def warp_specialized_kernel_wins(M: int, N: int, K: int) -> bool:
    """Where the warp-specialised kernel measured faster than the portable one: at least
    512 tokens and 256 of its 128x128 tiles. On an H100, bf16 weight and states, stochastic
    rounding, GPU time (results/kernel_warp_specialized_tiles_h100.json): 14336x4096 0.361
    against 0.402 ms (portable) at T = 512, 0.456 against 0.527 at T = 1024, 0.908 against
    1.215 at T = 4096; 4096x4096 0.109 against 0.120 and 1024x4096 (256 tiles) 0.032
    against 0.033 at T = 512. Earlier (results/kernel_warp_specialized_h100.json) 1024x1024
    (64 tiles) took 0.022 against 0.020 at T = 1024."""
    return K >= 512 and M * N >= 256 * 128 * 128


def _warp_specialized_kernel_chosen(weight: torch.Tensor, M: int, N: int, K: int) -> bool:
    setting = config.warp_specialize
    if setting == "never" or not hopper.AVAILABLE or not weight.is_cuda or _INTERPRETING:
        return False
    if not hopper.is_hopper(weight.device.index):
        return False
    return setting == "always" or warp_specialized_kernel_wins(M, N, K)


def _launch_warp_specialized(descriptors, weight, s0, s1, s2, scalars, M, N, K, grad_min, grad_max, rounding_seed,
                             first_row, plan, index_64) -> None:  # fmt: skip
    block_m, block_n, block_k, stages, epilogue_rows, _, _, async_slices = HOPPER_TILE
    if async_slices:
        c = plan.constexprs
        active = [weight] + [t for t, has in ((s0, c["HAS_S0"]), (s1, c["HAS_S1"]), (s2, c["HAS_S2"])) if has]
        shared_bytes = (stages * block_k * (block_m + block_n) * descriptors[0].base.element_size()
                        + block_m * block_n * 4 + async_slices * epilogue_rows * block_n * sum(t.element_size() for t in active))  # fmt: skip
        if not _copies_asynchronously(active, N, shared_bytes, weight.device.index):
            async_slices = 0
    args = (
        weight, s0, s1, s2, *scalars, M, N, K,
        0.0 if grad_min is None else float(grad_min), 0.0 if grad_max is None else float(grad_max),
        0 if rounding_seed is None else int(rounding_seed), first_row,
        *weight.stride(), *s0.stride(), *s1.stride(), *s2.stride(),
    )  # fmt: skip
    # The plan is one cached object per combination of switches: its identity stands for them.
    variant = (id(plan), index_64, HOPPER_TILE, async_slices)
    settings = _WARP_SPECIALIZED_SETTINGS.get(variant)
    if settings is None:
        settings = _WARP_SPECIALIZED_SETTINGS[variant] = _warp_specialized_settings(plan, index_64, async_slices)
    constexprs, kernel_config = settings
    grid_size = min(triton.cdiv(M, block_m) * triton.cdiv(N, block_n), hopper.multiprocessors(weight.device.index))
    if weight.device.index != torch.cuda.current_device():
        with torch.cuda.device(weight.device):
            hopper.launch(grid_size, descriptors, args, constexprs, kernel_config, variant)
    else:
        hopper.launch(grid_size, descriptors, args, constexprs, kernel_config, variant)


_WARP_SPECIALIZED_SETTINGS: dict[tuple, tuple[dict, dict]] = {}
"""The warp-specialised kernel's constexprs and launch config per variant, built once (see
linear_update_hopper._operand_layouts for what the two caches saved)."""


def _warp_specialized_settings(plan, index_64: bool, async_slices: int) -> tuple[dict, dict]:
    block_m, block_n, block_k, stages, epilogue_rows, epilogue_warps, epilogue_registers, _ = HOPPER_TILE
    c = plan.constexprs
    constexprs = dict(
        ROUND_STOCHASTIC=c["ROUND_STOCHASTIC"], COEFFICIENTS=c["COEFFICIENTS"], ELEMENTWISE=c["ELEMENTWISE"],
        HAS_S0=c["HAS_S0"], HAS_S1=c["HAS_S1"], HAS_S2=c["HAS_S2"], O0=c["O0"], O1=c["O1"], O2=c["O2"], O3=c["O3"],
        CLAMP_MIN=c["CLAMP_MIN"], CLAMP_MAX=c["CLAMP_MAX"], INDEX_64=index_64,
        ROUNDING_KEY=rounding_key, ROUND=round_bfloat16_stochastically,
    )  # fmt: skip
    kernel_config = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, GROUP_M=8,
                         EPILOGUE_ROWS=epilogue_rows, EPILOGUE_WARPS=epilogue_warps,
                         EPILOGUE_REGISTERS=epilogue_registers, ASYNC_SLICES=async_slices, num_warps=4)  # fmt: skip
    return constexprs, kernel_config


def _copies_asynchronously(tensors, N: int, shared_bytes: int, device_index: int) -> bool:
    """Whether the update warps can copy these weight and state rows by cp.async: in 16-byte
    pieces, which the compiler proves only from 16-byte aligned rows, row strides and N
    divisible by 16 (Triton's specialization), and with their slots within shared memory."""
    if N % 16 or shared_bytes > hopper.shared_memory_bytes(device_index):
        return False
    return all(t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 for t in tensors)


_TUNED: dict[tuple, triton.Config] = {}
"""The autotuner's choice per tuning key, once made (cleared with its cache by only_config)."""


_LAUNCHES: dict[tuple, _CompiledLaunch] = {}
"""The compiled kernel per variant and argument specialization, once the JIT has launched it."""


def _run_kernel(grid, args, constexprs, tuning_key, variant) -> None:
    """Launch through the autotuner the first time a tuning key comes, then once through the
    JIT function with the config it chose, then straight through the compiled kernel's
    launcher. Each layer skipped is host time saved on every fused weight of every step:
    the autotuner's bookkeeping (dicts of all ~60 arguments, its cache key) took the op
    from 105.8 to 233.5 us a call on the H200 host, and the JIT function (specializing
    each argument, its cache key) from 69.2 to 106.3 us on the H100 host
    (benchmarks/launch_overhead.py --device cuda, results/launch_overhead_cuda.json)."""
    chosen = _TUNED.get(tuning_key)
    if chosen is None:
        _fused_linear_update_kernel[grid](*args, **constexprs)
        _TUNED[tuning_key] = _fused_linear_update_kernel.best_config
        return
    if _INTERPRETING:  # no compiled kernel to keep
        _fused_linear_update_kernel.fn[grid](*args, **constexprs, **chosen.all_kwargs())
        return
    key = (variant, args[0].device.index, _specialization(args))
    launch = _LAUNCHES.get(key)
    if launch is not None:
        launch(args)
        return
    compiled = _fused_linear_update_kernel.fn[grid](*args, **constexprs, **chosen.all_kwargs())
    if compiled is not None:
        _LAUNCHES[key] = _CompiledLaunch.of(compiled, grid, args, {**constexprs, **chosen.kwargs})


_KERNEL_ARGUMENTS = _fused_linear_update_kernel.fn.arg_names
# The launch's argument layout (see _launch): the tensors (weight, operands, states, scales,
# step and hyperparameters), M, N, K, the clamp bounds, the two unspecialized ints, strides.
_TENSORS, _INTS, _UNSPECIALIZED, _STRIDES = slice(0, 18), slice(18, 21), slice(23, 25), slice(25, None)
assert _KERNEL_ARGUMENTS[_INTS] == ["M", "N", "K"] and _KERNEL_ARGUMENTS[_UNSPECIALIZED] == ["rounding_seed", "first_row"]
assert _KERNEL_ARGUMENTS[_TENSORS][-1] == "h7_ptr" and _KERNEL_ARGUMENTS[_STRIDES][0] == "stride_wm"


def _specialization(args) -> tuple:
    """What the JIT function specializes a compiled kernel on, or finer: each tensor's dtype
    and 16-byte alignment, the ints' values (of rounding_seed and first_row, declared
    do_not_specialize, whether they fit 32 bits). Spelled for speed: it runs every launch
    (~11 us on a 2-core CPU, where a loop over the arguments took 31)."""
    tensors = args[_TENSORS]
    return (
        tuple([t.dtype for t in tensors]),
        tuple([t.data_ptr() % 16 == 0 for t in tensors]),
        args[_INTS],
        tuple([-(2**31) <= value < 2**31 for value in args[_UNSPECIALIZED]]),
        args[_STRIDES],
    )


@dataclass(frozen=True)
class _CompiledLaunch:
    """A compiled variant of the fused kernel with its grid and constexpr arguments fixed:
    calling it does what the JIT function does for a launch it has compiled already."""

    kernel: object  # triton.compiler.CompiledKernel
    grid: tuple[int, int, int]
    constexpr_values: tuple  # the kernel's arguments after ``args``, in its order

    @classmethod
    def of(cls, kernel, grid, args, constexprs: dict) -> "_CompiledLaunch":
        size = grid(constexprs)
        return cls(kernel, (*size, *(1,) * (3 - len(size))),
                   tuple(constexprs[name] for name in _KERNEL_ARGUMENTS[len(args):]))  # fmt: skip

    def __call__(self, args) -> None:
        launch_compiled(self.kernel, self.grid, (*args, *self.constexpr_values))


@dataclass(frozen=True)
class _LaunchPlan:
    """What a launch's static switches decide, worked out once per combination: the
    kernel's constexprs and which of the op's state tensors fills each slot (None: the
    weight, a placeholder the kernel never reads)."""

    constexprs: dict
    state_slots: tuple
    scale_slots: tuple


@functools.cache
def _launch_plan(rule_name, options, quantized_states, stochastic, gradient_given, clamp_min, clamp_max,
                 dot_precision) -> _LaunchPlan:  # fmt: skip
    rule = rules.get(rule_name)
    active = list(rule.active_states(options))
    active += [False] * (rules.MAX_STATES - len(active))
    n_states = sum(active)
    state_slots, scale_slots, given = [], [], 0
    for is_active in active:
        state_slots.append(given if is_active else None)
        scale_slots.append(n_states + given if is_active and quantized_states else None)
        given += bool(is_active)
    signed = [not n for n in rule.nonnegative_states] + [True] * (rules.MAX_STATES - len(rule.state_keys))
    opts = list(options) + [0] * (rules.MAX_OPTIONS - len(options))
    constexprs = dict(
        RULE_KEY=_rule_key(rule.name, options),
        COEFFICIENTS=rule.triton_coefficients, ELEMENTWISE=rule.triton_elementwise,
        HAS_S0=active[0], HAS_S1=active[1], HAS_S2=active[2],
        O0=opts[0], O1=opts[1], O2=opts[2], O3=opts[3],
        DOT_PRECISION=dot_precision, CLAMP_MIN=clamp_min, CLAMP_MAX=clamp_max,
        QUANTIZED=quantized_states, SIGNED0=signed[0], SIGNED1=signed[1], SIGNED2=signed[2],
        ROUND_STOCHASTIC=stochastic, QUANT_BLOCK=storage.QUANT_BLOCK, GRADIENT_GIVEN=gradient_given,
    )  # fmt: skip
    return _LaunchPlan(constexprs, tuple(state_slots), tuple(scale_slots))


# --- the chunked path and the choice between the two ------------------------------------------

# A block of the chunked path's fp32 gradient holds at most this many elements (64 MiB),
# and never the whole weight: a 4096-row block of a 14336x4096 weight (29% of it)
# matched cuBLAS + fused AdamW at T = 512..16384 on the H200 (0.364 / 0.593 / 1.677 /
# 2.998 ms against 0.380 / 0.597 / 1.605 / 3.168 at T = 512 / 2048 / 8192 / 16384), where
# 1024-row blocks paid for their launches at small T (0.715 ms at T = 512). A later run
# (results/kernel_configs_occupancy.json) timed these blocks at 0.543 ms at T = 512: at
# small T the host's launches, not the GPU, set the chunked path's pace.
# Running block i's rule on a second stream beside block i+1's matmul (cuBLAS on a
# high-priority stream, 0-48 SMs carved out for the rule, two gradient buffers in turn;
# commit d052d75) gained nothing on an H100: 14336x4096 in 2^24-element blocks took 0.487 /
# 0.562 / 1.038 ms at T = 512 / 1024 / 4096 against 0.476 / 0.548 / 1.044 serially, with
# the same times at every carveout; 2^22-element blocks took 1.68 ms at T = 512, paced by
# the host. In a 4-layer Llama-3.1-8B step the kernels ran 2.4 ms of the 28.0 ms side by
# side, and the step took as long as the fused kernel's (27.95 ms).
_CHUNK_ELEMENTS = 1 << 24


def _chunk_rows(M: int, N: int) -> int:
    rows = min(max(1, _CHUNK_ELEMENTS // N), -(-M // 2))
    return max(1, rows // 64 * 64) if rows >= 64 else rows


_FP32_OUTPUT_MM: list[bool] = []


def _fp32_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with fp32 output: cuBLAS's bf16/fp16 kernels write their fp32 accumulators
    (torch.mm's out_dtype), so the gradient is not rounded to bf16 on the way."""
    if a.dtype == torch.float32 or not a.is_cuda:
        return a.to(torch.float32) @ b.to(torch.float32)
    if not _FP32_OUTPUT_MM:
        try:
            torch.mm(a[:1], b[:, :1], out_dtype=torch.float32)
            _FP32_OUTPUT_MM.append(True)
        except (TypeError, RuntimeError):  # a torch without mm's out_dtype
            _FP32_OUTPUT_MM.append(False)
    if _FP32_OUTPUT_MM[0]:
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).to(torch.float32)


_PATHS: dict[str, str] = {}
"""On-disk choices, keyed by GPU name and shape key (as text)."""
_CHOSEN: dict[tuple, str] = {}
"""This process's choices, keyed by (device index, shape key)."""


def _paths_file() -> Path:
    root = os.environ.get("FORGE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "forge_compile")
    return Path(root) / "linear_update_paths.json"


def _chosen_path(shape_key: tuple, weight: torch.Tensor, candidates: dict, mutated: list[torch.Tensor]) -> str:
    """The faster of ``candidates`` for this shape on this GPU: measured once (each run
    restores the weight and states it changed), then remembered in memory and on disk so
    that the next process's first step neither measures nor tunes."""
    if not weight.is_cuda or _INTERPRETING or not config.autotune:
        return "fused"
    chosen = _CHOSEN.get((weight.device.index, shape_key))
    if chosen is not None:
        return chosen
    key = f"{torch.cuda.get_device_name(weight.device)}|{'|'.join(map(str, shape_key))}"
    chosen = _chosen_on_disk_or_measured(key, candidates, mutated)
    _CHOSEN[(weight.device.index, shape_key)] = chosen
    return chosen


def _chosen_on_disk_or_measured(key: str, candidates: dict, mutated: list[torch.Tensor]) -> str:
    if key in _PATHS:
        return _PATHS[key]
    path = _paths_file()
    try:
        _PATHS.update(json.loads(path.read_text()))
    except (OSError, ValueError):
        pass
    if key in _PATHS:
        return _PATHS[key]
    saved = [t.clone() for t in mutated]

    def restore():
        for t, copy in zip(mutated, saved):
            t.copy_(copy)

    # Runs back to back between two events, as a step issues them: one run alone is timed
    # with the GPU idle while the host launches it, and that jitter (tens of microseconds)
    # picked the slower path for small weights (1024x4096 at T = 512 on an H100: chunked,
    # 0.072 ms a call, over fused, 0.034 ms; results/kernel_h100.json). Each run updates
    # the weight and states again, which changes no time; they are restored after.
    times = {}
    for name, run in candidates.items():
        run()  # compiles and tunes its kernel
        restore()
        trials = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                run()
            end.record()
            end.synchronize()
            trials.append(start.elapsed_time(end))
            restore()
        times[name] = min(trials)
    _PATHS[key] = min(times, key=times.get)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_PATHS, indent=1))
    except OSError:  # a read-only home: measured again next process
        pass
    return _PATHS[key]
