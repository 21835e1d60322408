"""forge_compile.optim.RAdam: torch.optim.RAdam with a traceable, fusable step."""

from __future__ import annotations

import torch

from ._common import nonzero
from .base import ForgeOptimizer


class RAdam(ForgeOptimizer, torch.optim.RAdam):
    """torch.optim.RAdam (variance rectification, L2 or decoupled weight decay), compiled by forge.

    Whether a step is rectified depends on the step count only; the switch at step 6
    happens inside the compiled step, without recompiling.

    Example::

        opt = forge_compile.optim.RAdam(model.parameters(), lr=1e-3, weight_decay=0.01, decoupled_weight_decay=True)
    """

    _forge_rule_name = "radam"

    def _forge_options(self, group):
        return (group["decoupled_weight_decay"], group["maximize"], nonzero(group["weight_decay"]))

    def _forge_hyperparameter_values(self, group):
        beta1, beta2 = group["betas"]
        return (group["lr"], beta1, beta2, group["eps"], group["weight_decay"])
