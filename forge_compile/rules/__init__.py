"""One definition of each element-wise optimizer rule.

A rule is two small functions written once, in Triton's dialect (``tl.*`` calls,
arithmetic operators, ``if`` on static switches):

* ``coefficients(step, h0, ..., h7)`` turns the step count and the hyperparameters
  into per-step scalars (bias corrections, decay factors, RAdam's rectification). It
  runs once per step: once per program in the fused kernel, once per call in the torch
  paths, never per element.
* ``elementwise(param, grad, s0, s1, s2, c0, ..., c9, O0, ..., O3)`` updates one
  tile (or tensor) of the weight and its states in fp32.

A rule whose state includes per-parameter scalars (NAdam's ``mu_product``) names them
in ``scalar_states`` and gives ``advance(step, h0, ..., scalar states)``, which the
optimizer runs once per step on those 0-d tensors before the update; their new values
follow the hyperparameters into ``coefficients``. Helpers the rules share are
``@triton.jit`` functions (:mod:`forge_compile.rules.common`); the torch dialect
rebinds them too.

The same Python function objects serve three implementations:

* the fused Triton kernel calls ``triton.jit`` versions of them in its epilogue;
* the CPU implementation of the fused op, the unfused Inductor path and the
  optimizer's own per-step scalar code call them with ``tl`` bound to
  :mod:`forge_compile.rules.torch_dialect`, which maps the few ``tl`` names the rules
  use onto torch operations.

The stochastic rounding of :mod:`forge_compile.rules.storage` has a third dialect,
:mod:`forge_compile.rules.inductor_dialect`, for Inductor's lowering of the unfused
path. So the fused, the CPU and the unfused paths cannot drift apart: there is one text.
The slots are positional and fixed in number so that one kernel serves every rule;
a rule names its own slots in ``Rule``.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field
from typing import Callable

MAX_STATES = 3
MAX_HYPERPARAMETERS = 8
MAX_COEFFICIENTS = 10
MAX_OPTIONS = 4


@dataclass(frozen=True)
class Rule:
    """An element-wise optimizer rule and the names of its slots."""

    name: str
    """Registry key, also the ``rule`` argument of forge's ops (``"adam"``)."""
    state_keys: tuple[str, ...]
    """torch.optim state keys in slot order (``exp_avg``, ``exp_avg_sq``, ...)."""
    hyperparameters: tuple[str, ...]
    """Hyperparameter names in slot order; each is one 0-d tensor at run time."""
    options: tuple[str, ...]
    """Static switches in slot order; changing one recompiles, as in torch."""
    coefficients: Callable = field(repr=False)
    elementwise: Callable = field(repr=False)
    active_states: Callable[[tuple[int, ...]], tuple[bool, ...]] = field(repr=False)
    """Which state slots exist for given option values (amsgrad adds one)."""
    nonnegative_states: tuple[bool, ...] = ()
    """Per state slot: never negative (second moments, sums of squares). 8-bit states store
    those with the unsigned code (:mod:`forge_compile.rules.storage`), the others signed."""
    scalar_states: tuple[str, ...] = ()
    """Per-parameter 0-d states (torch.optim keys), after the hyperparameters in ``coefficients``."""
    scalar_initial_values: tuple[float, ...] = ()
    """Their values before the first step (NAdam's ``mu_product`` starts at 1)."""
    advance: Callable | None = field(default=None, repr=False)
    """``advance(step, *hyperparameters, *scalar_states)``: the scalar states' values for this step."""

    def __post_init__(self):
        if len(self.state_keys) > MAX_STATES:
            raise ValueError(f"rule {self.name}: at most {MAX_STATES} states")
        if len(self.hyperparameters) + len(self.scalar_states) > MAX_HYPERPARAMETERS:
            raise ValueError(f"rule {self.name}: at most {MAX_HYPERPARAMETERS} hyperparameters and scalar states")
        if len(self.options) > MAX_OPTIONS:
            raise ValueError(f"rule {self.name}: at most {MAX_OPTIONS} options")
        if len(self.nonnegative_states) != len(self.state_keys):
            raise ValueError(f"rule {self.name}: nonnegative_states needs one entry per state")
        if len(self.scalar_initial_values) != len(self.scalar_states) or (
            bool(self.scalar_states) != (self.advance is not None)
        ):
            raise ValueError(f"rule {self.name}: scalar states need initial values and an advance function")

    def signed_active_states(self, options: tuple[int, ...]) -> tuple[bool, ...]:
        """For each state present with these options, in order: may it be negative (its
        8-bit codes are int8, else uint8)."""
        return tuple(not nonnegative for nonnegative, on in zip(self.nonnegative_states, self.active_states(options))
                     if on)  # fmt: skip

    @property
    def scalar_inputs(self) -> tuple[str, ...]:
        """What the ops' ``hyperparameters`` list holds: the group's hyperparameters, then the scalar states."""
        return self.hyperparameters + self.scalar_states

    @functools.cached_property
    def torch_advance(self) -> Callable:
        return _in_torch_dialect(self.advance)

    @functools.cached_property
    def torch_coefficients(self) -> Callable:
        return _in_torch_dialect(self.coefficients)

    @functools.cached_property
    def torch_elementwise(self) -> Callable:
        return _in_torch_dialect(self.elementwise)

    @functools.cached_property
    def triton_coefficients(self):
        import triton

        return triton.jit(self.coefficients)

    @functools.cached_property
    def triton_elementwise(self):
        import triton

        return triton.jit(self.elementwise)


def _in_torch_dialect(fn: Callable) -> Callable:
    """The same function with the global name ``tl`` bound to the torch dialect."""
    from . import torch_dialect

    return in_dialect(fn, torch_dialect)


def in_dialect(fn: Callable, dialect: types.ModuleType, _done: dict | None = None) -> Callable:
    """The same function with the global name ``tl`` bound to ``dialect``.

    ``@triton.jit`` helpers it calls are rebound the same way, so shared pieces
    (:mod:`forge_compile.rules.common`) serve every dialect as well.
    """
    import triton

    done = {} if _done is None else _done
    fn = getattr(fn, "fn", fn)  # a JITFunction's Python function
    if fn in done:
        return done[fn]
    scope = dict(fn.__globals__)
    scope["tl"] = dialect
    clone = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__qualname__ = fn.__qualname__
    done[fn] = clone
    for name, value in fn.__globals__.items():
        # triton.jit gives a JITFunction, or under TRITON_INTERPRET=1 an InterpretedFunction.
        if isinstance(value, triton.runtime.KernelInterface) and callable(getattr(value, "fn", None)):
            scope[name] = in_dialect(value.fn, dialect, done)
    return clone


_RULES: dict[str, Rule] = {}


def register(rule: Rule) -> Rule:
    if rule.name in _RULES:
        raise ValueError(f"forge: rule {rule.name!r} is registered twice")
    _RULES[rule.name] = rule
    return rule


def get(name: str) -> Rule:
    if not _builtin_rules_loaded:
        _load_builtin_rules()
    try:
        return _RULES[name]
    except KeyError:
        raise KeyError(f"forge: unknown optimizer rule {name!r}; known: {sorted(_RULES)}") from None


_builtin_rules_loaded = False


def _load_builtin_rules() -> None:
    global _builtin_rules_loaded
    from . import adagrad, adam, lion, nadam, radam, rmsprop, sgd  # noqa: F401

    _builtin_rules_loaded = True
