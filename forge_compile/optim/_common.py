"""Small helpers the optimizer classes share."""

from __future__ import annotations

import torch


def nonzero(value) -> bool:
    """Whether a hyperparameter switches its term on; a Tensor is on (its value may change)."""
    return bool(value != 0) if not isinstance(value, torch.Tensor) else True
