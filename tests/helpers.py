"""Shared pieces of the tests: models, a training step, and a comparison with a tolerance."""

from __future__ import annotations

import copy

import torch
from torch import nn


class MLP(nn.Module):
    """Linear layers with biases on 3-D inputs (batch, sequence, features)."""

    def __init__(self, sizes=(12, 24, 20, 6), bias=True):
        super().__init__()
        layers = []
        for a, b in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(a, b, bias=bias), nn.GELU()]
        self.net = nn.Sequential(*layers[:-1])

    def forward(self, x):
        return self.net(x)


def mse_step(model, optimizer, detach=True):
    def train_step(x, y):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach() if detach else loss

    return train_step


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def assert_close_params(actual: nn.Module, expected: nn.Module, atol: float = 1e-5, context: str = ""):
    """Every parameter within ``atol`` of the reference (absolute, element-wise)."""
    for (name, a), (_, e) in zip(actual.named_parameters(), expected.named_parameters()):
        err = (a.detach().double() - e.detach().double()).abs().max().item() if a.numel() else 0.0
        assert err <= atol, f"{context} {name}: max abs error {err:.3g} > {atol}"
        assert torch.isnan(a).eq(torch.isnan(e)).all(), f"{context} {name}: NaN pattern differs"


def max_param_error(actual: nn.Module, expected: nn.Module) -> float:
    return max(
        (a.detach().double() - e.detach().double()).abs().max().item()
        for a, e in zip(actual.parameters(), expected.parameters())
        if a.numel()
    )
