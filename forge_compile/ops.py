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

import functools
import math
from typing import Optional

import torch
from torch import Tensor

from . import dtensor, rules
from .rules import storage
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
    quantized_states: bool = False,
    rounding_seed: Optional[int | Tensor] = None,
    first_row: int = 0,
) -> tuple[Tensor, list[Tensor]]:
    """The rule on torch tensors: returns (new param, new states) as they are stored.

    The math is fp32 (float64 for float64 parameters, as torch.optim computes them). With
    ``quantized_states`` the states are the 8-bit codes of each active state followed by
    their block scales (:mod:`forge_compile.rules.storage`), and so are the new ones.
    ``rounding_seed`` rounds a bf16 parameter stochastically (``first_row``: where
    ``param`` starts in its weight, so that each element draws its own bits): an int, or
    an int64 tensor whose elements all hold it (:func:`rounding_seed_tensor`), which the
    unfused Inductor path passes so that the seed is read at run time, not written into
    the generated code.

    Every torch path runs this: the functional op, the unfused decomposition that
    Inductor compiles, and the CPU implementation of the fused op.
    """
    compute = torch.float64 if param.dtype == torch.float64 and not quantized_states else torch.float32
    coefficients = rule.torch_coefficients(
        step.to(torch.float64),
        *[h.to(torch.float64) for h in hyperparameters],
        *[step.new_zeros((), dtype=torch.float64)] * (rules.MAX_HYPERPARAMETERS - len(hyperparameters)),
    )
    coefficients = [c.to(compute) for c in coefficients]
    param_c, grad_c = param.to(compute), grad.to(compute)
    active = rule.active_states(tuple(options))
    signed = rule.signed_active_states(tuple(options))
    if quantized_states:
        # The rule runs on [rows, blocks, 64] (each row padded with zeros to whole blocks,
        # which every rule keeps zero): see _in_blocks.
        param_c, grad_c = _in_blocks(param_c), _in_blocks(grad_c)
        codes, scales = states[: len(signed)], states[len(signed) :]
        values = [_dequantize_in_blocks(c, a, is_signed) for c, a, is_signed in zip(codes, scales, signed)]
    else:
        values = [s.to(compute) for s in states]
    slots, given = [], iter(values)
    for is_active in active:
        slots.append(next(given) if is_active else param_c)
    slots += [param_c] * (rules.MAX_STATES - len(slots))
    out = rule.torch_elementwise(
        param_c, grad_c, *slots, *coefficients, *options,
        *[0] * (rules.MAX_OPTIONS - len(options)),
    )  # fmt: skip
    new_values = [s for s, is_active in zip(out[1:], active) if is_active]
    new_param = out[0]
    if quantized_states:
        stored = [_quantize_in_blocks(v, is_signed) for v, is_signed in zip(new_values, signed)]
        new_states = [_from_blocks(c, param.shape) for c, _ in stored] + [a for _, a in stored]
        new_param = _from_blocks(_stored_as_computed(new_param), param.shape)
    else:
        new_states = [v.to(s.dtype) for v, s in zip(new_values, states)]
    if rounding_seed is not None and param.dtype == torch.bfloat16:
        new_param = _round_stochastically(new_param, step, rounding_seed, first_row)
    return new_param.to(param.dtype), new_states


def _as_rows(t: Tensor) -> Tensor:
    """A parameter-shaped tensor as the [rows, columns] matrix its 8-bit blocks run along."""
    return t.reshape(t.shape[0], -1)


