"""What every forge optimizer adds to its torch.optim class.

A forge optimizer is its torch.optim class (same constructor, ``param_groups``,
``state`` keys and ``state_dict()`` format) with three changes that make ``step()``
traceable by Dynamo as one graph with the backward:

* **Hyperparameters as tensors.** Dynamo bakes Python floats read during tracing into
  the graph and recompiles when they change, so a learning-rate schedule would recompile
  every step. Each param group is a :class:`ParamGroup`, a dict that copies every write
  of a hyperparameter (``group["lr"] = ...`` by a scheduler) into a 0-d float64 tensor on
  the parameters' device; the traced step reads only those tensors. A hyperparameter the
  user gives as a Tensor is used as it is.
* **State created up front.** Inside the compiled step the real ``p.grad`` is not set yet
  (the backward is in the graph), and creating state there would cost a second compile.
  So state is created for every trainable parameter when the optimizer is built, with
  ``step`` on the parameter's device (as torch's capturable mode keeps it).
  ``state_dict()`` leaves out entries that never took a step, as torch would not have
  them, and gives ``step`` in torch's own format.
* **One opaque op per parameter.** The traced ``step()`` emits ``forge::optimizer_update``
  for each parameter, which forge's pass fuses into the weight-gradient matmul or hands
  to Inductor as pointwise code; ``zero_grad()`` is traceable too (torch's is not).

Outside torch.compile, ``step()`` and ``zero_grad()`` are torch's own.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from .. import ops  # noqa: F401  (registers torch.ops.forge.*)
from .. import rules


class ParamGroup(dict):
    """A param group that reports writes, so forge's tensor copies of its hyperparameters stay current."""

    __slots__ = ("_forge_view",)

    def __init__(self, view: "_GroupView", items):
        super().__init__(items)
        self._forge_view = view

    def _changed(self, keys):
        view = getattr(self, "_forge_view", None)
        if view is not None:
            view.refresh(self, keys)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._changed((key,))

    def __delitem__(self, key):
        super().__delitem__(key)
        self._changed((key,))

    def update(self, *args, **kwargs):
        before = set(self)
        new = dict(*args, **kwargs)
        super().update(new)
        self._changed(tuple(new) or tuple(set(self) - before))

    def setdefault(self, key, default=None):
        had = key in self
        value = super().setdefault(key, default)
        if not had:
            self._changed((key,))
        return value

    def pop(self, key, *default):
        value = super().pop(key, *default)
        self._changed((key,))
        return value

    def __ior__(self, other):
        self.update(other)
        return self

    def __reduce__(self):
        # Pickles and deep copies as a plain dict; the optimizer's __setstate__ wraps it again.
        return (dict, (dict(self),))


class _GroupView:
    """What the traced step reads of one param group: no Python floats, only tensors and switches."""

    def __init__(self, optimizer: "ForgeOptimizer"):
        self._optimizer = optimizer
        self.group: dict = {}
        self.params: list[Tensor] = []
        self.options: tuple[int, ...] = ()
        self.state_keys: tuple[str, ...] = ()
        self.hyperparameters: list[list[Tensor]] = []
        self._copies: dict[tuple[torch.device, int], Tensor] = {}
        self._copied_values: dict[tuple[torch.device, int], float] = {}

    def refresh(self, group: dict, keys=None) -> None:
        """Re-read ``group`` after a write of ``keys`` (None: everything)."""
        opt = self._optimizer
        rule = opt._forge_rule
        self.group = group
        params_changed = keys is None or "params" in keys
        if params_changed:
            self.params = list(group["params"])
        self.options = tuple(int(o) for o in opt._forge_options(group))
        active = rule.active_states(self.options)
        state_keys = tuple(k for k, on in zip(rule.state_keys, active) if on)
        states_changed = params_changed or state_keys != self.state_keys
        self.state_keys = state_keys
        values = opt._forge_hyperparameter_values(group)
        per_device: dict[torch.device, list[Tensor]] = {}
        for p in self.params:
            if p.device not in per_device:
                per_device[p.device] = [self._tensor(p.device, i, v) for i, v in enumerate(values)]
        self.hyperparameters = [per_device[p.device] for p in self.params]
        if states_changed:
            for p in self.params:
                if p.requires_grad:
                    opt._forge_complete_state(p, self)

    def _tensor(self, device: torch.device, slot: int, value: Any) -> Tensor:
        name = self._optimizer._forge_rule.hyperparameters[slot]
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ValueError(f"forge: hyperparameter {name} must be a scalar tensor, got shape {tuple(value.shape)}")
            if value.device != device and value.device.type != "cpu":
                raise ValueError(
                    f"forge: hyperparameter {name} is a tensor on {value.device} but its parameters are on {device}; "
                    f"put it on {device} or the CPU, or pass a float"
                )
            # The user's own tensor (a scheduler writes into it); the step copies a CPU one over.
            return value.reshape(())
        key = (device, slot)
        value = float(value)
        copy = self._copies.get(key)
        if copy is None:
            copy = self._copies[key] = torch.tensor(value, dtype=torch.float64, device=device)
            self._copied_values[key] = value
        elif self._copied_values[key] != value:
            copy.fill_(value)
            self._copied_values[key] = value
        return copy


