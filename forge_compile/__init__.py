"""forge-compile: a torch.compile backend that fuses each linear layer's weight-gradient
matmul with its optimizer update, so weight gradients never exist as tensors.

Example::

    import forge_compile
    opt = forge_compile.optim.AdamW(model.parameters(), lr=3e-4)
    def train_step(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    step = torch.compile(train_step, backend="forge")
    print(forge_compile.explain(step, x, y))
"""

from __future__ import annotations

import torch

from . import optim
from .backend import forge_backend
from .explain import Decision, GraphRecord, Report, explain
from .optim import attach

__all__ = ["Decision", "GraphRecord", "Report", "attach", "config", "explain", "forge_backend", "optim"]
__version__ = "0.1.0"

# Dynamo traces loss.backward() into the graph (as autograd.grad) only with this on; then
# forward, backward and the optimizer step reach forge's pass as one graph.
if hasattr(torch._dynamo.config, "trace_autograd_ops"):
    torch._dynamo.config.trace_autograd_ops = True
    # With it, Dynamo silently drops a backward() resumed after a graph break in the forward.
    from ._dynamo_fix import install as _install_backward_guard

    _install_backward_guard()


def _register_backend() -> None:
    """Register "forge" unless the installed entry point will (a second registration fails)."""
    from importlib.metadata import entry_points

    from torch._dynamo.backends import registry

    if "forge" in registry._COMPILER_FNS:
        return
    for entry in entry_points(group="torch_dynamo_backends"):
        if entry.name == "forge" and entry.value.startswith("forge_compile"):
            return  # torch loads it on first use of backend="forge"
    registry.register_backend(forge_backend, name="forge")


_register_backend()
# TORCH_LOGS="forge" (also registered while torch is imported, by the installed entry point)
import forge_compile_torch_logs  # noqa: E402

forge_compile_torch_logs.register()

from .config import config  # noqa: E402  (the settings object, not the module)
