"""Each rule's fused op, Triton kernel and torch implementation, against torch.optim in float64.

A weight is stepped ``final_step - 1`` times by torch's own optimizer in float64 (random
gradients), the forge optimizer loads that state through ``load_state_dict``, and one
more step runs through ``forge::fused_linear_update_`` with ``dW = dY^T X`` computed
inside it. The reference takes the same step in float64 with ``dY^T X`` in float64.
Lion, which torch lacks, is checked against the paper's formula in float64.

Under TRITON_INTERPRET=1 the Triton kernel runs on the CPU (fp32 operands only: the
interpreter's bf16 tl.dot is wrong).
"""

import copy

import pytest
import torch

import forge_compile
from benchmarks.references import lion_reference
from forge_compile.config import config

from helpers import KERNEL_DEVICE as DEVICE
from helpers import ON_GPU, TRITON_AVAILABLE

SHAPE = (37, 29, 23)  # odd sizes: every tile edge is masked
# The warp-specialised Hopper kernel reads dY and X by TMA, whose row strides must be
# multiples of 16 bytes: rows and columns multiples of 8, one partial 128x128 tile on each axis
# (columns multiples of 16, so that the cp.async variant copies the weight and states).
WARP_SPECIALIZED_SHAPE = (136, 272, 23)

# One setting per option switch of each rule (torch's hyperparameter names).
SETTINGS = {
    torch.optim.SGD: [
        dict(lr=0.1), dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.1),
        dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1, maximize=True),
    ],
    torch.optim.RMSprop: [
        dict(lr=1e-2), dict(lr=1e-2, centered=True, momentum=0.5, weight_decay=0.1, maximize=True),
        dict(lr=1e-2, alpha=0.9, eps=1e-4, momentum=0.9),
    ],
    torch.optim.Adagrad: [
        dict(lr=0.1, lr_decay=0.05, weight_decay=0.1, initial_accumulator_value=0.2), dict(lr=0.1, maximize=True),
    ],
    torch.optim.Adam: [dict(lr=1e-2, amsgrad=True, weight_decay=0.1), dict(lr=1e-2, maximize=True)],
    torch.optim.AdamW: [dict(lr=1e-2, weight_decay=0.5, amsgrad=True)],
    torch.optim.NAdam: [
        dict(lr=1e-2, weight_decay=0.1, momentum_decay=6e-3),
        dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, maximize=True),
    ],
    torch.optim.RAdam: [
        dict(lr=1e-2, weight_decay=0.1), dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, maximize=True),
    ],
}  # fmt: skip
# Step 1 starts every state (SGD's buffer is the gradient); by step 7 bias corrections,
# Adagrad's lr decay and NAdam's mu products have moved and RAdam is rectified (step >= 6).
FINAL_STEPS = [1, 7]



def _on_hopper():
    from forge_compile.kernels import linear_update_hopper

    return ON_GPU and linear_update_hopper.AVAILABLE and torch.cuda.get_device_capability()[0] == 9


IMPLEMENTATIONS = [
    pytest.param("triton", marks=pytest.mark.skipif(not TRITON_AVAILABLE, reason="needs a GPU or TRITON_INTERPRET=1")),
    pytest.param("warp-specialized", marks=pytest.mark.skipif(not _on_hopper(), reason="needs a Hopper GPU")),
    pytest.param("warp-specialized-async", marks=pytest.mark.skipif(not _on_hopper(), reason="needs a Hopper GPU")),
    "torch",
]


def _cases():
    for torch_class, settings in SETTINGS.items():
        for s in settings:
            label = ",".join(f"{k}={v}" for k, v in s.items())
            yield pytest.param(torch_class, s, id=f"{torch_class.__name__}({label})")


def _random_grad_output_and_input(implementation):
    """Operands on a grid of 1/8 in [-2, 2]: every product and partial sum of ``dY^T X`` is
    exact in fp32, so the float64 reference sees the very gradient the kernel accumulates and
    the comparison measures the rule alone (with Gaussian operands a cancelling sum's rounding,
    amplified by ``g / sqrt(v)`` where g is small, is larger than the rule's own error). The
    grid is exact in bf16 too: the warp-specialised kernel takes bf16 operands (dY as a
    transposed view, as the graph hands it over)."""
    M, N, T = implementation.shape
    grid = lambda *shape: torch.randint(-16, 17, shape, device=DEVICE).float() / 8  # noqa: E731
    if implementation.startswith("warp-specialized"):
        return grid(T, M).to(torch.bfloat16).t(), grid(T, N).to(torch.bfloat16)
    return grid(M, T), grid(T, N)


