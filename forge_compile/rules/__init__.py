"""One definition of each element-wise optimizer rule.

A rule is two small functions written once, in Triton's dialect (``tl.*`` calls,
arithmetic operators, ``if`` on static switches):

* ``coefficients(step, h0, ..., h5)`` turns the step count and the hyperparameters
  into per-step scalars (bias corrections, decay factors). It runs once per step:
  once per program in the fused kernel, once per call in the torch paths.
* ``elementwise(param, grad, s0, s1, s2, c0, ..., c7, O0, ..., O3)`` updates one
  tile (or tensor) of the weight and its states in fp32.

The same Python function objects serve three implementations:

* the fused Triton kernel calls ``triton.jit`` versions of them in its epilogue;
* the CPU implementation of the fused op and the unfused Inductor path call them
  with ``tl`` bound to :mod:`forge_compile.rules.torch_dialect`, which maps the few
  ``tl`` names the rules use onto torch operations.

So the fused, the CPU and the unfused paths cannot drift apart: there is one text.
The slots are positional and fixed in number so that one kernel serves every rule;
a rule names its own slots in ``Rule``.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field
from typing import Callable

MAX_STATES = 3
MAX_HYPERPARAMETERS = 6
MAX_COEFFICIENTS = 8
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

    def __post_init__(self):
        if len(self.state_keys) > MAX_STATES:
            raise ValueError(f"rule {self.name}: at most {MAX_STATES} states")
        if len(self.hyperparameters) > MAX_HYPERPARAMETERS:
            raise ValueError(f"rule {self.name}: at most {MAX_HYPERPARAMETERS} hyperparameters")
        if len(self.options) > MAX_OPTIONS:
            raise ValueError(f"rule {self.name}: at most {MAX_OPTIONS} options")

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

    scope = dict(fn.__globals__)
    scope["tl"] = torch_dialect
    clone = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__qualname__ = fn.__qualname__
    return clone


_RULES: dict[str, Rule] = {}


def register(rule: Rule) -> Rule:
    if rule.name in _RULES:
        raise ValueError(f"forge: rule {rule.name!r} is registered twice")
    _RULES[rule.name] = rule
    return rule


def get(name: str) -> Rule:
    _load_builtin_rules()
    try:
        return _RULES[name]
    except KeyError:
        raise KeyError(f"forge: unknown optimizer rule {name!r}; known: {sorted(_RULES)}") from None


@functools.cache
def _load_builtin_rules() -> None:
    from . import adam  # noqa: F401
