"""What a training loop does besides loss/backward/step, compiled with forge against torch.optim eager.

Schedulers and hyperparameter writes without recompiling, param groups, frozen and
gradient-less parameters, bit-identical resumes, and Dynamo's recompilation rules
(batch size, train/eval, no_grad evaluation) as under backend="inductor".
"""

import io

import pytest
import torch
from helpers import MLP, assert_close_params, assert_matches_torch_optim, mse_step, twin
from torch import nn
from torch.optim import lr_scheduler

import forge_compile


def _batches(count, batch=4, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 5, 12, generator=generator), torch.randn(batch, 5, 6, generator=generator))
            for _ in range(count)]  # fmt: skip


@pytest.fixture(autouse=True)
def fresh_counters():
    torch._dynamo.utils.counters.clear()  # torch._dynamo.reset() keeps them


def _unique_graphs():
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _adamw_pair(lr):
    """An MLP with forge's AdamW compiled, and its twin with torch's AdamW eager."""
    model = MLP()
    reference = twin(model)
    opt = forge_compile.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=lr, weight_decay=0.1)
    step, reference_step = torch.compile(mse_step(model, opt), backend="forge"), mse_step(reference, reference_opt)
    return model, reference, opt, reference_opt, step, reference_step


SCHEDULERS = {
    "StepLR": lambda o: lr_scheduler.StepLR(o, step_size=10, gamma=0.5),
    "CosineAnnealingLR": lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=100, eta_min=1e-5),
    # OneCycleLR also cycles Adam's beta1 (cycle_momentum): betas change every step too.
    "OneCycleLR": lambda o: lr_scheduler.OneCycleLR(o, max_lr=3e-3, total_steps=100),
    "LambdaLR": lambda o: lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1.0 + 0.1 * s)),
    "warmup-then-cosine": lambda o: lr_scheduler.SequentialLR(
        o, [lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=10), lr_scheduler.CosineAnnealingLR(o, T_max=90)],
        milestones=[10],
    ),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scheduler_changes_lr_every_step_in_one_graph(name):
    model, reference, opt, reference_opt, step, reference_step = _adamw_pair(lr=3e-3)
    scheduler, reference_scheduler = SCHEDULERS[name](opt), SCHEDULERS[name](reference_opt)
    lrs = set()
    for x, y in _batches(100):
        step(x, y), reference_step(x, y)
        scheduler.step(), reference_scheduler.step()
        lrs.add(opt.param_groups[0]["lr"])
        assert opt.param_groups[0]["lr"] == reference_opt.param_groups[0]["lr"]
        assert opt.param_groups[0]["betas"] == reference_opt.param_groups[0]["betas"]
    assert len(lrs) >= 10  # the schedule did move
    assert _unique_graphs() == 1
    assert_matches_torch_optim(model, reference, lr=3e-3, steps=100)


def test_weight_decay_and_betas_written_by_user_code_do_not_recompile():
    model, reference, opt, reference_opt, step, reference_step = _adamw_pair(lr=1e-2)
    for i, (x, y) in enumerate(_batches(8)):
        step(x, y), reference_step(x, y)
        for group in (*opt.param_groups, *reference_opt.param_groups):
            group["weight_decay"] = 0.1 / (i + 2)
            group["betas"] = (0.9 - 0.02 * i, 0.999 - 0.001 * i)
            group["eps"] = 1e-8 * (i + 1)
    assert _unique_graphs() == 1
    assert_matches_torch_optim(model, reference, lr=1e-2, steps=8)


def test_weight_decay_switched_off_recompiles_once_and_stays_right():
    """0 switches the decay term off (torch skips it too): one more graph, never a wrong step."""
    model, reference, opt, reference_opt, step, reference_step = _adamw_pair(lr=1e-2)
    for i, (x, y) in enumerate(_batches(6)):
        step(x, y), reference_step(x, y)
        if i == 2:
            for group in (*opt.param_groups, *reference_opt.param_groups):
                group["weight_decay"] = 0.0
    assert _unique_graphs() == 2
    assert_matches_torch_optim(model, reference, lr=1e-2, steps=6)


