"""Convergence of low-precision training: does bf16 with forge track fp32 AdamW?

Continued pretraining of a small Llama-style model (byte-level tokens, random weights
from a transformers config) on the Python standard library's sources, with every 20th
file held out. A shared warm-up phase trains the model in fp32; each run then continues
from those weights, on the same batches in the same order:

* ``fp32``: fp32 weights and states, torch AdamW (fused), eager: the reference;
* ``torch_bf16``: bf16 weights and states, torch AdamW (fused), eager: the standard bf16 path;
* ``forge_bf16_sr``: bf16 weights and states, forge's AdamW compiled with backend="forge":
  fp32 gradient tiles in registers, stochastic rounding of the weights, no fp32 copy;
* ``forge_bf16_sr_int8``: the same with 8-bit blockwise states.

    PYTHONPATH=. python benchmarks/convergence.py                    # every run
    PYTHONPATH=. python benchmarks/convergence.py --runs forge_bf16_sr,forge_bf16_sr_int8

Runs already in benchmarks/results/convergence.json (same settings) are kept and
skipped, so the study can be split over several calls; the summary and the plot
(convergence.png) are rebuilt from every run present.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.utils import RESULTS, causal_lm_train_step, environment  # noqa: E402

RUNS = ("fp32", "torch_bf16", "forge_bf16_sr", "forge_bf16_sr_int8")
SMOOTHING = 50
"""Steps in the moving average of the loss gap (one batch's loss is noisy)."""


def corpus(device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The standard library's .py files as bytes: (train, held-out, description)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    train, held_out = bytearray(), bytearray()
    for index, path in enumerate(files):
        (held_out if index % 20 == 0 else train).extend(path.read_bytes())
    info = {"root": str(root), "files": len(files), "train_bytes": len(train), "held_out_bytes": len(held_out)}
    as_tensor = lambda b: torch.frombuffer(b, dtype=torch.uint8).to(device=device, dtype=torch.long)  # noqa: E731
    return as_tensor(train), as_tensor(held_out), info


def batches(data: torch.Tensor, count: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq, (count, batch), generator=generator).to(data.device)
    offsets = torch.arange(seq, device=data.device)
    return [data[s[:, None] + offsets] for s in starts]


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=args.width, intermediate_size=args.width * 8 // 3 // 64 * 64,
                         num_hidden_layers=args.layers, num_attention_heads=args.width // 64,
                         num_key_value_heads=args.width // 64, max_position_embeddings=args.seq,
                         tie_word_embeddings=False, attn_implementation="sdpa")  # fmt: skip
    return LlamaForCausalLM(config)


def lr_schedule(peak: float, warmup: int, total: int):
    """Linear warm-up, then cosine to a tenth of the peak."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


@torch.no_grad()
def held_out_loss(model, eval_batches) -> float:
    model.eval()
    losses = [model(input_ids=b, labels=b).loss.float() for b in eval_batches]
    model.train()
    return torch.stack(losses).mean().item()


def warm_up(args, train_batches, device) -> tuple[dict, float]:
    """The shared fp32 phase: returns its weights (on the CPU) and a checksum of them."""
    model = build_model(args).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(args.lr, args.warm_steps // 2, 10**9))
    step = causal_lm_train_step(model, optimizer)
    for batch in train_batches[: args.warm_steps]:
        step(batch)
        scheduler.step()
    weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    checksum = sum(float(v.double().abs().sum()) for v in weights.values())
    return weights, checksum


def run(name: str, args, weights: dict, train_batches, eval_batches, device) -> dict:
    import forge_compile

    torch._dynamo.reset()
    model = build_model(args)
    model.load_state_dict(weights)
    dtype = torch.float32 if name == "fp32" else torch.bfloat16
    model = model.to(device=device, dtype=dtype)
    hyper = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    fused = None
    if name.startswith("forge"):
        optimizer = forge_compile.optim.AdamW(model.parameters(), **hyper,
                                              state_dtype="int8" if name.endswith("int8") else None)  # fmt: skip
        step = torch.compile(causal_lm_train_step(model, optimizer), backend="forge")
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **hyper, fused=True)
        step = causal_lm_train_step(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(args.lr, args.rewarm_steps, args.steps))
    continued = train_batches[args.warm_steps : args.warm_steps + args.steps]
    losses, evals, step_seconds = [], [], []
    progress = _progress(len(continued), name)
    compile_seconds = None
    for index, batch in enumerate(continued):
        start = time.perf_counter()
        if index == 0 and name.startswith("forge"):
            with torch.no_grad():  # explain returns no loss: the same forward, before the step
                losses.append(model(input_ids=batch, labels=batch).loss.detach())
            report = forge_compile.explain(step, batch)
            fused = {"fused": sum(d.fused for d in report.decisions), "candidates": len(report.decisions),
                     "graphs": len(report.graphs)}  # fmt: skip
        else:
            losses.append(step(batch))
        scheduler.step()
        if index < 3 or index % 100 == 0:
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            if index == 0:
                compile_seconds = elapsed
            elif index >= 3:
                step_seconds.append(elapsed)
        if (index + 1) % args.eval_every == 0 or index + 1 == len(continued):
            evals.append([index + 1, held_out_loss(model, eval_batches)])
        progress.update(1)
    progress.close()
    state_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for k, t in s.items()
                      if isinstance(t, torch.Tensor) and k != "step")  # fmt: skip
    parameters = sum(p.numel() for p in model.parameters())
    result = {
        "train_loss": [round(x, 5) for x in torch.stack(losses).float().tolist()],
        "held_out": evals,
        "final_held_out_loss": evals[-1][1],
        "first_step_seconds": compile_seconds,
        "step_ms_median": 1e3 * sorted(step_seconds)[len(step_seconds) // 2] if step_seconds else None,
        "optimizer_state_bytes_per_parameter": state_bytes / parameters,
        "parameters": parameters,
        "fused": fused,
    }
    del model, optimizer, step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _progress(total: int, name: str):
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=name, mininterval=10, file=sys.stdout)
    except ImportError:
        class _Quiet:
            def update(self, n):
                pass

            def close(self):
                pass

        return _Quiet()


def moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def summarize(runs: dict) -> dict:
    """Loss gaps to the fp32 reference: the mean over the run of (run - reference) per step,
    the mean and max of |gap| after a 50-step moving average, and the final held-out gap."""
    if "fp32" not in runs:
        return {}
    reference = runs["fp32"]["train_loss"]
    summary = {"reference_final_held_out_loss": runs["fp32"]["final_held_out_loss"]}
    # Runs made in different processes repeat the shared fp32 phase; its kernels are not
    # all deterministic, so their starting weights can differ. How much (relative, of the
    # sum of |w|), so that a reader can weigh the gaps:
    reference_checksum = runs["fp32"].get("warm_checksum")
    if reference_checksum:
        summary["start_difference_to_reference"] = max(
            abs(r.get("warm_checksum", reference_checksum) - reference_checksum) / reference_checksum
            for r in runs.values()
        )
    for name, r in runs.items():
        if name == "fp32":
            continue
        gaps = [a - b for a, b in zip(r["train_loss"], reference)]  # a diverged (NaN) run fails the checks
        smooth = moving_average(gaps, SMOOTHING)
        summary[name] = {
            "mean_gap": sum(gaps) / len(gaps),
            "mean_abs_gap_smoothed": sum(abs(g) for g in smooth) / len(smooth),
            "max_abs_gap_smoothed": max(abs(g) for g in smooth),
            "final_held_out_loss": r["final_held_out_loss"],
            "final_held_out_gap": r["final_held_out_loss"] - runs["fp32"]["final_held_out_loss"],
            "optimizer_state_bytes_per_parameter": r["optimizer_state_bytes_per_parameter"],
        }
    if "forge_bf16_sr" in summary and "torch_bf16" in summary:
        summary["checks"] = {
            "forge_bf16_sr_tracks_fp32_at_least_as_closely_as_torch_bf16": (
                summary["forge_bf16_sr"]["mean_abs_gap_smoothed"] <= summary["torch_bf16"]["mean_abs_gap_smoothed"]
            ),
        }
        if "forge_bf16_sr_int8" in summary:
            summary["checks"]["int8_states_mean_gap_within_0.01"] = abs(summary["forge_bf16_sr_int8"]["mean_gap"]) <= 0.01
    return summary


def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, gaps) = plt.subplots(1, 2, figsize=(13, 4.5))
    reference = runs.get("fp32")
    for name, r in runs.items():
        losses = r["train_loss"]
        curves.plot(moving_average(losses, SMOOTHING), label=name, linewidth=1)
        steps, held = zip(*r["held_out"])
        curves.plot(steps, held, "o", markersize=3, color=curves.lines[-1].get_color())
        if reference is not None and name != "fp32":
            gap = [a - b for a, b in zip(r["train_loss"], reference["train_loss"])]
            gaps.plot(moving_average(gap, SMOOTHING), label=name, linewidth=1)
    curves.set(xlabel="step (continued pretraining)", ylabel="loss (nats/byte)",
               title=f"training loss ({SMOOTHING}-step mean) and held-out loss (dots)")  # fmt: skip
    curves.legend()
    gaps.axhline(0, color="black", linewidth=0.5)
    gaps.set(xlabel="step", ylabel="loss - fp32 loss (nats)", title=f"gap to fp32 AdamW ({SMOOTHING}-step mean)")
    if gaps.lines[1:]:
        gaps.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--steps", type=int, default=2000, help="continued-pretraining steps per run")
    parser.add_argument("--warm-steps", type=int, default=300, help="shared fp32 steps before the runs")
    parser.add_argument("--rewarm-steps", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--output", default=os.environ.get("OUT"), help="also write the results here")
    parser.add_argument("--results", default=str(RESULTS), help="the results folder it resumes from")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU: tiny smoke runs only
    settings = {k: getattr(args, k) for k in ("steps", "warm_steps", "rewarm_steps", "eval_every", "batch", "seq",
                                              "width", "layers", "lr")}  # fmt: skip
    results_path = Path(args.results) / "convergence.json"
    previous = json.loads(results_path.read_text()) if results_path.exists() else {}
    runs = previous.get("runs", {}) if previous.get("settings") == settings else {}
    environments = previous.get("environments", {}) if runs else {}

    train, held_out, corpus_info = corpus(device)
    train_batches = batches(train, args.warm_steps + args.steps, args.batch, args.seq, seed=1)
    eval_batches = batches(held_out, 8, args.batch, args.seq, seed=2)
    wanted = [r for r in args.runs.split(",") if r and r not in runs]
    unknown = set(wanted) - set(RUNS)
    if unknown:
        parser.error(f"unknown runs {sorted(unknown)}; choose from {RUNS}")
    if wanted:
        weights, checksum = warm_up(args, train_batches, device)
        for name in wanted:
            runs[name] = run(name, args, weights, train_batches, eval_batches, device)
            runs[name]["warm_checksum"] = checksum
            environments[name] = environment()
            _write(results_path, args.output, settings, corpus_info, runs, environments)
    _write(results_path, args.output, settings, corpus_info, runs, environments)
    print(json.dumps(summarize(runs), indent=2))
    return 0


def _write(results_path: Path, output: str | None, settings, corpus_info, runs, environments) -> None:
    payload = {"settings": settings, "corpus": corpus_info, "summary": summarize(runs), "runs": runs,
               "environments": environments}  # fmt: skip
    text = json.dumps(payload, indent=1)
    targets = [results_path.parent] + ([Path(output)] if output else [])
    for folder in targets:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "convergence.json").write_text(text)
        if runs:
            plot(runs, folder / "convergence.png")


if __name__ == "__main__":
    sys.exit(main())
