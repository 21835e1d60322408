"""Whole training steps on the GPU: forge against the standard paths, each case in its own process.

Models with random weights from transformers configs (the shapes of Qwen3-0.6B,
Qwen3-1.7B, Llama-3.1-8B with untied embeddings, Qwen3-14B), bf16 weights and states,
micro-batch x sequence as given. Modes:

* ``eager_fused``: eager model, ``torch.optim.AdamW(fused=True)``;
* ``hooks``: eager model, one fused AdamW per parameter stepped in its
  post-accumulate-grad hook (the optimizer-in-backward recipe);
* ``inductor``: ``torch.compile(train_step, backend="inductor")``, torch's AdamW compiled
  with it (foreach, capturable);
* ``forge``: forge's AdamW, ``torch.compile(train_step, backend="forge")``;
* ``forge_int8``: the same with ``state_dtype="int8"``;
* ``forge_unchunked_head``: ``forge`` with ``forge_compile.config.chunk_head_loss`` off (the
  logits whole, as before the chunked head loss), for the side-by-side of its cost;
* ``inductor_cudagraphs``, ``forge_cudagraphs``: ``inductor`` and ``forge`` compiled with
  ``mode="reduce-overhead"`` (CUDA graphs: the step replays without host launches).

Step time is the median of CUDA-event timings of the steps after warm-up; peak memory is
``max_memory_allocated`` over those steps (after a reset), and also over the whole run
including compilation. A case that runs out of memory is recorded as such.

    PYTHONPATH=. python benchmarks/step.py --models llama-8b --batches 1 --modes eager_fused,forge
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.utils import (  # noqa: E402
    RESULTS, build_causal_lm, causal_lm_train_step, environment, for_this_card, run_in_subprocess,
)  # fmt: skip

MODELS = {
    # name: (hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings)
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, 151936, True),
    "qwen3-1.7b": (2048, 6144, 28, 16, 8, 151936, True),
    "llama-8b": (4096, 14336, 32, 32, 8, 128256, False),
    "qwen3-14b": (5120, 17408, 40, 40, 8, 151936, False),
    "tiny-llama": (64, 128, 2, 4, 2, 256, False),  # a smoke test of this script on the CPU
}
MODES = ("eager_fused", "hooks", "inductor", "forge", "forge_int8", "forge_unchunked_head", "inductor_cudagraphs",
         "forge_cudagraphs")  # fmt: skip
WARMUP, TIMED = 3, 10


def build(name: str, device, layers: int | None = None):
    """The model ``name`` (``layers`` overrides its depth), bf16, on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    hidden, intermediate, depth, heads, kv_heads, vocab, tied = MODELS[name]
    layers = layers or depth
    common = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                  tie_word_embeddings=tied, max_position_embeddings=4096, attn_implementation="sdpa")  # fmt: skip
    config, cls = ((Qwen3Config(head_dim=128, **common), Qwen3ForCausalLM) if name.startswith("qwen")
                   else (LlamaConfig(**common), LlamaForCausalLM))  # fmt: skip
    return build_causal_lm(cls, config, device, torch.bfloat16), config


def optimizer_step(model, mode: str):
    import forge_compile

    hyper = dict(lr=1e-5, betas=(0.9, 0.95), weight_decay=0.1)
    if mode == "eager_fused":
        return causal_lm_train_step(model, torch.optim.AdamW(model.parameters(), **hyper, fused=True))
    if mode == "hooks":
        optimizers = {}
        for p in model.parameters():
            optimizers[p] = torch.optim.AdamW([p], **hyper, fused=True)

            def hook(param):
                optimizers[param].step()
                optimizers[param].zero_grad()

            p.register_post_accumulate_grad_hook(hook)

        def train_step(input_ids):
            loss = model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            return loss.detach()

        return train_step
    compile_mode = "reduce-overhead" if mode.endswith("_cudagraphs") else None
    if mode.startswith("inductor"):
        optimizer = torch.optim.AdamW(model.parameters(), **hyper, foreach=True, capturable=True)
        return torch.compile(causal_lm_train_step(model, optimizer), backend="inductor", mode=compile_mode)
    state_dtype = "int8" if mode == "forge_int8" else None
    forge_compile.config.chunk_head_loss = mode != "forge_unchunked_head"  # each case runs in a process of its own
    optimizer = forge_compile.optim.AdamW(model.parameters(), **hyper, state_dtype=state_dtype)
    return torch.compile(causal_lm_train_step(model, optimizer), backend="forge", mode=compile_mode)


def _synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_ms(step, batch, device):
    """One step's time in ms: CUDA events on the GPU, the host clock elsewhere."""
    if device.type != "cuda":
        start = time.perf_counter()
        loss = step(batch)
        return (time.perf_counter() - start) * 1e3, loss
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    loss = step(batch)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end), loss


def _peak_bytes(device):
    return torch.cuda.max_memory_allocated() if device.type == "cuda" else None


