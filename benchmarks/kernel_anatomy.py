"""Where the fused kernel's time goes: its matmul loop alone, its epilogue alone, and both,
per tile config, beside cuBLAS's matmul alone and torch's fused AdamW alone.

* ``full``: the fused kernel (``linear_update.only_config``), bf16 dY/X/W and states.
* ``epilogue``: the same kernel on T = 16 tokens (one k-step): loading, updating and
  storing the weight and states, with next to no matmul.
* ``mainloop``: the same matmul loop (same loads, same tl.dot) in a kernel that stores one
  number per program instead of running the rule: the GEMM part alone.
* ``cublas_mm``: ``dY.t() @ X`` (bf16 out); ``fused_adamw``: ``torch._fused_adamw_`` on a
  given bf16 gradient; ``baseline``: the two in turn, as benchmarks/kernel.py times it.

Every time is GPU time alone (CUDA-graph replays, kernel.py's ``_graph_median_ms``),
rotating among input sets larger than the L2.

    PYTHONPATH=. python benchmarks/kernel_anatomy.py     # writes results/kernel_anatomy.json

First reading (results/kernel_anatomy.json, H100, 14336x4096, 64x128x64 with 8 warps):
at T = 512 the full kernel took 0.395 ms, its matmul loop alone 0.175 (cuBLAS: 0.101) and
its epilogue alone 0.321 (torch's fused AdamW, which moves 17% more bytes: 0.346); at
T = 1024, 0.519 = 0.80 x (0.326 + 0.319), cuBLAS 0.191. So the loop runs at ~0.58x
cuBLAS's rate, the epilogue alone is no faster than fused AdamW, and the two overlap by
only a fifth. Nsight Compute on the T = 1024 kernel (results/kernel_counters.json): DRAM
at 48% of its peak, tensor pipes active 25% of the time, L2 at 64%: latency, not a
saturated unit, sets its pace. With Adam's IEEE division and square root made approximate
(a trial edit of rules/adam.py, not kept; results/kernel_anatomy_approximate_adam.json,
another H100 the same day, baseline 0.446 against 0.447 ms): the full kernel 0.369 / 0.477
ms at T = 512 / 1024 against 0.395 / 0.519, the epilogue alone 0.312 against 0.321. The
epilogue alone is bound by memory, and its instruction count shows where it shares the
SM with the loop.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.kernel import (  # noqa: E402
    BETA1, BETA2, EPS, L2_BYTES, LR, WEIGHT_DECAY, _graph_median_ms, _inputs, baseline_update, minimum_bytes,
)  # fmt: skip
from benchmarks.kernel_configs import _config  # noqa: E402
from benchmarks.utils import write_result  # noqa: E402
from forge_compile.kernels.common import grouped_tile_position  # noqa: E402

CONFIGS = [
    "64x128x64_w8_s4_e2", "128x128x64_w16_s4_e2", "128x128x64_w8_s4_e2", "128x128x64_w8_s4_e4",
    "128x256x64_w16_s3_e4", "256x128x64_w16_s3_e4", "128x256x64_w8_s3_e4",
]  # fmt: skip
SHAPES = [(14336, 4096), (4096, 4096)]
TOKENS = [512, 1024, 4096]


@triton.jit
def _mainloop_kernel(
    out_ptr, a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """The fused kernel's program order and matmul loop; one sum per program out, so that
    the loop is not optimised away and almost nothing is stored."""
    pid_m, pid_n = grouped_tile_position(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < M
    mask_n = rn < N
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_remaining = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (rk[None, :] < k_remaining), other=0.0)
        b = tl.load(b_ptrs, mask=(rk[:, None] < k_remaining) & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.sum(acc, 1), 0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--shapes", default=",".join(f"{m}x{n}" for m, n in SHAPES))
    parser.add_argument("--output-name", default="kernel_anatomy")
    args = parser.parse_args()
    from forge_compile import rules
    from forge_compile.kernels import linear_update

    device = torch.device("cuda")
    rule = rules.get("adam")
    hyper = [torch.tensor(h, dtype=torch.float64, device=device) for h in (LR, BETA1, BETA2, EPS, WEIGHT_DECAY)]
    step = torch.tensor(10.0, device=device)
    configs = args.configs.split(",")
    rows, failures = [], {}
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is optional
        tqdm = lambda x, **_: x  # noqa: E731
    cases = [(tuple(map(int, s.split("x"))), int(t)) for s in args.shapes.split(",") for t in args.tokens.split(",")]
    for (M, N), T in tqdm(cases, desc="cases", file=sys.stdout):
        sets = max(2, -(-L2_BYTES // minimum_bytes(M, N, T, 2)))
        inputs = _inputs(M, N, T, torch.bfloat16, device, sets)
        short = [dy[:16] for _, dy, _, _, _ in inputs], [x[:16] for _, _, x, _, _ in inputs]
        grads = [(dy.t() @ x) for _, dy, x, _, _ in inputs]
        steps = [torch.tensor(10.0, device=device) for _ in inputs]
        out = torch.empty(M * N // (64 * 64) + 1, device=device)

        def cublas_mm(i):
            _, dy, x, _, _ = inputs[i]
            return dy.t() @ x

        def fused_adamw(i):
            w, _, _, m, v = inputs[i]
            torch._fused_adamw_([w], [grads[i]], [m], [v], [], [steps[i]], lr=LR, beta1=BETA1, beta2=BETA2,
                                weight_decay=WEIGHT_DECAY, eps=EPS, amsgrad=False, maximize=False)  # fmt: skip

        row = {"M": M, "N": N, "T": T, "states": "bf16",
               "baseline_ms": _graph_median_ms(baseline_update(inputs, device), sets),
               "cublas_mm_ms": _graph_median_ms(cublas_mm, sets), "fused_adamw_ms": _graph_median_ms(fused_adamw, sets),
               "configs": {}}  # fmt: skip
        for name in configs:
            if name in failures:
                continue
            kernel_config = _config(name)
            meta = kernel_config.kwargs

            def full(i, dys=None, xs=None):
                w, dy, x, m, v = inputs[i]
                dy, x = (dy, x) if dys is None else (dys[i], xs[i])
                linear_update.fused_linear_update(rule, w, dy.t(), x, [m, v], step, hyper, (1, 0, 0, 1))

            def mainloop(i):
                _, dy, x, _, _ = inputs[i]
                a = dy.t()
                grid = (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)
                _mainloop_kernel[grid](out, a, x, M, N, T, *a.stride(), *x.stride(), BLOCK_M=meta["BLOCK_M"],
                                       BLOCK_N=meta["BLOCK_N"], BLOCK_K=meta["BLOCK_K"], GROUP_M=meta["GROUP_M"],
                                       num_warps=kernel_config.num_warps, num_stages=kernel_config.num_stages)  # fmt: skip

            try:
                with linear_update.only_config(kernel_config):
                    times = {"full_ms": _graph_median_ms(full, sets),
                             "epilogue_ms": _graph_median_ms(lambda i: full(i, *short), sets)}  # fmt: skip
                times["mainloop_ms"] = _graph_median_ms(mainloop, sets)
            except Exception as error:  # out of shared memory or registers: recorded, the others go on
                failures[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
                continue
            times["full_over_parts_sum"] = times["full_ms"] / (times["mainloop_ms"] + times["epilogue_ms"])
            row["configs"][name] = times
            print(f"{M}x{N} T={T} {name}: " + " ".join(f"{k} {v:.3f}" for k, v in times.items()), flush=True)
        print(f"{M}x{N} T={T}: baseline {row['baseline_ms']:.3f} cuBLAS {row['cublas_mm_ms']:.3f} "
              f"fused AdamW {row['fused_adamw_ms']:.3f}", flush=True)
        rows.append(row)
        write_result(args.output_name, {"rows": rows, "failures": failures})
        inputs = grads = short = None
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
