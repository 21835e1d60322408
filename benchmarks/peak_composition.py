"""What is alive at a training step's peak: the allocations, by the line that made them.

One step of a model from ``benchmarks/step.py`` (after two untimed steps) runs under
CUDA's allocator history (Python stacks only). Replaying the history's allocations and
frees finds the moment the step's own memory peaks; each allocation alive then is named
by the innermost frame in Inductor's generated code, forge or the benchmarks (the
generated line says which buffer of which kernel it is). Weights, states and anything
else allocated before the step are the baseline, reported as one figure.

    PYTHONPATH=. python benchmarks/peak_composition.py --model llama-8b --mode forge

writes results/peak_composition[_card].json: the baseline, the step's peak above it,
``max_memory_allocated``, the allocation that reached the peak, every allocation alive at
the peak (largest first, identical sources summed; ``--top`` of them printed) and the same
grouped by the shape and dtype the generated code allocated them with. Inductor reuses a
buffer for later values of its size (``buf51 = reinterpret_tensor(buf27, ...)``), so a
source names where the memory was allocated, not what it holds at the peak; the shapes
say what sizes of value hold it.
"""

from __future__ import annotations

import argparse
import collections
import linecache
import os
import re
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


def peak_of(trace: list[dict]) -> tuple[int, dict[int, dict], dict | None]:
    """Replay an allocator trace: the largest sum of live allocations it reaches, those
    allocations (address -> trace entry) and the allocation that reached it. Blocks
    allocated before the trace began are not counted, and their frees are ignored."""
    live: dict[int, dict] = {}
    current = best = 0
    at_best: dict[int, dict] = {}
    reached_by = None
    for entry in trace:
        if entry["action"] == "alloc":
            live[entry["addr"]] = entry
            current += entry["size"]
            if current > best:
                best, at_best, reached_by = current, dict(live), entry
        elif entry["action"] == "free_completed" and entry["addr"] in live:
            current -= live.pop(entry["addr"])["size"]
    return best, at_best, reached_by


def composition(alive: dict[int, dict]) -> list[dict]:
    """The allocations alive at the peak grouped by source, largest total first."""
    by_source: dict[str, list[int]] = collections.defaultdict(list)
    for entry in alive.values():
        by_source[source_of(entry.get("frames", []))].append(entry["size"])
    rows = [{"source": source, "bytes": sum(sizes), "allocations": len(sizes)} for source, sizes in by_source.items()]
    return sorted(rows, key=lambda row: -row["bytes"])


_ALLOCATED_AS = re.compile(r"empty_strided_\w+\(\(([^)]*)\), \([^)]*\), torch\.(\w+)\)")


def by_shape(rows: list[dict]) -> list[dict]:
    """:func:`composition`'s rows summed by the shape and dtype that generated code allocated
    them with ("other" where the source is not such an allocation), largest total first."""
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for row in rows:
        match = _ALLOCATED_AS.search(row["source"])
        shape = f"({match.group(1)}) {match.group(2)}" if match else "other"
        groups[shape][0] += row["bytes"]
        groups[shape][1] += row["allocations"]
    return sorted(({"shape": shape, "bytes": b, "allocations": n} for shape, (b, n) in groups.items()),
                  key=lambda group: -group["bytes"])  # fmt: skip


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
    step_peak, alive, reached_by = peak_of(trace)
    rows = composition(alive)
    result = {"model": args.model, "mode": args.mode, "batch": args.batch, "seq": args.seq,
              "baseline_bytes": baseline, "step_peak_above_baseline_bytes": step_peak,
              "max_memory_allocated_bytes": torch.cuda.max_memory_allocated(), "trace_entries": len(trace),
              "peak_reached_by": source_of(reached_by.get("frames", [])) if reached_by else None,
              "alive_at_peak_by_shape": by_shape(rows), "alive_at_peak": rows}  # fmt: skip
    write_result(for_this_card("peak_composition"), result)
    print(f"baseline {baseline / 2**30:.2f} GiB, step peak +{step_peak / 2**30:.2f} GiB, "
          f"max_memory_allocated {result['max_memory_allocated_bytes'] / 2**30:.2f} GiB")  # fmt: skip
    print(f"reached by {result['peak_reached_by']}")
    for group in result["alive_at_peak_by_shape"]:
        print(f"{group['bytes'] / 2**20:10.1f} MiB  x{group['allocations']:<4d} {group['shape']}")
    for row in rows[: args.top]:
        print(f"{row['bytes'] / 2**20:10.1f} MiB  x{row['allocations']:<3d} {row['source']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