def worker(model_name: str, mode: str, batch: int, seq: int, device: str = "cuda", layers: int | None = None) -> dict:
    device = torch.device(device)
    result = {"model": model_name, "mode": mode, "batch": batch, "seq": seq, "device": device.type}
    if layers:
        result["layers"] = layers
    try:
        model, config = build(model_name, device, layers)
        result["parameters"] = sum(p.numel() for p in model.parameters())
        step = optimizer_step(model, mode)
        generator = torch.Generator(device=device).manual_seed(0)
        batches = [torch.randint(0, config.vocab_size, (batch, seq), device=device, generator=generator)
                   for _ in range(4)]  # fmt: skip
        start = time.perf_counter()
        if mode.startswith("forge"):  # the first step, run through explain to record what was fused
            import forge_compile

            report = forge_compile.explain(step, batches[0])
            result["fused_weights"] = len(report.fused)
            result["unfused"] = {d.name: d.code for d in report.rejected}
        else:
            step(batches[0])
        _synchronize(device)
        result["first_step_s"] = time.perf_counter() - start
        for i in range(1, WARMUP):
            step(batches[i % 4])
        _synchronize(device)
        result["peak_with_compile_bytes"] = _peak_bytes(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        for i in range(TIMED):
            milliseconds, loss = timed_ms(step, batches[i % 4], device)
            times.append(milliseconds)
            losses.append(float(loss))
        result.update(step_ms_median=statistics.median(times), step_ms_all=times, peak_bytes=_peak_bytes(device),
                      loss=losses[-1], losses=losses, status="ok")  # fmt: skip
        if mode.endswith("_cudagraphs"):  # how many graphs Inductor ran without CUDA graphs
            from torch._dynamo.utils import counters

            result["cudagraph_skip_count"] = counters["inductor"]["cudagraph_skips"]
    except torch.OutOfMemoryError as error:
        result.update(status="out_of_memory", error=str(error).splitlines()[0])
    return result


def plot(cases: list[dict], path: Path) -> None:
    """Step time and peak memory against micro-batch, one line per mode, a panel pair per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [c for c in cases if c.get("status") == "ok"]
    models = sorted({(c["model"], c["seq"]) for c in ok})
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 3.6 * len(models)), squeeze=False)
    for (model, seq), (time_ax, memory_ax) in zip(models, axes):
        for mode in MODES:
            points = sorted((c["batch"], c["step_ms_median"], (c["peak_bytes"] or 0) / 2**30) for c in ok
                            if (c["model"], c["seq"], c["mode"]) == (model, seq, mode))  # fmt: skip
            if points:
                batches, times, peaks = zip(*points)
                time_ax.plot(batches, times, "o-", label=mode)
                memory_ax.plot(batches, peaks, "o-", label=mode)
        time_ax.set(title=f"{model}, seq {seq}: step time", xlabel="micro-batch", ylabel="ms", xscale="log", xticks=[1, 2, 4, 8])
        memory_ax.set(title=f"{model}, seq {seq}: peak memory", xlabel="micro-batch", ylabel="GiB", xscale="log", xticks=[1, 2, 4, 8])
        time_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen3-0.6b,qwen3-1.7b,llama-8b")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=None,
                        help="a shallower model of the same width; results go to results/step_<N>layers.json (step_<N>layers_h100.json on an H100)")
    parser.add_argument("--worker", nargs=4, metavar=("MODEL", "MODE", "BATCH", "SEQ"), help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=560, help="seconds per case")
    parser.add_argument("--device", default="cuda", help="cpu runs the tiny-llama smoke test")
    parser.add_argument("--redo", action="store_true", help="measure cases already in results/step.json again")
    parser.add_argument("--plot", action="store_true", help="only redraw results/step.png from results/step.json")
    args = parser.parse_args()
    if args.worker:
        name, mode, batch, seq = args.worker
        print(json.dumps(worker(name, mode, int(batch), int(seq), args.device, args.layers)))
        return 0
    # step.json on the H200, step_h100.json on an H100: one card's cases never join another's
    result_name = for_this_card(f"step_{args.layers}layers" if args.layers else "step")
    path = RESULTS / f"{result_name}.json"
    previous = json.loads(path.read_text()) if path.exists() else {"cases": []}
    if args.plot:
        plot(previous["cases"], RESULTS / "step.png")
        return 0
    cases = [(m, mode, int(b), args.seq) for m in args.models.split(",") for b in args.batches.split(",")
             for mode in args.modes.split(",")]  # fmt: skip
    key = lambda c: (c["model"], c["mode"], c["batch"], c["seq"])  # noqa: E731
    if args.redo:  # the new measurement replaces the old one
        previous["cases"] = [c for c in previous["cases"] if key(c) not in set(cases)]
    done = {key(c) for c in previous["cases"]}
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is optional
        tqdm = lambda x, **_: x  # noqa: E731
    for case in tqdm([c for c in cases if c not in done], desc="step", file=sys.stdout):
        try:
            depth = ["--layers", str(args.layers)] if args.layers else []
            result = run_in_subprocess("benchmarks.step", ["--worker", *map(str, case), "--device", args.device, *depth],
                                       timeout=args.timeout)  # fmt: skip
        except Exception as error:  # a crash or a timeout: recorded, the other cases go on
            result = dict(zip(("model", "mode", "batch", "seq"), case), status="failed", error=str(error)[-2000:])
        result["environment"] = environment()
        previous["cases"].append(result)
        for folder in [path.parent] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else []):
            (folder / f"{result_name}.json").write_text(json.dumps(previous, indent=1))
        print(json.dumps({k: result.get(k) for k in ("model", "mode", "batch", "status", "step_ms_median",
                                                      "peak_bytes", "first_step_s")}))  # fmt: skip
    plot(previous["cases"], RESULTS / f"{result_name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
