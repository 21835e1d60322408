"""Drop-in replacements for torch.optim classes, one rule per file."""

from __future__ import annotations

import torch

from .adagrad import Adagrad
from .adam import Adam, AdamW
from .base import ForgeOptimizer, attach
from .lion import Lion
from .nadam import NAdam
from .radam import RAdam
from .rmsprop import RMSprop
from .sgd import SGD

__all__ = ["SGD", "Adagrad", "Adam", "AdamW", "ForgeOptimizer", "Lion", "NAdam", "RAdam", "RMSprop", "attach",
           "forge_class_for"]  # fmt: skip

_FORGE_CLASSES: dict[type, type] = {
    torch.optim.SGD: SGD,
    torch.optim.RMSprop: RMSprop,
    torch.optim.Adagrad: Adagrad,
    torch.optim.Adam: Adam,
    torch.optim.AdamW: AdamW,
    torch.optim.NAdam: NAdam,
    torch.optim.RAdam: RAdam,
}

# torch.optim classes whose update needs the whole gradient (or a closure), so no
# element-wise epilogue can compute it.
_NOT_ELEMENT_WISE = {
    "LBFGS": "needs a closure and the whole gradient for its line search",
    "SparseAdam": "updates sparse gradients row by row",
    "Adafactor": "factors the second moment over whole rows and columns",
    "Muon": "orthogonalizes the whole gradient matrix",
    "LAMB": "scales each update by a trust ratio of whole-tensor norms",
    "Shampoo": "preconditions with whole-gradient statistics",
}


def forge_class_for(torch_class: type) -> type:
    """The forge class that replaces ``torch_class``, or a TypeError that says what to do."""
    cls = _FORGE_CLASSES.get(torch_class)
    if cls is not None:
        return cls
    name = f"{torch_class.__module__}.{torch_class.__qualname__}"
    supported = ", ".join(f"torch.optim.{c.__name__}" for c in _FORGE_CLASSES)
    why = _NOT_ELEMENT_WISE.get(torch_class.__name__)
    if why is not None:
        raise TypeError(
            f"forge: {name} is not element-wise (it {why}), so its update cannot be fused into the "
            f"weight-gradient matmul; keep it and compile with backend='inductor'. forge supports {supported}"
        )
    if any(issubclass(torch_class, base) for base in _FORGE_CLASSES):
        raise TypeError(
            f"forge: {name} subclasses a torch optimizer and may change its step(); forge converts only the "
            f"torch classes themselves ({supported}). Build forge's class instead"
        )
    raise TypeError(
        f"forge: cannot convert {name}; forge supports {supported} and forge_compile.optim.Lion. "
        "Keep it and compile with backend='inductor'"
    )
