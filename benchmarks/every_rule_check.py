"""Every forge rule, fused, trains a Hugging Face Llama as its eager optimizer does.

For each optimizer (its setting turns on every state the rule has) a small
LlamaForCausalLM (random weights from a config, untied embeddings) trains ``STEPS`` steps
three ways on the same batches and starting weights:

* float64 eager with torch.optim's class (Lion: the paper's formula), the reference;
* fp32 eager with the same optimizer: the rounding any fp32 run has;
* fp32 ``torch.compile(train_step, backend="forge")`` with forge's class.

Passes when, for every rule, every Linear weight is fused in one graph and forge's
weights are as close to the float64 run as fp32 eager's are: relative L2 error within
1.5x of eager's, plus fp32's machine epsilon (1.2e-7) for runs where both are at the
level of one rounding.

    PYTHONPATH=. python benchmarks/every_rule_check.py                     # on the GPU
    PYTHONPATH=. python benchmarks/every_rule_check.py --tiny --device cpu --rules sgd lion   # a smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.references import LionReference  # noqa: E402
from benchmarks.utils import causal_lm_train_step, write_result  # noqa: E402

STEPS = 8  # RAdam's rectified steps start at 6

# rule name -> (torch's eager class, forge's class name, settings)
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, "SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "rmsprop": (torch.optim.RMSprop, "RMSprop", dict(lr=1e-3, centered=True, momentum=0.5, weight_decay=0.01)),
    "adagrad": (torch.optim.Adagrad, "Adagrad", dict(lr=1e-2, lr_decay=1e-3, weight_decay=0.01,
                                                     initial_accumulator_value=0.1)),
    "adam": (torch.optim.Adam, "Adam", dict(lr=1e-3, amsgrad=True, weight_decay=0.01)),
    "adamw": (torch.optim.AdamW, "AdamW", dict(lr=1e-3, weight_decay=0.1)),
    "nadam": (torch.optim.NAdam, "NAdam", dict(lr=1e-3, weight_decay=0.1, decoupled_weight_decay=True)),
    "radam": (torch.optim.RAdam, "RAdam", dict(lr=1e-3, weight_decay=0.1, decoupled_weight_decay=True)),
    "lion": (LionReference, "Lion", dict(lr=1e-4, weight_decay=0.1)),
}  # fmt: skip


def _config(tiny: bool):
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)  # fmt: skip
    return LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                       tie_word_embeddings=False)  # fmt: skip


def _train(model, optimizer, batches, compile_with=None):
    import forge_compile

    train_step = causal_lm_train_step(model, optimizer)
    step = torch.compile(train_step, backend=compile_with) if compile_with else train_step
    report = forge_compile.explain(step, batches[0]) if compile_with == "forge" else step(batches[0])
    losses = []
    for batch in batches[1:]:
        losses.append(step(batch).item())
    return report, losses


def check_rule(rule: str, tiny: bool, device: str) -> dict:
    from transformers import LlamaForCausalLM

    import forge_compile

    eager_class, forge_name, settings = OPTIMIZERS[rule]
    cfg = _config(tiny)
    torch.manual_seed(0)
    initial = LlamaForCausalLM(cfg).to(device)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (2, 64), generator=generator).to(device) for _ in range(STEPS)]
    weights, losses = {}, {}
    started = time.perf_counter()
    for mode, dtype in (("eager-fp64", torch.float64), ("eager-fp32", torch.float32), ("forge", torch.float32)):
        torch._dynamo.reset()
        model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
        model.load_state_dict(initial.state_dict())
        model.train()
        if mode == "forge":
            optimizer = getattr(forge_compile.optim, forge_name)(model.parameters(), **settings)
            report, losses[mode] = _train(model, optimizer, batches, compile_with="forge")
        else:
            _, losses[mode] = _train(model, eager_class(model.parameters(), **settings), batches)
        weights[mode] = {n: p.detach().double() for n, p in model.named_parameters()}
    reference = weights["eager-fp64"]
    norm = sum(r.square().sum() for r in reference.values()).sqrt()

    def error(mode):
        diff = [weights[mode][n] - r for n, r in reference.items()]
        return {"relative_l2": (sum(d.square().sum() for d in diff).sqrt() / norm).item(),
                "max_abs": max(d.abs().max().item() for d in diff)}  # fmt: skip

    linear = sorted(f"{n}.weight" for n, m in initial.named_modules() if isinstance(m, torch.nn.Linear))
    errors = {mode: error(mode) for mode in ("eager-fp32", "forge")}
    fused = sorted(d.name.removeprefix("model.") for d in report.fused)
    checks = {
        "every_linear_weight_fused": fused == linear,
        "one_graph": len(report.graphs) == 1,
        "forge_as_close_to_float64_as_eager_fp32": errors["forge"]["relative_l2"]
        <= 1.5 * errors["eager-fp32"]["relative_l2"] + torch.finfo(torch.float32).eps,
    }
    return {
        "rule": rule,
        "optimizer": forge_name,
        "settings": settings,
        "linear_weights": len(linear),
        "fused": len(fused),
        "rejected": {d.name: d.reason for d in report.rejected},
        "gradient_bytes_eliminated": report.gradient_bytes_eliminated,
        "weight_error_vs_float64": errors,
        "losses": losses,
        "seconds": round(time.perf_counter() - started, 1),
        "checks": checks,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny config, for a smoke run")
    parser.add_argument("--rules", nargs="+", choices=list(OPTIMIZERS), default=list(OPTIMIZERS))
    args = parser.parse_args()
    results = {}
    for rule in args.rules:
        results[rule] = r = check_rule(rule, args.tiny, args.device)
        e = r["weight_error_vs_float64"]
        status = "PASS" if all(r["checks"].values()) else "FAIL " + ",".join(k for k, v in r["checks"].items() if not v)
        print(f"{rule:>8}: fused {r['fused']}/{r['linear_weights']}  |w - w64|/|w64|: eager fp32 "
              f"{e['eager-fp32']['relative_l2']:.2e}  forge {e['forge']['relative_l2']:.2e}  "
              f"({r['seconds']} s)  {status}", flush=True)  # fmt: skip
    passed = all(all(r["checks"].values()) for r in results.values())
    name = "every_rule_check" if not args.tiny else "every_rule_check_tiny_" + args.device.split(":")[0]
    write_result(name, {"passed": passed, "steps": STEPS, "rules": results})
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
