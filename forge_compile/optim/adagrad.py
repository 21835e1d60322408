"""forge_compile.optim.Adagrad: torch.optim.Adagrad with a traceable, fusable step."""

from __future__ import annotations

import torch

from ._common import nonzero
from .base import ForgeOptimizer


class Adagrad(ForgeOptimizer, torch.optim.Adagrad):
    """torch.optim.Adagrad (lr_decay, initial_accumulator_value, eps, weight decay), compiled by forge.

    Example::

        opt = forge_compile.optim.Adagrad(model.parameters(), lr=0.1, lr_decay=1e-4)
    """

    _forge_rule_name = "adagrad"
    _forge_state_from_construction = True  # torch.optim.Adagrad creates every entry in __init__

    def _forge_options(self, group):
        return (group["maximize"], nonzero(group["weight_decay"]))

    def _forge_hyperparameter_values(self, group):
        return (group["lr"], group["lr_decay"], group["weight_decay"], group["eps"])

    def _forge_initial_state(self, p, key, view):
        return torch.full_like(p, view.group["initial_accumulator_value"], memory_format=torch.preserve_format)
