"""forge_compile.optim.Lion: the Lion optimizer (Chen et al., 2023), which torch.optim lacks."""

from __future__ import annotations

import torch
from torch import Tensor

from ._common import nonzero
from .base import ForgeOptimizer


class Lion(ForgeOptimizer, torch.optim.Optimizer):
    """Lion: ``p -= lr * sign(beta1 * m + (1 - beta1) * g)``, then ``m = beta2 * m + (1 - beta2) * g``.

    Decoupled weight decay (``p *= 1 - lr * weight_decay``) as in the paper; the paper
    suggests an lr 3-10x smaller and a weight decay 3-10x larger than AdamW's. State:
    ``exp_avg`` and ``step`` per parameter. Outside torch.compile the step runs the same
    rule with torch ops.

    Example::

        opt = forge_compile.optim.Lion(model.parameters(), lr=1e-4, weight_decay=1.0)
    """

    _forge_rule_name = "lion"

    def __init__(self, params, lr: float | Tensor = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, maximize: bool = False, differentiable: bool = False,
                 **storage):  # fmt: skip
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        for index, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {index}: {beta}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize,
                        differentiable=differentiable)  # fmt: skip
        super().__init__(params, defaults, **storage)

    def _forge_options(self, group):
        return (group["maximize"], nonzero(group["weight_decay"]))

    def _forge_hyperparameter_values(self, group):
        beta1, beta2 = group["betas"]
        return (group["lr"], beta1, beta2, group["weight_decay"])

    def _forge_eager_step(self, closure):
        return self._forge_rule_step(closure)  # torch has no Lion: forge's rule, with torch ops
