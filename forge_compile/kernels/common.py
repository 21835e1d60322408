"""What both fused kernels (the portable one and the warp-specialised one) share."""

import triton
import triton.language as tl
from triton import knobs
from triton.runtime.driver import driver


def launch_compiled(kernel, grid: tuple[int, int, int], arguments: tuple) -> None:
    """What Triton's JIT function does to launch a kernel it has compiled already: on the
    current stream, with its launch hooks, all ``arguments`` (constexprs included) in order."""
    stream = driver.active.get_current_stream(driver.active.get_current_device())
    kernel.run(*grid, stream, kernel.function, kernel.packed_metadata, kernel.launch_metadata(grid, stream, *arguments),
               knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *arguments)  # fmt: skip


@triton.jit
def grouped_tile_position(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row block, column block) of the ``tile``-th tile in grouped order: GROUP_M row blocks
    in turn walk the column blocks, so that they share X's column panels in L2."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile % num_pid_in_group) % group_size_m)
    pid_n = (tile % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def step_coefficients(COEFFICIENTS: tl.constexpr, step_ptr, h0_ptr, h1_ptr, h2_ptr, h3_ptr, h4_ptr, h5_ptr, h6_ptr,
                      h7_ptr):  # fmt: skip
    """The rule's per-step scalars (bias corrections, learning-rate products), worked out once
    per program in fp64 from the step and hyperparameter tensors, as fp32 for the tile math."""
    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9 = COEFFICIENTS(
        tl.load(step_ptr).to(tl.float64),
        tl.load(h0_ptr).to(tl.float64), tl.load(h1_ptr).to(tl.float64), tl.load(h2_ptr).to(tl.float64),
        tl.load(h3_ptr).to(tl.float64), tl.load(h4_ptr).to(tl.float64), tl.load(h5_ptr).to(tl.float64),
        tl.load(h6_ptr).to(tl.float64), tl.load(h7_ptr).to(tl.float64),
    )  # fmt: skip
    return (c0.to(tl.float32), c1.to(tl.float32), c2.to(tl.float32), c3.to(tl.float32), c4.to(tl.float32),
            c5.to(tl.float32), c6.to(tl.float32), c7.to(tl.float32), c8.to(tl.float32), c9.to(tl.float32))  # fmt: skip
