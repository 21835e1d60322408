"""The head and its cross-entropy alone, forward and backward: whole against chunked, side by side.

Llama-3.1-8B's head (128256 x 4096, bf16; ``--heads`` adds Qwen3-0.6B's, 151936 x 1024,
where a chunk of the same columns holds a quarter of the matmul work) at micro-batch x 1024
tokens, on one GPU:

* ``whole``: ``F.cross_entropy(F.linear(h, W).float(), labels)`` and autograd (eager), the
  logits and their gradient whole;
* ``whole_compiled``: the same under ``torch.compile`` (Inductor fuses the point-wise work);
* ``chunked_torch_ops``: ``forge::linear_cross_entropy`` and its unfused backward with each
  chunk's point-wise work as torch ops (``config.kernel="torch"``, the CPU path);
* ``chunked``: the same op with forge's one-pass Triton kernels (kernels/head_loss.py);
* ``whole_compiled_then_fused_adamw``: ``whole_compiled``, then ``torch._fused_adamw_`` on
  the head from its whole gradient (bf16 states): what an unfused step does with the head;
* ``chunked_update_fused``: the chunked loss, then its backward with each chunk's AdamW
  update fused (``forge::linear_cross_entropy_backward_update_``): what a forge step does.

Each mode: median CUDA-event time of forward + backward (the first four return the weight's
gradient whole, as an unfused head's backward does; the last two also update the weight),
the peak memory above the inputs, and the GPU time of its kernels by name (torch.profiler
over a few runs): where a mode's time goes, the chunked modes' against the whole logits'.
The chunked modes run one more head matmul (the backward computes the logits again).

    PYTHONPATH=. python benchmarks/head_loss.py [--batches 1,4] [--columns 2048,4096,8192]
    # writes results/head_loss.json (_h100 on an H100)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.utils import for_this_card, gpu_ms_by_kernel, write_result

HEADS = {"llama-8b": (128256, 4096), "qwen3-0.6b": (151936, 1024)}  # vocabulary, width
SEQ = 1024
MODES = ("whole", "whole_compiled", "chunked_torch_ops", "chunked", "whole_compiled_then_fused_adamw",
         "chunked_update_fused")  # fmt: skip
LR, BETAS, EPS, WEIGHT_DECAY = 1e-5, (0.9, 0.95), 1e-8, 0.1


def head_inputs(tokens: int, vocabulary: int, width: int, device, lr: float = LR) -> dict:
    """bf16 hidden states, head weight and AdamW states (bf16), labels with every 7th ignored,
    and AdamW's hyperparameters at ``lr``, as a float and as the fused op's fp64 tensors
    (made here once: a tensor made from a Python number in a timed run copies it to the GPU
    there)."""
    generator = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(tokens, width, device=device, generator=generator).bfloat16().requires_grad_()
    weight = (torch.randn(vocabulary, width, device=device, generator=generator) / width**0.5).bfloat16()
    labels = torch.randint(0, vocabulary, (tokens,), device=device, generator=generator)
    labels[::7] = -100
    states = [torch.zeros_like(weight), torch.zeros_like(weight)]
    hyperparameters = [torch.tensor(v, dtype=torch.float64, device=device) for v in (lr, *BETAS, EPS, WEIGHT_DECAY)]
    return {"hidden": hidden, "weight": weight.requires_grad_(), "labels": labels, "states": states,
            "step": torch.tensor(0.0, device=device), "lr": lr, "hyperparameters": hyperparameters}  # fmt: skip


def runner(mode: str):
    """The mode as a function of :func:`head_inputs`' dict: one forward and backward, and for the
    last two modes the head's AdamW step too. Returns the loss."""
    from forge_compile import head_loss  # noqa: F401  (torch.ops.forge.linear_cross_entropy)

    def whole_loss(hidden, weight, labels):
        return F.cross_entropy(F.linear(hidden, weight).float(), labels, ignore_index=-100)

    def whole(i):
        loss = whole_loss(i["hidden"], i["weight"], i["labels"])
        torch.autograd.grad(loss, [i["hidden"], i["weight"]])
        return loss

    compiled_loss = torch.compile(whole_loss)

    def whole_compiled_gradients(i):
        loss = compiled_loss(i["hidden"], i["weight"], i["labels"])
        return loss, torch.autograd.grad(loss, [i["hidden"], i["weight"]])

    def whole_compiled(i):
        return whole_compiled_gradients(i)[0]

    def whole_compiled_then_fused_adamw(i):
        """What an unfused step does with the head: its whole gradient, then torch's fused AdamW."""
        loss, (_, grad_weight) = whole_compiled_gradients(i)
        i["step"] += 1
        with torch.no_grad():
            torch._fused_adamw_([i["weight"]], [grad_weight], *([s] for s in i["states"]), [], [i["step"]],
                                lr=i["lr"], beta1=BETAS[0], beta2=BETAS[1], weight_decay=WEIGHT_DECAY, eps=EPS,
                                amsgrad=False, maximize=False)  # fmt: skip
        return loss

    def chunked(i):
        loss, _ = torch.ops.forge.linear_cross_entropy(i["hidden"], i["weight"], i["labels"], -100, "mean")
        torch.autograd.grad(loss, [i["hidden"], i["weight"]])
        return loss

    def chunked_update_fused(i):
        """What a forge step does with the head: the chunked loss, then its backward with the
        AdamW update of each chunk's weight rows fused (no weight gradient)."""
        with torch.no_grad():
            loss, lse = torch.ops.forge.linear_cross_entropy(i["hidden"], i["weight"], i["labels"], -100, "mean")
            i["step"] += 1
            torch.ops.forge.linear_cross_entropy_backward_update_(
                torch.ones_like(loss), i["hidden"], i["weight"], i["labels"], lse, -100, "mean", i["states"],
                i["step"], i["hyperparameters"], "adam", [1, 0, 0, 1])  # fmt: skip
        return loss

    return {"whole": whole, "whole_compiled": whole_compiled, "chunked_torch_ops": chunked, "chunked": chunked,
            "whole_compiled_then_fused_adamw": whole_compiled_then_fused_adamw,
            "chunked_update_fused": chunked_update_fused}[mode]  # fmt: skip


