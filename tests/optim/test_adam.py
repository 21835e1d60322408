"""Adam/AdamW specifics: eager steps with every switch, complex parameters, Tensor lr, a param group added late.

(What every class shares, checkpoints and attach included: test_drop_in.py.)
"""


import pytest
import torch
from helpers import MLP, assert_close_params, assert_matches_torch_optim, mse_step, twin

from forge_compile.optim import Adam, AdamW


def _train_eager(model, opt, steps=3, seed=1):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(4, 5, 12, generator=generator), torch.randn(4, 5, 6, generator=generator)
        mse_step(model, opt)(x, y)


@pytest.mark.parametrize("settings", [dict(lr=1e-2, weight_decay=0.1), dict(lr=1e-2, amsgrad=True, maximize=True)])
def test_eager_steps_are_torch_steps(settings):
    model = MLP()
    reference = twin(model)
    _train_eager(model, AdamW(model.parameters(), **settings))
    _train_eager(reference, torch.optim.AdamW(reference.parameters(), **settings))
    assert_close_params(model, reference, atol=0)


def test_unsupported_settings_are_refused_at_construction():
    with pytest.raises(ValueError, match=r"differentiable=True\) is not supported"):
        AdamW(MLP().parameters(), differentiable=True)
    with pytest.raises(ValueError, match="complex parameters"):
        Adam([torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))])


def test_tensor_learning_rate_is_used_as_given():
    model = MLP()
    reference = twin(model)
    lr = torch.tensor(1e-2)
    opt = AdamW(model.parameters(), lr=lr)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = torch.compile(mse_step(model, opt), backend="forge")
    for i in range(3):
        x, y = torch.randn(4, 5, 12), torch.randn(4, 5, 6)
        step(x, y), mse_step(reference, reference_opt)(x, y)
        lr.fill_(lr.item() * 0.5)
        reference_opt.param_groups[0]["lr"] *= 0.5
    assert_matches_torch_optim(model, reference, lr=1e-2, steps=3)
    with pytest.raises(ValueError, match="1-element|scalar tensor"):
        AdamW(model.parameters(), lr=torch.ones(2))


def test_param_group_added_after_compilation_is_trained():
    first, second = MLP(), MLP(sizes=(6, 5))
    reference_first, reference_second = twin(first), twin(second)
    opt = AdamW(first.parameters(), lr=1e-2)
    reference_opt = torch.optim.AdamW(reference_first.parameters(), lr=1e-2)

    def make(a, b, o):
        def train_step(x, y):
            ((b(a(x)) - y) ** 2).mean().backward()
            o.step()
            o.zero_grad()

        return train_step

    step = torch.compile(make(first, second, opt), backend="forge")
    x, y = torch.randn(4, 5, 12), torch.randn(4, 5, 5)
    step(x, y), make(reference_first, reference_second, reference_opt)(x, y)
    opt.add_param_group({"params": second.parameters(), "lr": 3e-3})
    reference_opt.add_param_group({"params": reference_second.parameters(), "lr": 3e-3})
    for _ in range(2):
        step(x, y), make(reference_first, reference_second, reference_opt)(x, y)
    assert_matches_torch_optim(first, reference_first, lr=1e-2, steps=3)
    assert_matches_torch_optim(second, reference_second, lr=3e-3, steps=2)