class ForgeOptimizer:
    """Mixin placed before a torch.optim class; see the module docstring."""

    _forge_rule_name: ClassVar[str]
    _forge_hidden_state_keys: ClassVar[tuple[str, ...]] = ()
    """State forge keeps that torch's class does not (SGD's step count); left out of state_dict()."""
    _forge_state_from_construction: ClassVar[bool] = False
    """torch's class creates every entry in __init__ (Adagrad): state_dict() keeps unstepped ones."""

    @property
    def _forge_rule(self) -> rules.Rule:
        return rules.get(self._forge_rule_name)

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **kwargs)
        self._forge_setup()

    # --- what each optimizer defines -------------------------------------------------
    def _forge_options(self, group: dict) -> tuple[int, ...]:
        raise NotImplementedError

    def _forge_hyperparameter_values(self, group: dict) -> tuple[Any, ...]:
        raise NotImplementedError

    def _forge_check_group(self, group: dict) -> None:
        """Raise for settings forge cannot compute exactly."""
        if group.get("differentiable", False):
            raise ValueError(
                f"forge: {type(self).__name__}(differentiable=True) is not supported: forge's update is not "
                "differentiable; use torch.optim for differentiable optimizers"
            )
        for p in group["params"]:
            if p.is_complex():
                raise ValueError(f"forge: complex parameters are not supported; use torch.optim.{type(self).__name__}")
            if p.is_sparse:
                raise ValueError("forge: sparse parameters are not supported; use torch.optim.SparseAdam")

    # --- set-up ------------------------------------------------------------------------
    def _forge_setup(self) -> None:
        """Wrap the groups, create missing state, move ``step`` to the devices. Idempotent."""
        self._forge_ready = False
        views = []
        for index, group in enumerate(self.param_groups):
            self._forge_check_group(group)
            if isinstance(group, ParamGroup):
                group._forge_view = None
            view = _GroupView(self)
            wrapped = ParamGroup(view, group)
            self.param_groups[index] = wrapped
            view.refresh(wrapped)
            views.append(view)
        self._forge_groups = views
        # The wrapper's one job, flagging that step() ran so that a scheduler stepped first
        # can warn: inside compiled code Dynamo drops attribute writes on an optimizer, so
        # the flag could never be set there and the scheduler would warn on every run.
        self._opt_called = True
        self._forge_ready = True

    def _forge_complete_state(self, p: Tensor, view: _GroupView) -> None:
        state = self.state[p]
        rule = self._forge_rule
        initial = {"step": self._forge_initial_step(state)}
        initial.update(zip(rule.scalar_states, rule.scalar_initial_values))
        for key, value in initial.items():
            # 0-d fp32 on the parameter's device, as torch's capturable mode keeps them.
            current = state.get(key)
            if current is None:
                state[key] = torch.full((), value, dtype=torch.float32, device=p.device)
            elif not isinstance(current, Tensor) or current.device != p.device or current.dtype != torch.float32:
                state[key] = torch.as_tensor(current, dtype=torch.float32).to(p.device)
        for key in view.state_keys:
            if key not in state:
                state[key] = self._forge_initial_state(p, key, view)

    def _forge_initial_step(self, state: dict) -> float:
        """The step count of a parameter whose state has none (new, or loaded from torch)."""
        return 0.0

    def _forge_initial_state(self, p: Tensor, key: str, view: _GroupView) -> Tensor:
        return torch.zeros_like(p, memory_format=torch.preserve_format)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if self.__dict__.get("_forge_ready"):
            self._forge_setup()

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._forge_setup()

    # --- the step ------------------------------------------------------------------------
    def step(self, closure=None):
        if torch.compiler.is_compiling():
            if closure is not None:
                raise RuntimeError(
                    "forge: step(closure) cannot be compiled: call the closure (loss and backward) in the compiled "
                    "function and then opt.step() without it"
                )
            self._forge_traced_step()
            return None
        return self._forge_eager_step(closure)

    # An LR scheduler replaces ``opt.step`` with a wrapper from torch/optim/lr_scheduler.py,
    # a file Dynamo never traces: the step would break the graph and nothing would fuse.
    # It leaves alone a step that says it is wrapped already (see _forge_setup).
    step._wrapped_by_lr_sched = True

    @torch.compiler.disable
    def _forge_eager_step(self, closure):
        """A step outside torch.compile: torch's own. Also what runs when Dynamo breaks the
        graph at ``step()`` (a closure, a GradScaler): never traced as a frame of its own, since
        Dynamo's optimizer tracing does not take forge's param groups; torch's eager step it is."""
        return super().step(closure)

    @torch.no_grad()
    def _forge_traced_step(self) -> None:
        """Every parameter's update as one ``forge::optimizer_update``; eager too where torch has no class."""
        rule_name = self._forge_rule_name
        for view in self._forge_groups:
            indices = [i for i, p in enumerate(view.params) if p.grad is not None]
            if not indices:
                continue
            for i in indices:
                if view.params[i] not in self.state:
                    self._forge_complete_state(view.params[i], view)
            steps = [self.state[view.params[i]]["step"] for i in indices]
            torch._foreach_add_(steps, 1)
            options = list(view.options)
            for i in indices:
                p = view.params[i]
                state = self.state[p]
                states = [state[key] for key in view.state_keys]
                hyperparameters = self._forge_step_hyperparameters(view, i)
                new = torch.ops.forge.optimizer_update(
                    p, p.grad, states, state["step"], hyperparameters, rule_name, options
                )
                p.copy_(new[0])
                for old, value in zip(states, new[1:]):
                    old.copy_(value)

    def _forge_step_hyperparameters(self, view: _GroupView, index: int) -> list[Tensor]:
        """The rule's hyperparameter tensors for ``view.params[index]`` in a step whose count
        is already advanced, followed by its scalar states, advanced here (NAdam's mu_product)."""
        rule = self._forge_rule
        p = view.params[index]
        state = self.state[p]
        # A hyperparameter given as a CPU tensor follows the parameter to its device.
        hyperparameters = [h if h.device == p.device else h.to(p.device) for h in view.hyperparameters[index]]
        if rule.scalar_states:
            scalars = [state[key] for key in rule.scalar_states]
            advanced = torch.ops.forge.advance_scalar_states(state["step"], hyperparameters, scalars, rule.name)
            for scalar, value in zip(scalars, advanced):
                scalar.copy_(value)
            hyperparameters = hyperparameters + scalars
        return hyperparameters

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not torch.compiler.is_compiling():
            return super().zero_grad(set_to_none)
        for view in self._forge_groups:
            for p in view.params:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()
        return None

    # --- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state_dict: entries for parameters that took a step, ``step`` as torch keeps it."""
        sd = super().state_dict()
        groups_by_index = {}
        for group in sd["param_groups"]:
            for index in group["params"]:
                groups_by_index[index] = group
        state = {}
        scalar_keys = ("step", *self._forge_rule.scalar_states)
        for index, entry in sd["state"].items():
            step = entry.get("step")
            if not self._forge_state_from_construction and isinstance(step, Tensor) and float(step) == 0.0:
                continue  # created up front, never stepped: torch would have no entry
            entry = {key: value for key, value in entry.items() if key not in self._forge_hidden_state_keys}
            if not entry:
                continue
            group = groups_by_index.get(index, {})
            for key in scalar_keys:
                value = entry.get(key)
                if isinstance(value, Tensor) and not (group.get("capturable") or group.get("fused")):
                    entry[key] = value.detach().to("cpu", torch.float32)  # torch's non-capturable format
            state[index] = entry
        sd["state"] = state
        return sd


def attach(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Turn a torch.optim optimizer into its forge counterpart in place, keeping its state.

    Example::

        opt = forge_compile.attach(torch.optim.AdamW(model.parameters(), lr=3e-4))
    """
    from . import forge_class_for

    if isinstance(optimizer, ForgeOptimizer):
        return optimizer
    cls = forge_class_for(type(optimizer))
    optimizer.__class__ = cls
    optimizer._patch_step_function()
    optimizer._forge_setup()
    return optimizer
