"""Peak memory of a forge step with and without recomputing activations in the backward.

A Llama-3.1-8B shape scaled down by ``--scale`` in every width and in depth (``--scale 8``:
hidden 512, intermediate 1792, 4 heads and 1 KV head of 128, vocabulary 16032, 4 layers),
micro-batch 1 x ``--seq`` tokens, bf16 weights and states, forge's AdamW. Scaling width,
vocabulary and depth alike keeps the 8B step's ratio of activations to embedding and logits.
Each setting of ``forge_compile.config.recompute_activations`` runs in its own process with
empty Inductor caches and reports:

* Inductor's own estimate of the compiled graph's peak (``torch._inductor.memory``, the
  planner behind ``reorder_for_peak_memory``: the graph's buffers, inputs not counted);
* the pass's simulated peak of the post-grad graph before and after it ran;
* on a GPU, the measured peak (``max_memory_allocated``) of the steps after the first;
* the loss after 3 steps (bf16: kernels fused differently round differently).

    PYTHONPATH=. python benchmarks/recompute_memory.py                  # CPU: results/recompute_memory_cpu.json
    PYTHONPATH=. python benchmarks/recompute_memory.py --device cuda    # results/recompute_memory_cuda.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.utils import environment, run_in_subprocess, write_result  # noqa: E402

LLAMA_8B = dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256)


def worker(recompute: bool, scale: int, seq: int, device_name: str) -> dict:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="forge_recompute_memory_")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import forge_compile
    import forge_compile.backend as backend
    from forge_compile.passes.recompute_activations import simulated_peak_bytes

    from benchmarks.utils import build_causal_lm, causal_lm_train_step

    estimates = []

    class _Estimate(logging.Handler):  # Inductor logs the estimated peak of the order it keeps
        def emit(self, record):
            if record.getMessage().startswith("Baseline peak memory:"):
                estimates.append(int(record.args[0]))

    memory_log = logging.getLogger("torch._inductor.memory")
    memory_log.setLevel(logging.INFO)
    memory_log.addHandler(_Estimate())
    memory_log.propagate = False

    simulated = {}
    original_pass = backend.recompute_activations

    def measured_pass(graph, *args):
        simulated["before"] = simulated_peak_bytes(graph)
        rebuilt = simulated["rebuilt"] = original_pass(graph, *args)
        simulated["after"] = simulated_peak_bytes(graph)
        return rebuilt

    backend.recompute_activations = measured_pass
    forge_compile.config.recompute_activations = recompute
    device = torch.device(device_name)
    shape = {k: max(1, v // scale) for k, v in LLAMA_8B.items()}
    config = LlamaConfig(hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                         num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["kv_heads"], head_dim=128, vocab_size=shape["vocab"],
                         max_position_embeddings=max(seq, 2048), attn_implementation="sdpa")  # fmt: skip
    config.use_cache = False
    torch.manual_seed(0)
    model = build_causal_lm(LlamaForCausalLM, config, device, torch.bfloat16)
    optimizer = forge_compile.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    step = torch.compile(causal_lm_train_step(model, optimizer), backend="forge")
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, shape["vocab"], (1, seq), generator=generator).to(device) for _ in range(3)]
    step(batches[0])
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for batch in batches[1:]:
        loss = step(batch)
    result = {"recompute_activations": recompute, "shape": shape, "seq": seq,
              "inductor_estimated_peak_bytes": estimates[-1] if estimates else None,
              "simulated_peak_bytes_before_pass": simulated.get("before"),
              "simulated_peak_bytes_after_pass": simulated.get("after"),
              "values_recomputed": simulated.get("rebuilt"), "loss_after_3_steps": float(loss)}  # fmt: skip
    if device.type == "cuda":
        weights_and_states = sum(p.numel() * p.element_size() * 3 for p in model.parameters())
        result.update(peak_bytes=torch.cuda.max_memory_allocated(), weights_and_states_bytes=weights_and_states)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--scale", type=int, default=8, help="divide the 8B shape's widths and depth by this")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.worker == "1", args.scale, args.seq, args.device)))
        return 0
    runs = {}
    for recompute in (False, True):
        runs["recompute" if recompute else "keep"] = run_in_subprocess(
            "benchmarks.recompute_memory",
            ["--worker", str(int(recompute)), "--device", args.device, "--scale", str(args.scale), "--seq", str(args.seq)],
        )
    keep, recompute = runs["keep"], runs["recompute"]
    summary = {"estimated_peak_ratio": recompute["inductor_estimated_peak_bytes"] / keep["inductor_estimated_peak_bytes"],
               # bf16 kernels fused differently round differently; the fp32 check against torch.optim
               # is tests/passes/test_recompute_activations.py
               "loss_relative_difference": abs(recompute["loss_after_3_steps"] / keep["loss_after_3_steps"] - 1)}  # fmt: skip
    if args.device == "cuda":
        summary["measured_peak_ratio"] = recompute["peak_bytes"] / keep["peak_bytes"]
    payload = {"environment": environment(), "summary": summary, "runs": runs,
               "model": f"llama-8b shape / {args.scale}, bf16, micro-batch 1 x {args.seq}"}  # fmt: skip
    write_result(f"recompute_memory_{'cuda' if args.device == 'cuda' else 'cpu'}", payload)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