def _padded_columns(columns: int) -> int:
    return -(-columns // storage.QUANT_BLOCK) * storage.QUANT_BLOCK


def _in_blocks(t: Tensor) -> Tensor:
    """``t`` as [rows, blocks, 64]: its 8-bit blocks, each row (:func:`_as_rows`) padded with zeros.

    The unfused update of a parameter with 8-bit states is computed in this shape, and
    what leaves it (codes, new weight) is stored in it first (:func:`_stored_as_computed`),
    so that every value Inductor computes reads a block's scale at the block's own index.
    Each code reads the scale of its block, a reduction over the block; computed in a
    parameter's [rows, columns] shape instead, a value reads it at ``row * blocks +
    column // 64``:

    * Inductor's scheduler does not match that index with the one the reduction writes,
      so the values that read the scales and the reduction went to different kernels,
      with the new fp32 moments stored whole between them (in the generated Triton code:
      the codes in a kernel of their own with torch 2.13, the new moments and weight with
      torch 2.11 on an H100). For Llama-3.1-8B's 128256 x 4096 embedding that is two
      buffers of 2.0 GiB each at the end of the backward. With 64 columns, one block a
      row, the indices match.
    * Inductor's C++ backend (torch 2.13) splits a loop over ``column`` with such an index
      into ``columns // 64`` whole blocks and drops the rest: for a width that is not
      whole blocks, the last partial block of each row was never computed, its scale
      read uninitialized memory, and the weight went NaN a step later.
    """
    rows = _as_rows(t)
    padding = _padded_columns(rows.shape[1]) - rows.shape[1]
    padded = torch.nn.functional.pad(rows, (0, padding)) if padding else rows
    return padded.reshape(rows.shape[0], -1, storage.QUANT_BLOCK)


def _from_blocks(blocks: Tensor, shape: torch.Size) -> Tensor:
    """The inverse of :func:`_in_blocks` for a tensor of ``shape``: the row padding cut off."""
    return blocks.reshape(blocks.shape[0], -1)[:, : math.prod(shape[1:])].reshape(shape)


def _stored_as_computed(t: Tensor) -> Tensor:
    """``t``, which Inductor stores in the shape computed here (its ``as_strided`` lowering needs
    its input in memory) rather than computing it inside each reader."""
    return t if dtensor.is_dtensor(t) else t.as_strided(t.shape, t.stride())  # DTensor has no as_strided


def dequantize_state(codes: Tensor, scales: Tensor, signed: bool) -> Tensor:
    """An 8-bit state's values (fp32, the codes' shape) from its codes and [rows, blocks] scales."""
    return _from_blocks(_dequantize_in_blocks(codes, scales, signed), codes.shape)


def _dequantize_in_blocks(codes: Tensor, scales: Tensor, signed: bool) -> Tensor:
    blocks = _in_blocks(codes.to(torch.float32))
    rows = blocks.reshape(blocks.shape[0], -1)
    values = _torch_storage("dequantize_blocks")(rows, scales, *rows.shape, storage.QUANT_BLOCK, signed)
    return values.reshape(blocks.shape)


def code_dtype(signed: bool) -> torch.dtype:
    """The dtype of a state's 8-bit codes: int8 for a state that may be negative, else uint8."""
    return torch.int8 if signed else torch.uint8


def quantize_state(values: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """(codes shaped like ``values``, [rows, blocks] fp32 scales): the 8-bit storage of a
    state (:mod:`forge_compile.rules.storage`)."""
    codes, scales = _quantize_in_blocks(_in_blocks(values.to(torch.float32)), signed)
    return _from_blocks(codes, values.shape), scales


def _quantize_in_blocks(values: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """[rows, blocks, 64] fp32 ``values`` -> (their codes, stored in that shape; [rows, blocks] scales)."""
    rows = values.reshape(values.shape[0], -1)
    codes, scales = _torch_storage("quantize_blocks")(rows, *rows.shape, storage.QUANT_BLOCK, signed)
    return _stored_as_computed(codes.reshape(values.shape).to(code_dtype(signed))), scales


_SEED_ELEMENTS = 16


def rounding_seed_tensor(seed: int, device: torch.device) -> Tensor:
    """``seed`` as the int64 tensor that :func:`apply_rule` also takes for ``rounding_seed``.

    The unfused path hands Inductor each parameter's seed as such a tensor, a constant of
    the compiled graph. Inductor writes a 0-d constant, or one of at most 8 elements, into
    the code that reads it: as an int, the seed made each parameter's update code differ
    from every other's, so no two same-shaped parameters could share a generated kernel.
    A constant of ``_SEED_ELEMENTS`` elements it keeps as a buffer, read at run time.
    """
    return torch.full((_SEED_ELEMENTS,), seed, dtype=torch.int64, device=device)


def _round_stochastically(values: Tensor, step: Tensor, seed: int | Tensor, first_row: int) -> Tensor:
    if not isinstance(seed, Tensor):
        seed = rounding_seed_tensor(seed, values.device)
    rows = _as_rows(values).to(torch.float32)
    return torch.ops.forge.round_bfloat16_stochastically(rows, step, seed, first_row).reshape(values.shape)


@torch.library.custom_op("forge::round_bfloat16_stochastically", mutates_args=())
def round_bfloat16_stochastically(rows: Tensor, step: Tensor, seed: Tensor, first_row: int) -> Tensor:
    """fp32 ``rows`` ([R, C], rows ``first_row`` on of a weight) rounded stochastically to
    bf16 values, returned as fp32: :func:`forge_compile.rules.storage.round_bfloat16_stochastically`
    with the key of ``seed`` (an int64 tensor whose elements all hold the parameter's seed,
    :func:`rounding_seed_tensor`) at the step count ``step``.

    An op of its own so that Inductor compiles it through forge's lowering
    (:mod:`forge_compile.lowerings`), which emits the hash once per element; this body is
    what runs everywhere else.
    """
    _check_rounding_arguments(rows, seed)
    index = (torch.arange(rows.shape[0], device=rows.device) + first_row)[:, None] * rows.shape[1] + torch.arange(
        rows.shape[1], device=rows.device
    )
    key = _torch_storage("rounding_key")(seed.reshape(-1)[0], step)
    return _torch_storage("round_bfloat16_stochastically")(rows, index, key)


@round_bfloat16_stochastically.register_fake
def _round_bfloat16_stochastically_fake(rows, step, seed, first_row):
    _check_rounding_arguments(rows, seed)
    return torch.empty_like(rows)


def _check_rounding_arguments(rows: Tensor, seed: Tensor) -> None:
    if rows.dtype != torch.float32 or rows.dim() != 2:
        raise ValueError(f"forge: round_bfloat16_stochastically takes fp32 rows [R, C], got {rows.dtype} "
                         f"of shape {tuple(rows.shape)}: cast the values to float32 and reshape them to rows")  # fmt: skip
    if seed.dtype != torch.int64 or seed.numel() == 0:
        raise ValueError(f"forge: the rounding seed is an int64 tensor of the parameter's seed "
                         f"(forge_compile.ops.rounding_seed_tensor), got {seed.dtype} of shape {tuple(seed.shape)}")  # fmt: skip


@functools.cache
def _torch_storage(name: str):
    return rules._in_torch_dialect(getattr(storage, name))


def scale_shape(param_shape: tuple[int, ...]) -> tuple[int, int]:
    """The [rows, blocks] shape of the scales of an 8-bit state of a parameter of this shape."""
    rows = param_shape[0]
    columns = 1
    for size in param_shape[1:]:
        columns *= size
    return rows, _padded_columns(columns) // storage.QUANT_BLOCK


def _check_update_arguments(rule_name, param, states, hyperparameters, options, quantized_states=False):
    rule = rules.get(rule_name)
    expected = sum(rule.active_states(tuple(options)))
    if len(states) != expected * (2 if quantized_states else 1):
        raise ValueError(
            f"forge: rule {rule_name} with options {list(options)} takes {expected} states"
            + (f" (codes, then scales: {2 * expected} tensors)" if quantized_states else "")
            + f", got {len(states)}"
        )
    if len(hyperparameters) != len(rule.scalar_inputs):
        raise ValueError(
            f"forge: rule {rule_name} takes hyperparameters {rule.scalar_inputs}, got {len(hyperparameters)} tensors"
        )
    codes, scales = (states[:expected], states[expected:]) if quantized_states else (states, [])
    for s in codes:
        if s.shape != param.shape:
            raise ValueError(f"forge: state of shape {tuple(s.shape)} for a parameter of shape {tuple(param.shape)}")
    if quantized_states:
        if param.dim() < 2:
            raise ValueError("forge: 8-bit states need a parameter of 2 or more dimensions")
        for c, a, signed in zip(codes, scales, rule.signed_active_states(tuple(options))):
            wanted = code_dtype(signed)
            if c.dtype != wanted:
                raise ValueError(f"forge: {'signed' if signed else 'non-negative'} 8-bit state codes are {wanted}, got {c.dtype}")
            if tuple(a.shape) != scale_shape(tuple(param.shape)) or a.dtype != torch.float32:
                raise ValueError(
                    f"forge: 8-bit state scales must be float32 of shape {scale_shape(tuple(param.shape))}, "
                    f"got {a.dtype} {tuple(a.shape)}"
                )
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
    quantized_states: bool = False,
    rounding_seed: Optional[int] = None,
) -> list[Tensor]:
    """One parameter's optimizer update, functional: returns [new param, *new states].

    ``step`` is the already incremented step count (0-d), ``hyperparameters`` the rule's
    0-d tensors in the rule's order (``Rule.scalar_inputs``: the group's hyperparameters,
    then per-parameter scalar states such as NAdam's ``mu_product``, already advanced),
    ``options`` its static switches. ``quantized_states``: ``states`` are 8-bit codes
    followed by their scales; ``rounding_seed``: a bf16 ``param`` is rounded stochastically
    (see :func:`apply_rule`).

    Example::

        new_p, new_m, new_v = torch.ops.forge.optimizer_update(
            p, g, [m, v], step, [lr, beta1, beta2, eps, wd], "adam", [1, 0, 0, 1])
    """
    the_rule = _check_update_arguments(rule, param, states, hyperparameters, options, quantized_states)
    new_param, new_states = apply_rule(the_rule, param, grad, states, step, hyperparameters, tuple(options),
                                       quantized_states, rounding_seed)  # fmt: skip
    return [_distinct_output(new_param, param)] + [_distinct_output(n, s) for n, s in zip(new_states, states)]


@optimizer_update.register_fake
def _optimizer_update_fake(param, grad, states, step, hyperparameters, rule, options, quantized_states=False,
                           rounding_seed=None):  # fmt: skip
    return [torch.empty_like(param)] + [torch.empty_like(s) for s in states]


# The fused op runs once per fused weight in every step, so its dispatch is kept lean.
# Measured on a 2-core CPU with the kernel launch stubbed out: as a
# torch.library.custom_op, 150 us a call (its Python ADInplaceOrView pass alone spends
# 65 us filling defaults, walking the schema quadratically); defined with
# torch.library.Library and one Autograd kernel that redispatches below autograd under
# no_grad (what custom_op's does), 63 us, of which 23 us are forge's own launcher; with grad
# mode off the Autograd kernel now runs the CPU/CUDA kernel itself (see below).
_LIBRARY = torch.library.Library("forge", "FRAGMENT")
_LIBRARY.define(
    "fused_linear_update_(Tensor(a0!) weight, Tensor grad_output_t, Tensor input, Tensor(a3!)[] states, Tensor step, "
    "Tensor[] hyperparameters, str rule, SymInt[] options, float? grad_min=None, float? grad_max=None, "
    "bool quantized_states=False, SymInt? rounding_seed=None, SymInt first_row=0) -> ()"
)


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
    quantized_states: bool = False,
    rounding_seed: Optional[int] = None,
    first_row: int = 0,
) -> None:
    """Update ``weight`` and ``states`` in place with the gradient ``grad_output_t @ input``.

    ``grad_output_t`` is [out_features, tokens] and ``input`` [tokens, in_features], any
    strides; the gradient is accumulated in fp32 and never stored. ``grad_min``/``grad_max``
    clamp it first, as ``torch.nn.utils.clip_grad_value_`` does. ``quantized_states`` and
    ``rounding_seed`` as for ``forge::optimizer_update``. ``first_row``: ``weight`` and
    ``states`` are the rows from ``first_row`` on of a parameter (the chunked head loss
    updates its weight by row blocks), so that stochastic rounding draws what the whole
    parameter's update would for them.

    Example::

        torch.ops.forge.fused_linear_update_(
            w, dy.t(), x, [m, v], step, [lr, beta1, beta2, eps, wd], "adam", [1, 0, 0, 1])
    """
    the_rule = _check_update_arguments(rule, weight, states, hyperparameters, options, quantized_states)
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
                            grad_min, grad_max, quantized_states, rounding_seed, first_row)  # fmt: skip
    else:
        _fused_linear_update_torch(the_rule, weight, grad_output_t, input, states, step, hyperparameters,
                                   tuple(options), grad_min, grad_max, quantized_states, rounding_seed,
                                   first_row)  # fmt: skip
    # What custom_op's ADInplaceOrView pass would do: mark the written tensors as changed.
    torch.autograd.graph.increment_version([weight, *states])


