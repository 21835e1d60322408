"""forge's torch.library operators.

``forge::optimizer_update`` is what a forge optimizer's traced ``step()`` emits for each
parameter: a functional, opaque op, so the rewrite pass can recognise an update in the
post-grad graph whatever torch version decomposed the surrounding code. It returns the
new parameter and new states; the optimizer copies them back.

``forge::fused_linear_update_`` is what the pass puts in place of ``mm -> update ->
copies`` for a linear layer's weight: it computes ``grad_output_t @ input`` tile by tile
and updates the weight and its states in place, so the weight gradient never exists as
a tensor. On CUDA it runs the Triton kernel; elsewhere it computes the same math with
torch ops, in row chunks, so that even there no full gradient is allocated.

Both ops take the rule's hyperparameters as 0-d tensors (learning-rate schedules do not
recompile) and its static switches as ``options`` ints.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import rules
from .config import config

# A chunk of the CPU path's gradient holds about this many fp32 elements (4 MiB).
_CPU_CHUNK_ELEMENTS = 1 << 20


def apply_rule(
    rule: rules.Rule,
    param: Tensor,
    grad: Tensor,
    states: list[Tensor],
    step: Tensor,
    hyperparameters: list[Tensor],
    options: tuple[int, ...],
) -> tuple[Tensor, list[Tensor]]:
    """The rule on torch tensors, in fp32 (float64 for float64 parameters, as torch.optim
    computes them): returns (new param, new active states) in that dtype.

    Every torch path runs this: the functional op, the unfused decomposition that
    Inductor compiles, and the CPU implementation of the fused op.
    """
    compute = torch.float64 if param.dtype == torch.float64 else torch.float32
    coefficients = rule.torch_coefficients(
        step.to(torch.float64),
        *[h.to(torch.float64) for h in hyperparameters],
        *[step.new_zeros((), dtype=torch.float64)] * (rules.MAX_HYPERPARAMETERS - len(hyperparameters)),
    )
    coefficients = [c.to(compute) for c in coefficients]
    param_c = param.to(compute)
    active = rule.active_states(tuple(options))
    slots, given = [], iter(states)
    for is_active in active:
        slots.append(next(given).to(compute) if is_active else param_c)
    slots += [param_c] * (rules.MAX_STATES - len(slots))
    out = rule.torch_elementwise(
        param_c, grad.to(compute), *slots, *coefficients, *options,
        *[0] * (rules.MAX_OPTIONS - len(options)),
    )  # fmt: skip
    new_states = [s for s, is_active in zip(out[1:], active) if is_active]
    return out[0], new_states


def _check_update_arguments(rule_name, param, states, hyperparameters, options):
    rule = rules.get(rule_name)
    expected = sum(rule.active_states(tuple(options)))
    if len(states) != expected:
        raise ValueError(f"forge: rule {rule_name} with options {list(options)} takes {expected} states, got {len(states)}")
    if len(hyperparameters) != len(rule.scalar_inputs):
        raise ValueError(
            f"forge: rule {rule_name} takes hyperparameters {rule.scalar_inputs}, got {len(hyperparameters)} tensors"
        )
    for s in states:
        if s.shape != param.shape:
            raise ValueError(f"forge: state of shape {tuple(s.shape)} for a parameter of shape {tuple(param.shape)}")
    return rule


def _distinct_output(value: Tensor, like: Tensor) -> Tensor:
    """Cast to ``like``'s dtype as a new tensor: a custom op may not return its inputs."""
    out = value.to(like.dtype)
    return out.clone() if out is like or out.data_ptr() == like.data_ptr() else out


@torch.library.custom_op("forge::optimizer_update", mutates_args=())
def optimizer_update(
    param: Tensor,
    grad: Tensor,
    states: list[Tensor],
    step: Tensor,
    hyperparameters: list[Tensor],
    rule: str,
    options: list[int],
) -> list[Tensor]:
    """One parameter's optimizer update, functional: returns [new param, *new states].

    ``step`` is the already incremented step count (0-d), ``hyperparameters`` the rule's
    0-d tensors in the rule's order (``Rule.scalar_inputs``: the group's hyperparameters,
    then per-parameter scalar states such as NAdam's ``mu_product``, already advanced),
    ``options`` its static switches.

    Example::

        new_p, new_m, new_v = torch.ops.forge.optimizer_update(
            p, g, [m, v], step, [lr, beta1, beta2, eps, wd], "adam", [1, 0, 0, 1])
    """
    the_rule = _check_update_arguments(rule, param, states, hyperparameters, options)
    new_param, new_states = apply_rule(the_rule, param, grad, states, step, hyperparameters, tuple(options))
    return [_distinct_output(new_param, param)] + [_distinct_output(n, s) for n, s in zip(new_states, states)]


