"""Which tile configs and loop variants of the fused kernel are fastest on this GPU.

Each candidate (BLOCK_M x BLOCK_N x BLOCK_K, warps, stages; EPILOGUE_SPLIT: the rule run
on the whole tile or on its column halves in turn) runs alone (``linear_update.only_config``) on the dW + AdamW problem of
benchmarks/kernel.py, bf16 dY/X/W and states, beside cuBLAS's ``dY.t() @ X`` alone and
cuBLAS + ``torch._fused_adamw_``. The kernel's candidate list (``_configs``) and
default are chosen from results/kernel_configs.json. An earlier run of this script
(results/kernel_configs_prefetch_persistent.json) tried requesting the weight and state
tiles before the matmul loop, and persistent programs walking the tiles: both were slower
than the plain kernel in every case (5-50%), so the kernel has neither. Copying the
operand panels and the weight and state tiles with TMA descriptors instead of pointer
loads (commit 876f670; results/kernel_configs_tma_on_off.json and
kernel_configs_tma_operands_states.json) took 0.99-1.33x the pointer kernel's time for
the operands and 1.06-1.65x for the states, so the kernel loads through pointers.
Prefetching the weight and state tiles into the L2 (``prefetch.global.L2``, no registers)
1, 2 or 4 k-steps before the loop ends, or before it (commit 5ad0fd3;
results/kernel_configs_prefetch.json, bf16 and fp32 states) took 0.84-1.13x the time of
the same tile without it, and the fastest case by at most 8% (14336x4096, bf16 states,
T = 4096): not enough to pay for autotuning it, so the kernel does not prefetch. Loading
the weight and state tiles into registers before the loop (EARLY_LOAD, commit ee7e47e;
results/kernel_configs_early_load.json, on an H100) took 1.06-1.57x the time of the same
tile without it: 64x128x64 with 8 warps went from 114 to 182 registers a thread (one
program an SM instead of two), and 128x128x64 with 16 warps spilled 42; so it was removed.
The rule on column quarters (EPILOGUE_SPLIT=4), alone or with each quarter's weight and
state tiles loaded before the rule runs on the quarter before it (EPILOGUE_AHEAD, commit
7030fc7), on an H100 with both roundings (results/kernel_configs_quarters.json,
``--rounding stochastic,nearest``): stochastic rounding takes 64x128x64 w8 from 114 to 182
registers with halves (one program an SM; 124 with quarters, results/kernel_resources.json),
so there the halves tile runs 0.580 ms on 14336x4096 at T = 512 and quarters 0.469, but
128x128x64 w16 with halves, already a candidate, runs 0.443 (baseline 0.451). Over the 18
cases the best quartered or loaded-ahead config beat the best halves config by at most 1.4%
(64x128x64 w8 s3 quarters, 3 programs an SM, T = 1024 round-to-nearest: 0.499 against
0.506), and loading ahead never won: so the candidates keep halves and EPILOGUE_AHEAD was
removed.
Capping registers (a name ending in ``_r128``: ptxas's maxnreg) took 64x128x64 w8 with
stochastic rounding from 162 registers (one program an SM) to 128 without spilling, and
from 0.575 to 0.406 ms on 14336x4096 at T = 512 (on an H100, baseline 0.453; rounding to
nearest: 0.395 and 0.394; results/kernel_configs_registers.json), so that candidate is
capped. A cap of 80 registers, for three programs an SM with 3 stages, spilled 34-44
registers and took 0.460-0.494 ms there.
The chunked path's kernel (``--chunk-elements``; ``--chunk-configs`` times its candidates
one by one, ``--gpu-time`` adds CUDA-graph GPU times) runs tiles of its own: on an H100,
14336x4096 at T = 512 in 2^24-element blocks, 4x256 and 8x256 tiles (64 registers a
thread) took 0.465 ms of GPU time, 16x256 (199 registers) 0.564, and the matmul tiles
64x128 w8 and 128x128 w16 0.491 and 0.512 (results/kernel_chunked_tiles.json; a wider
first sweep, results/kernel_chunked_epilogue.json). The fused kernel took 0.404 there.

    PYTHONPATH=. python benchmarks/kernel_configs.py [--budget-s 300]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.kernel import (  # noqa: E402
    BETA1, BETA2, EPS, L2_BYTES, LR, STATE_DTYPES, WEIGHT_DECAY, _graph_median_ms, _inputs, baseline_update,
    minimum_bytes,
)  # fmt: skip
from benchmarks.utils import write_result  # noqa: E402

SHAPES = [(14336, 4096), (4096, 14336), (4096, 4096), (1024, 4096)]
TOKENS = [512, 1024, 4096, 16384]
TILES = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
    (128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
    (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (64, 256, 64, 4, 3),
]  # fmt: skip
SPLITS = [1, 2]  # EPILOGUE_SPLIT: the rule on the whole tile, or on its column halves in turn


def _quick_ms(fn, sets: int) -> float:
    """Median of CUDA-event timings over ~50 ms, rotating input sets as benchmarks/kernel.py does."""
    import triton.testing

    counter = iter(range(10**9))
    return triton.testing.do_bench(lambda: fn(next(counter) % sets), warmup=10, rep=50, return_mode="median")


def _chunked_ms(fused, elements: int, sets: int, kernel_config=None, gpu_time: bool = False) -> dict:
    """The chunked path with blocks of ``elements`` fp32 gradient elements, its kernel
    autotuned or ``kernel_config`` alone: {"ms": CUDA-event median[, "gpu_ms": graph replays]}."""
    from forge_compile.config import config
    from forge_compile.kernels import linear_update

    saved_path, saved_elements = config.linear_update_path, linear_update._CHUNK_ELEMENTS
    config.linear_update_path, linear_update._CHUNK_ELEMENTS = "chunked", elements
    try:
        with linear_update.only_config(kernel_config) if kernel_config else contextlib.nullcontext():
            fused(0)
            out = {"ms": _quick_ms(fused, sets)}
            if gpu_time:
                out["gpu_ms"] = _graph_median_ms(fused, sets, replays=10)
            return out
    finally:
        config.linear_update_path, linear_update._CHUNK_ELEMENTS = saved_path, saved_elements


def config_name(m: int, n: int, k: int, warps: int, stages: int, split: int, registers: int | None = None) -> str:
    """``128x128x64_w8_s3_e2``; ``_r128`` at the end caps ptxas at 128 registers a thread."""
    return f"{m}x{n}x{k}_w{warps}_s{stages}_e{split}" + (f"_r{registers}" if registers else "")


def kernel_candidate_names() -> list[str]:
    """The fused kernel's own autotuning candidates on the GPU."""
    from forge_compile.kernels.linear_update import EPILOGUE_SPLITS, GPU_TILES

    return [config_name(*tile[:5], split, tile[5]) for tile in GPU_TILES for split in EPILOGUE_SPLITS]