def _fused_linear_update_below_autograd(*args, **kwargs) -> None:
    if _runs_on_plain_tensors(args):
        # What the redispatch below reaches for plain CPU/CUDA tensors, without its second
        # boxed dispatch: 61 -> 50 us a call on a 2-core CPU (the kernel launch stubbed out,
        # the two routes alternated in one process); forge's compiled backward calls this once per
        # fused weight and step, with grad mode off.
        fused_linear_update_(*args, **kwargs)
        return
    # Redispatch, so that a fake-tensor mode (compilation) reaches the fake implementation.
    with torch._C._AutoDispatchBelowAutograd(), torch.no_grad():
        torch.ops.forge.fused_linear_update_.default(*args, **kwargs)


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _runs_on_plain_tensors(args: tuple) -> bool:
    """Whether the op's CPU/CUDA kernel may run straight from its Autograd kernel: grad mode
    off (the kernel then needs no no_grad), no Python dispatch mode (fake tensors,
    functionalization, proxies), and weight, gradient, input, states, step and
    hyperparameters all plain tensors on the CPU or a CUDA device, none wrapped by
    functionalization or functorch."""
    if torch.is_grad_enabled() or torch._C._len_torch_dispatch_stack() or len(args) < 6:
        return False
    weight, grad_output_t, input, states, step, hyperparameters = args[:6]
    for t in (weight, grad_output_t, input, step, *states, *hyperparameters):
        if type(t) not in _PLAIN_TENSOR_TYPES:
            return False
    for t in (weight, grad_output_t, input):
        if (t.device.type not in ("cpu", "cuda") or torch._is_functional_tensor(t)
                or torch._C._functorch.is_functorch_wrapped_tensor(t)):  # fmt: skip
            return False
    return True


