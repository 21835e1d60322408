"""The order in which the fused kernels visit a weight's tiles."""

import triton
import triton.language as tl


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