def given_gradient_candidate_names() -> list[str]:
    """The chunked path's kernel's autotuning candidates on the GPU."""
    from forge_compile.kernels.linear_update import GIVEN_GRADIENT_TILES

    return [config_name(*tile[:5], 1, tile[5]) for tile in GIVEN_GRADIENT_TILES]


def _config(name: str):
    """``128x128x64_w8_s3_e2`` or ``64x128x64_w8_s4_e2_r128`` -> the triton.Config it names."""
    from forge_compile.kernels.linear_update import tile_config

    tile, warps, stages, split, *registers = name.split("_")
    if len(registers) > 1 or any(not r.startswith("r") for r in registers):
        raise ValueError(f"config name {name!r} is not MxNxK_wW_sS_eE[_rR]")
    m, n, k = map(int, tile.split("x"))
    cap = int(registers[0][1:]) if registers else None
    return tile_config((m, n, k, int(warps[1:]), int(stages[1:]), cap), int(split[1:]))


def compiled_resources() -> dict[str, dict]:
    """Registers a thread, spilled registers and shared memory of every compiled variant of
    the fused kernel, keyed by its config (what ptxas gave each)."""
    from forge_compile.kernels import linear_update

    out = {}
    for kernel_cache, *_ in getattr(linear_update._fused_linear_update_kernel.fn, "device_caches", {}).values():
        for kernel in kernel_cache.values():
            kernel._init_handles()  # n_regs and n_spills are read when the binary is loaded
            arg_names = kernel.src.fn.arg_names
            constants = {}
            for key, value in kernel.src.constants.items():  # keyed by (argument index,) in Triton 3.x
                index = key[0] if isinstance(key, tuple) else key
                constants[arg_names[index] if isinstance(index, int) else index] = value
            meta = kernel.metadata
            name = config_name(*(constants.get(k, "?") for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")), meta.num_warps,
                               meta.num_stages, constants.get("EPILOGUE_SPLIT", "?"), getattr(meta, "maxnreg", None))  # fmt: skip
            if constants.get("ROUND_STOCHASTIC"):
                name += " stochastic"
            out[name] = {"registers": kernel.n_regs, "spills": kernel.n_spills, "shared_bytes": meta.shared}
    return out


def candidates(spec: str | None):
    """The named configs; "kernel" stands for the kernel's own autotuning candidates;
    none given: the search grid TILES x SPLITS."""
    if spec is None:
        names = [config_name(*tile, split) for tile in TILES for split in SPLITS]
    else:
        names = []
        for item in spec.split(","):
            names += kernel_candidate_names() if item == "kernel" else [item]
    return [(name, _config(name)) for name in dict.fromkeys(names)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=300, help="stop timing new cases after this long")
    parser.add_argument("--configs", default=None, help='comma-separated config names; "kernel": its candidates')
    parser.add_argument("--output-name", default="kernel_configs", help="results/NAME.json")
    parser.add_argument("--chunk-elements", default="",
                        help="comma-separated block sizes (elements) at which to time the chunked path too")
    parser.add_argument("--chunk-configs", default="",
                        help='configs of the chunked path\'s kernel to time one by one at each --chunk-elements '
                             '("kernel": its candidates); the autotuned chunked path is timed either way')
    parser.add_argument("--gpu-time", action="store_true",
                        help="also time the baseline, the best config and the chunked path from CUDA-graph replays "
                             "(GPU time alone, no host launch time)")
    parser.add_argument("--states", default="bf16", help="state dtypes, comma-separated: bf16, fp32")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--rounding", default="nearest",
                        help="weight rounding, comma-separated: nearest, stochastic (forge's default for bf16 "
                             "weights in a training step; the baseline rounds to nearest either way)")
    parser.add_argument("--shapes", default=None, help="MxN,... (default: %s)" % ",".join(f"{m}x{n}" for m, n in SHAPES))
    args = parser.parse_args()
    from forge_compile import rules
    from forge_compile.kernels import linear_update

    device = torch.device("cuda")
    rule = rules.get("adam")
    hyper = [torch.tensor(h, dtype=torch.float64, device=device) for h in (LR, BETA1, BETA2, EPS, WEIGHT_DECAY)]
    step = torch.tensor(10.0, device=device)
    configs = candidates(args.configs)
    chunk_sizes = [int(c) for c in args.chunk_elements.split(",") if c]
    chunk_configs = [] if not args.chunk_configs else [
        (name, _config(name)) for item in args.chunk_configs.split(",")
        for name in (given_gradient_candidate_names() if item == "kernel" else [item])
    ]  # fmt: skip
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else SHAPES
    started = time.perf_counter()
    rows, failures = [], {}
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is optional
        tqdm = lambda x, **_: x  # noqa: E731
    tokens = [int(t) for t in args.tokens.split(",")]
    state_names = args.states.split(",")
    roundings = args.rounding.split(",")
    cases = [(M, N, states, T, r) for M, N in shapes for states in state_names for T in tokens for r in roundings]
    for M, N, states, T, rounding in tqdm(cases, desc="cases", file=sys.stdout):
        if time.perf_counter() - started > args.budget_s:
            break
        state_dtype = STATE_DTYPES[states]
        per_set = minimum_bytes(M, N, T, torch.finfo(state_dtype).bits // 8)
        sets = max(2, -(-L2_BYTES // per_set))
        inputs = _inputs(M, N, T, state_dtype, device, sets)
        baseline = baseline_update(inputs, device)

        def matmul(i):
            _, dy, x, _, _ = inputs[i]
            return dy.t() @ x

        def fused(i):
            w, dy, x, m, v = inputs[i]
            linear_update.fused_linear_update(rule, w, dy.t(), x, [m, v], step, hyper, (1, 0, 0, 1),
                                              rounding_seed=1234 if rounding == "stochastic" else None)  # fmt: skip

        row = {"M": M, "N": N, "T": T, "states": states, "rounding": rounding, "baseline_ms": _quick_ms(baseline, sets),
               "cublas_matmul_ms": _quick_ms(matmul, sets), "configs_ms": {}}  # fmt: skip
        for name, kernel_config in configs:
            if name in failures:
                continue
            try:
                with linear_update.only_config(kernel_config):
                    fused(0)
                    row["configs_ms"][name] = _quick_ms(fused, sets)
            except Exception as error:  # out of shared memory or registers: recorded, the others go on
                failures[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        for elements in chunk_sizes:  # the chunked path (cuBLAS blocks + the kernel's epilogue)
            timed = {"autotuned": _chunked_ms(fused, elements, sets, gpu_time=args.gpu_time)}
            for name, kernel_config in chunk_configs:
                timed[name] = _chunked_ms(fused, elements, sets, kernel_config, gpu_time=args.gpu_time)
            row.setdefault("chunked", {})[str(elements)] = timed
        best = min(row["configs_ms"], key=row["configs_ms"].get)
        row.update(best=best, best_ms=row["configs_ms"][best], speedup=row["baseline_ms"] / row["configs_ms"][best])
        if args.gpu_time:
            row["gpu_baseline_ms"] = _graph_median_ms(baseline, sets, replays=10)
            with linear_update.only_config(dict(configs)[best]):
                row["gpu_best_ms"] = _graph_median_ms(fused, sets, replays=10)
        rows.append(row)
        print(f"{M}x{N} {states} {rounding} T={T}: baseline {row['baseline_ms']:.3f} cuBLAS mm {row['cublas_matmul_ms']:.3f} "
              f"best {best} {row['best_ms']:.3f} ({row['speedup']:.2f}x)", flush=True)
        for elements, timed in row.get("chunked", {}).items():
            print(f"  chunked, blocks of {elements}: " + ", ".join(
                f"{name} {t['ms']:.3f}" + (f" (GPU {t['gpu_ms']:.3f})" if "gpu_ms" in t else "")
                for name, t in timed.items()), flush=True)
        write_result(args.output_name, {"rows": rows, "failures": failures})
        inputs = baseline = None  # freed before the next case allocates
        torch.cuda.empty_cache()
    # One config for all cases: the smallest worst-case ratio to each case's best.
    names = set.intersection(*(set(r["configs_ms"]) for r in rows))
    worst = {n: max(r["configs_ms"][n] / r["best_ms"] for r in rows) for n in names}
    ranking = sorted(worst, key=worst.get)
    try:
        resources = compiled_resources()
    except Exception as error:  # Triton's internals move between releases: the timings stand without it
        resources = {"error": f"{type(error).__name__}: {error}"}
    write_result(args.output_name, {"rows": rows, "failures": failures, "compiled": resources,
                                    "worst_ratio_to_best_by_config": {n: worst[n] for n in ranking}})  # fmt: skip
    print("compiled:", resources)
    print("best single configs (worst ratio to each case's best):", [(n, round(worst[n], 3)) for n in ranking[:8]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