def _fused_step(optimizer, weight, grad_output_t, input, grad_min=None, grad_max=None):
    """The traced step's work for one weight, with the gradient left to the fused op."""
    [view] = optimizer._forge_groups
    state = optimizer.state[weight]
    state["step"] += 1
    hyperparameters = optimizer._forge_step_hyperparameters(view, 0)
    states = [state[key] for key in view.state_keys]
    torch.ops.forge.fused_linear_update_(weight.data, grad_output_t, input, states, state["step"], hyperparameters,
                                         optimizer._forge_rule_name, list(view.options), grad_min, grad_max)  # fmt: skip


class _Implementation(str):
    """The implementation's name, and the weight shape [M, N] and token count T it is tested on."""

    shape: tuple


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request, monkeypatch):
    name = _Implementation(request.param)
    warp_specialized = name.startswith("warp-specialized")
    name.shape = WARP_SPECIALIZED_SHAPE if warp_specialized else SHAPE
    monkeypatch.setattr(config, "kernel", "torch" if name == "torch" else "triton")
    if not warp_specialized:
        yield name
        return
    from forge_compile.kernels import linear_update, linear_update_hopper

    # forge's tile without cp.async (as fp32 weight and states take it), or with: two fp32 slots of
    # four tensors fit beside a 3-stage ring.
    tile = (128, 128, 64, 3, 16, 8, 112, 2) if name.endswith("async") else (*linear_update.HOPPER_TILE[:7], 0)
    async_slices = tile[7]
    monkeypatch.setattr(linear_update, "HOPPER_TILE", tile)
    launches = []
    launch = linear_update_hopper.launch
    monkeypatch.setattr(config, "warp_specialize", "always")
    monkeypatch.setattr(linear_update_hopper, "launch", lambda *a, **k: (launches.append(a[4]), launch(*a, **k)))
    yield name
    assert launches, "the warp-specialised kernel did not run"
    assert all(kernel_config["ASYNC_SLICES"] == async_slices for kernel_config in launches)


@pytest.mark.parametrize("final_step", FINAL_STEPS)
@pytest.mark.parametrize("torch_class,settings", list(_cases()))
def test_fused_op_matches_torch_optim_in_float64(implementation, torch_class, settings, final_step):
    M, N, _ = implementation.shape
    reference_weight = torch.nn.Parameter(torch.randn(M, N, device=DEVICE, dtype=torch.float64))
    reference = torch_class([reference_weight], **settings)
    for _ in range(final_step - 1):
        reference_weight.grad = torch.randn_like(reference_weight)
        reference.step()
    weight = torch.nn.Parameter(reference_weight.detach().float())
    optimizer = forge_compile.optim.forge_class_for(torch_class)([weight], **settings)
    # A copy: load_state_dict keeps torch's CPU step tensors as they are, shared with the reference.
    optimizer.load_state_dict(copy.deepcopy(reference.state_dict()))

    # torch.optim's own step in fp32 from the same state: the error it makes sizes the
    # tolerance where the rule is ill-conditioned (below).
    fp32_weight = torch.nn.Parameter(reference_weight.detach().float())
    fp32_reference = torch_class([fp32_weight], **settings)
    fp32_reference.load_state_dict(copy.deepcopy(reference.state_dict()))

    grad_output_t, input = _random_grad_output_and_input(implementation)
    _fused_step(optimizer, weight, grad_output_t, input)
    reference_weight.grad = grad_output_t.double() @ input.double()
    reference.step()
    fp32_weight.grad = reference_weight.grad.float()  # exact: the grid operands
    fp32_reference.step()

    _assert_as_close_as_fp32_can_be(weight, reference_weight, fp32_weight, "weight")
    expected_state, fp32_state = reference.state[reference_weight], fp32_reference.state[fp32_weight]
    for key, value in optimizer.state[weight].items():
        if key in expected_state:
            expected = torch.as_tensor(expected_state[key], dtype=torch.float64).to(DEVICE)
            fp32 = torch.as_tensor(fp32_state[key]).to(DEVICE)
            _assert_as_close_as_fp32_can_be(value, expected, fp32, key)
    if "step" in expected_state:  # SGD keeps none (forge's own count is hidden)
        assert float(optimizer.state[weight]["step"]) == final_step


