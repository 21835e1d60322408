"""Does forge train a Hugging Face Llama like torch.optim, with no weight gradient, in less memory?

A small LlamaForCausalLM (random weights from a config, fp32, untied embeddings) trains a
few steps in four modes, each in its own process so that no mode's memory leaks into
another's peak:

* eager-fp64: the same in float64, the reference for all the others;
* eager: the model and torch.optim.AdamW, uncompiled, fp32;
* inductor: ``torch.compile(train_step, backend="inductor")`` with torch.optim.AdamW;
* forge-unfused: forge's AdamW compiled with forge but ``config.fuse = False``;
* forge: forge's AdamW compiled with ``backend="forge"``.

Adam amplifies rounding where a gradient is near zero (torch's own compiled step differs
from its eager step by up to ~1e-3 on single weights after a few steps), so each mode's
weights are compared with the float64 run: forge must be as close to it as torch's fp32
eager step is. It also checks that Inductor's generated code for the
forge step calls the fused op once per linear weight and that its final post-grad graph
has no matmul contracting over the tokens (a dW matmul), while the inductor step's has
one per weight; and that forge's peak memory is below the inductor step's by at least
the fused gradients' bytes.

    PYTHONPATH=. python benchmarks/hf_llama_check.py            # on the GPU
    PYTHONPATH=. python benchmarks/hf_llama_check.py --tiny --device cpu   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.utils import causal_lm_train_step, run_in_subprocess, write_result  # noqa: E402

MODES = ("eager-fp64", "eager", "inductor", "forge-unfused", "forge")
STEPS = 8
MEASURED_FROM = 3  # steps before this one compile and warm up


def _config(tiny: bool):
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                           tie_word_embeddings=False)  # fmt: skip
    return LlamaConfig(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                       num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=512,
                       tie_word_embeddings=False)  # fmt: skip


def _batches(cfg, device, batch=2, seq=100):
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(0, cfg.vocab_size, (batch, seq), generator=generator).to(device) for _ in range(STEPS)]


def _linear_weight_shapes(model) -> dict[str, tuple[int, int]]:
    return {f"{n}.weight": tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


class _CountWeightGradientMatmuls:
    """Inductor post-grad pass (after all others) counting matmuls that contract over the tokens.

    ``dW = dY^T @ X`` is the only matmul of a linear layer's step that sums over tokens
    (forward and ``dX`` contract over features), so with a token count that equals no
    feature size this counts exactly the weight-gradient matmuls Inductor generates code for.
    """

    def __init__(self, tokens: int):
        self.tokens = tokens
        self.count = 0

    def __call__(self, graph):
        aten = torch.ops.aten
        for node in graph.nodes:
            if node.target in (aten.mm.default, aten.addmm.default):
                left = node.args[-2].meta["val"]
                if left.shape[-1] == self.tokens:
                    self.count += 1

    def uuid(self):
        return None  # never cache: the count must be taken on every compile


def _profile(step, batch, top: int = 12) -> dict[str, float]:
    """CUDA time per kernel name over one more step, the largest first (microseconds)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(batch)
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)
    return {e.key[:90]: round(e.device_time_total, 1) for e in rows[:top]}


