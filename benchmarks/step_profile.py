"""Where a training step's GPU time goes: kernel time by kind for each mode, side by side.

The modes of benchmarks/step.py on a model of its list (``--layers`` cuts the depth, so
that compiling takes seconds and per-layer costs still show), each in its own process:
after warm-up, ``torch.profiler`` records a few steps; each GPU kernel is put in a kind
by its name (forge's fused kernel, cuBLAS matmuls, attention, the optimizer's kernels,
Inductor's fused kernels, embedding backward, copies, the rest), and the step time
(CUDA events, median) is set against the summed kernel time: what is left is time the
GPU waited for the host.

    PYTHONPATH=. python benchmarks/step_profile.py --model llama-8b --layers 4 --modes forge,inductor

Writes results/step_profile.json (step_profile_h100.json on an H100, and so on): a case
measured again replaces its old one, the file's other cases stay, each with its own run's
environment.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.step import build, optimizer_step, timed_ms  # noqa: E402
from benchmarks.utils import (  # noqa: E402
    RESULTS,
    environment,
    for_this_card,
    gpu_ms_by_kernel,
    run_in_subprocess,
    write_result,
)

KINDS = [  # (kind, pattern on the kernel name), first match wins
    ("forge fused dW + update", r"_fused_linear_update_kernel|_hopper_linear_update_kernel"),
    ("forge head loss chunks", r"_fold_chunk_kernel|_logits_gradient_kernel"),
    ("optimizer (Inductor foreach)", r"^triton_for_"),
    ("optimizer (torch fused)", r"adam|multi_tensor_apply"),
    ("embedding backward", r"embedding|indexing_backward|compute_grad_weight|sum_and_scatter|krn_partial"),
    ("attention", r"flash|fmha|attention|_efficient_"),
    ("matmul (cuBLAS)", r"gemm|nvjet|xmma|cutlass|cublas|splitKreduce"),
    ("Inductor fused (Triton)", r"^triton_"),
    ("copy / fill", r"copy|fill|Memcpy|Memset|memset"),
]
PROFILED, TIMED = 3, 10


def kind_of(kernel_name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, kernel_name, flags=re.IGNORECASE):
            return kind
    return "other"


def worker(model_name: str, mode: str, layers: int, batch: int, seq: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda")
    model, config = build(model_name, device, layers)
    step = optimizer_step(model, mode)
    generator = torch.Generator(device=device).manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (batch, seq), device=device, generator=generator) for _ in range(2)]
    for i in range(3):
        step(batches[i % 2])
    torch.cuda.synchronize()
    step_ms = statistics.median(timed_ms(step, batches[i % 2], device)[0] for i in range(TIMED))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(PROFILED):
            step(batches[i % 2])
        torch.cuda.synchronize()
    by_kind, by_kernel = defaultdict(float), defaultdict(float)
    for name, ms in gpu_ms_by_kernel(prof, PROFILED).items():
        by_kind[kind_of(name)] += ms
        by_kernel[name[:120]] += ms
    kernel_ms = sum(by_kind.values())
    top = sorted(by_kernel.items(), key=lambda item: -item[1])[:25]
    return {"model": model_name, "layers": layers, "mode": mode, "batch": batch, "seq": seq, "step_ms": step_ms,
            "kernel_ms": kernel_ms, "gpu_idle_ms": step_ms - kernel_ms,
            "ms_by_kind": dict(sorted(by_kind.items(), key=lambda item: -item[1])),
            "top_kernels_ms": dict(top), "peak_gib": torch.cuda.max_memory_allocated() / 2**30}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-8b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--modes", default="forge,inductor,eager_fused")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.model, args.worker, args.layers, args.batch, args.seq)))
        return 0
    name = for_this_card("step_profile")
    # Cases of other models, depths or sizes stay in the file; a case measured again replaces its old one.
    key = ("model", "layers", "batch", "seq", "mode")
    try:
        earlier = json.loads((RESULTS / f"{name}.json").read_text())["cases"]
    except (OSError, ValueError, KeyError):
        earlier = []
    results = []
    for mode in args.modes.split(","):
        common = ["--model", args.model, "--layers", str(args.layers), "--batch", str(args.batch), "--seq", str(args.seq)]
        try:
            result = run_in_subprocess("benchmarks.step_profile", [*common, "--worker", mode], timeout=540)
        except Exception as error:  # recorded; the other modes go on
            result = {"model": args.model, "layers": args.layers, "batch": args.batch, "seq": args.seq, "mode": mode,
                      "status": "failed", "error": str(error)[-2000:]}  # fmt: skip
        results.append({**result, "environment": environment()})  # a kept case keeps its own run's
        print(json.dumps({k: result.get(k) for k in ("mode", "step_ms", "kernel_ms", "gpu_idle_ms", "ms_by_kind")}),
              flush=True)  # fmt: skip
        measured = {tuple(case.get(k) for k in key) for case in results}
        kept = [case for case in earlier if tuple(case.get(k) for k in key) not in measured]
        write_result(name, {"cases": kept + results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
