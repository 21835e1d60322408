"""What limits the fused kernel: the GPU's own counters (Nsight Compute) for tile configs of
the fused kernel beside cuBLAS's ``dY.t() @ X`` and torch's fused AdamW on the same problem.

For each case (weight shape, T) a worker process launches every named config of the fused
kernel once (``linear_update.only_config``, bf16 dY/X/W and AdamW states) and the
baseline's two kernels once, under ``ncu`` with the sections that answer the question:
duration, DRAM and L2 bytes and throughput, tensor-pipe use, occupancy and registers, and
why warps stall. ncu replays each kernel with its memory restored and its caches flushed,
so the figures are of one cold launch (kernel.py's timings rotate warm inputs instead).

    PYTHONPATH=. python benchmarks/kernel_counters.py --configs 64x128x64_w8_s4_e2,128x128x64_w16_s4_e2
    PYTHONPATH=. python benchmarks/kernel_counters.py --configs ws_128x128_w8r16,ws_128x128_w8r16_s3_async3 \
        --tokens 1024 --output-name kernel_counters_warp_specialized
    # writes results/kernel_counters.json: one row per launch, every metric ncu reported
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.kernel import BETA1, BETA2, EPS, LR, WEIGHT_DECAY, _inputs  # noqa: E402
from benchmarks.utils import write_result  # noqa: E402

SECTIONS = ["SpeedOfLight", "MemoryWorkloadAnalysis", "ComputeWorkloadAnalysis", "Occupancy", "LaunchStats",
            "WarpStateStats", "SchedulerStats"]  # fmt: skip
KERNELS = "regex:_fused_linear_update_kernel|_hopper_linear_update_kernel|nvjet|gemm|adam|multi_tensor_apply"
SUMMARY = [  # raw metric names (Hopper) printed per launch; all that ncu reported go to the result file
    "gpu__time_duration.sum", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", "dram__bytes.sum.per_second",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread",
    "launch__occupancy_limit_registers", "sm__warps_active.avg.pct_of_peak_sustained_active",
    "smsp__average_warp_latency_per_inst_issued.ratio",
]  # fmt: skip
STALLS = "smsp__average_warps_issue_stalled_"


def _ncu() -> str:
    found = shutil.which("ncu") or sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))
    if not found:
        raise SystemExit("kernel_counters: no ncu on this machine (Nsight Compute)")
    return found if isinstance(found, str) else found[-1]


def worker(M: int, N: int, T: int, names: list[str]) -> None:
    """One launch of each config, then cuBLAS's matmul and torch's fused AdamW once each."""
    from benchmarks.kernel_configs import _config
    from forge_compile import rules
    from forge_compile.kernels import linear_update

    device = torch.device("cuda")
    (w, dy, x, m, v), = _inputs(M, N, T, torch.bfloat16, device, 1)
    rule = rules.get("adam")
    hyper = [torch.tensor(h, dtype=torch.float64, device=device) for h in (LR, BETA1, BETA2, EPS, WEIGHT_DECAY)]
    step = torch.tensor(10.0, device=device)
    from benchmarks.kernel_warp_specialized import VARIANTS
    from forge_compile.config import config

    default_tile = linear_update.HOPPER_TILE
    for name in names:
        if name in VARIANTS:  # a tile of the warp-specialised kernel
            config.warp_specialize, linear_update.HOPPER_TILE = "always", VARIANTS[name]
            linear_update.fused_linear_update(rule, w, dy.t(), x, [m, v], step, hyper, (1, 0, 0, 1))
        else:
            config.warp_specialize, linear_update.HOPPER_TILE = "never", default_tile
            with linear_update.only_config(_config(name)):
                linear_update.fused_linear_update(rule, w, dy.t(), x, [m, v], step, hyper, (1, 0, 0, 1))
        torch.cuda.synchronize()
    grad = dy.t() @ x
    torch._fused_adamw_([w], [grad], [m], [v], [], [step], lr=LR, beta1=BETA1, beta2=BETA2, weight_decay=WEIGHT_DECAY,
                        eps=EPS, amsgrad=False, maximize=False)  # fmt: skip
    torch.cuda.synchronize()


def _parse(text: str) -> list[dict]:
    """ncu's ``--csv --page raw`` output (a header row, a units row, a row per launch) ->
    one dict per launch: ``metric [unit]`` -> value, with the kernel's name."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    if len(lines) < 3:
        return []
    header, units, *launches = list(csv.reader(io.StringIO("\n".join(lines))))
    out = []
    for values in launches:
        launch = {"kernel": values[header.index("Kernel Name")][:120]}
        for name, unit, value in zip(header, units, values):
            launch[f"{name} [{unit}]" if unit else name] = value
        out.append(launch)
    return out


def _summary(launch: dict) -> dict:
    """The SUMMARY metrics and the five largest stall reasons."""
    plain = {key.split(" [")[0]: value for key, value in launch.items()}
    out = {name: plain[name] for name in SUMMARY if name in plain}
    stalls = {}
    for key, value in plain.items():
        if key.startswith(STALLS) and key.endswith("per_issue_active.ratio"):
            try:
                stalls[key[len(STALLS):-len("_per_issue_active.ratio")]] = float(value.replace(",", ""))
            except ValueError:
                continue
    out["top_stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:5])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", required=True,
                        help="comma-separated config names: kernel_configs.py's, or kernel_warp_specialized.py's VARIANTS")
    parser.add_argument("--shapes", default="14336x4096")
    parser.add_argument("--tokens", default="512,1024")
    parser.add_argument("--output-name", default="kernel_counters")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = args.configs.split(",")
    if args.worker:
        M, N, T = map(int, args.worker.split(","))
        worker(M, N, T, names)
        return 0
    ncu = _ncu()
    cases = [(*map(int, s.split("x")), int(t)) for s in args.shapes.split(",") for t in args.tokens.split(",")]
    rows = []
    for M, N, T in cases:
        command = [ncu, "--csv", "--page", "raw", "--clock-control", "none", "--target-processes", "all",
                   "--kernel-name", KERNELS, *(a for s in SECTIONS for a in ("--section", s)),
                   sys.executable, __file__, "--configs", args.configs, "--worker", f"{M},{N},{T}"]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        launches = _parse(done.stdout)
        if done.returncode != 0 or not launches:
            print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
            rows.append({"M": M, "N": N, "T": T, "error": (done.stderr or done.stdout)[-2000:]})
            continue
        fused = [launch for launch in launches if "linear_update_kernel" in launch["kernel"]]
        for name, launch in zip(names, fused):
            launch["config"] = name
        for launch in launches:
            row = {"M": M, "N": N, "T": T, "config": launch.get("config", launch["kernel"][:60]),
                   "summary": _summary(launch), "metrics": launch}  # fmt: skip
            rows.append(row)
            print(f"{M}x{N} T={T} {row['config']}: {row['summary']}", flush=True)
        write_result(args.output_name, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
