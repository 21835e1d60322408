"""DTensor parameters (tensor and sequence parallelism, torch.distributed.tensor.parallel).

Under tensor parallelism each rank's weight shard gets its complete local gradient in
backward (a column-parallel weight's gradient is ``dY_local^T X``, a row-parallel one's
``dY^T X_local``), and forge's rules are element-wise, so the fused update on the local
shards is exact. Three pieces make that work:

* :func:`local_shards`: the traced optimizer step updates a DTensor parameter through
  its local shards. A parameter replicated over the mesh while the activations are
  sharded (the sequence-parallel norm weights, a replicated gate) gets a ``Partial``
  gradient, which DTensor's backward all-reduces to the parameter's layout: a collective
  between the matmul and the update, so forge's pass leaves that parameter unfused
  (``reduced_across_ranks``) and the update stays correct. A gradient that still
  arrives in another layout is redistributed here before the update.
* :func:`install_shard_order_fix`: Dynamo (torch 2.13) fails to trace a backward through
  DTensor parameters: rebuilding a gradient's DTensorSpec runs its ``shard_order``
  consistency check on symbolic values (``SymNodeVariable() is not a constant``). The
  check only validates a spec DTensor built itself, so it is skipped while compiling.
* :func:`leaf_names`: AOTAutograd hands the post-grad graph each DTensor as its inner
  tensors (the local shard; the mesh is an opaque input), so explain's parameter names
  are expanded the same way.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch import Tensor


def is_dtensor(t) -> bool:
    module = sys.modules.get("torch.distributed.tensor")  # never imported: no DTensor exists
    return module is not None and isinstance(t, module.DTensor)


def local_shards(param: Tensor, grad: Tensor, states: list[Tensor]) -> tuple[Tensor, Tensor, list[Tensor]]:
    """``param``, ``grad`` and ``states`` as this rank's shards where ``param`` is a DTensor,
    the gradient laid out as the parameter first; plain tensors pass through."""
    if not is_dtensor(param):
        return param, grad, states
    if not same_layout(grad, param):
        grad = grad.redistribute(param.device_mesh, param.placements)
    local = param.to_local()
    grad_local = grad.to_local()
    if grad_local.shape != local.shape:
        raise RuntimeError(f"forge: {tuple(grad_local.shape)} local gradient for a {tuple(local.shape)} shard after "
                           "redistribution; please report this with the parallelize plan")  # fmt: skip
    return local, grad_local, [s.to_local() if is_dtensor(s) else s for s in states]


def same_layout(a, b) -> bool:
    """Two DTensors whose local shards hold the same elements: the same mesh and placements.
    (torch 2.13 also keeps a shard order in the spec, which Dynamo cannot read; two
    orders of one mesh dimension set show as different _StridedShard placements, and the
    local shapes are checked after.)"""
    return (a.device_mesh is b.device_mesh or a.device_mesh == b.device_mesh) and a.placements == b.placements


def shard_seed(param, seed: int) -> int:
    """The stochastic-rounding seed of this rank's shard of ``param``: shards of one weight
    on different ranks hold different elements, so they draw different bits (the element
    index the kernel hashes is local to the shard). Plain tensors keep ``seed``."""
    if not is_dtensor(param):
        return seed
    coordinate = param.device_mesh.get_coordinate() or []
    for c in coordinate:
        seed = (seed * 1_000_003 + c + 1) % 2**31  # the kernel takes seeds in [0, 2**31)
    return seed


@functools.cache
def install_shard_order_fix() -> None:
    """Skip DTensorSpec's shard-order check while Dynamo traces (see the module docstring);
    a torch without the check is left alone."""
    from torch.distributed.tensor import _dtensor_spec

    spec = _dtensor_spec.DTensorSpec
    check = getattr(spec, "_verify_shard_order", None)
    if check is None:
        return

    @functools.wraps(check)
    def verify_unless_compiling(self, shard_order):
        if torch.compiler.is_compiling():
            return None
        return check(self, shard_order)

    spec._verify_shard_order = verify_unless_compiling


def leaf_names(name: str, value) -> list[str]:
    """The names of the tensor inputs that AOTAutograd makes of one Dynamo input: ``name``
    itself, or for a tensor subclass its inner tensors in flattening order, the first
    (a DTensor's local shard) keeping ``name``."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(value):
        return [name]
    attrs, _ = value.__tensor_flatten__()
    names = []
    for i, attr in enumerate(attrs):
        inner = getattr(value, attr)
        if isinstance(inner, torch.Tensor):  # not the mesh, an opaque object there
            names += leaf_names(name if i == 0 else f"{name}.{attr}", inner)
    return names
