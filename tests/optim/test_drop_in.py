"""Every forge optimizer as a drop-in for its torch.optim class: defaults, eager steps,
state_dict format and round trips with torch, attach, refusals.

(Adam/AdamW's finer points, Tensor lr and param groups added late: test_adam.py.)
"""

import copy

import pytest
import torch
from helpers import MLP, assert_close_params, assert_matches_torch_optim, mse_step, twin

import forge_compile
from forge_compile.optim import forge_class_for

# A setting per class that creates every state that class can have.
SETTINGS = {
    torch.optim.SGD: dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1),
    torch.optim.RMSprop: dict(lr=1e-2, centered=True, momentum=0.5, weight_decay=0.1),
    torch.optim.Adagrad: dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
    torch.optim.Adam: dict(lr=1e-2, amsgrad=True),
    torch.optim.AdamW: dict(lr=1e-2, weight_decay=0.1),
    torch.optim.NAdam: dict(lr=1e-2, momentum_decay=6e-3, decoupled_weight_decay=True, weight_decay=0.1),
    torch.optim.RAdam: dict(lr=1e-2, weight_decay=0.1),
}
CLASSES = [pytest.param(c, id=c.__name__) for c in SETTINGS]
STEPS = 7  # past RAdam's switch to rectified steps at step 6


def _batches(count, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 5, 12, generator=generator), torch.randn(4, 5, 6, generator=generator))
            for _ in range(count)]  # fmt: skip


def _run(step, batches):
    for x, y in batches:
        step(x, y)


def _train(model, opt, steps, seed=1):
    _run(mse_step(model, opt), _batches(steps, seed))


def _assert_close_to_torch(model, reference, torch_class, steps):
    if torch_class in (torch.optim.SGD, torch.optim.Adagrad):
        assert_close_params(model, reference, atol=1e-5)
    else:  # normalizing rules: see assert_matches_torch_optim
        assert_matches_torch_optim(model, reference, lr=SETTINGS[torch_class]["lr"], steps=steps, outlier_fraction=0.1)


@pytest.mark.parametrize("torch_class", CLASSES)
def test_same_defaults_and_group_keys_as_torch(torch_class):
    model = MLP()
    forge_opt, torch_opt = forge_class_for(torch_class)(model.parameters()), torch_class(model.parameters())
    assert isinstance(forge_opt, torch_class)
    assert forge_opt.defaults == torch_opt.defaults
    assert dict(forge_opt.param_groups[0]) == torch_opt.param_groups[0]


@pytest.mark.parametrize("torch_class", CLASSES)
def test_eager_steps_are_torch_steps(torch_class):
    model = MLP()
    reference = twin(model)
    _train(model, forge_class_for(torch_class)(model.parameters(), **SETTINGS[torch_class]), STEPS, seed=1)
    _train(reference, torch_class(reference.parameters(), **SETTINGS[torch_class]), STEPS, seed=1)
    assert_close_params(model, reference, atol=0)


def _assert_same_state_dict(ours, theirs):
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for index, entry in theirs["state"].items():
        assert list(ours["state"][index]) == list(entry), f"param {index}: keys or their order differ"
        for key, value in entry.items():
            mine = ours["state"][index][key]
            assert (mine.device, mine.dtype) == (value.device, value.dtype), f"param {index} {key}"
            torch.testing.assert_close(mine, value, atol=0, rtol=0, msg=lambda m: f"param {index} {key}: {m}")


@pytest.mark.parametrize("torch_class", CLASSES)
def test_state_dict_is_torchs_before_and_after_steps(torch_class):
    model = MLP()
    reference = twin(model)
    forge_opt = forge_class_for(torch_class)(model.parameters(), **SETTINGS[torch_class])
    torch_opt = torch_class(reference.parameters(), **SETTINGS[torch_class])
    _assert_same_state_dict(forge_opt.state_dict(), torch_opt.state_dict())  # Adagrad has entries already
    _train(model, forge_opt, STEPS, seed=1)
    _train(reference, torch_opt, STEPS, seed=1)
    _assert_same_state_dict(forge_opt.state_dict(), torch_opt.state_dict())


@pytest.mark.parametrize("torch_class", CLASSES)
def test_compiled_run_continues_in_torch_and_back(torch_class):
    settings = SETTINGS[torch_class]
    forge_class = forge_class_for(torch_class)
    model = MLP()
    reference = twin(model)
    reference_opt = torch_class(reference.parameters(), **settings)
    batches = _batches(3 * STEPS)
    for x, y in batches:  # uninterrupted, torch eager
        mse_step(reference, reference_opt)(x, y)

    # forge compiled -> torch eager -> forge compiled, each through state_dict()
    forge_opt = forge_class(model.parameters(), **settings)
    _run(torch.compile(mse_step(model, forge_opt), backend="forge"), batches[:STEPS])
    torch_opt = torch_class(model.parameters(), **settings)
    torch_opt.load_state_dict(copy.deepcopy(forge_opt.state_dict()))
    _run(mse_step(model, torch_opt), batches[STEPS : 2 * STEPS])
    resumed = forge_class(model.parameters(), **settings)
    resumed.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    _run(torch.compile(mse_step(model, resumed), backend="forge"), batches[2 * STEPS :])

    _assert_close_to_torch(model, reference, torch_class, 3 * STEPS)
    _assert_same_state_dict_shape(resumed.state_dict(), reference_opt.state_dict())