def run_mode(mode: str, tiny: bool, device: str, save_to: str) -> dict:
    from torch._inductor.utils import run_and_get_code
    from transformers import LlamaForCausalLM

    import forge_compile

    torch.manual_seed(0)
    cfg = _config(tiny)
    dtype = torch.float64 if mode == "eager-fp64" else torch.float32
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
    model.train()
    if mode.startswith("forge"):
        optimizer = forge_compile.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        forge_compile.config.fuse = mode == "forge"
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    train_step = causal_lm_train_step(model, optimizer)

    step = train_step
    if not mode.startswith("eager"):
        step = torch.compile(train_step, backend="forge" if mode.startswith("forge") else "inductor")
    batches = _batches(cfg, device)
    counter = _CountWeightGradientMatmuls(tokens=batches[0].numel())
    torch._inductor.config.post_grad_custom_post_pass = counter
    losses, times, code, report = [], [], "", None
    cuda = device.startswith("cuda")
    for i, batch in enumerate(batches):
        if i == MEASURED_FROM and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (None, None)
        if start is not None:
            start.record()
        if i == 0 and mode.startswith("forge"):
            report, codes = run_and_get_code(forge_compile.explain, step, batch)
            code = "\n".join(codes)
            loss = None
        elif i == 0 and mode == "inductor":
            loss, codes = run_and_get_code(step, batch)
            code = "\n".join(codes)
        else:
            loss = step(batch)
        if end is not None:
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        losses.append(loss.item() if loss is not None else None)
    torch.save({n: p.detach().cpu() for n, p in model.named_parameters()}, save_to)
    kernels = _profile(step, batches[-1]) if cuda and mode != "eager-fp64" else None
    result = {
        "mode": mode,
        "losses": losses,
        "step_ms_median": statistics.median(times[MEASURED_FROM:]) if times else None,
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "fused_op_calls": code.count("torch.ops.forge.fused_linear_update_.default("),
        "weight_gradient_matmuls": None if mode.startswith("eager") else counter.count,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    if kernels is not None:
        result["profile_top_kernels_us"] = kernels
    if report is not None:
        result["fused"] = [d.name for d in report.fused]
        result["rejected"] = {d.name: d.reason for d in report.rejected}
        result["gradient_bytes_eliminated"] = report.gradient_bytes_eliminated
        result["explain"] = str(report)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny config, for a smoke run")
    parser.add_argument("--mode", choices=MODES, help="run one mode in this process (used by the parent)")
    parser.add_argument("--save-to")
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.tiny, args.device, args.save_to)))
        return 0

    results, weights = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            path = str(Path(tmp) / f"{mode}.pt")
            extra = ["--tiny"] if args.tiny else []
            results[mode] = run_in_subprocess("benchmarks.hf_llama_check",
                                              ["--mode", mode, "--device", args.device, "--save-to", path, *extra])  # fmt: skip
            weights[mode] = torch.load(path)
            print(f"{mode:>14}: done", flush=True)

    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        linear_weights = _linear_weight_shapes(LlamaForCausalLM(_config(args.tiny)))
    reference = weights["eager-fp64"]

    def errors_against(ref):
        out = {}
        for mode in MODES:
            if weights[mode] is ref:
                continue
            diff = [(weights[mode][n].double() - ref[n].double()) for n in ref]
            norm = sum(d.square().sum() for d in diff).sqrt() / sum(ref[n].double().square().sum() for n in ref).sqrt()
            out[mode] = {"max_abs": max(d.abs().max().item() for d in diff), "relative_l2": norm.item(),
                         "fraction_above_1e-5": sum((d.abs() > 1e-5).sum().item() for d in diff)
                         / sum(d.numel() for d in diff)}  # fmt: skip
        return out

    errors = errors_against(reference)
    errors_vs_eager = errors_against(weights["eager"])
    forge, inductor = results["forge"], results["inductor"]
    fused_bytes = forge["gradient_bytes_eliminated"]
    checks = {
        "forge_as_close_to_float64_as_torch_eager_fp32": errors["forge"]["relative_l2"]
        <= 1.5 * errors["eager"]["relative_l2"],
        "forge_matches_eager_fp32_on_all_but_0.1%_of_weights_within_1e-5": errors_vs_eager["forge"][
            "fraction_above_1e-5"] <= 1e-3,
        "every_linear_weight_fused": sorted(n.removeprefix("model.") for n in forge["fused"])
        == sorted(linear_weights),
        "fused_op_once_per_linear_weight": forge["fused_op_calls"] == len(linear_weights),
        "no_weight_gradient_matmul_in_forge_code": forge["weight_gradient_matmuls"] == 0,
        "inductor_code_has_one_weight_gradient_matmul_per_weight": inductor["weight_gradient_matmuls"]
        == len(linear_weights),
    }
    if args.device.startswith("cuda"):
        checks["forge_peak_below_inductor_by_fused_gradient_bytes"] = (
            inductor["peak_bytes"] - forge["peak_bytes"] >= fused_bytes
        )
    summary = {
        "weight_error_vs_float64": errors,
        "weight_error_vs_eager_fp32": errors_vs_eager,
        "linear_weights": len(linear_weights),
        "fused_gradient_bytes": fused_bytes,
        "peak_bytes": {m: r["peak_bytes"] for m, r in results.items()},
        "step_ms_median": {m: r["step_ms_median"] for m, r in results.items()},
        "checks": checks,
    }
    name = "hf_llama_check_tiny_" + args.device.split(":")[0] if args.tiny else "hf_llama_check"
    write_result(name, {"summary": summary, "modes": results})
    print(forge["explain"])
    print()
    for mode, r in results.items():
        peak = f"{r['peak_bytes'] / 2**20:9.1f} MiB" if r["peak_bytes"] else "        n/a"
        step = f"{r['step_ms_median']:8.2f} ms" if r["step_ms_median"] else "     n/a"
        err = f"{errors[mode]['relative_l2']:.2e}" if mode in errors else "reference"
        print(f"{mode:>14}: peak {peak}  step {step}  |w - w_fp64|/|w_fp64| {err}  "
              f"dW matmuls in code {r['weight_gradient_matmuls']}")
    print(f"fused gradient bytes: {fused_bytes / 2**20:.1f} MiB")
    if forge.get("profile_top_kernels_us"):
        print("forge step, CUDA time per kernel (us):")
        for name, us in forge["profile_top_kernels_us"].items():
            print(f"  {us:10.1f}  {name}")
    for check, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {check}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
