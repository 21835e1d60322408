"""Reference optimizers written from their papers, for checks of rules torch.optim lacks."""

from __future__ import annotations

import torch


def lion_reference(params, grads, exp_avgs, lr, beta1, beta2, weight_decay, maximize):
    """Lion as the paper writes it (Chen et al. 2023, Algorithm 2), in place, in the tensors' dtype."""
    for p, g, m in zip(params, grads, exp_avgs):
        g = -g if maximize else g
        update = torch.sign(beta1 * m + (1 - beta1) * g)
        p.mul_(1 - lr * weight_decay).sub_(lr * update)
        m.mul_(beta2).add_((1 - beta2) * g)


class LionReference(torch.optim.Optimizer):
    """:func:`lion_reference` as an eager torch.optim optimizer (the baseline forge's Lion is checked against)."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            exp_avgs = [self.state[p].setdefault("exp_avg", torch.zeros_like(p)) for p in params]
            lion_reference(params, [p.grad for p in params], exp_avgs, float(group["lr"]), *group["betas"],
                           group["weight_decay"], group["maximize"])  # fmt: skip
