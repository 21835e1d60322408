"""forge_compile.optim.Adam/AdamW as drop-ins for torch.optim: construction, eager steps, checkpoints, attach."""

import copy

import pytest
import torch
from helpers import MLP, assert_close_params, assert_matches_torch_optim, mse_step, twin

import forge_compile
from forge_compile.optim import Adam, AdamW


def _train_eager(model, opt, steps=3, seed=1):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(4, 5, 12, generator=generator), torch.randn(4, 5, 6, generator=generator)
        mse_step(model, opt)(x, y)


@pytest.mark.parametrize("forge_class,torch_class", [(Adam, torch.optim.Adam), (AdamW, torch.optim.AdamW)])
def test_same_defaults_and_group_keys_as_torch(forge_class, torch_class):
    model = MLP()
    forge_opt, torch_opt = forge_class(model.parameters()), torch_class(model.parameters())
    assert forge_opt.defaults == torch_opt.defaults
    assert isinstance(forge_opt, torch_class)
    assert {k: v for k, v in forge_opt.param_groups[0].items() if k != "params"} == {
        k: v for k, v in torch_opt.param_groups[0].items() if k != "params"
    }


@pytest.mark.parametrize("settings", [dict(lr=1e-2, weight_decay=0.1), dict(lr=1e-2, amsgrad=True, maximize=True)])
def test_eager_steps_are_torch_steps(settings):
    model = MLP()
    reference = twin(model)
    _train_eager(model, AdamW(model.parameters(), **settings))
    _train_eager(reference, torch.optim.AdamW(reference.parameters(), **settings))
    assert_close_params(model, reference, atol=0)


def test_state_dict_matches_torch_format_and_round_trips():
    model = MLP()
    reference = twin(model)
    forge_opt = AdamW(model.parameters(), lr=1e-2, amsgrad=True)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, amsgrad=True)
    assert forge_opt.state_dict()["state"] == {}  # like torch before its first step
    _train_eager(model, forge_opt)
    _train_eager(reference, torch_opt)
    ours, theirs = forge_opt.state_dict(), torch_opt.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for index, entry in theirs["state"].items():
        assert list(ours["state"][index]) == list(entry)  # same keys, same order
        for key, value in entry.items():
            assert ours["state"][index][key].device == value.device and ours["state"][index][key].dtype == value.dtype
            torch.testing.assert_close(ours["state"][index][key], value, atol=0, rtol=0)

    # forge -> torch and torch -> forge continue identically
    loaded_torch = torch.optim.AdamW(twin(model).parameters())
    resumed_model = twin(model)
    loaded_torch = torch.optim.AdamW(resumed_model.parameters())
    loaded_torch.load_state_dict(copy.deepcopy(ours))
    resumed_forge_model = twin(reference)
    loaded_forge = AdamW(resumed_forge_model.parameters())
    loaded_forge.load_state_dict(copy.deepcopy(theirs))
    assert all(isinstance(g, forge_compile.optim.base.ParamGroup) for g in loaded_forge.param_groups)
    _train_eager(resumed_model, loaded_torch, seed=2)
    _train_eager(resumed_forge_model, loaded_forge, seed=2)
    assert_close_params(resumed_forge_model, resumed_model, atol=1e-7)


def test_compiled_run_resumes_in_torch_optim():
    model = MLP()
    reference = twin(model)
    opt = AdamW(model.parameters(), lr=1e-2)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = torch.compile(mse_step(model, opt), backend="forge")
    x, y = torch.randn(4, 5, 12), torch.randn(4, 5, 6)
    for _ in range(3):
        step(x, y), mse_step(reference, reference_opt)(x, y)
    resumed_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    resumed_opt.load_state_dict(opt.state_dict())
    for _ in range(2):
        mse_step(model, resumed_opt)(x, y), mse_step(reference, reference_opt)(x, y)
    assert_matches_torch_optim(model, reference, lr=1e-2, steps=5)


def test_attach_converts_in_place_and_keeps_state():
    model = MLP()
    reference = twin(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    _train_eager(model, opt)
    _train_eager(reference, reference_opt)
    same = forge_compile.attach(opt)
    assert same is opt and isinstance(opt, AdamW)
    assert int(opt.state[next(model.parameters())]["step"]) == 3
    step = torch.compile(mse_step(model, opt), backend="forge")
    x, y = torch.randn(4, 5, 12), torch.randn(4, 5, 6)
    for _ in range(2):
        step(x, y), mse_step(reference, reference_opt)(x, y)
    assert_matches_torch_optim(model, reference, lr=1e-2, steps=5)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda p: torch.optim.LBFGS(p), "not element-wise"),
        (lambda p: torch.optim.SparseAdam(p), "not element-wise"),
        (lambda p: type("MyAdam", (torch.optim.Adam,), {})(p), "subclasses a torch optimizer"),
        (lambda p: torch.optim.Adadelta(p), "cannot convert torch.optim.adadelta.Adadelta"),
    ],
)
def test_attach_refuses_what_it_cannot_convert(make, match):
    with pytest.raises(TypeError, match=match):
        forge_compile.attach(make(MLP().parameters()))


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
