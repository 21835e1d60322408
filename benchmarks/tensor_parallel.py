"""Tensor parallelism: forge against torch's fused AdamW on the same TP setup, per rank.

A Llama-shaped model (random weights from a transformers config) is split with
torch.distributed.tensor.parallel (q/k/v/gate/up column-parallel, o/down row-parallel;
embeddings, norms and the head replicated) over all ranks. The script measures

* exactness: the TP forge step against the unsharded forge step in one process on the
  same data, after a few steps (relative L2 of the weights, gathered);
* per-rank step time (median of CUDA-event timings) and peak memory of forge and of
  torch.optim.AdamW(fused=True) on the same TP model;
* the largest micro-batch each fits (doubling until out of memory).

    torchrun --nproc-per-node 2 benchmarks/tensor_parallel.py --model llama-8b-4l
    torchrun --nproc-per-node 2 benchmarks/tensor_parallel.py --device cpu   # a check of the script over gloo

NCCL runs leave NVLink multicast off (NCCL_NVLS_ENABLE=0), as the device notes ask.
Results go to results/tensor_parallel.json (results/tensor_parallel_cpu.json on the CPU).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.utils import build_causal_lm, causal_lm_train_step, write_result  # noqa: E402

MODELS = {
    # name: (hidden, intermediate, layers, heads, kv heads, vocab)
    "tiny": (64, 128, 2, 4, 2, 256),
    "llama-8b-4l": (4096, 14336, 4, 32, 8, 128256),  # Llama-3.1-8B's layers, four of them
    "llama-8b": (4096, 14336, 32, 32, 8, 128256),
}
HYPER = dict(lr=1e-5, betas=(0.9, 0.95), weight_decay=0.1)


def build(name: str, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, intermediate, layers, heads, kv_heads, vocab = MODELS[name]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         tie_word_embeddings=False, attn_implementation="sdpa")  # fmt: skip
    return build_causal_lm(LlamaForCausalLM, config, device, dtype), config


def parallelize(model, mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)


def param_groups(model) -> list[dict]:
    """The sharded (DTensor) and the replicated (plain) parameters in separate groups:
    torch's fused AdamW takes one kind per call."""
    from forge_compile.dtensor import is_dtensor

    params = list(model.parameters())
    groups = [[p for p in params if is_dtensor(p)], [p for p in params if not is_dtensor(p)]]
    return [{"params": g} for g in groups if g]


def make_step(model, mode: str, stochastic_rounding=None):
    import forge_compile

    if mode == "forge":
        optimizer = forge_compile.optim.AdamW(param_groups(model), **HYPER, stochastic_rounding=stochastic_rounding)
        return torch.compile(causal_lm_train_step(model, optimizer), backend="forge"), optimizer
    optimizer = torch.optim.AdamW(param_groups(model), **HYPER, fused=True)
    return causal_lm_train_step(model, optimizer), optimizer


def gathered(model) -> dict[str, torch.Tensor]:
    """Every weight whole, on every rank (full_tensor is a collective)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu()
    return out


def exactness(args, device, dtype, mesh, batches) -> dict:
    """TP forge against unsharded forge on the same steps: relative L2 over all weights.
    bf16 weights round to nearest here: stochastic rounding draws different bits for a
    shard than for the same elements of the whole weight, so it could not be compared."""
    import forge_compile

    model, _ = build(args.model, device, dtype)
    reference = copy.deepcopy(model) if dist.get_rank() == 0 else None
    parallelize(model, mesh)
    step, _ = make_step(model, "forge", stochastic_rounding=False)
    report = forge_compile.explain(step, batches[0])
    for b in batches[1:]:
        step(b)
    sharded = gathered(model)
    result = {"fused": len(report.fused), "not_fused": {d.name: d.code for d in report.rejected}}
    if reference is not None:
        torch._dynamo.reset()
        ref_step, _ = make_step(reference, "forge", stochastic_rounding=False)
        for b in batches:
            ref_step(b)
        expected = {n: p.detach().float().cpu() for n, p in reference.named_parameters()}
        diff = sum((sharded[n] - expected[n]).square().sum() for n in expected).sqrt()
        norm = sum(expected[n].square().sum() for n in expected).sqrt()
        result["relative_l2_vs_unsharded_forge"] = float(diff / norm)
        result["max_abs_vs_unsharded_forge"] = max(float((sharded[n] - expected[n]).abs().max()) for n in expected)
    del model, reference
    torch._dynamo.reset()
    return result


def timed(args, device, dtype, mesh, mode: str, batch: int) -> dict:
    """Median step time and peak memory of one mode on this rank; out_of_memory if it does not fit."""
    model, config = build(args.model, device, dtype)
    parallelize(model, mesh)
    step, _ = make_step(model, mode)
    generator = torch.Generator(device=device).manual_seed(1)
    ids = [torch.randint(0, config.vocab_size, (batch, args.seq), device=device, generator=generator) for _ in range(2)]
    cuda = device.type == "cuda"
    try:
        start = time.perf_counter()
        step(ids[0])
        first = time.perf_counter() - start
        step(ids[1])
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for i in range(args.steps):
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                step(ids[i % 2])
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end))
            else:
                begin = time.perf_counter()
                step(ids[i % 2])
                times.append((time.perf_counter() - begin) * 1e3)
        result = {"status": "ok", "step_ms_median": statistics.median(times), "first_step_s": first,
                  "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None}  # fmt: skip
    except torch.OutOfMemoryError:
        result = {"status": "out_of_memory"}
    # Every rank decides alike, or one leaves the capacity search while the others wait in
    # a collective.
    fitted = torch.tensor([result["status"] == "ok"], dtype=torch.int32, device=device)
    dist.all_reduce(fitted, op=dist.ReduceOp.MIN)
    if not fitted.item() and result["status"] == "ok":
        result = {"status": "out_of_memory_on_another_rank"}
    del model, step
    torch._dynamo.reset()
    if cuda:
        torch.cuda.empty_cache()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-8b-4l", choices=MODELS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-batch", type=int, default=64, help="largest micro-batch tried for capacity")
    parser.add_argument("--results-dir", default=None, help="write the JSON here instead of benchmarks/results/")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32  # fp32 on the CPU: the exactness check is tight
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    vocab = MODELS[args.model][5]
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (args.batch, args.seq), generator=generator).to(device) for _ in range(3)]
    result = {"model": args.model, "world_size": world, "seq": args.seq, "dtype": str(dtype),
              "exactness": exactness(args, device, dtype, mesh, batches)}  # fmt: skip
    result["modes"] = {mode: timed(args, device, dtype, mesh, mode, args.batch) for mode in ("eager_fused", "forge")}
    if cuda:
        capacity = {}
        for mode in ("eager_fused", "forge"):
            fits, batch = None, 1
            while batch <= args.max_batch and timed(args, device, dtype, mesh, mode, batch)["status"] == "ok":
                fits, batch = batch, batch * 2
            capacity[mode] = fits
        result["largest_micro_batch"] = capacity
    if rank == 0:
        name = "tensor_parallel" if cuda else "tensor_parallel_cpu"
        if args.results_dir:
            import json

            from benchmarks.utils import environment

            Path(args.results_dir, f"{name}.json").write_text(json.dumps({"environment": environment(), **result}))
        else:
            write_result(name, result)
        print(result)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
