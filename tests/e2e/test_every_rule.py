"""Every forge optimizer, compiled, against torch.optim's eager step (Lion: the paper's formula).

The settings are those torch's own optimizer tests exercise
(torch/testing/_internal/common_optimizers.py, ``optim_inputs_func_*``), with the
CUDA-only ``capturable`` flag left out: forge ignores it as an implementation hint.
"""

import pytest
import torch
from helpers import MLP, assert_matches_torch_optim, mse_step, train_mlp_side_by_side, twin

import forge_compile
from benchmarks.references import lion_reference

STEPS = 8  # RAdam's rectification switches on at step 6

TORCH_SETTINGS = {
    torch.optim.SGD: [
        dict(), dict(lr=1e-2), dict(lr=torch.tensor(0.001)), dict(weight_decay=0.5), dict(momentum=0.9),
        dict(weight_decay=0.1, maximize=True), dict(momentum=0.9, dampening=0.5),
        dict(momentum=0.9, weight_decay=0.1), dict(momentum=0.9, nesterov=True, weight_decay=0.1),
    ],
    torch.optim.RMSprop: [
        dict(), dict(lr=1e-3), dict(weight_decay=0.1), dict(maximize=True), dict(weight_decay=0.1, centered=True),
        dict(maximize=True, weight_decay=0.1), dict(weight_decay=0.1, centered=True, momentum=0.1),
        dict(weight_decay=0.1, centered=True, momentum=0.1, maximize=True), dict(lr=torch.tensor(0.001)),
    ],
    torch.optim.Adagrad: [
        dict(), dict(weight_decay=0.1), dict(weight_decay=0.1, maximize=True), dict(lr=0.1),
        dict(initial_accumulator_value=0.1, weight_decay=0.1), dict(lr=0.1, lr_decay=0.5, weight_decay=0.1),
        dict(lr=torch.tensor(0.001)),
    ],
    torch.optim.NAdam: [
        dict(), dict(lr=1e-3), dict(momentum_decay=6e-3), dict(weight_decay=0.1),
        dict(weight_decay=0.1, momentum_decay=6e-3),
        dict(weight_decay=0.1, momentum_decay=6e-3, decoupled_weight_decay=True),
        dict(weight_decay=0.1, maximize=True), dict(lr=torch.tensor(0.001)),
    ],
    torch.optim.RAdam: [
        dict(), dict(lr=2e-3), dict(eps=1e-6), dict(weight_decay=0.1),
        dict(weight_decay=0.1, decoupled_weight_decay=True), dict(weight_decay=0.1, maximize=True),
        dict(lr=torch.tensor(0.001), weight_decay=0.1, decoupled_weight_decay=True),
    ],
}  # fmt: skip


def _cases():
    for torch_class, settings in TORCH_SETTINGS.items():
        for s in settings:
            label = ",".join(f"{k}={float(v) if isinstance(v, torch.Tensor) else v}" for k, v in s.items())
            yield pytest.param(torch_class, s, id=f"{torch_class.__name__}({label})")


def _copy_settings(settings):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in settings.items()}


def _assert_relative_close(model, reference, rtol=1e-5):
    """Each weight within ``rtol`` of torch's, relative to the size of that parameter's weights."""
    for (name, a), (_, e) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.isnan(a).eq(torch.isnan(e)).all(), f"{name}: NaN pattern differs"
        scale = e.detach().double().abs().max().item()
        err = (a.detach().double() - e.detach().double()).abs().max().item()
        assert err <= rtol * scale, f"{name}: max error {err:.3g} > {rtol} * {scale:.3g}"


@pytest.mark.parametrize("torch_class,settings", list(_cases()))
def test_compiled_rule_matches_torch_optim(torch_class, settings):
    torch.manual_seed(0)
    model = MLP()
    reference = twin(model)
    forge_class = forge_compile.optim.forge_class_for(torch_class)
    step = torch.compile(mse_step(model, forge_class(model.parameters(), **_copy_settings(settings))), backend="forge")
    reference_step = mse_step(reference, torch_class(reference.parameters(), **_copy_settings(settings)))
    report = train_mlp_side_by_side(step, reference_step, STEPS)
    if torch_class in (torch.optim.SGD, torch.optim.Adagrad):
        _assert_relative_close(model, reference)
    else:
        # Normalizing rules divide by sqrt(v) + eps: torch's own compiled step differs from
        # its eager step as much (RMSprop default: 5.6% of net.2.weight beyond 1e-5 relative).
        assert_matches_torch_optim(model, reference, lr=float(settings.get("lr", 1e-2)), steps=STEPS,
                                   outlier_fraction=0.1)
    assert {d.name for d in report.fused} == {f"model.net.{i}.weight" for i in (0, 2, 4)}
    assert {d.rule for d in report.fused} == {forge_class._forge_rule_name}
    assert len(report.graphs) == 1


LION_SETTINGS = [dict(), dict(lr=3e-3, weight_decay=0.5), dict(lr=1e-3, betas=(0.95, 0.98), maximize=True),
                 dict(lr=torch.tensor(2e-3), weight_decay=0.1)]  # fmt: skip


@pytest.mark.parametrize("settings", LION_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "default")
def test_compiled_lion_matches_the_paper(settings):
    torch.manual_seed(0)
    model = MLP()
    reference = [p.detach().double().clone() for p in model.parameters()]
    exp_avgs = [torch.zeros_like(p) for p in reference]
    opt = forge_compile.optim.Lion(model.parameters(), **_copy_settings(settings))
    step = torch.compile(mse_step(model, opt), backend="forge")
    hyper = dict(lr=float(settings.get("lr", 1e-4)), beta1=settings.get("betas", (0.9, 0.99))[0],
                 beta2=settings.get("betas", (0.9, 0.99))[1], weight_decay=settings.get("weight_decay", 0.0),
                 maximize=settings.get("maximize", False))  # fmt: skip
    for i in range(STEPS):
        x, y = torch.randn(4, 5, 12), torch.randn(4, 5, 6)
        # the reference's gradient: of the same loss at the same (fp32) weights
        probe = twin(model)
        ((probe(x) - y) ** 2).mean().backward()
        grads = [p.grad.double() for p in probe.parameters()]
        if i == 0:
            report = forge_compile.explain(step, x, y)
        else:
            step(x, y)
        lion_reference(reference, grads, exp_avgs, **hyper)
        for p, r in zip(model.parameters(), reference):
            # sign() makes each step +-lr exactly; fp32 rounding of the weights is all that differs
            torch.testing.assert_close(p.detach().double(), r, atol=1e-6, rtol=1e-6)
            r.copy_(p.detach().double())  # keep both on the same weights: a sign flip near 0 must not compound
    assert {d.name for d in report.fused} == {f"model.net.{i}.weight" for i in (0, 2, 4)}
    assert opt.state[model.net[0].weight]["exp_avg"].shape == (24, 12)