PROFILED = 3


def kernel_ms(run, inputs, top: int = 10) -> dict:
    """GPU milliseconds per run of the ``top`` kernels by time, and of all kernels together
    (``"all kernels"``), from torch.profiler over :data:`PROFILED` runs."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED):
            run(inputs)
        torch.cuda.synchronize()
    by_kernel = defaultdict(float)
    for name, ms in gpu_ms_by_kernel(prof, PROFILED).items():
        by_kernel[name[:100]] += ms
    ranked = dict(sorted(by_kernel.items(), key=lambda item: -item[1])[:top])
    return {"all kernels": sum(by_kernel.values()), **ranked}


def measure(mode: str, tokens: int, columns: int | None = None, head: str = "llama-8b") -> dict:
    """One mode at ``tokens`` on ``head``'s shape; a chunked mode in chunks of ``columns``
    (None: forge's policy)."""
    import triton.testing

    from forge_compile.config import config
    from forge_compile.head_loss import chunk_columns

    config.kernel = "torch" if mode == "chunked_torch_ops" else "auto"
    config.head_chunk_columns = columns or 0
    vocabulary, width = HEADS[head]
    inputs = head_inputs(tokens, vocabulary, width, "cuda")
    run = runner(mode)
    loss = run(inputs)  # compiles, tunes
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run(inputs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    ms = triton.testing.do_bench(lambda: run(inputs), warmup=5, rep=200, return_mode="median")
    kernels = kernel_ms(run, inputs)
    columns = chunk_columns(vocabulary) if mode.startswith("chunked") else None
    return {"head": head, "vocabulary": vocabulary, "width": width, "mode": mode, "tokens": tokens,
            "chunk_columns": columns, "ms_median": ms, "peak_above_inputs_bytes": peak, "loss": loss.item(),
            "gpu_ms_by_kernel": kernels}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default="llama-8b", help=f"comma-separated, of {', '.join(HEADS)}")
    parser.add_argument("--batches", default="1,4", help="micro-batches of 1024 tokens")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--columns", default="",
                        help="chunk widths to run the chunked modes at, comma-separated (default: forge's policy)")
    args = parser.parse_args()
    widths = [int(c) for c in args.columns.split(",") if c] or [None]
    cases = []
    runs = [(head, batch, mode, columns) for head in args.heads.split(",") for batch in map(int, args.batches.split(","))
            for mode in args.modes.split(",") for columns in (widths if mode.startswith("chunked") else [None])]  # fmt: skip
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is optional
        tqdm = lambda x, **_: x  # noqa: E731
    for head, batch, mode, columns in tqdm(runs, desc="head loss", file=sys.stdout, mininterval=10):
        case = measure(mode, batch * SEQ, columns, head)
        cases.append(case)
        print(f"{head:>10} {mode:>30} {case['chunk_columns'] or '':>6} {case['tokens']:>6} tokens {case['ms_median']:8.3f} ms "
              f"{case['peak_above_inputs_bytes'] / 2**30:6.3f} GiB loss {case['loss']:.5f} "
              f"kernels {case['gpu_ms_by_kernel']['all kernels']:8.3f} ms", flush=True)  # fmt: skip
        write_result(for_this_card("head_loss"), {"cases": cases})  # after each case: a run cut off keeps its cases
    return 0


if __name__ == "__main__":
    sys.exit(main())
