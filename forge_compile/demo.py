"""``python -m forge_compile demo``: train a small transformer with forge and with Inductor.

The text is this Python installation's own standard library sources, as bytes, so every
machine has it. Both runs start from the same weights and see the same batches:

* forge: ``torch.compile(train_step, backend="forge")`` with ``forge_compile.optim.AdamW``;
* inductor: ``torch.compile(train_step, backend="inductor")`` with ``torch.optim.AdamW``.

It prints forge's explain table, the two loss curves side by side and the held-out
loss; on CUDA also each run's peak memory and median step time.
"""

from __future__ import annotations

import argparse
import statistics
import sysconfig
import time
from pathlib import Path

import torch

from .explain import explain
from .models import TinyGPT, TinyGPTConfig, language_model_loss, language_model_train_step
from .optim import AdamW


def stdlib_bytes(limit: int = 4 << 20) -> torch.Tensor:
    """Up to ``limit`` bytes of the standard library's .py files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


class Batches:
    """Random [batch, context + 1] windows of a token stream, reproducible from a seed."""

    def __init__(self, tokens: torch.Tensor, batch: int, context: int, seed: int):
        self.tokens, self.batch, self.context = tokens, batch, context
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        starts = torch.randint(0, len(self.tokens) - self.context - 1, (self.batch,), generator=self.generator)
        return torch.stack([self.tokens[s : s + self.context + 1] for s in starts.tolist()])


@torch.no_grad()
def _held_out_loss(model, batches: Batches, device, n: int = 8) -> float:
    return statistics.fmean(language_model_loss(model, batches.next().to(device)).item() for _ in range(n))


def _run(mode: str, cfg, state, train, held_out, steps, device, lr):
    model = TinyGPT(cfg).to(device)
    model.load_state_dict(state)
    if mode == "forge":
        optimizer = AdamW(model.parameters(), lr=lr, weight_decay=0.1)
        step = torch.compile(language_model_train_step(model, optimizer), backend="forge")
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
        step = torch.compile(language_model_train_step(model, optimizer), backend="inductor")
    batches = Batches(train, 8, cfg.context, seed=1)
    report = None
    losses, times = [], []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for i in range(steps):
        tokens = batches.next().to(device)
        start = time.perf_counter()
        if i == 0 and mode == "forge":
            report = explain(step, tokens)  # the first step, compiled and recorded
            loss = None
        else:
            loss = step(tokens)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item() if loss is not None else float("nan"))
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return dict(losses=losses, times=times, peak=peak, report=report,
                held_out=_held_out_loss(model, Batches(held_out, 8, cfg.context, seed=2), device))  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m forge_compile demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    tokens = stdlib_bytes()
    split = int(0.9 * len(tokens))
    train, held_out = tokens[:split], tokens[split:]
    cfg = TinyGPTConfig(width=args.width, depth=args.depth, heads=4, context=64)
    state = TinyGPT(cfg).state_dict()
    print(f"forge demo: TinyGPT width {cfg.width}, depth {cfg.depth}, context {cfg.context}, "
          f"{len(tokens) / 2**20:.1f} MiB of standard-library source, {args.steps} steps on {device}")  # fmt: skip
    results = {}
    for mode in ("forge", "inductor"):
        print(f"  compiling and training with backend={mode!r} ...", flush=True)
        results[mode] = _run(mode, cfg, state, train, held_out, args.steps, device, args.lr)
    print()
    print(results["forge"]["report"])
    print()
    print(f"{'step':>6}  {'forge loss':>10}  {'inductor loss':>13}")
    every = max(1, args.steps // 15)
    for i in range(every - 1, args.steps, every):
        f, n = results["forge"]["losses"][i], results["inductor"]["losses"][i]
        print(f"{i + 1:>6}  {f:>10.4f}  {n:>13.4f}")
    print(f"{'held-out':>6}  {results['forge']['held_out']:>10.4f}  {results['inductor']['held_out']:>13.4f}")
    if device.type == "cuda":
        print()
        for mode, r in results.items():
            median = statistics.median(r["times"][5:]) * 1e3
            print(f"{mode:>9}: peak memory {r['peak'] / 2**20:8.1f} MiB, median step {median:6.2f} ms")
    return 0
