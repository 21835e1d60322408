"""forge_compile.optim.Adam and AdamW: torch.optim.Adam/AdamW with a traceable, fusable step."""

from __future__ import annotations

import torch

from ._common import nonzero
from .base import ForgeOptimizer


class _AdamFamily(ForgeOptimizer):
    _forge_rule_name = "adam"

    def _forge_options(self, group):
        decoupled = group.get("decoupled_weight_decay", isinstance(self, torch.optim.AdamW))
        return (decoupled, group["amsgrad"], group["maximize"], nonzero(group["weight_decay"]))

    def _forge_hyperparameter_values(self, group):
        beta1, beta2 = group["betas"]
        return (group["lr"], beta1, beta2, group["eps"], group["weight_decay"])


class Adam(_AdamFamily, torch.optim.Adam):
    """torch.optim.Adam, compiled by forge: same arguments, state and checkpoints.

    Example::

        opt = forge_compile.optim.Adam(model.parameters(), lr=1e-3)
    """


class AdamW(_AdamFamily, torch.optim.AdamW):
    """torch.optim.AdamW, compiled by forge: same arguments, state and checkpoints.

    Example::

        opt = forge_compile.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    """
