"""The fused kernel for Hopper GPUs, warp-specialised: one tile's update runs while the
next tile's matmul does.

In :mod:`.linear_update`'s kernel every warp first multiplies, then updates, so a
program's tensor cores idle while it streams the weight and states, and its memory
traffic waits while it multiplies. Here one persistent program an SM runs three
partitions of warps over the same sequence of weight tiles:

* ``load`` (one warp): TMA copies of the dY and X blocks of each tile into a ring of
  ``STAGES`` shared-memory slots;
* ``multiply`` (the default partition, one warpgroup): wgmma over the ring into fp32
  registers; a finished tile goes to a shared-memory accumulator, and the warpgroup goes
  on to the next tile;
* ``update`` (``EPILOGUE_WARPS`` warps): reads the accumulator in ``EPILOGUE_ROWS``-row
  slices, loads the weight and state slices, applies the rule (the same Triton text as
  the other kernel: :mod:`forge_compile.rules`) and stores them.

mbarriers hand the ring slots and the accumulator between partitions. The gradient
exists only as one fp32 tile a program, in shared memory.

Written in Gluon (``triton.experimental.gluon``, Triton >= 3.6). It takes bf16 or fp16
operands whose rows TMA can read (dY contiguous over the weight's rows, X over its
columns) and plain (not 8-bit) states; other launches use the portable kernel.
"""

from __future__ import annotations

import functools
import inspect

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # warp_specialize([(function, args), ...], worker warps, worker registers) is Triton 3.6's
    # form; earlier Gluon took the default partition's and the workers' arguments apart.
    AVAILABLE = (hasattr(gl, "warp_specialize")
                 and next(iter(inspect.signature(gl.warp_specialize).parameters)) == "functions_and_args")  # fmt: skip
    from .common import grouped_tile_position, launch_compiled, step_coefficients
except ImportError:  # a Triton without Gluon: the portable kernel runs everywhere
    AVAILABLE = False


