"""The warp-specialised Hopper kernel's variants against the portable kernel and cuBLAS +
torch's fused AdamW, GPU time side by side in one run.

One linear layer's ``dW = dY^T X`` and AdamW update, bf16 dY, X, weight and states, the
weight rounded stochastically (forge's default for bf16 weights) unless ``--rounding
nearest``. Each variant of kernels/linear_update_hopper.py (tile, ring stages, update rows
and warps, slices copied ahead by cp.async) runs with ``config.warp_specialize =
"always"``; ``portable`` is the autotuned portable kernel (``"never"``), ``auto`` forge's
own choice (``"auto"``: the kernel, with linear_update.HOPPER_TILE). Times are medians of
CUDA-graph replays (``*_gpu_ms``: GPU time alone) and of do_bench (``*_ms``: with the
host's launches), as in benchmarks/kernel.py; the floor is kernel.py's.

    PYTHONPATH=. python benchmarks/kernel_warp_specialized.py --shapes 14336x4096,4096x4096 --tokens 512,1024,4096
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.kernel import (  # noqa: E402
    L2_BYTES, _graph_median_ms, _inputs, _median_ms, baseline_update, measure_ceilings, minimum_bytes,
)  # fmt: skip
from benchmarks.utils import write_result  # noqa: E402

# name: (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, EPILOGUE_ROWS, EPILOGUE_WARPS, EPILOGUE_REGISTERS, ASYNC_SLICES)
VARIANTS = {
    "ws_128x128_w8r16": (128, 128, 64, 4, 16, 8, 112, 0),
    "ws_128x128_w8r16_s3_async3": (128, 128, 64, 3, 16, 8, 112, 3),
    "ws_128x128_w8r16_async2": (128, 128, 64, 4, 16, 8, 112, 2),
    "ws_128x128_w8r32": (128, 128, 64, 4, 32, 8, 160, 0),
}


def case(M: int, N: int, T: int, stochastic: bool, ceilings: dict, device) -> dict:
    from forge_compile import rules
    from forge_compile.config import config
    from forge_compile.kernels import linear_update

    per_set = minimum_bytes(M, N, T, 2)
    sets = max(2, -(-L2_BYTES // per_set))
    inputs = _inputs(M, N, T, torch.bfloat16, device, sets)
    hyper = [torch.tensor(h, dtype=torch.float64, device=device) for h in (1e-4, 0.9, 0.95, 1e-8, 0.1)]
    step = torch.tensor(10.0, device=device)

    def forge(setting, tile=linear_update.HOPPER_TILE):
        def run(i):
            w, dy, x, m, v = inputs[i]
            config.warp_specialize = setting
            linear_update.HOPPER_TILE = tile
            linear_update.fused_linear_update(rules.get("adam"), w, dy.t(), x, [m, v], step, hyper, (1, 0, 0, 1),
                                              rounding_seed=1234 if stochastic else None)  # fmt: skip

        return run

    # "auto": forge's own choice of kernel (linear_update.warp_specialized_kernel_wins), with its tile
    runs = {"baseline": baseline_update(inputs, device), "portable": forge("never"), "auto": forge("auto")}
    runs.update({name: forge("always", tile) for name, tile in VARIANTS.items()})
    row = {"M": M, "N": N, "T": T, "stochastic": stochastic}
    saved = config.warp_specialize, linear_update.HOPPER_TILE
    try:
        for name, run in runs.items():
            run(0)  # compiles (and for the portable kernel, tunes) outside the timing
            torch.cuda.synchronize()
            row[f"{name}_gpu_ms"] = _graph_median_ms(run, sets)
            row[f"{name}_ms"] = _median_ms(run, sets)
    finally:
        config.warp_specialize, linear_update.HOPPER_TILE = saved
    compute_ms = 2 * M * N * T / (ceilings["bf16_matmul_tflops"] * 1e9)
    row["floor_ms"] = max(compute_ms, per_set / (ceilings["copy_gb_per_s"] * 1e6))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="14336x4096,4096x4096,1024x4096,1024x1024", help="MxN,...")
    parser.add_argument("--tokens", default="512,1024,4096")
    parser.add_argument("--rounding", choices=("stochastic", "nearest"), default="stochastic")
    parser.add_argument("--output-name", default="kernel_warp_specialized")
    args = parser.parse_args()
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is optional
        tqdm = lambda x, **_: x  # noqa: E731
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    cases = [(tuple(map(int, s.split("x"))), int(t)) for s in args.shapes.split(",") for t in args.tokens.split(",")]
    rows = []
    for (M, N), T in tqdm(cases, desc="kernel variants", file=sys.stdout):
        rows.append(case(M, N, T, args.rounding == "stochastic", ceilings, device))
        write_result(args.output_name, {"ceilings": ceilings, "variants": VARIANTS, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
