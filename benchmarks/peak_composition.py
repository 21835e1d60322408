"""What is alive at a training step's peak: the allocations, by the line that made them.

One step of a model from ``benchmarks/step.py`` (after two untimed steps) runs under
CUDA's allocator history (Python stacks only). Replaying the history's allocations and
frees finds the moment the step's own memory peaks; each allocation alive then is named
by the innermost frame in Inductor's generated code, forge or the benchmarks (the
generated line says which buffer of which kernel it is). Weights, states and anything
else allocated before the step are the baseline, reported as one figure.

    PYTHONPATH=. python benchmarks/peak_composition.py --model llama-8b --mode forge

writes results/peak_composition[_card].json: the baseline, the step's peak above it,
``max_memory_allocated``, and the allocations alive at the peak, largest first, with
identical sources summed.
"""

from __future__ import annotations

import argparse
import collections
import linecache
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.utils import for_this_card, write_result  # noqa: E402

_OWN_FRAMES = ("torchinductor", "forge_compile", "benchmarks")


def source_of(frames: list[dict]) -> str:
    """``file:line  code`` of the innermost frame in generated code, forge or the benchmarks."""
    for frame in frames:
        if any(part in frame["filename"] for part in _OWN_FRAMES):
            code = linecache.getline(frame["filename"], frame["line"]).strip()
            return f"{os.path.basename(frame['filename'])}:{frame['line']}  {code[:160]}"
    return f"{frames[0]['filename']}:{frames[0]['line']}" if frames else "?"


def peak_of(trace: list[dict]) -> tuple[int, dict[int, dict]]:
    """Replay an allocator trace: the largest sum of live allocations it reaches and those
    allocations (address -> trace entry). Blocks allocated before the trace began are not
    counted, and their frees are ignored."""
    live: dict[int, dict] = {}
    current = best = 0
    at_best: dict[int, dict] = {}
    for entry in trace:
        if entry["action"] == "alloc":
            live[entry["addr"]] = entry
            current += entry["size"]
            if current > best:
                best, at_best = current, dict(live)
        elif entry["action"] == "free_completed" and entry["addr"] in live:
            current -= live.pop(entry["addr"])["size"]
    return best, at_best


def composition(alive: dict[int, dict], top: int) -> list[dict]:
    """The allocations alive at the peak grouped by source, largest total first."""
    by_source: dict[str, list[int]] = collections.defaultdict(list)
    for entry in alive.values():
        by_source[source_of(entry.get("frames", []))].append(entry["size"])
    rows = [{"source": source, "bytes": sum(sizes), "allocations": len(sizes)} for source, sizes in by_source.items()]
    return sorted(rows, key=lambda row: -row["bytes"])[:top]


def main() -> int:
    from benchmarks.step import MODELS, build, optimizer_step

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-8b", choices=sorted(MODELS))
    parser.add_argument("--mode", default="forge")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("peak_composition needs a CUDA device (the allocator history is CUDA's)")
        return 1
    device = torch.device("cuda")
    model, config = build(args.model, device)
    step = optimizer_step(model, args.mode)
    generator = torch.Generator(device=device).manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device, generator=generator)
               for _ in range(3)]  # fmt: skip
    for batch in batches[:2]:
        step(batch)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    step(batches[2])
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    step_peak, alive = peak_of(trace)
    rows = composition(alive, args.top)
    result = {"model": args.model, "mode": args.mode, "batch": args.batch, "seq": args.seq,
              "baseline_bytes": baseline, "step_peak_above_baseline_bytes": step_peak,
              "max_memory_allocated_bytes": torch.cuda.max_memory_allocated(),
              "trace_entries": len(trace), "alive_at_peak": rows}  # fmt: skip
    write_result(for_this_card("peak_composition"), result)
    print(f"baseline {baseline / 2**30:.2f} GiB, step peak +{step_peak / 2**30:.2f} GiB, "
          f"max_memory_allocated {result['max_memory_allocated_bytes'] / 2**30:.2f} GiB")  # fmt: skip
    for row in rows:
        print(f"{row['bytes'] / 2**20:10.1f} MiB  x{row['allocations']:<3d} {row['source']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
