"""The head and its cross-entropy alone, forward and backward: whole against chunked, side by side.

Llama-3.1-8B's head (128256 x 4096, bf16) at micro-batch x 1024 tokens, on one GPU:

* ``whole``: ``F.cross_entropy(F.linear(h, W).float(), labels)`` and autograd (eager), the
  logits and their gradient whole;
* ``whole_compiled``: the same under ``torch.compile`` (Inductor fuses the point-wise work);
* ``chunked_torch_ops``: ``forge::linear_cross_entropy`` and its unfused backward with each
  chunk's point-wise work as torch ops (``config.kernel="torch"``, the CPU path);
* ``chunked``: the same op with forge's one-pass Triton kernels (kernels/head_loss.py),
  what a forge step runs.

Each mode: median CUDA-event time of forward + backward (the weight's gradient whole, as
an unfused head's backward returns it), and the peak memory above the inputs. The
chunked modes run one more head matmul (the backward computes the logits again).

    PYTHONPATH=. python benchmarks/head_loss.py [--batches 1,4]   # writes results/head_loss.json (_h100 on an H100)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.utils import for_this_card, write_result

VOCABULARY, WIDTH, SEQ = 128256, 4096, 1024
MODES = ("whole", "whole_compiled", "chunked_torch_ops", "chunked")


def _loss_and_gradients(mode: str):
    from forge_compile import head_loss  # noqa: F401  (torch.ops.forge.linear_cross_entropy)

    def whole(hidden, weight, labels):
        loss = F.cross_entropy(F.linear(hidden, weight).float(), labels, ignore_index=-100)
        return (loss, *torch.autograd.grad(loss, [hidden, weight]))

    def chunked(hidden, weight, labels):
        loss, _ = torch.ops.forge.linear_cross_entropy(hidden, weight, labels, -100, "mean")
        return (loss, *torch.autograd.grad(loss, [hidden, weight]))

    if mode == "whole":
        return whole
    if mode == "whole_compiled":
        return torch.compile(whole)
    return chunked


def measure(mode: str, tokens: int) -> dict:
    import triton.testing

    from forge_compile.config import config

    config.kernel = "torch" if mode == "chunked_torch_ops" else "auto"
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(tokens, WIDTH, device="cuda", generator=generator).bfloat16().requires_grad_()
    weight = (torch.randn(VOCABULARY, WIDTH, device="cuda", generator=generator) / WIDTH**0.5).bfloat16()
    weight.requires_grad_()
    labels = torch.randint(0, VOCABULARY, (tokens,), device="cuda", generator=generator)
    labels[::7] = -100
    run = _loss_and_gradients(mode)
    loss, grad_hidden, grad_weight = run(hidden, weight, labels)  # compiles, tunes
    torch.cuda.synchronize()
    del grad_hidden, grad_weight
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run(hidden, weight, labels)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    ms = triton.testing.do_bench(lambda: run(hidden, weight, labels), warmup=5, rep=200, return_mode="median")
    from forge_compile.head_loss import chunk_columns

    columns = chunk_columns(VOCABULARY) if mode.startswith("chunked") else None
    return {"mode": mode, "tokens": tokens, "chunk_columns": columns, "ms_median": ms, "peak_above_inputs_bytes": peak,
            "loss": loss.item()}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4", help="micro-batches of 1024 tokens")
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    cases = []
    for batch in (int(b) for b in args.batches.split(",")):
        for mode in args.modes.split(","):
            case = measure(mode, batch * SEQ)
            cases.append(case)
            print(f"{mode:>18} {case['tokens']:>6} tokens {case['ms_median']:8.3f} ms "
                  f"{case['peak_above_inputs_bytes'] / 2**30:6.3f} GiB loss {case['loss']:.5f}", flush=True)  # fmt: skip
    write_result(for_this_card("head_loss"), {"vocabulary": VOCABULARY, "width": WIDTH, "cases": cases})
    return 0


if __name__ == "__main__":
    sys.exit(main())