class _NormedMLP(nn.Module):
    """Linear layers with LayerNorm, a frozen layer and a layer the forward never uses."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 24)
        self.norm = nn.LayerNorm(24)
        self.frozen = nn.Linear(24, 24)
        self.out = nn.Linear(24, 6)
        self.unused = nn.Linear(6, 6)  # no gradient, ever: torch keeps no state for it
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.out(torch.nn.functional.gelu(self.frozen(self.norm(self.inp(x)))))


def _decay_groups(model, lr):
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": lr / 3}]


def test_param_groups_frozen_and_gradientless_parameters():
    model = _NormedMLP()
    reference = twin(model)
    opt = forge_compile.optim.AdamW(_decay_groups(model, 1e-2), lr=1e-2)
    reference_opt = torch.optim.AdamW(_decay_groups(reference, 1e-2), lr=1e-2)
    step, reference_step = torch.compile(mse_step(model, opt), backend="forge"), mse_step(reference, reference_opt)
    x, y = _batches(1)[0]
    report = forge_compile.explain(step, x, y)
    reference_step(x, y)
    for x, y in _batches(5, seed=2):
        step(x, y), reference_step(x, y)
    assert_matches_torch_optim(model, reference, lr=1e-2, steps=6)
    assert torch.equal(model.frozen.weight, reference.frozen.weight)
    assert torch.equal(model.unused.weight, reference.unused.weight)
    assert {d.name for d in report.fused} == {"model.inp.weight", "model.out.weight"}
    assert not any("frozen" in d.name or "unused" in d.name for d in report.decisions)
    # the same state entries as torch (none for frozen or unused parameters)
    assert opt.state_dict()["state"].keys() == reference_opt.state_dict()["state"].keys()
    assert opt.state_dict()["param_groups"] == reference_opt.state_dict()["param_groups"]


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(12, 16)
        self.heads = nn.ModuleList([nn.Linear(16, 6), nn.Linear(16, 6)])

    def forward(self, x, head: int):
        return self.heads[head](torch.relu(self.body(x)))


def test_parameters_without_a_gradient_in_some_steps():
    model = _TwoHeads()
    reference = twin(model)
    opt = forge_compile.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)

    def make(m, o):
        def train_step(x, y, head):
            loss = ((m(x, head) - y) ** 2).mean()
            loss.backward()
            o.step()
            o.zero_grad()
            return loss.detach()

        return train_step

    step, reference_step = torch.compile(make(model, opt), backend="forge"), make(reference, reference_opt)
    for i, (x, y) in enumerate(_batches(7)):
        head = 0 if i % 3 else 1  # head 1 in steps 0, 3, 6 only: its step count lags
        step(x, y, head), reference_step(x, y, head)
    assert_matches_torch_optim(model, reference, lr=1e-2, steps=7)
    for p, r in zip(model.parameters(), reference.parameters()):
        assert float(opt.state[p]["step"]) == float(reference_opt.state[r]["step"])


def test_resuming_from_a_checkpoint_is_bit_identical():
    batches = _batches(8)
    model = MLP()
    resumed = twin(model)
    opt = forge_compile.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = torch.compile(mse_step(model, opt), backend="forge")
    for x, y in batches:
        step(x, y)

    first = forge_compile.optim.AdamW(resumed.parameters(), lr=1e-2, weight_decay=0.1)
    step = torch.compile(mse_step(resumed, first), backend="forge")
    for x, y in batches[:4]:
        step(x, y)
    buffer = io.BytesIO()
    torch.save({"model": resumed.state_dict(), "optimizer": first.state_dict()}, buffer)
    torch._dynamo.reset()  # a new process, as far as compiled code goes
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    fresh = MLP()
    fresh.load_state_dict(checkpoint["model"])
    second = forge_compile.optim.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1)
    second.load_state_dict(checkpoint["optimizer"])
    step = torch.compile(mse_step(fresh, second), backend="forge")
    for x, y in batches[4:]:
        step(x, y)
    assert_close_params(fresh, model, atol=0)


def _graphs_for(backend, loop):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    loop(backend)
    return _unique_graphs()


def test_changing_batch_size_recompiles_as_inductor_does_and_stays_right():
    def loop(backend):
        torch.manual_seed(0)
        model = MLP()
        reference = twin(model)
        # forge's class under both backends: the same Dynamo graph, only the compiler differs
        opt = forge_compile.optim.AdamW(model.parameters(), lr=1e-2)
        reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        step = torch.compile(mse_step(model, opt), backend=backend)
        for i, batch in enumerate((4, 6, 8, 3, 6)):
            (x, y), reference_step = _batches(1, batch=batch, seed=i)[0], mse_step(reference, reference_opt)
            torch.testing.assert_close(step(x, y), reference_step(x, y), rtol=1e-5, atol=1e-6)
        assert_matches_torch_optim(model, reference, lr=1e-2, steps=5)

    forge_graphs, inductor_graphs = _graphs_for("forge", loop), _graphs_for("inductor", loop)
    assert forge_graphs == inductor_graphs <= 2  # static, then dynamic batch size


class _BatchNormMLP(nn.Module):
    def __init__(self):
        super().__init__()
        # No bias before the norm: BatchNorm removes it, so its gradient is rounding noise
        # and Adam's first step (lr * sign(g)) would move it by +-lr at random.
        self.inp, self.bn, self.out = nn.Linear(12, 16, bias=False), nn.BatchNorm1d(16), nn.Linear(16, 6)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.inp(x))))


def test_eval_mode_and_no_grad_evaluation_between_steps():
    def loop(backend):
        torch.manual_seed(0)
        model = _BatchNormMLP()
        reference = twin(model)
        # forge's class under both backends: the same Dynamo graph, only the compiler differs
        opt = forge_compile.optim.AdamW(model.parameters(), lr=1e-2)
        reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)

        def make(m, o):
            def train_step(x, y):
                loss = ((m(x) - y) ** 2).mean()
                loss.backward()
                o.step()
                o.zero_grad()
                return loss.detach()

            return train_step

        def evaluate(m, x):
            with torch.no_grad():
                return m(x)

        step, compiled_eval = torch.compile(make(model, opt), backend=backend), torch.compile(evaluate, backend=backend)
        generator = torch.Generator().manual_seed(3)
        for _ in range(4):
            x, y = torch.randn(8, 12, generator=generator), torch.randn(8, 6, generator=generator)
            model.train(), reference.train()
            torch.testing.assert_close(step(x, y), make(reference, reference_opt)(x, y), rtol=1e-5, atol=1e-6)
            model.eval(), reference.eval()
            torch.testing.assert_close(compiled_eval(model, x), evaluate(reference, x), rtol=1e-4, atol=1e-5)
        assert_matches_torch_optim(model, reference, lr=1e-2, steps=4)
        torch.testing.assert_close(model.bn.running_mean, reference.bn.running_mean)

    forge_graphs, inductor_graphs = _graphs_for("forge", loop), _graphs_for("inductor", loop)
    assert forge_graphs == inductor_graphs
