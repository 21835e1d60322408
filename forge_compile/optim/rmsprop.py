"""forge_compile.optim.RMSprop: torch.optim.RMSprop with a traceable, fusable step."""

from __future__ import annotations

import torch

from ._common import nonzero
from .base import ForgeOptimizer


class RMSprop(ForgeOptimizer, torch.optim.RMSprop):
    """torch.optim.RMSprop (alpha, eps, centered, momentum, weight decay), compiled by forge.

    Example::

        opt = forge_compile.optim.RMSprop(model.parameters(), lr=1e-3, centered=True, momentum=0.9)
    """

    _forge_rule_name = "rmsprop"

    def _forge_options(self, group):
        return (group["centered"], nonzero(group["momentum"]), group["maximize"], nonzero(group["weight_decay"]))

    def _forge_hyperparameter_values(self, group):
        return (group["lr"], group["alpha"], group["eps"], group["weight_decay"], group["momentum"])
