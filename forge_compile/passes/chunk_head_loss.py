"""Put the chunked head loss (``forge::linear_cross_entropy``) in place of a head and its loss.

Runs on the graph Dynamo captured, before AOTAutograd traces forward and backward from it,
so that the backward traced is the chunked one (head_loss.py). The pattern is what
transformers' causal-LM loss and plain training loops write::

    logits = F.linear(hidden, weight)            # no bias; weight a graph input
    loss = F.cross_entropy(logits.float().view(-1, V), labels, ignore_index=i, reduction="mean" | "sum")

through any of ``.float()``, ``.to(torch.float32)``, ``.view``/``.reshape`` to
``[tokens, V]``, each read by the next alone. A class weight, label smoothing, a reduction
of ``"none"``, logits read elsewhere (returned, logged) or kept in a lower precision than
fp32, and DTensor operands (tensor parallelism) leave the graph as it is.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx import Node

from .. import dtensor, head_loss  # noqa: F401  (torch.ops.forge.linear_cross_entropy)

log = logging.getLogger(__name__)

_LINEARS = (F.linear, torch._C._nn.linear)
_CROSS_ENTROPIES = (F.cross_entropy,)
_RESHAPES = ("view", "reshape")


def chunk_head_losses(graph: fx.Graph) -> int:
    """Rewrite ``graph`` in place; returns how many head losses it replaced."""
    replaced = 0
    for loss in [n for n in graph.nodes if n.op == "call_function" and n.target in _CROSS_ENTROPIES]:
        found = _match(loss)
        if found is None:
            continue
        hidden, weight, labels, ignore_index, reduction, chain = found
        with graph.inserting_before(loss):
            chunked = graph.call_function(torch.ops.forge.linear_cross_entropy.default,
                                          (hidden, weight, labels, ignore_index, reduction))  # fmt: skip
            value = graph.call_function(operator.getitem, (chunked, 0))
        value.meta = dict(loss.meta)
        loss.replace_all_uses_with(value)
        graph.erase_node(loss)
        for node in chain:  # from the cross-entropy's input back to the linear
            if not node.users:
                graph.erase_node(node)
        replaced += 1
    return replaced


def _example(node) -> torch.Tensor | None:
    value = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _argument(node: Node, index: int, name: str, default):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _match(loss: Node):
    """``(hidden, weight, labels, ignore_index, reduction, chain)`` or None."""
    logits, labels = _argument(loss, 0, "input", None), _argument(loss, 1, "target", None)
    if _argument(loss, 2, "weight", None) is not None or _argument(loss, 7, "label_smoothing", 0.0) != 0.0:
        return None
    if _argument(loss, 3, "size_average", None) is not None or _argument(loss, 5, "reduce", None) is not None:
        return None
    ignore_index, reduction = _argument(loss, 4, "ignore_index", -100), _argument(loss, 6, "reduction", "mean")
    if reduction not in ("mean", "sum") or not isinstance(ignore_index, int) or not isinstance(labels, Node):
        return None
    flat = _example(logits)
    if flat is None or flat.dim() != 2 or flat.dtype != torch.float32:
        return None
    chain, node = [], logits
    while isinstance(node, Node) and len(node.users) == 1:
        chain.append(node)
        if node.op == "call_function" and node.target in _LINEARS:
            break
        if node.op == "call_method" and (node.target == "float" or node.target in _RESHAPES
                                         or (node.target == "to" and _to_float32(node))):  # fmt: skip
            node = node.args[0]
            continue
        return None
    else:
        return None
    linear = chain[-1]
    hidden, weight = _argument(linear, 0, "input", None), _argument(linear, 1, "weight", None)
    if _argument(linear, 2, "bias", None) is not None or not isinstance(weight, Node) or weight.op != "placeholder":
        return None
    weight_value, hidden_value = _example(weight), _example(hidden)
    if weight_value is None or hidden_value is None or weight_value.dim() != 2:
        return None
    if dtensor.is_dtensor(weight_value) or dtensor.is_dtensor(hidden_value) or dtensor.is_dtensor(_example(labels)):
        return None  # a vocabulary-parallel head is loss_parallel's to chunk: its logits are already sharded
    if flat.shape[1] != weight_value.shape[0] or flat.shape[0] * hidden_value.shape[-1] != hidden_value.numel():
        return None
    log.debug("forge: %s computed in vocabulary chunks (head weight %s)", loss.name, weight.name)
    return hidden, weight, labels, ignore_index, reduction, chain


def _to_float32(node: Node) -> bool:
    """``x.to(torch.float32)`` (a dtype alone, positional or keyword)."""
    dtypes = [a for a in node.args[1:] if isinstance(a, torch.dtype)] + [node.kwargs.get("dtype")]
    others = [a for a in node.args[1:] if not isinstance(a, torch.dtype)]
    return torch.float32 in dtypes and not others and set(node.kwargs) <= {"dtype"}
