"""forge::fused_linear_update_ from its Autograd kernel: the CPU/CUDA kernel straight away
for plain tensors with grad mode off (forge's compiled backward), the redispatch otherwise."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import forge_compile  # noqa: F401  (registers the ops)
from forge_compile import ops

LR, BETA1, BETA2, EPS, WEIGHT_DECAY = 1e-2, 0.9, 0.999, 1e-8, 0.1


def _problem():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 6, generator=generator, dtype=torch.float64)
    grad_output_t = torch.randn(8, 5, generator=generator, dtype=torch.float64)
    input = torch.randn(5, 6, generator=generator, dtype=torch.float64)
    return weight.float(), grad_output_t.float(), input.float()


def _torch_adamw(weight, grad):
    param = torch.nn.Parameter(weight.double().clone())
    param.grad = grad.double()
    optimizer = torch.optim.AdamW([param], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WEIGHT_DECAY)
    optimizer.step()
    state = optimizer.state[param]
    return param.detach(), state["exp_avg"], state["exp_avg_sq"]


def _call(weight, grad_output_t, input, states):
    hyperparameters = [torch.tensor(h, dtype=torch.float64) for h in (LR, BETA1, BETA2, EPS, WEIGHT_DECAY)]
    torch.ops.forge.fused_linear_update_(weight, grad_output_t, input, states, torch.tensor(1.0), hyperparameters,
                                         "adam", [1, 0, 0, 1])  # fmt: skip


@pytest.fixture
def direct_calls(monkeypatch):
    """The decisions of ``_runs_on_plain_tensors``, one per op call."""
    seen = []
    decide = ops._runs_on_plain_tensors

    def spy(args):
        seen.append(decide(args))
        return seen[-1]

    monkeypatch.setattr(ops, "_runs_on_plain_tensors", spy)
    return seen


@pytest.mark.parametrize("grad_enabled", [False, True], ids=["no-grad-direct", "grad-redispatched"])
def test_both_routes_update_as_torch_adamw(direct_calls, grad_enabled):
    weight, grad_output_t, input = _problem()
    expected = _torch_adamw(weight, grad_output_t.double() @ input.double())
    weight = torch.nn.Parameter(weight)  # a leaf that requires grad, as a model's weight
    states = [torch.zeros_like(weight), torch.zeros_like(weight)]
    with torch.set_grad_enabled(grad_enabled):
        _call(weight, grad_output_t, input, states)
    assert direct_calls == [not grad_enabled]
    for got, want in zip([weight.detach(), *states], expected):
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)


def test_fake_tensors_are_redispatched_and_left_alone(direct_calls):
    with FakeTensorMode() as mode, torch.no_grad():
        weight, grad_output_t, input = (mode.from_tensor(t) for t in _problem())
        states = [torch.zeros_like(weight), torch.zeros_like(weight)]
        _call(weight, grad_output_t, input, states)
    assert direct_calls == [False]


def test_functional_tensors_are_redispatched():
    weight, grad_output_t, input = _problem()
    functional = torch._to_functional_tensor(weight)
    args = (functional, grad_output_t, input, [weight.clone(), weight.clone()], torch.tensor(1.0), [])
    with torch.no_grad():
        assert not ops._runs_on_plain_tensors(args)
        assert ops._runs_on_plain_tensors((weight, *args[1:]))
