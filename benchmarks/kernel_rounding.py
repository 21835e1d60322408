"""What stochastic rounding costs the fused kernel: the same update with and without it.

``benchmarks/kernel.py`` times the fused kernel rounding to nearest; a compiled bf16 step
rounds stochastically by default (a hash of each element's index a tile). In the 8B step
profile on an H100 (``results/step_profile_h100.json``, 4 layers) the fused kernels took
12.6 ms where kernel.py's per-shape times add up to about 9.6 ms; this measures how much
of that the rounding is. Llama-3.1-8B's weight shapes and its head, bf16 states, T tokens,
each shape tuned for each variant before timing (the rounding is a constexpr of the kernel).

    PYTHONPATH=. python benchmarks/kernel_rounding.py            # results/kernel_rounding[_card].json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.kernel import BETA1, BETA2, EPS, L2_BYTES, LR, WEIGHT_DECAY, _inputs, _median_ms, minimum_bytes  # noqa: E402
from benchmarks.utils import for_this_card, write_result  # noqa: E402

SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
ROUNDING_SEED = 12345


def case(M: int, N: int, T: int, device) -> dict:
    from forge_compile import rules
    from forge_compile.kernels.linear_update import fused_linear_update

    sets = max(2, -(-L2_BYTES // minimum_bytes(M, N, T, 2)))
    inputs = _inputs(M, N, T, torch.bfloat16, device, sets)
    step = torch.tensor(10.0, device=device)
    hyper = [torch.tensor(h, dtype=torch.float64, device=device) for h in (LR, BETA1, BETA2, EPS, WEIGHT_DECAY)]
    rule = rules.get("adam")

    def variant(seed):
        def run(i):
            w, dy, x, m, v = inputs[i]
            fused_linear_update(rule, w, dy.t(), x, [m, v], step, hyper, (1, 0, 0, 1), rounding_seed=seed)

        return run

    times = {}
    for name, seed in (("nearest", None), ("stochastic", ROUNDING_SEED)):
        fn = variant(seed)
        fn(0)  # tunes this shape and variant
        torch.cuda.synchronize()
        times[name] = _median_ms(fn, sets)
    return {"M": M, "N": N, "T": T, "nearest_ms": times["nearest"], "stochastic_ms": times["stochastic"],
            "stochastic_over_nearest": times["stochastic"] / times["nearest"]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1024")
    parser.add_argument("--shapes", default=",".join(f"{m}x{n}" for m, n in SHAPES), help="MxN,...")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernel_rounding times the fused kernel on a CUDA device")
        return 1
    device = torch.device("cuda")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        for M, N in shapes:
            rows.append(case(M, N, T, device))
            r = rows[-1]
            print(f"{M}x{N} T={T}: nearest {r['nearest_ms']:.3f} ms, stochastic {r['stochastic_ms']:.3f} ms, "
                  f"{r['stochastic_over_nearest']:.3f}x", flush=True)  # fmt: skip
    summary = {"median_stochastic_over_nearest": statistics.median(r["stochastic_over_nearest"] for r in rows)}
    write_result(for_this_card("kernel_rounding"), {"summary": summary, "rows": rows})
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
