"""A guard for Dynamo's in-graph ``loss.backward()``, which forge turns on at import.

With ``torch._dynamo.config.trace_autograd_ops`` on, Dynamo rewrites ``loss.backward()``
into ``autograd.grad(loss, leaves)`` over the leaf tensors *the current frame has seen*.
After a graph break inside the forward (transformers' GPT2LMHeadModel logs a
``warning_once`` in its loss, for one), the step resumes in a new frame whose only input
is ``loss``: it has seen no parameter, finds no leaves, and Dynamo (torch 2.11 to 2.13,
``TensorVariable.method_backward``) then drops the backward as a no-op. Nothing is
trained, with no error; this happens under any backend once forge is imported.

:func:`install` wraps that method: when the leaves are auto-detected, the loss has a
``grad_fn`` and the frame knows no leaf, it graph-breaks instead, so ``backward()`` runs
eagerly, as it would without the flag. Every other call goes to Dynamo unchanged.
"""

from __future__ import annotations

import functools
from itertools import chain


def _known_leaves(tensor_var, tx) -> list | None:
    """The leaves Dynamo's backward would differentiate for; None where Dynamo's internals differ."""
    output = getattr(tx, "output", None)
    order = getattr(output, "leaf_var_creation_order", None)
    sources = getattr(output, "input_source_to_var", None)
    collect = getattr(tensor_var, "_collect_backward_inputs", None)
    if order is None or sources is None or collect is None:
        return None
    return collect(chain(order, sources.values())) or []


def install() -> None:
    try:
        from torch._dynamo.exc import unimplemented
        from torch._dynamo.variables.tensor import TensorVariable
    except ImportError:
        return
    original = getattr(TensorVariable, "method_backward", None)
    if original is None or getattr(original, "_forge_guarded", False):
        return

    @functools.wraps(original)
    def method_backward(self, tx, gradient=None, retain_graph=None, create_graph=None, inputs=None):
        if inputs is None and getattr(self, "has_grad_fn", False) and _known_leaves(self, tx) == []:
            unimplemented(
                gb_type="backward() of a loss whose leaves this frame has not seen",
                context=f"call_method {self} backward (no leaf tensor among the frame's inputs)",
                explanation=(
                    "The loss was computed in an earlier graph (a graph break in the forward), so Dynamo's "
                    "in-graph backward would find no parameter and do nothing; forge runs backward() eagerly."
                ),
                hints=["Remove the graph break in the forward to get the backward (and forge's fusion) in one graph."],
            )
        return original(self, tx, gradient, retain_graph, create_graph, inputs)

    method_backward._forge_guarded = True
    TensorVariable.method_backward = method_backward