@optimizer_update.register_fake
def _optimizer_update_fake(param, grad, states, step, hyperparameters, rule, options):
    return [torch.empty_like(param)] + [torch.empty_like(s) for s in states]


@torch.library.custom_op("forge::fused_linear_update_", mutates_args=("weight", "states"))
def fused_linear_update_(
    weight: Tensor,
    grad_output_t: Tensor,
    input: Tensor,
    states: list[Tensor],
    step: Tensor,
    hyperparameters: list[Tensor],
    rule: str,
    options: list[int],
    grad_min: Optional[float] = None,
    grad_max: Optional[float] = None,
) -> None:
    """Update ``weight`` and ``states`` in place with the gradient ``grad_output_t @ input``.

    ``grad_output_t`` is [out_features, tokens] and ``input`` [tokens, in_features], any
    strides; the gradient is accumulated in fp32 and never stored. ``grad_min``/``grad_max``
    clamp it first, as ``torch.nn.utils.clip_grad_value_`` does.

    Example::

        torch.ops.forge.fused_linear_update_(
            w, dy.t(), x, [m, v], step, [lr, beta1, beta2, eps, wd], "adam", [1, 0, 0, 1])
    """
    the_rule = _check_update_arguments(rule, weight, states, hyperparameters, options)
    if grad_output_t.shape[0] != weight.shape[0] or input.shape[1] != weight.shape[1] or (
        grad_output_t.shape[1] != input.shape[0]
    ):
        raise ValueError(
            f"forge: fused_linear_update_ needs grad_output_t [{weight.shape[0]}, T] and input [T, {weight.shape[1]}], "
            f"got {tuple(grad_output_t.shape)} and {tuple(input.shape)}"
        )
    if _use_triton(weight):
        from .kernels.linear_update import fused_linear_update

        fused_linear_update(the_rule, weight, grad_output_t, input, states, step, hyperparameters, tuple(options),
                            grad_min, grad_max)  # fmt: skip
    else:
        _fused_linear_update_torch(the_rule, weight, grad_output_t, input, states, step, hyperparameters,
                                   tuple(options), grad_min, grad_max)  # fmt: skip


@fused_linear_update_.register_fake
def _fused_linear_update_fake(weight, grad_output_t, input, states, step, hyperparameters, rule, options,
                              grad_min=None, grad_max=None):  # fmt: skip
    return None


def _use_triton(weight: Tensor) -> bool:
    if config.kernel == "torch":
        return False
    if config.kernel == "triton":
        return True
    return weight.is_cuda


def _fused_linear_update_torch(rule, weight, grad_output_t, input, states, step, hyperparameters, options,
                               grad_min=None, grad_max=None):  # fmt: skip
    """The fused op's math with torch ops: fp32 gradient of a row chunk, then the rule."""
    rows_per_chunk = max(1, _CPU_CHUNK_ELEMENTS // max(1, weight.shape[1]))
    input32 = input.to(torch.float32)
    for start in range(0, weight.shape[0], rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        grad = grad_output_t[rows].to(torch.float32) @ input32
        if grad_min is not None or grad_max is not None:
            grad = grad.clamp(grad_min, grad_max)
        new_weight, new_states = apply_rule(
            rule, weight[rows], grad, [s[rows] for s in states], step, hyperparameters, options
        )
        weight[rows].copy_(new_weight)
        for state, new in zip(states, new_states):
            state[rows].copy_(new)


@torch.library.custom_op("forge::advance_scalar_states", mutates_args=())
def advance_scalar_states(
    step: Tensor, hyperparameters: list[Tensor], scalar_states: list[Tensor], rule: str
) -> list[Tensor]:
    """A rule's per-parameter scalar states for this step (NAdam's ``mu_product * mu_t``).

    An op rather than traced code: the rule runs in the torch dialect, whose rebound
    globals Dynamo cannot guard on.

    Example::

        [mu_product] = torch.ops.forge.advance_scalar_states(step, [lr, b1, b2, eps, wd, md], [mu_product], "nadam")
    """
    the_rule = rules.get(rule)
    advanced = the_rule.torch_advance(
        step.to(torch.float64),
        *[h.to(torch.float64) for h in hyperparameters],
        *[s.to(torch.float64) for s in scalar_states],
    )
    return [_distinct_output(value, s) for value, s in zip(advanced, scalar_states)]


@advance_scalar_states.register_fake
def _advance_scalar_states_fake(step, hyperparameters, scalar_states, rule):
    return [torch.empty_like(s) for s in scalar_states]
