"""First-step time (compilation) of a small Qwen3 train step, forge against backend="inductor".

Each backend runs in its own process with fresh, empty Inductor and Triton caches, so the
first step compiles everything. The model is Qwen3 with random weights (hidden 256,
intermediate 512, 8/4 heads of 32, vocab 2048, tied embeddings; ``--layers`` deep), bf16,
a batch of 2 x 64 tokens; forge runs its AdamW (stochastic rounding of the bf16 weights, its
default), inductor torch's AdamW (foreach, capturable) compiled with the step. Runs on the
CPU (``--device cpu``, the default) or a GPU; the whole models' first steps on the GPU are in
benchmarks/step.py's ``first_step_s``.

    PYTHONPATH=. python benchmarks/compile_time.py --layers 4      # writes results/compile_time_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
BACKENDS = ("forge", "inductor")


def worker(backend: str, layers: int, device_name: str) -> dict:
    # Set before torch imports Inductor: every kernel is compiled, none served from a cache.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="forge_compile_time_inductor_")
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="forge_compile_time_triton_")
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import forge_compile

    from benchmarks.utils import build_causal_lm, causal_lm_train_step

    device = torch.device(device_name)
    config = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=32, vocab_size=2048, tie_word_embeddings=True,
                         max_position_embeddings=512, attn_implementation="sdpa")  # fmt: skip
    model = build_causal_lm(Qwen3ForCausalLM, config, device, torch.bfloat16)
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    if backend == "forge":
        optimizer = forge_compile.optim.AdamW(model.parameters(), **hyper)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **hyper, foreach=True, capturable=True)
    train_step = causal_lm_train_step(model, optimizer)
    step = torch.compile(train_step, backend=backend)
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, config.vocab_size, (2, 64), generator=generator).to(device)
    start = time.perf_counter()
    step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - start
    return {"backend": backend, "layers": layers, "first_step_s": first,
            "kernels_generated": torch._inductor.metrics.generated_kernel_count}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.layers, args.device)))
        return 0
    from benchmarks.utils import run_in_subprocess, write_result

    runs = {}
    for backend in BACKENDS:
        runs[backend] = run_in_subprocess("benchmarks.compile_time", ["--worker", backend, "--layers", str(args.layers),
                                                                      "--device", args.device], timeout=1800)  # fmt: skip
        print(f"{backend}: first step {runs[backend]['first_step_s']:.1f} s", flush=True)
    ratio = runs["forge"]["first_step_s"] / runs["inductor"]["first_step_s"]
    print(f"forge / inductor: {ratio:.2f}x")
    write_result(f"compile_time_{args.device}", {"runs": runs, "forge_over_inductor": ratio,
                                                 "model": "qwen3, hidden 256, tied, bf16, batch 2x64"})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
