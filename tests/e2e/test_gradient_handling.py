"""Code between backward() and step() that touches gradients: what fuses, what stays unfused, all right.

(clip_grad_norm_ and accumulation: test_compiled_step.py; logged gradients: tests/passes.)
"""

import pytest
import torch
from helpers import MLP, assert_matches_torch_optim, train_side_by_side, twin

import forge_compile


def _step_with(model, optimizer, between):
    def train_step(x, y):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        between(model)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return train_step


def _side_by_side(between, steps=5, lr=1e-2):
    model = MLP()
    reference = twin(model)
    step = torch.compile(_step_with(model, forge_compile.optim.AdamW(model.parameters(), lr=lr), between),
                         backend="forge")  # fmt: skip
    reference_step = _step_with(reference, torch.optim.AdamW(reference.parameters(), lr=lr), between)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 5, 12, generator=generator), torch.randn(4, 5, 6, generator=generator))
               for _ in range(steps)]  # fmt: skip
    report = train_side_by_side(step, reference_step, batches)
    assert_matches_torch_optim(model, reference, lr=lr, steps=steps)
    return model, reference, report


@pytest.mark.parametrize("foreach", [None, False], ids=["foreach", "per-tensor"])
def test_clip_grad_value_fuses_into_the_update(foreach):
    # 0.005 clips a good part of this MLP's gradients, so a clamp left out would show.
    clip = lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 0.005, foreach=foreach)  # noqa: E731
    _, _, report = _side_by_side(clip)
    assert {d.name for d in report.fused} == {f"model.net.{i}.weight" for i in (0, 2, 4)}
    probe = MLP()
    ((probe(torch.randn(4, 5, 12)) - torch.randn(4, 5, 6)) ** 2).mean().backward()
    clipped = sum((p.grad.abs() > 0.005).sum().item() for p in probe.parameters())
    clipped /= sum(p.numel() for p in probe.parameters())
    assert clipped > 0.05, f"only {clipped:.1%} of gradients clipped: the test would not see a missing clamp"


def test_clamp_with_crossed_bounds_stays_unfused_and_right():
    def crossed(m):
        for p in m.parameters():
            p.grad.clamp_(min=0.01, max=-0.01)  # torch.clamp: every element becomes max

    _, _, report = _side_by_side(crossed)
    weights = [d for d in report.rejected if len(d.shape) == 2]
    assert len(weights) == 3 and all("crossed bounds" in d.reason for d in weights), weights


def test_gradient_scaling_by_a_tensor_stays_unfused_and_right():
    scale = torch.tensor(0.5)

    def rescale(m):
        for p in m.parameters():
            p.grad.mul_(scale)

    _, _, report = _side_by_side(rescale)
    weights = [d for d in report.rejected if len(d.shape) == 2]
    assert len(weights) == 3 and all(d.code == "not_a_matmul" and "scaled" in d.reason for d in weights), weights


def test_grad_scaler_is_right_and_explained():
    """GradScaler reads every gradient (inf check) and decides the step on the host: the
    graph breaks there, so the update runs in its own graph on materialized gradients."""

    def run(model, optimizer, compiled):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)

        def train_step(x, y):
            loss = ((model(x) - y) ** 2).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            return loss.detach()

        step = torch.compile(train_step, backend="forge") if compiled else train_step
        generator = torch.Generator().manual_seed(1)
        report = None
        for i in range(4):
            x, y = torch.randn(4, 5, 12, generator=generator), torch.randn(4, 5, 6, generator=generator)
            if i == 0 and compiled:
                report = forge_compile.explain(step, x, y)
            else:
                step(x, y)
        return report

    model = MLP()
    reference = twin(model)
    report = run(model, forge_compile.optim.AdamW(model.parameters(), lr=1e-2), compiled=True)
    run(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), compiled=False)
    assert_matches_torch_optim(model, reference, lr=1e-2, steps=4)
    assert not report.fused
    assert all(d.code == "gradient_from_outside" for d in report.rejected if len(d.shape) == 2)