def _assert_same_state_dict_shape(ours, theirs):
    assert ours["param_groups"] == theirs["param_groups"]
    assert {i: list(e) for i, e in ours["state"].items()} == {i: list(e) for i, e in theirs["state"].items()}
    for index, entry in theirs["state"].items():
        for key in ("step", "mu_product"):
            if key in entry:
                assert float(ours["state"][index][key]) == pytest.approx(float(entry[key]), rel=1e-6), key


@pytest.mark.parametrize("torch_class", CLASSES)
def test_attach_converts_in_place_and_keeps_state(torch_class):
    settings = SETTINGS[torch_class]
    model = MLP()
    reference = twin(model)
    opt = torch_class(model.parameters(), **settings)
    reference_opt = torch_class(reference.parameters(), **settings)
    batches = _batches(STEPS)
    _run(mse_step(model, opt), batches[:3])
    before = copy.deepcopy(opt.state_dict())
    assert forge_compile.attach(opt) is opt and isinstance(opt, forge_class_for(torch_class))
    _assert_same_state_dict(opt.state_dict(), before)
    _run(torch.compile(mse_step(model, opt), backend="forge"), batches[3:])
    _run(mse_step(reference, reference_opt), batches)
    _assert_close_to_torch(model, reference, torch_class, STEPS)


@pytest.mark.parametrize("torch_class", CLASSES)
def test_differentiable_is_refused_with_what_to_do(torch_class):
    with pytest.raises(ValueError, match=r"differentiable=True\) is not supported.*use torch.optim"):
        forge_class_for(torch_class)(MLP().parameters(), differentiable=True)
    with pytest.raises(ValueError, match=r"differentiable=True\) is not supported"):
        forge_compile.attach(torch_class(MLP().parameters(), differentiable=True))


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda p: torch.optim.LBFGS(p), "LBFGS is not element-wise .*closure"),
        (lambda p: torch.optim.SparseAdam(p), "SparseAdam is not element-wise"),
        (lambda p: torch.optim.Adadelta(p), "cannot convert torch.optim.adadelta.Adadelta; forge supports"),
        (lambda p: torch.optim.Rprop(p), "cannot convert torch.optim.rprop.Rprop.*backend='inductor'"),
        (lambda p: type("MySGD", (torch.optim.SGD,), {})(p, lr=0.1), "subclasses a torch optimizer"),
    ],
    ids=["LBFGS", "SparseAdam", "Adadelta", "Rprop", "subclass"],
)
def test_attach_refuses_what_it_cannot_convert(make, match):
    with pytest.raises(TypeError, match=match):
        forge_compile.attach(make(MLP().parameters()))


def test_lion_defaults_and_checks():
    opt = forge_compile.optim.Lion(MLP().parameters())
    assert opt.defaults == dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False, differentiable=False)
    assert list(opt.state_dict()["state"]) == []  # like torch's classes before the first step
    for bad, match in [(dict(lr=-1.0), "learning rate"), (dict(betas=(0.9, 1.0)), "beta parameter at index 1"),
                       (dict(weight_decay=-0.1), "weight_decay"), (dict(lr=torch.ones(2)), "1-element")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            forge_compile.optim.Lion(MLP().parameters(), **bad)


def test_lion_checkpoint_resumes_bit_identically():
    batches = _batches(2 * STEPS)
    model = MLP()
    resumed_model = twin(model)
    opt = forge_compile.optim.Lion(model.parameters(), lr=1e-3, weight_decay=0.1)
    _run(torch.compile(mse_step(model, opt), backend="forge"), batches)

    first_half = forge_compile.optim.Lion(resumed_model.parameters(), lr=1e-3, weight_decay=0.1)
    _run(torch.compile(mse_step(resumed_model, first_half), backend="forge"), batches[:STEPS])
    model_state, optimizer_state = copy.deepcopy((resumed_model.state_dict(), first_half.state_dict()))
    assert list(optimizer_state["state"][0]) == ["step", "exp_avg"]  # torch's order (Adam: step first)
    torch._dynamo.reset()
    fresh = MLP()
    fresh.load_state_dict(model_state)
    second_half = forge_compile.optim.Lion(fresh.parameters())
    second_half.load_state_dict(optimizer_state)
    _run(torch.compile(mse_step(fresh, second_half), backend="forge"), batches[STEPS:])
    assert_close_params(fresh, model, atol=0)
