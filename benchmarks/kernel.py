"""One linear layer's weight gradient plus its AdamW update: forge's fused kernel against
cuBLAS + torch's fused AdamW, and against the floor, side by side in one run.

For weight shapes of Llama-3.1-8B (4096x4096, 1024x4096, 14336x4096, 4096x14336) and a
small model (1024x1024), T tokens, bf16 dY, X and W, with bf16 and with fp32 states:

* baseline: ``g = dY.t() @ X`` (cuBLAS, bf16 gradient) then ``torch._fused_adamw_``
  (with fp32 states, which it takes only beside fp32 parameters, on an fp32 master copy
  of W that is then rounded back into W);
* forge: ``forge::fused_linear_update_`` (the gradient never exists);
* floor: max(2 M N T / measured bf16 matmul rate, minimum bytes / measured copy bandwidth),
  the minimum bytes reading dY, X, W and the states once and writing W and the states once.

Times are medians of CUDA-event timings (triton.testing.do_bench), rotating among input
sets larger than the L2 so that no run reads another's cached operands; each kernel's
first call (autotuning) is outside the timing. The ``gpu_*`` columns time the same calls
replayed from a CUDA graph: GPU time alone, without the host's launch time, which is what
the small weights' do_bench times mostly are.

    PYTHONPATH=. python benchmarks/kernel.py            # writes results/kernel.{json,csv,png} (kernel_h100.* on an H100)
    PYTHONPATH=. python benchmarks/kernel.py --resume   # after a cut-off run: only the cases not yet measured
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.utils import RESULTS, environment, for_this_card, write_result  # noqa: E402

SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (1024, 1024)]
TOKENS = [512, 1024, 2048, 4096, 8192, 16384]
STATE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LR, BETA1, BETA2, EPS, WEIGHT_DECAY = 1e-4, 0.9, 0.95, 1e-8, 0.1
L2_BYTES = 60 * 2**20  # the H200's L2 is 50 MiB: rotate through more than that


def _median_ms(fn, sets: int) -> float:
    import triton.testing

    counter = iter(range(10**9))
    return triton.testing.do_bench(lambda: fn(next(counter) % sets), warmup=50, rep=300, return_mode="median")


def _graph_median_ms(fn, sets: int, replays: int = 20) -> float:
    """GPU time alone: ``fn`` on every input set, captured in one CUDA graph and replayed;
    the median replay over the calls it holds. do_bench's events also count the host's
    launch time wherever that exceeds the kernels' (the small weights)."""
    repeats = max(1, -(-32 // sets))  # >= 32 calls a replay
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(sets):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            for i in range(sets):
                fn(i)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (repeats * sets))
    del graph
    return sorted(times)[len(times) // 2]


def measure_ceilings(device) -> dict:
    """The bf16 matmul rate (8192^3) and the copy bandwidth (read + write of 2 GiB), measured here."""
    import triton.testing

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    matmul_ms = triton.testing.do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    src = torch.randn(2**29, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=100, rep=500, return_mode="median")
    return {"bf16_matmul_tflops": 2 * 8192**3 / matmul_ms / 1e9, "copy_gb_per_s": 2 * src.nbytes / copy_ms / 1e6}


def minimum_bytes(M: int, N: int, T: int, state_bytes: int) -> int:
    return 2 * (M * T + T * N) + 2 * (2 * M * N) + 2 * (2 * M * N * state_bytes)


def _inputs(M, N, T, state_dtype, device, sets):
    generator = torch.Generator(device=device).manual_seed(M * 7 + N * 3 + T)
    out = []
    for _ in range(sets):
        w = torch.randn(M, N, device=device, generator=generator).to(torch.bfloat16)
        dy = (torch.randn(T, M, device=device, generator=generator) * 0.05).to(torch.bfloat16)
        x = torch.randn(T, N, device=device, generator=generator).to(torch.bfloat16)
        m = (torch.randn(M, N, device=device, generator=generator) * 1e-3).to(state_dtype)
        v = (torch.rand(M, N, device=device, generator=generator) * 1e-6).to(state_dtype)
        out.append((w, dy, x, m, v))
    return out


def baseline_update(inputs, device):
    """cuBLAS ``dY.t() @ X`` then ``torch._fused_adamw_`` on input set ``i``, as a function of ``i``.

    torch's fused AdamW takes states of the parameter's dtype only: with fp32 states it
    updates an fp32 master copy of the bf16 weight, then rounds it back (mixed precision)."""
    steps = [torch.tensor(10.0, device=device) for _ in inputs]
    masters = [w.float() for w, *_ in inputs] if inputs[0][3].dtype != torch.bfloat16 else None

    def baseline(i):
        w, dy, x, m, v = inputs[i]
        grad = dy.t() @ x
        param = w if masters is None else masters[i]
        torch._fused_adamw_([param], [grad.to(param.dtype)], [m], [v], [], [steps[i]], lr=LR, beta1=BETA1,
                            beta2=BETA2, weight_decay=WEIGHT_DECAY, eps=EPS, amsgrad=False, maximize=False)  # fmt: skip
        if masters is not None:
            w.copy_(param)

    return baseline


def case(M: int, N: int, T: int, state_name: str, ceilings: dict, device) -> dict:
    from forge_compile import rules
    from forge_compile.config import config
    from forge_compile.kernels.linear_update import fused_linear_update

    state_dtype = STATE_DTYPES[state_name]
    state_bytes = torch.finfo(state_dtype).bits // 8
    per_set = minimum_bytes(M, N, T, state_bytes)
    sets = max(2, -(-L2_BYTES // per_set))
    inputs = _inputs(M, N, T, state_dtype, device, sets)
    step = torch.tensor(10.0, device=device)
    hyper = [torch.tensor(h, dtype=torch.float64, device=device) for h in (LR, BETA1, BETA2, EPS, WEIGHT_DECAY)]
    rule = rules.get("adam")
    baseline = baseline_update(inputs, device)

    def forge(path):
        def run(i):
            w, dy, x, m, v = inputs[i]
            fused_linear_update(rule, w, dy.t(), x, [m, v], step, hyper, (1, 0, 0, 1))

        def timed(i):
            before, config.linear_update_path = config.linear_update_path, path
            try:
                run(i)
            finally:
                config.linear_update_path = before

        return timed

    variants = {"forge": forge("auto"), "fused": forge("fused"), "chunked": forge("chunked")}
    for fn in variants.values():
        fn(0)  # tunes this shape (the tuners restore the inputs) and, for "auto", measures the paths
    baseline(0)
    torch.cuda.synchronize()
    baseline_ms = _median_ms(baseline, sets)
    variant_ms = {name: _median_ms(fn, sets) for name, fn in variants.items()}
    forge_ms = variant_ms["forge"]
    graph_ms = {"baseline": _graph_median_ms(baseline, sets), "forge": _graph_median_ms(variants["forge"], sets)}
    compute_ms = 2 * M * N * T / (ceilings["bf16_matmul_tflops"] * 1e9)
    memory_ms = per_set / (ceilings["copy_gb_per_s"] * 1e6)
    floor_ms = max(compute_ms, memory_ms)
    return {
        "M": M, "N": N, "T": T, "states": state_name,
        "baseline_ms": baseline_ms, "forge_ms": forge_ms, "fused_kernel_ms": variant_ms["fused"],
        "chunked_ms": variant_ms["chunked"], "floor_ms": floor_ms,
        "floor_bound": "compute" if compute_ms >= memory_ms else "memory",
        "speedup": baseline_ms / forge_ms, "forge_over_floor": forge_ms / floor_ms,
        "baseline_over_floor": baseline_ms / floor_ms,
        "gpu_baseline_ms": graph_ms["baseline"], "gpu_forge_ms": graph_ms["forge"],
        "gpu_speedup": graph_ms["baseline"] / graph_ms["forge"], "gpu_forge_over_floor": graph_ms["forge"] / floor_ms,
    }  # fmt: skip


def check(device) -> float:
    """The fused kernel against float64 on one shape before timing anything: relative L2 of W."""
    from forge_compile.kernels.linear_update import fused_linear_update
    from forge_compile import rules

    w, dy, x, m, v = _inputs(1024, 4096, 1024, torch.float32, device, 1)[0]
    ref = w.double()
    grad = dy.t().double() @ x.double()
    m64, v64 = m.double() * BETA1 + (1 - BETA1) * grad, v.double() * BETA2 + (1 - BETA2) * grad * grad
    step = 10.0
    ref = ref * (1 - LR * WEIGHT_DECAY) - LR / (1 - BETA1**step) * m64 / ((v64 / (1 - BETA2**step)).sqrt() + EPS)
    hyper = [torch.tensor(h, dtype=torch.float64, device=device) for h in (LR, BETA1, BETA2, EPS, WEIGHT_DECAY)]
    fused_linear_update(rules.get("adam"), w, dy.t(), x, [m, v], torch.tensor(step, device=device), hyper, (1, 0, 0, 1))
    return float((w.double() - ref).norm() / ref.norm())


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(STATE_DTYPES), figsize=(12, 4.5), sharey=True)
    for ax, state_name in zip(axes, STATE_DTYPES):
        for M, N in SHAPES:
            points = [(r["T"], r["speedup"]) for r in rows if (r["M"], r["N"], r["states"]) == (M, N, state_name)]
            if points:
                ax.plot(*zip(*points), "o-", label=f"{M}x{N}", markersize=3)
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.axhline(1.5, color="gray", linewidth=0.5, linestyle="--")
        ax.set(xscale="log", xlabel="tokens T", title=f"{state_name} states", ylabel="baseline / forge")
        if ax.lines:
            ax.legend()
    fig.suptitle("fused dW + AdamW: speedup over cuBLAS + torch._fused_adamw_")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--states", default=",".join(STATE_DTYPES))
    parser.add_argument("--shapes", default=",".join(f"{m}x{n}" for m, n in SHAPES), help="MxN,...")
    parser.add_argument("--output", default=None, help="also write the results here (default $OUT)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the cases of results/kernel_partial.json (kernel_h100_partial.json on an "
                             "H100, and so on) and measure only the others")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernel.py times CUDA kernels: no CUDA device here", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    error = check(device)
    ceilings = measure_ceilings(device)
    rows = []
    name = for_this_card("kernel")  # kernel.json on the H200, kernel_h100.json on an H100
    partial = RESULTS / f"{name}_partial.json"
    if args.resume and partial.exists():  # a run cut off at the device's time limit goes on where it stopped
        import json

        rows = json.loads(partial.read_text())["rows"]
        print(f"resuming after {len(rows)} cases of {partial}")
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is optional
        tqdm = lambda x, **_: x  # noqa: E731
    shapes = [tuple(map(int, shape.split("x"))) for shape in args.shapes.split(",")]
    done = {(r["M"], r["N"], r["T"], r["states"]) for r in rows}
    cases = [(M, N, T, s) for s in args.states.split(",") for M, N in shapes for T in map(int, args.tokens.split(","))
             if (M, N, T, s) not in done]  # fmt: skip
    for M, N, T, s in tqdm(cases, desc="kernel", mininterval=10, file=sys.stdout):
        rows.append(case(M, N, T, s, ceilings, device))
        write_result(f"{name}_partial", {"ceilings": ceilings, "rows": rows}, args.output)  # survives a cut-off run
    largest = max(((r["M"], r["N"]) for r in rows), key=lambda s: s[0] * s[1])
    summary = {
        "fp32_check_relative_l2_vs_float64": error,
        "ceilings": ceilings,
        "largest_shape": list(largest),
    }
    for T in (512, 1024):
        hits = [r for r in rows if (r["M"], r["N"], r["T"], r["states"]) == (*largest, T, "bf16")]
        if hits:
            summary[f"kernel_speedup_T{T}"] = hits[0]["speedup"]
            summary[f"kernel_gpu_speedup_T{T}"] = hits[0]["gpu_speedup"]  # GPU time alone (CUDA graphs)
    summary["kernel_min_speedup_all_T"] = min(r["speedup"] for r in rows)
    summary["kernel_worst_over_floor"] = max(r["forge_over_floor"] for r in rows)
    summary["kernel_gpu_min_speedup_all_T"] = min(r["gpu_speedup"] for r in rows)
    summary["kernel_gpu_worst_over_floor"] = max(r["gpu_forge_over_floor"] for r in rows)
    write_result(name, {"summary": summary, "rows": rows}, args.output)
    with open(RESULTS / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, RESULTS / f"{name}.png")
    out = args.output or os.environ.get("OUT")
    if out:
        import shutil

        for file in (f"{name}.csv", f"{name}.png"):
            shutil.copy(RESULTS / file, Path(out) / file)
    print(f"{'M':>6} {'N':>6} {'T':>6} {'states':>6} {'baseline':>9} {'forge':>8} {'fused':>8} {'chunked':>8} "
          f"{'floor':>8} {'speedup':>8} {'/floor':>7} {'gpu x':>6} {'gpu/fl':>6}")
    for r in rows:
        print(f"{r['M']:>6} {r['N']:>6} {r['T']:>6} {r['states']:>6} {r['baseline_ms']:>9.3f} {r['forge_ms']:>8.3f} "
              f"{r['fused_kernel_ms']:>8.3f} {r['chunked_ms']:>8.3f} {r['floor_ms']:>8.3f} {r['speedup']:>8.2f} "
              f"{r['forge_over_floor']:>7.2f} {r['gpu_speedup']:>6.2f} {r['gpu_forge_over_floor']:>6.2f}")
    print({k: v for k, v in summary.items() if k != "ceilings"}, environment()["gpu"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
