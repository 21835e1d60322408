"""The largest micro-batch that trains on one GPU: forge against the standard paths.

For a model of ``benchmarks/step.py`` (bf16 weights and states) at one sequence length,
each mode runs in its own process and searches the micro-batch: doubling from 2 until a
step runs out of memory, then bisecting between the last size that trained and the first
that did not (batch 1 is tried only when 2 does not fit). A size fits when two steps run,
the second with everything the first left behind (optimizer states, workspaces).

The batch dimension is marked dynamic, so a compiled mode compiles its step for sizes from
2 up: once, or again where a size breaks a guard Inductor added for the first (Llama-8B on
an H100: compiled at 2, 193 s, again at 8, 256 s). A search its timeout stops is kept with
its trials and resumes from them on the next run, so a long search spans several calls;
and forge runs with ``FORGE_AUTOTUNE=0``: tuning a new token count clones
each weight and its states for the trials, a one-off that a tuned, cached shape never
pays and that would otherwise decide the search. A step that runs out of memory leaves
the weights partly updated, which changes no later size's memory; its gradients are
dropped before the next size.

    PYTHONPATH=. python benchmarks/capacity.py --models llama-8b --modes eager_fused,forge
    PYTHONPATH=. python benchmarks/capacity.py --models qwen3-14b --modes eager_fused,forge

writes results/capacity[_card].json: per model and mode the largest micro-batch, every
size tried (fits or not, peak memory, seconds) and the card's memory. A case already in
the file is not measured again unless ``--redo`` (one that timed out resumes).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import step  # noqa: E402
from benchmarks.utils import RESULTS, environment, for_this_card, run_in_subprocess  # noqa: E402

MODES = ("eager_fused", "hooks", "inductor", "forge", "forge_int8")


def largest_fitting(fits: Callable[[int], bool], max_batch: int) -> int:
    """The largest size in [1, max_batch] for which ``fits`` holds, assuming that a size
    fits when a larger one does: 2, 4, 8, ... until one does not fit, then bisection.
    0 when not even 1 fits."""
    if not fits(min(2, max_batch)):
        return 1 if max_batch >= 2 and fits(1) else 0
    fitting, failing = min(2, max_batch), None
    while failing is None and fitting < max_batch:
        candidate = min(2 * fitting, max_batch)
        if fits(candidate):
            fitting = candidate
        else:
            failing = candidate
    while failing is not None and failing - fitting > 1:
        middle = (fitting + failing) // 2
        if fits(middle):
            fitting = middle
        else:
            failing = middle
    return fitting


def worker(model_name: str, mode: str, seq: int, max_batch: int, device: str = "cuda",
           known: list[dict] = ()) -> dict:  # fmt: skip
    """The search in this process; ``known``: trials of an earlier, stopped search on this
    card, whose outcomes stand in for running those sizes again."""
    device = torch.device(device)
    result = {"model": model_name, "mode": mode, "seq": seq, "device": device.type}
    if device.type == "cuda":
        result["card_bytes"] = torch.cuda.get_device_properties(device).total_memory
    model, config = step.build(model_name, device)
    result["parameters"] = sum(p.numel() for p in model.parameters())
    train = step.optimizer_step(model, mode)
    generator = torch.Generator(device=device).manual_seed(0)
    trials = list(known)
    outcomes = {trial["batch"]: trial["fits"] for trial in known}
    if known:
        result["resumed_from_trials"] = len(known)

    def record(trial: dict) -> None:  # printed too, for the parent to keep if it stops the worker
        trials.append(trial)
        print(json.dumps(trial), file=sys.stderr, flush=True)

    def fits(batch: int) -> bool:
        if batch in outcomes:
            return outcomes[batch]
        tokens = torch.randint(0, config.vocab_size, (batch, seq), device=device, generator=generator)
        if batch > 1:  # one compiled step for every size from 2 up
            torch._dynamo.mark_dynamic(tokens, 0)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start, failure = time.perf_counter(), None
        try:
            for _ in range(2):
                train(tokens)
            if device.type == "cuda":
                torch.cuda.synchronize()
        except torch.OutOfMemoryError as error:
            failure = str(error).splitlines()[0][:300]
        if failure is not None:  # outside the except block, whose traceback holds the step's tensors
            record({"batch": batch, "fits": False, "error": failure})
            del tokens
            for p in model.parameters():  # a backward cut short leaves gradients behind
                p.grad = None
            gc.collect()
            torch.cuda.empty_cache()
            return False
        record({"batch": batch, "fits": True, "seconds": time.perf_counter() - start,
                "peak_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None})  # fmt: skip
        return True

    result["largest_micro_batch"] = largest_fitting(fits, max_batch)
    result["trials"] = trials
    result["status"] = "ok"
    return result


def trials_printed(stderr: str | bytes | None) -> list[dict]:
    """The trials a worker printed to its stderr (one JSON object a line) before it was stopped."""
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr or ""
    trials = []
    for line in text.splitlines():
        if line.startswith('{"batch"'):
            try:
                trials.append(json.loads(line))
            except json.JSONDecodeError:  # the line the timeout cut
                pass
    return trials


class _Untried(Exception):
    pass


def settled_by(trials: list[dict], max_batch: int) -> int | None:
    """The search's answer where the trials of a stopped worker already settle it: the search
    replayed on their outcomes, or None where it would have tried a size they lack."""
    outcomes = {trial["batch"]: trial["fits"] for trial in trials}

    def recorded(batch: int) -> bool:
        if batch not in outcomes:
            raise _Untried
        return outcomes[batch]

    try:
        return largest_fitting(recorded, max_batch)
    except _Untried:
        return None


def timed_out_case(model: str, mode: str, seq: int, error: subprocess.TimeoutExpired, max_batch: int,
                   known: list[dict] = ()) -> dict:  # fmt: skip
    """A case whose worker was stopped: its trials so far (after ``known``, those it resumed
    from), and the answer where they settle it (the worker can be stopped after its last
    trial, before it reports). A later run resumes the search from these trials."""
    trials = list(known) + trials_printed(error.stderr)
    result = {"model": model, "mode": mode, "seq": seq, "trials": trials}
    largest = settled_by(trials, max_batch)
    if largest is None:
        result.update(status="failed", error=f"timed out after {error.timeout:.0f} s")
    else:
        result.update(status="ok", largest_micro_batch=largest,
                      note=f"the worker timed out after {error.timeout:.0f} s; its trials settle the search")  # fmt: skip
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-8b")
    parser.add_argument("--modes", default="eager_fused,forge")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=560, help="seconds per case")
    parser.add_argument("--device", default="cuda", help="cpu runs the tiny-llama smoke test")
    parser.add_argument("--redo", action="store_true", help="measure cases already in the results file again")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--known", default="[]", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.seq, args.max_batch, args.device, json.loads(args.known))))
        return 0
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}: choose from {', '.join(MODES)}")
    result_name = for_this_card("capacity")
    path = RESULTS / f"{result_name}.json"
    previous = json.loads(path.read_text()) if path.exists() else {"cases": []}
    cases = [(model, mode, args.seq) for model in args.models.split(",") for mode in args.modes.split(",")]
    key = lambda c: (c["model"], c["mode"], c["seq"])  # noqa: E731
    if args.redo:
        previous["cases"] = [c for c in previous["cases"] if key(c) not in set(cases)]
    # A search stopped by its timeout resumes from its trials: each call of a long search
    # (one compile per guard the batch size breaks) gets further.
    stopped = {key(c): c["trials"] for c in previous["cases"]
               if c.get("status") == "failed" and "timed out" in c.get("error", "") and c.get("trials")}  # fmt: skip
    previous["cases"] = [c for c in previous["cases"] if key(c) not in stopped]
    done = {key(c) for c in previous["cases"]}
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is optional
        tqdm = lambda x, **_: x  # noqa: E731
    os.environ["FORGE_AUTOTUNE"] = "0"  # for the workers: see the module docstring
    for model, mode, seq in tqdm([c for c in cases if c not in done], desc="capacity", file=sys.stdout):
        known = stopped.get((model, mode, seq), [])
        try:
            result = run_in_subprocess("benchmarks.capacity", ["--worker", model, mode, "--seq", str(seq),
                                                               "--max-batch", str(args.max_batch), "--device", args.device,
                                                               "--known", json.dumps(known)], timeout=args.timeout)  # fmt: skip
        except subprocess.TimeoutExpired as error:  # recorded with the sizes tried so far; the other cases go on
            result = timed_out_case(model, mode, seq, error, args.max_batch, known)
        except Exception as error:  # a crash: recorded, the other cases go on
            result = {"model": model, "mode": mode, "seq": seq, "status": "failed", "error": str(error)[-2000:]}
        result["environment"] = environment()
        previous["cases"].append(result)
        for folder in [path.parent] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else []):
            (folder / f"{result_name}.json").write_text(json.dumps(previous, indent=1))
        print(json.dumps({k: result.get(k) for k in ("model", "mode", "status", "largest_micro_batch")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