if AVAILABLE:

    @gluon.jit
    def _load_partition(a_desc, b_desc, a_ring, b_ring, ready, empty, M, N, K,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                        STAGES: gl.constexpr, GROUP_M: gl.constexpr):  # fmt: skip
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        k_tiles = gl.cdiv(K, BLOCK_K)
        slot_bytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        counter = 0
        for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
            pid_m, pid_n = grouped_tile_position(tile, num_pid_m, num_pid_n, GROUP_M)
            for k in range(k_tiles):
                slot = counter % STAGES
                # A fresh barrier is in phase 0, so waiting for the end of phase "1" passes:
                # the first round over the ring does not wait.
                mbarrier.wait(empty.index(slot), ((counter // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(slot), slot_bytes)
                # dY is [T, rows] and X [T, columns]: both blocks are [BLOCK_K, tile width].
                tma.async_copy_global_to_shared(a_desc, [k * BLOCK_K, pid_m * BLOCK_M], ready.index(slot),
                                                a_ring.index(slot))  # fmt: skip
                tma.async_copy_global_to_shared(b_desc, [k * BLOCK_K, pid_n * BLOCK_N], ready.index(slot),
                                                b_ring.index(slot))  # fmt: skip
                counter += 1

    @gluon.jit
    def _multiply_partition(a_ring, b_ring, ready, empty, accumulator, accumulator_full, accumulator_free, M, N, K,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                            STAGES: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        k_tiles = gl.cdiv(K, BLOCK_K)
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
        )
        counter = 0
        handoff = 0
        for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
            acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
            for k in range(k_tiles):
                slot = counter % STAGES
                mbarrier.wait(ready.index(slot), (counter // STAGES) & 1)
                a = a_ring.index(slot).permute((1, 0))  # [BLOCK_M, BLOCK_K], rows contiguous
                acc = warpgroup_mma(a, b_ring.index(slot), acc, is_async=True)
                # One wgmma in flight: the previous one is done, so its slot can be refilled.
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty.index((counter + STAGES - 1) % STAGES), count=1, pred=k > 0)
                counter += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((counter + STAGES - 1) % STAGES), count=1, pred=k_tiles > 0)
            # The update partition has read the previous tile out of the accumulator.
            mbarrier.wait(accumulator_free, handoff ^ 1)
            accumulator.store(acc)
            gl.thread_barrier()  # every warp of the group has stored its part
            mbarrier.arrive(accumulator_full, count=1)
            handoff ^= 1

    @gluon.jit
    def _update_slice(w, s0, s1, s2, grad, rm, rn, mask_n, M, N, first_row, key, grad_min, grad_max,
                      w_ptr, s0_ptr, s1_ptr, s2_ptr,
                      stride_wm, stride_wn, stride_s0m, stride_s0n, stride_s1m, stride_s1n, stride_s2m, stride_s2n,
                      c0, c1, c2, c3, c4, c5, c6, c7, c8, c9,
                      ROUND_STOCHASTIC: gl.constexpr, ELEMENTWISE: gl.constexpr,
                      HAS_S0: gl.constexpr, HAS_S1: gl.constexpr, HAS_S2: gl.constexpr,
                      O0: gl.constexpr, O1: gl.constexpr, O2: gl.constexpr, O3: gl.constexpr,
                      CLAMP_MIN: gl.constexpr, CLAMP_MAX: gl.constexpr, ROUND: gl.constexpr):  # fmt: skip
        """The rule on one slice: the gradient ``grad`` of rows ``rm``, columns ``rn``, the
        weight and states as loaded (their own dtypes); stores the results."""
        if CLAMP_MIN:  # clip_grad_value_ folded in; comparisons keep NaN, as torch.clamp does
            grad = gl.where(grad < grad_min, grad_min, grad)
        if CLAMP_MAX:
            grad = gl.where(grad > grad_max, grad_max, grad)
        new_w, new_s0, new_s1, new_s2 = ELEMENTWISE(
            w.to(gl.float32), grad, s0.to(gl.float32), s1.to(gl.float32), s2.to(gl.float32),
            c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, O0, O1, O2, O3,
        )  # fmt: skip
        if ROUND_STOCHASTIC:
            element_index = (rm[:, None] + first_row) * N + rn[None, :]
            new_w = ROUND(new_w, element_index, key)
        mask = (rm < M)[:, None] & mask_n[None, :]
        gl.store(w_ptr + rm[:, None] * stride_wm + rn[None, :] * stride_wn, new_w.to(w_ptr.dtype.element_ty), mask=mask)
        if HAS_S0:
            gl.store(s0_ptr + rm[:, None] * stride_s0m + rn[None, :] * stride_s0n,
                     new_s0.to(s0_ptr.dtype.element_ty), mask=mask)  # fmt: skip
        if HAS_S1:
            gl.store(s1_ptr + rm[:, None] * stride_s1m + rn[None, :] * stride_s1n,
                     new_s1.to(s1_ptr.dtype.element_ty), mask=mask)  # fmt: skip
        if HAS_S2:
            gl.store(s2_ptr + rm[:, None] * stride_s2m + rn[None, :] * stride_s2n,
                     new_s2.to(s2_ptr.dtype.element_ty), mask=mask)  # fmt: skip

    @gluon.jit
    def _copy_slice_async(w_slots, s0_slots, s1_slots, s2_slots, slot: gl.constexpr,
                          w_ptr, s0_ptr, s1_ptr, s2_ptr, rm, rn, mask_n, M,
                          stride_wm, stride_wn, stride_s0m, stride_s0n, stride_s1m, stride_s1n, stride_s2m, stride_s2n,
                          HAS_S0: gl.constexpr, HAS_S1: gl.constexpr, HAS_S2: gl.constexpr):  # fmt: skip
        """cp.async of one slice's weight and states into shared-memory slot ``slot``, as one group."""
        mask = (rm < M)[:, None] & mask_n[None, :]
        async_copy.async_copy_global_to_shared(
            w_slots.index(slot), w_ptr + rm[:, None] * stride_wm + rn[None, :] * stride_wn, mask=mask
        )
        if HAS_S0:
            async_copy.async_copy_global_to_shared(
                s0_slots.index(slot), s0_ptr + rm[:, None] * stride_s0m + rn[None, :] * stride_s0n, mask=mask
            )
        if HAS_S1:
            async_copy.async_copy_global_to_shared(
                s1_slots.index(slot), s1_ptr + rm[:, None] * stride_s1m + rn[None, :] * stride_s1n, mask=mask
            )
        if HAS_S2:
            async_copy.async_copy_global_to_shared(
                s2_slots.index(slot), s2_ptr + rm[:, None] * stride_s2m + rn[None, :] * stride_s2n, mask=mask
            )
        async_copy.commit_group()

    @gluon.jit
    def _load_slice(w_ptr, s0_ptr, s1_ptr, s2_ptr, rm, rn, mask_n, M,
                    stride_wm, stride_wn, stride_s0m, stride_s0n, stride_s1m, stride_s1n, stride_s2m, stride_s2n,
                    HAS_S0: gl.constexpr, HAS_S1: gl.constexpr, HAS_S2: gl.constexpr):  # fmt: skip
        """The weight and state elements of rows ``rm``, columns ``rn``, in their own dtypes."""
        mask = (rm < M)[:, None] & mask_n[None, :]
        w = gl.load(w_ptr + rm[:, None] * stride_wm + rn[None, :] * stride_wn, mask=mask, other=0.0)
        s0 = w
        s1 = w
        s2 = w
        if HAS_S0:
            s0 = gl.load(s0_ptr + rm[:, None] * stride_s0m + rn[None, :] * stride_s0n, mask=mask, other=0.0)
        if HAS_S1:
            s1 = gl.load(s1_ptr + rm[:, None] * stride_s1m + rn[None, :] * stride_s1n, mask=mask, other=0.0)
        if HAS_S2:
            s2 = gl.load(s2_ptr + rm[:, None] * stride_s2m + rn[None, :] * stride_s2n, mask=mask, other=0.0)
        return w, s0, s1, s2

    @gluon.jit
    def _update_partition(accumulator, accumulator_full, accumulator_free, w_slots, s0_slots, s1_slots, s2_slots,
                          w_ptr, s0_ptr, s1_ptr, s2_ptr, step_ptr, h0_ptr, h1_ptr, h2_ptr, h3_ptr, h4_ptr, h5_ptr,
                          h6_ptr, h7_ptr, M, N, grad_min, grad_max, rounding_seed, first_row,
                          stride_wm, stride_wn, stride_s0m, stride_s0n, stride_s1m, stride_s1n, stride_s2m, stride_s2n,
                          ROUND_STOCHASTIC: gl.constexpr, COEFFICIENTS: gl.constexpr, ELEMENTWISE: gl.constexpr,
                          HAS_S0: gl.constexpr, HAS_S1: gl.constexpr, HAS_S2: gl.constexpr,
                          O0: gl.constexpr, O1: gl.constexpr, O2: gl.constexpr, O3: gl.constexpr,
                          CLAMP_MIN: gl.constexpr, CLAMP_MAX: gl.constexpr, INDEX_64: gl.constexpr,
                          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
                          EPILOGUE_ROWS: gl.constexpr, EPILOGUE_WARPS: gl.constexpr, ASYNC_SLICES: gl.constexpr,
                          ROUNDING_KEY: gl.constexpr, ROUND: gl.constexpr):  # fmt: skip
        """The rule on each tile, EPILOGUE_ROWS rows at a time. The weight and states do not
        depend on the gradient, so their loads run ahead: the next slice's into registers
        (ASYNC_SLICES = 0), or ASYNC_SLICES - 1 slices ahead by cp.async into shared memory,
        which holds more bytes in flight than registers can. Either way the first slices'
        loads of a tile are issued before its gradient is ready."""
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        SLICES: gl.constexpr = BLOCK_M // EPILOGUE_ROWS
        # Eight consecutive columns a thread: 16-byte loads and stores of bf16 rows.
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [EPILOGUE_WARPS, 1], [1, 0])
        rows: gl.constexpr = gl.SliceLayout(1, layout)
        columns: gl.constexpr = gl.SliceLayout(0, layout)
        c0, c1, c2, c3, c4, c5, c6, c7, c8, c9 = step_coefficients(
            COEFFICIENTS, step_ptr, h0_ptr, h1_ptr, h2_ptr, h3_ptr, h4_ptr, h5_ptr, h6_ptr, h7_ptr
        )
        step = gl.load(step_ptr)
        key = ROUNDING_KEY(rounding_seed, step)
        handoff = 0
        for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
            pid_m, pid_n = grouped_tile_position(tile, num_pid_m, num_pid_n, GROUP_M)
            rn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=columns)
            first_rows = pid_m * BLOCK_M + gl.arange(0, EPILOGUE_ROWS, layout=rows)
            if INDEX_64:
                rn = rn.to(gl.int64)
                first_rows = first_rows.to(gl.int64)
            mask_n = rn < N
            if ASYNC_SLICES > 0:
                gl.static_assert(ASYNC_SLICES <= SLICES + 1, "at most one slot more than a tile has slices")
                for r in gl.static_range(ASYNC_SLICES - 1):
                    if r < SLICES:
                        _copy_slice_async(w_slots, s0_slots, s1_slots, s2_slots, r % ASYNC_SLICES,
                                          w_ptr, s0_ptr, s1_ptr, s2_ptr, first_rows + r * EPILOGUE_ROWS, rn, mask_n, M,
                                          stride_wm, stride_wn, stride_s0m, stride_s0n, stride_s1m, stride_s1n,
                                          stride_s2m, stride_s2n, HAS_S0, HAS_S1, HAS_S2)  # fmt: skip
            else:
                w, s0, s1, s2 = _load_slice(w_ptr, s0_ptr, s1_ptr, s2_ptr, first_rows, rn, mask_n, M,
                                            stride_wm, stride_wn, stride_s0m, stride_s0n, stride_s1m, stride_s1n,
                                            stride_s2m, stride_s2n, HAS_S0, HAS_S1, HAS_S2)  # fmt: skip
            mbarrier.wait(accumulator_full, handoff)
            for r in gl.static_range(SLICES):
                rm = first_rows + r * EPILOGUE_ROWS
                if ASYNC_SLICES > 0:
                    if r + ASYNC_SLICES - 1 < SLICES:
                        _copy_slice_async(w_slots, s0_slots, s1_slots, s2_slots, (r + ASYNC_SLICES - 1) % ASYNC_SLICES,
                                          w_ptr, s0_ptr, s1_ptr, s2_ptr,
                                          first_rows + (r + ASYNC_SLICES - 1) * EPILOGUE_ROWS, rn,
                                          mask_n, M, stride_wm, stride_wn, stride_s0m, stride_s0n, stride_s1m,
                                          stride_s1n, stride_s2m, stride_s2n, HAS_S0, HAS_S1, HAS_S2)  # fmt: skip
                    else:
                        async_copy.commit_group()  # an empty group: the wait below counts groups
                    async_copy.wait_group(ASYNC_SLICES - 1)
                    # The slot is read in the layout it was copied in; Triton's barrier pass adds
                    # the partition's bar.sync after the wait and before the slot is refilled.
                    w = w_slots.index(r % ASYNC_SLICES).load(layout)
                    s0 = w
                    s1 = w
                    s2 = w
                    if HAS_S0:
                        s0 = s0_slots.index(r % ASYNC_SLICES).load(layout)
                    if HAS_S1:
                        s1 = s1_slots.index(r % ASYNC_SLICES).load(layout)
                    if HAS_S2:
                        s2 = s2_slots.index(r % ASYNC_SLICES).load(layout)
                elif r + 1 < SLICES:
                    next_w, next_s0, next_s1, next_s2 = _load_slice(
                        w_ptr, s0_ptr, s1_ptr, s2_ptr, rm + EPILOGUE_ROWS, rn, mask_n, M,
                        stride_wm, stride_wn, stride_s0m, stride_s0n, stride_s1m, stride_s1n, stride_s2m, stride_s2n,
                        HAS_S0, HAS_S1, HAS_S2,
                    )  # fmt: skip
                grad = accumulator.slice(r * EPILOGUE_ROWS, EPILOGUE_ROWS).load(layout)
                if r == SLICES - 1:  # the whole tile has been read: the next one may be stored
                    gl.thread_barrier()
                    mbarrier.arrive(accumulator_free, count=1)
                _update_slice(w, s0, s1, s2, grad, rm, rn, mask_n, M, N, first_row, key, grad_min, grad_max,
                              w_ptr, s0_ptr, s1_ptr, s2_ptr, stride_wm, stride_wn, stride_s0m, stride_s0n,
                              stride_s1m, stride_s1n, stride_s2m, stride_s2n, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9,
                              ROUND_STOCHASTIC, ELEMENTWISE, HAS_S0, HAS_S1, HAS_S2, O0, O1, O2, O3,
                              CLAMP_MIN, CLAMP_MAX, ROUND)  # fmt: skip
                if ASYNC_SLICES == 0 and r + 1 < SLICES:
                    w, s0, s1, s2 = next_w, next_s0, next_s1, next_s2
            handoff ^= 1

    @gluon.jit(do_not_specialize=["rounding_seed", "first_row"])  # per-parameter values: one compile for all
    def _hopper_linear_update_kernel(
        a_desc, b_desc, w_ptr, s0_ptr, s1_ptr, s2_ptr,
        step_ptr, h0_ptr, h1_ptr, h2_ptr, h3_ptr, h4_ptr, h5_ptr, h6_ptr, h7_ptr,
        M, N, K, grad_min, grad_max, rounding_seed, first_row,
        stride_wm, stride_wn, stride_s0m, stride_s0n, stride_s1m, stride_s1n, stride_s2m, stride_s2n,
        ROUND_STOCHASTIC: gl.constexpr, COEFFICIENTS: gl.constexpr, ELEMENTWISE: gl.constexpr,
        HAS_S0: gl.constexpr, HAS_S1: gl.constexpr, HAS_S2: gl.constexpr,
        O0: gl.constexpr, O1: gl.constexpr, O2: gl.constexpr, O3: gl.constexpr,
        CLAMP_MIN: gl.constexpr, CLAMP_MAX: gl.constexpr, INDEX_64: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
        GROUP_M: gl.constexpr, EPILOGUE_ROWS: gl.constexpr, EPILOGUE_WARPS: gl.constexpr,
        EPILOGUE_REGISTERS: gl.constexpr, ASYNC_SLICES: gl.constexpr, ROUNDING_KEY: gl.constexpr,
        ROUND: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        accumulator = gl.allocate_shared_memory(
            gl.float32, [BLOCK_M, BLOCK_N], gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.float32)
        )
        # The update partition's cp.async slots (ASYNC_SLICES of them; one unused slot without).
        slot_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        slots: gl.constexpr = max(ASYNC_SLICES, 1)
        w_slots = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [slots, EPILOGUE_ROWS, BLOCK_N], slot_layout)
        s0_slots = w_slots
        s1_slots = w_slots
        s2_slots = w_slots
        if ASYNC_SLICES > 0 and HAS_S0:
            s0_slots = gl.allocate_shared_memory(s0_ptr.dtype.element_ty, [slots, EPILOGUE_ROWS, BLOCK_N], slot_layout)
        if ASYNC_SLICES > 0 and HAS_S1:
            s1_slots = gl.allocate_shared_memory(s1_ptr.dtype.element_ty, [slots, EPILOGUE_ROWS, BLOCK_N], slot_layout)
        if ASYNC_SLICES > 0 and HAS_S2:
            s2_slots = gl.allocate_shared_memory(s2_ptr.dtype.element_ty, [slots, EPILOGUE_ROWS, BLOCK_N], slot_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        accumulator_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        accumulator_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        mbarrier.init(accumulator_full, count=1)
        mbarrier.init(accumulator_free, count=1)

        gl.warp_specialize(
            [
                (_multiply_partition, (a_ring, b_ring, ready, empty, accumulator, accumulator_full, accumulator_free,
                                       M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M, num_warps)),
                (_update_partition, (accumulator, accumulator_full, accumulator_free,
                                     w_slots, s0_slots, s1_slots, s2_slots, w_ptr, s0_ptr, s1_ptr, s2_ptr, step_ptr, h0_ptr, h1_ptr, h2_ptr, h3_ptr, h4_ptr,
                                     h5_ptr, h6_ptr, h7_ptr, M, N, grad_min, grad_max, rounding_seed, first_row,
                                     stride_wm, stride_wn, stride_s0m, stride_s0n, stride_s1m, stride_s1n,
                                     stride_s2m, stride_s2n, ROUND_STOCHASTIC, COEFFICIENTS, ELEMENTWISE,
                                     HAS_S0, HAS_S1, HAS_S2, O0, O1, O2, O3, CLAMP_MIN, CLAMP_MAX, INDEX_64,
                                     BLOCK_M, BLOCK_N, GROUP_M, EPILOGUE_ROWS, EPILOGUE_WARPS, ASYNC_SLICES,
                                     ROUNDING_KEY, ROUND)),
                (_load_partition, (a_desc, b_desc, a_ring, b_ring, ready, empty, M, N, K,
                                   BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M)),
            ],
            [EPILOGUE_WARPS, 1],
            [EPILOGUE_REGISTERS, 24],
        )  # fmt: skip


@functools.cache
def _gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


def operand_descriptors(grad_output_t: torch.Tensor, input: torch.Tensor, block_m: int, block_n: int, block_k: int):
    """TMA descriptors of dY ([T, rows], the transpose of ``grad_output_t``) and X ([T,
    columns]) in [block_k, block] boxes, or None where TMA cannot read them."""
    dy, x = grad_output_t.t(), input
    for t in (dy, x):
        if t.dtype not in (torch.bfloat16, torch.float16) or t.stride(1) != 1 or t.data_ptr() % 16:
            return None
        # TMA needs rows that do not overlap (no expanded views), 16-byte aligned, and no empty dimension.
        if (t.stride(0) * t.element_size()) % 16 or t.stride(0) < t.shape[1] or 0 in t.shape:
            return None
    if dy.dtype != x.dtype:
        return None
    a_layout, b_layout = _operand_layouts(dy.dtype, block_m, block_n, block_k)
    return (TensorDescriptor(dy, list(dy.shape), list(dy.stride()), [block_k, block_m], a_layout),
            TensorDescriptor(x, list(x.shape), list(x.stride()), [block_k, block_n], b_layout))  # fmt: skip


@functools.cache
def _operand_layouts(dtype: torch.dtype, block_m: int, block_n: int, block_k: int):
    """The shared-memory layouts of the dY and X blocks, worked out once per dtype and tile:
    Gluon's layout functions are slow to call (with this cache and _WARP_SPECIALIZED_SETTINGS,
    the launch path went from 50.7 to 19.4 us of host time on a 2-core CPU with Triton 3.6,
    `benchmarks/launch_overhead.py --warp-specialized`)."""
    return (gl.NVMMASharedLayout.get_default_for([block_k, block_m], _gl_dtype(dtype)),
            gl.NVMMASharedLayout.get_default_for([block_k, block_n], _gl_dtype(dtype)))  # fmt: skip


@functools.cache
def multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def shared_memory_bytes(device_index: int) -> int:
    """Shared memory a program may use (opted in), less 1 KiB for the barriers and the compiler's own."""
    properties = torch.cuda.get_device_properties(device_index)
    return getattr(properties, "shared_memory_per_block_optin", 232448) - 1024


@functools.cache
def is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 9


_TENSORS = 13  # the weight, three state slots, the step and eight hyperparameters
_COMPILED: dict[tuple, tuple] = {}
"""The compiled kernel and its trailing constexpr arguments per variant and specialization."""
if AVAILABLE:  # launch's slices of its arguments, against the kernel's signature (after the two descriptors)
    _NAMES = _hopper_linear_update_kernel.arg_names[2:]
    assert _NAMES[_TENSORS - 1] == "h7_ptr" and _NAMES[_TENSORS : _TENSORS + 3] == ["M", "N", "K"]
    assert _NAMES[_TENSORS + 5 : _TENSORS + 7] == ["rounding_seed", "first_row"] and _NAMES[_TENSORS + 7] == "stride_wm"


def launch(grid_size: int, descriptors, args: tuple, constexprs: dict, config: dict, variant: tuple) -> None:
    """One launch: ``args`` are the kernel's arguments after the two descriptors (tensors,
    then M, N, K, the clamp bounds, rounding_seed, first_row, strides); ``variant`` stands
    for ``constexprs`` and ``config``. The first launch of a variant and specialization goes
    through the JIT function; later ones call the compiled kernel's launcher directly, as
    the portable kernel's do (the JIT function's binding and cache key cost 50-200 us of
    host time a call on an H100 host, benchmarks/launch_overhead.py)."""
    tensors = args[:_TENSORS]
    key = (
        variant,
        tensors[0].device.index,  # a compiled kernel's function is loaded in one device's context
        descriptors[0].base.dtype,
        tuple([t.dtype for t in tensors]),
        tuple([t.data_ptr() % 16 == 0 for t in tensors]),
        args[_TENSORS : _TENSORS + 3],  # M, N, K
        tuple([-(2**31) <= value < 2**31 for value in args[_TENSORS + 5 : _TENSORS + 7]]),  # seed, first row
        args[_TENSORS + 7 :],  # strides
    )
    compiled = _COMPILED.get(key)
    if compiled is None:
        kernel = _hopper_linear_update_kernel[(grid_size,)](*descriptors, *args, **constexprs, **config)
        if kernel is not None:
            names = _hopper_linear_update_kernel.arg_names[2 + len(args):]
            _COMPILED[key] = (kernel, tuple({**constexprs, **config}[name] for name in names))
        return
    kernel, tail = compiled
    launch_compiled(kernel, (grid_size, 1, 1), (*descriptors, *args, *tail))
