"""forge_compile.optim.NAdam: torch.optim.NAdam with a traceable, fusable step."""

from __future__ import annotations

import torch

from ._common import nonzero
from .base import ForgeOptimizer


class NAdam(ForgeOptimizer, torch.optim.NAdam):
    """torch.optim.NAdam (momentum_decay, L2 or decoupled weight decay), compiled by forge.

    ``state["mu_product"]`` is kept as torch keeps it, a 0-d tensor per parameter,
    advanced once per step outside the fused kernel.

    Example::

        opt = forge_compile.optim.NAdam(model.parameters(), lr=2e-3, momentum_decay=4e-3)
    """

    _forge_rule_name = "nadam"

    def _forge_options(self, group):
        return (group["decoupled_weight_decay"], group["maximize"], nonzero(group["weight_decay"]))

    def _forge_hyperparameter_values(self, group):
        beta1, beta2 = group["betas"]
        return (group["lr"], beta1, beta2, group["eps"], group["weight_decay"], group["momentum_decay"])