def _assert_as_close_as_fp32_can_be(actual, expected, fp32_torch, what):
    """fp32 tile math against float64 on an exact gradient: what is left is fp32 rounding of
    the rule's arithmetic, at most 3.6e-7 on weights and states (measured, seeds 0 and 1).
    Where weight decay all but cancels the gradient (RMSprop centered with decay, maximize:
    ``g = 0.156 - 0.1 * 1.5625`` is 2e-6, so eps moves the update by 5%), any fp32 rounding
    of ``g`` is amplified, and an order of operations other than torch's can round it twice
    where torch rounds once (measured: forge 2.04x torch's miss on the worst momentum
    element). There each element may miss by four times torch.optim's own fp32 miss."""
    actual, expected, fp32_miss = actual.detach().double(), expected.detach(), (fp32_torch.detach().double() - expected).abs()
    allowed = 2e-6 + 2e-6 * expected.abs() + 4 * fp32_miss
    excess = (actual - expected).abs() - allowed
    worst = int(excess.argmax())
    assert excess.max() <= 0, (f"{what}: {int((excess > 0).sum())} of {excess.numel()} elements beyond fp32 rounding; "
                               f"worst {actual.flatten()[worst].item()!r} against {expected.flatten()[worst].item()!r} "
                               f"(torch.optim in fp32: {fp32_torch.detach().flatten()[worst].item()!r})")  # fmt: skip


LION_SETTINGS = [dict(lr=1e-2), dict(lr=3e-3, betas=(0.95, 0.98), weight_decay=0.5, maximize=True)]


@pytest.mark.parametrize("final_step", FINAL_STEPS)
@pytest.mark.parametrize("settings", LION_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_fused_lion_matches_the_paper_in_float64(implementation, settings, final_step):
    M, N, _ = implementation.shape
    hyper = dict(lr=settings["lr"], beta1=settings.get("betas", (0.9, 0.99))[0],
                 beta2=settings.get("betas", (0.9, 0.99))[1], weight_decay=settings.get("weight_decay", 0.0),
                 maximize=settings.get("maximize", False))  # fmt: skip
    reference_weight = torch.randn(M, N, device=DEVICE, dtype=torch.float64)
    exp_avg = torch.zeros_like(reference_weight)
    for _ in range(final_step - 1):
        lion_reference([reference_weight], [torch.randn_like(reference_weight)], [exp_avg], **hyper)
    weight = torch.nn.Parameter(reference_weight.float())
    optimizer = forge_compile.optim.Lion([weight], **settings)
    optimizer.state[weight]["exp_avg"].copy_(exp_avg)
    optimizer.state[weight]["step"].fill_(final_step - 1)

    grad_output_t, input = _random_grad_output_and_input(implementation)
    _fused_step(optimizer, weight, grad_output_t, input)
    lion_reference([reference_weight], [grad_output_t.double() @ input.double()], [exp_avg], **hyper)

    torch.testing.assert_close(weight.detach().double(), reference_weight, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(optimizer.state[weight]["exp_avg"].double(), exp_avg, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("bounds", [(-1.0, 1.5), (None, 0.5), (-0.25, None)], ids=["both", "max", "min"])
def test_fused_op_clamps_the_gradient_as_clip_grad_value_does(implementation, bounds):
    """The kernel's clamp of the fp32 gradient tile against torch's clamp in float64
    (the grid operands give gradients of several units, so each bound clips many)."""
    grad_min, grad_max = bounds
    M, N, _ = implementation.shape
    reference_weight = torch.nn.Parameter(torch.randn(M, N, device=DEVICE, dtype=torch.float64))
    reference = torch.optim.Adam([reference_weight], lr=1e-2)
    weight = torch.nn.Parameter(reference_weight.detach().float())
    optimizer = forge_compile.optim.Adam([weight], lr=1e-2)
    grad_output_t, input = _random_grad_output_and_input(implementation)
    _fused_step(optimizer, weight, grad_output_t, input, grad_min, grad_max)
    reference_weight.grad = (grad_output_t.double() @ input.double()).clamp(grad_min, grad_max)
    assert (reference_weight.grad != grad_output_t.double() @ input.double()).double().mean() > 0.2
    reference.step()
    torch.testing.assert_close(weight.detach().double(), reference_weight.detach(), atol=2e-6, rtol=2e-6)
    expected_exp_avg = reference.state[reference_weight]["exp_avg"]
    torch.testing.assert_close(optimizer.state[weight]["exp_avg"].double(), expected_exp_avg, atol=2e-6, rtol=2e-6)
