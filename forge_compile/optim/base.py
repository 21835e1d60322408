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

Outside torch.compile, ``step()`` and ``zero_grad()`` are torch's own, unless a storage
option below asks for math torch's classes do not have: then the eager step runs forge's
rule with torch ops.

**Storage options** (keyword arguments of every forge optimizer and of :func:`attach`):

* ``state_dtype``: None (the parameter's dtype, as torch), ``torch.float32``,
  ``torch.bfloat16``, or ``"int8"``: 8-bit blockwise states (64 elements per fp32 scale
  along each weight row; :mod:`forge_compile.rules.storage`) for parameters of 2+
  dimensions and at least 4096 elements, fp32 states for the small rest. An 8-bit state
  ``exp_avg`` lives in ``state[p]["exp_avg"]`` (int8 or uint8 codes) and
  ``state[p]["exp_avg_absmax"]`` (scales); ``state_dict()`` gives it dequantized in fp32
  under torch's key, so checkpoints load into torch.optim and back.
* ``stochastic_rounding``: None (on for bf16 parameters), True or False. The fp32 result
  of each bf16 update is rounded up or down at random so that its expected value is
  exact, which keeps sub-ULP updates: bf16 weights train without an fp32 master copy.
* ``rounding_seed``: the seed of those roundings (default ``torch.initial_seed()`` when
  the optimizer is built); each parameter and step draws its own bits from it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from .. import dtensor, ops  # ops also registers torch.ops.forge.*
from .. import rules


_STATE_DTYPES = (None, torch.float32, torch.bfloat16, "int8")
_MIN_8BIT_ELEMENTS = 4096
"""Smaller parameters (and 1-D ones) keep fp32 states under state_dtype="int8": their bytes are few."""
_SCALE_SUFFIX = "_absmax"
_STORAGE_ATTRIBUTES = ("_forge_state_dtype", "_forge_stochastic_rounding", "_forge_rounding_seed")


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

    def __init__(self, optimizer: "ForgeOptimizer", index: int):
        self._optimizer = optimizer
        self.index = index
        self.rounding_seeds: list[int | None] = []
        """Per parameter: its stochastic-rounding seed, or None (rounds to nearest)."""
        self.own_math = False
        """A parameter's storage needs forge's rule outside torch.compile too."""
        self.group: dict = {}
        self.params: list[Tensor] = []
        self.options: tuple[bool, ...] = ()
        """The rule's switches, as bools: Dynamo bakes a bool into the graph (and guards on
        it) under ``dynamic=True`` too, where an int read from here would become a symbol."""
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
            # A DTensor's shards draw their own bits (dtensor.shard_seed), worked out here,
            # outside the traced step: the mesh coordinate does not trace.
            self.rounding_seeds = [dtensor.shard_seed(p, opt._forge_seed_for(self.index, i))
                                   if opt._forge_rounds_stochastically(p) else None
                                   for i, p in enumerate(self.params)]  # fmt: skip
            self.own_math = any(seed is not None for seed in self.rounding_seeds) or any(
                opt._forge_state_format(p) != p.dtype for p in self.params
            )
        self.options = tuple(bool(o) for o in opt._forge_options(group))
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

    def __init__(self, params, *args, state_dtype=None, stochastic_rounding=None, rounding_seed=None, **kwargs):
        self._forge_set_storage(state_dtype, stochastic_rounding, rounding_seed)
        super().__init__(params, *args, **kwargs)
        self._forge_setup()

    def _forge_set_storage(self, state_dtype, stochastic_rounding, rounding_seed) -> None:
        if state_dtype not in _STATE_DTYPES:
            raise ValueError(
                f"forge: state_dtype={state_dtype!r} is not one of None (the parameter's dtype), torch.float32, "
                "torch.bfloat16 or 'int8'"
            )
        if stochastic_rounding not in (None, True, False):
            raise ValueError(f"forge: stochastic_rounding must be None (on for bf16 weights), True or False, "
                             f"got {stochastic_rounding!r}")  # fmt: skip
        if rounding_seed is None:
            rounding_seed = torch.initial_seed()
        if not isinstance(rounding_seed, int) or isinstance(rounding_seed, bool):
            raise ValueError(f"forge: rounding_seed must be an int, got {rounding_seed!r}")
        self._forge_state_dtype = state_dtype
        self._forge_stochastic_rounding = stochastic_rounding
        self._forge_rounding_seed = rounding_seed & 0x7FFFFFFF

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
            view = _GroupView(self, index)
            wrapped = ParamGroup(view, group)
            self.param_groups[index] = wrapped
            view.refresh(wrapped)
            views.append(view)
            if any(dtensor.is_dtensor(p) for p in view.params):
                dtensor.install_shard_order_fix()
        self._forge_groups = views
        # The wrapper's one job, flagging that step() ran so that a scheduler stepped first
        # can warn: inside compiled code Dynamo drops attribute writes on an optimizer, so
        # the flag could never be set there and the scheduler would warn on every run.
        self._opt_called = True
        self._forge_ready = True

    # --- storage -------------------------------------------------------------------------
    def _forge_state_format(self, p: Tensor):
        """How ``p``'s states are stored: a dtype, or ``"int8"`` (codes and block scales)."""
        wanted = self.__dict__.get("_forge_state_dtype")
        if wanted is None:
            return p.dtype
        if wanted == "int8":
            return "int8" if p.dim() >= 2 and p.numel() >= _MIN_8BIT_ELEMENTS else torch.float32
        return wanted

    def _forge_rounds_stochastically(self, p: Tensor) -> bool:
        wanted = self.__dict__.get("_forge_stochastic_rounding")
        if wanted and p.dtype == torch.float16:
            raise ValueError(
                "forge: stochastic_rounding supports bf16 parameters; fp16 parameters round to nearest: pass "
                "stochastic_rounding=None or False"
            )
        return p.dtype == torch.bfloat16 and wanted is not False

    def _forge_seed_for(self, group_index: int, index: int) -> int:
        """The rounding seed of a group's ``index``-th parameter: distinct per parameter."""
        position = (group_index << 24) + index
        return (self.__dict__.get("_forge_rounding_seed", 0) + position * 0x9E3779B1) & 0x7FFFFFFF

    def _forge_store_state(self, p: Tensor, key: str, value: Tensor) -> None:
        """Put ``value`` (any float dtype, or already in the format) into ``state[p][key]`` in ``p``'s format."""
        state = self.state[p]
        scale_key = key + _SCALE_SUFFIX
        form = self._forge_state_format(p)
        if form == "int8":
            if value.dtype in (torch.int8, torch.uint8) and scale_key in state:
                state[key] = value
                return
            codes, scales = ops.quantize_state(value.detach().to(p.device, torch.float32), self._forge_signed(key))
            state[key], state[scale_key] = codes.contiguous(), scales
            return
        if value.dtype in (torch.int8, torch.uint8) and scale_key in state:
            value = self._forge_dequantized(key, value, state.pop(scale_key))
        state.pop(scale_key, None)
        if value.dtype != form or value.device != p.device:
            value = value.to(device=p.device, dtype=form)
        state[key] = value

    def _forge_signed(self, key: str) -> bool:
        """8-bit codes of ``key`` are signed (int8) unless the rule says the state is never negative."""
        return not self._forge_rule.nonnegative_states[self._forge_rule.state_keys.index(key)]

    def _forge_dequantized(self, key: str, codes: Tensor, scales: Tensor) -> Tensor:
        return ops.dequantize_state(codes, scales, self._forge_signed(key))

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
            value = state.get(key)
            if value is None:
                value = self._forge_initial_state(p, key, view)
            self._forge_store_state(p, key, value)

    def _forge_initial_step(self, state: dict) -> float:
        """The step count of a parameter whose state has none (new, or loaded from torch)."""
        return 0.0

    def _forge_initial_state(self, p: Tensor, key: str, view: _GroupView) -> Tensor:
        return torch.zeros_like(p, memory_format=torch.preserve_format)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if self.__dict__.get("_forge_ready"):
            self._forge_setup()

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        for key in _STORAGE_ATTRIBUTES:
            if key in self.__dict__:
                state[key] = self.__dict__[key]
        return state

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
        if any(view.own_math for view in self._forge_groups):
            return self._forge_rule_step(closure)
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

    @torch.compiler.disable
    def _forge_rule_step(self, closure):
        """A step outside torch.compile with forge's rule on torch tensors: the math of the
        compiled step, for storage formats torch's classes do not have."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._forge_traced_step()
        return loss

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
            options = [int(switch) for switch in view.options]
            for i in indices:
                p = view.params[i]
                state = self.state[p]
                states = [state[key] for key in view.state_keys]
                storage = {}
                if self._forge_state_format(p) == "int8":
                    states += [state[key + _SCALE_SUFFIX] for key in view.state_keys]
                    storage["quantized_states"] = True
                if view.rounding_seeds[i] is not None:
                    storage["rounding_seed"] = view.rounding_seeds[i]
                hyperparameters = self._forge_step_hyperparameters(view, i)
                param, grad, states = dtensor.local_shards(p, p.grad, states)
                new = torch.ops.forge.optimizer_update(
                    param, grad, states, state["step"], hyperparameters, rule_name, options, **storage
                )
                param.copy_(new[0])
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
            for key in self._forge_rule.state_keys:
                scales = entry.pop(key + _SCALE_SUFFIX, None)
                if scales is not None:  # 8-bit: torch's key, dequantized
                    entry[key] = self._forge_dequantized(key, entry[key], scales)
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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch.optim's load_state_dict; states then take this optimizer's storage format
        from the saved values (torch casts them to the parameter's dtype first, which would
        lose precision where the format is wider)."""
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, p in zip(saved_ids, params):
            entry = state_dict["state"].get(saved_id, {})
            for key in self._forge_rule.state_keys:
                value = entry.get(key)
                if isinstance(value, Tensor) and key in self.state[p] and self._forge_state_format(p) != p.dtype:
                    self._forge_store_state(p, key, value.to(p.device))


def attach(optimizer: torch.optim.Optimizer, *, state_dtype=None, stochastic_rounding=None,
           rounding_seed=None) -> torch.optim.Optimizer:  # fmt: skip
    """Turn a torch.optim optimizer into its forge counterpart in place, keeping its state
    (converted to ``state_dtype``; the storage options are the forge optimizers').

    Example::

        opt = forge_compile.attach(torch.optim.AdamW(model.parameters(), lr=3e-4))
    """
    from . import forge_class_for

    if isinstance(optimizer, ForgeOptimizer):
        return optimizer
    cls = forge_class_for(type(optimizer))
    ForgeOptimizer._forge_set_storage(optimizer, state_dtype, stochastic_rounding, rounding_seed)
    optimizer.__class__ = cls
    optimizer._patch_step_function()
    optimizer._forge_setup()
    return optimizer