# Backend kernels, not CompositeExplicitAutograd: tracing with fake tensors must reach the
# fake implementation below instead of running the real one.
for _device in ("CPU", "CUDA"):
    _LIBRARY.impl("fused_linear_update_", fused_linear_update_, _device)
_LIBRARY.impl("fused_linear_update_", _fused_linear_update_below_autograd, "Autograd")


@torch.library.register_fake("forge::fused_linear_update_")
def _fused_linear_update_fake(weight, grad_output_t, input, states, step, hyperparameters, rule, options,
                              grad_min=None, grad_max=None, quantized_states=False, rounding_seed=None,
                              first_row=0):  # fmt: skip
    return None


def _use_triton(weight: Tensor) -> bool:
    if config.kernel == "torch":
        return False
    if config.kernel == "triton":
        return True
    return weight.is_cuda


def _fused_linear_update_torch(rule, weight, grad_output_t, input, states, step, hyperparameters, options,
                               grad_min=None, grad_max=None, quantized_states=False, rounding_seed=None,
                               first_row=0):  # fmt: skip
    """The fused op's math with torch ops: fp32 gradient of a row chunk, then the rule."""
    rows_per_chunk = max(1, _CPU_CHUNK_ELEMENTS // max(1, weight.shape[1]))
    input32 = input.to(torch.float32)
    for start in range(0, weight.shape[0], rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        grad = grad_output_t[rows].to(torch.float32) @ input32
        if grad_min is not None or grad_max is not None:
            grad = grad.clamp(grad_min, grad_max)
        new_weight, new_states = apply_rule(
            rule, weight[rows], grad, [s[rows] for s in states], step, hyperparameters, options,
            quantized_states, rounding_seed, first_row=first_row + start,
        )  # fmt: skip
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
