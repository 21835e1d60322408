"""forge_compile.optim.SGD: torch.optim.SGD with a traceable, fusable step."""

from __future__ import annotations

import torch

from ._common import nonzero
from .base import ForgeOptimizer


class SGD(ForgeOptimizer, torch.optim.SGD):
    """torch.optim.SGD (momentum, dampening, Nesterov, weight decay), compiled by forge.

    torch keeps no step count for SGD; forge keeps one per parameter to tell the first
    momentum step (buffer = gradient) from later ones, and leaves it out of
    ``state_dict()``, so checkpoints are torch's.

    Example::

        opt = forge_compile.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    """

    _forge_rule_name = "sgd"
    _forge_hidden_state_keys = ("step",)

    def _forge_options(self, group):
        return (nonzero(group["momentum"]), group["nesterov"], group["maximize"], nonzero(group["weight_decay"]))

    def _forge_hyperparameter_values(self, group):
        return (group["lr"], group["momentum"], group["dampening"], group["weight_decay"])

    def _forge_initial_step(self, state):
        # A buffer loaded from a torch checkpoint has seen at least one step.
        return 1.0 if "momentum_buffer" in state else 0.0

    @torch.no_grad()
    def _forge_eager_step(self, closure):
        # torch starts a buffer from the first gradient only when it finds none: hand it
        # none for parameters that have not stepped, and put zeros back where no gradient came.
        unstepped = {}
        for view in self._forge_groups:
            if view.options[0]:
                for p in view.params:
                    state = self.state.get(p, {})
                    if "momentum_buffer" in state and float(state["step"]) == 0.0:
                        unstepped[p] = state.pop("momentum_buffer")
        loss = super()._forge_eager_step(closure)
        steps = [self.state[p]["step"] for view in self._forge_groups for p in view.params
                 if p.grad is not None and "step" in self.state.get(p, {})]  # fmt: skip
        if steps:
            torch._foreach_add_(steps, 1)
        for p, zeros in unstepped.items():
            self.state[p].setdefault("momentum_buffer", zeros)
        return loss
