"""Fuse each linear weight's gradient matmul with its optimizer update.

In the post-grad graph a forge optimizer's update of a linear weight ``W`` reads::

    dW  = mm(grad_output_t, input)            # possibly through views and dtype casts
    new = forge.optimizer_update(W, dW, [states], step, [hyperparameters], rule, options)
    copy_(W, new[0]); copy_(state_i, new[1 + i])   # at the end of the graph

The pass replaces the chain by one mutating op::

    forge.fused_linear_update_(W, grad_output_t, input, [states], step, [hyperparameters], rule, options)

when the gradient has no other consumer (tied weights, clipping, accumulation, logging
and returned gradients all read it elsewhere) and the updated values are only copied
back. The op is placed right after the last reader of the old weight (its ``dX``
matmul), so ``grad_output`` and the saved input die early instead of at the graph's
end; the step's scalar inputs (the ``step`` increment) are moved up to meet it.

Every update it does not fuse is replaced by the rule's torch decomposition, which
Inductor compiles to pointwise kernels that write the weight and states in place.
Each candidate gets a :class:`forge_compile.explain.Decision`.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import fx
from torch.fx import Node

from .. import explain, head_loss, ops, rules  # noqa: F401  (torch.ops.forge.*)

log = logging.getLogger(__name__)
aten = torch.ops.aten
prims = torch.ops.prims

_UPDATE = torch.ops.forge.optimizer_update.default
_FUSED = torch.ops.forge.fused_linear_update_.default
_FUSABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TRANSPOSES = (aten.permute.default, aten.t.default, aten.transpose.int)
_SAME_SHAPE_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
                   aten.alias.default, aten.contiguous.default)  # fmt: skip
_CASTS = (prims.convert_element_type.default, aten._to_copy.default)
_STATISTICS = {"pow", "abs", "sum", "amax", "amin", "mean", "square"}
_NORMS = (aten.linalg_vector_norm.default, aten.norm.Scalar, aten.norm.ScalarOpt_dim, aten._foreach_norm.Scalar)
# Besides views, only nodes this small (the step's scalar arithmetic) move up to meet a fused op.
_MAX_HOISTED_ELEMENTS = 4096


class Rejection(Exception):
    def __init__(self, code: str, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass
class _Candidate:
    update: Node
    weight: Node
    states: list[Node]
    step: Node
    hyperparameters: list[Node]
    rule: str
    options: list[int]
    copies: list[Node]
    """copy_ nodes that write the new weight and states back, in that order."""
    chain: list[Node]
    """The gradient's nodes from the update back to (and including) the matmul."""
    left: Node
    right: Node
    """The matmul's operands: it computes ``left @ right``."""
    transposed: bool
    """The matmul computes dW^T, so the fused op takes ``right^T @ left^T``."""
    grad_min: float | None
    grad_max: float | None
    """Bounds of a clamp of the gradient before the update (clip_grad_value_), or None."""
    quantized_states: bool
    rounding_seed: int | None
    """The update's storage arguments (8-bit states, stochastic rounding), passed on."""


def _storage_arguments(update: Node) -> tuple[bool, int | None]:
    """``(quantized_states, rounding_seed)`` of a ``forge.optimizer_update`` node."""
    extra = list(update.args[7:]) + [None] * 2
    quantized = update.kwargs.get("quantized_states", extra[0] if extra[0] is not None else False)
    seed = update.kwargs.get("rounding_seed", extra[1])
    return bool(quantized), seed


def fuse_linear_updates(graph: fx.Graph, name_of: Callable[[Node], str], fuse: bool = True) -> list[explain.Decision]:
    """Rewrite ``graph`` in place; returns one decision per ``forge.optimizer_update``.

    Example::

        decisions = fuse_linear_updates(gm.graph, lambda placeholder: placeholder.name)
    """
    decisions = []
    if fuse and any(n.target is _UPDATE for n in graph.nodes):
        _split_foreach_clamps(graph)
    for update in [n for n in graph.nodes if n.target is _UPDATE]:
        param = update.args[0]
        val = param.meta.get("val") if isinstance(param, Node) else None
        decision = explain.Decision(
            name=name_of(param) if isinstance(param, Node) and param.op == "placeholder" else str(param),
            shape=tuple(val.shape) if val is not None else (),
            dtype=str(val.dtype).replace("torch.", "") if val is not None else "?",
            rule=update.args[5],
            fused=False,
            code=explain.FUSED,
        )
        decision.chain = [update.name] + ([update.args[1].name] if isinstance(update.args[1], Node) else [])
        try:
            head = _match_chunked_head(update)
            if head is not None:
                decision.chain = [update.name] + [n.name for n in head.chain]
                if not fuse:
                    raise Rejection(explain.DISABLED, "fusion disabled (forge_compile.config.fuse is False)")
                gradient_bytes = _bytes(head.chain[-1])
                _rewrite_chunked_head(graph, head)
                decision.fused = True
                decision.gradient_bytes = gradient_bytes
                decisions.append(decision)
                continue
            candidate = _match(update)
            decision.chain = [update.name] + [n.name for n in candidate.chain]
            if not fuse:
                raise Rejection(explain.DISABLED, "fusion disabled (forge_compile.config.fuse is False)")
            gradient_bytes = _gradient_bytes(candidate)
            _rewrite(graph, candidate)
            decision.fused = True
            decision.gradient_bytes = gradient_bytes
        except Rejection as rejection:
            decision.code = rejection.code
            decision.reason = rejection.reason
        log.debug("forge: %s %s", decision.name, "fused" if decision.fused else f"not fused: {decision.reason}")
        decisions.append(decision)
    traced: dict = {}
    for update in [n for n in graph.nodes if n.target is _UPDATE]:
        decompose_update(graph, update, traced)
    graph.lint()
    return decisions


# --- matching ---------------------------------------------------------------------------------


def _match(update: Node) -> _Candidate:
    param, grad, states, step, hyperparameters, rule, options = update.args[:7]
    quantized_states, rounding_seed = _storage_arguments(update)
    if not isinstance(param, Node) or param.op != "placeholder":
        raise Rejection(explain.NOT_AN_INPUT, "the parameter is not an input of the compiled graph")
    weight = param.meta["val"]
    if weight.dim() != 2:
        raise Rejection(explain.NOT_A_MATRIX, f"a {weight.dim()}-D parameter (bias, norm or scale), not a matmul weight")
    _check_dtypes(weight, states, quantized_states)
    copies = _copies_back(update, [param, *states])
    chain, matmul_operands, transposed, (grad_min, grad_max) = _trace_gradient(grad, tuple(weight.shape))
    _check_single_consumer(chain)
    left, right = matmul_operands
    return _Candidate(update, param, list(states), step, list(hyperparameters), rule, list(options),
                      copies, chain, left, right, transposed, grad_min, grad_max, quantized_states,
                      rounding_seed)  # fmt: skip


def _check_dtypes(weight: torch.Tensor, states, quantized_states: bool) -> None:
    """Rejects a weight or state the fused op cannot take, or a state made inside the graph."""
    if weight.dtype not in _FUSABLE_DTYPES:
        raise Rejection(explain.UNSUPPORTED_DTYPE, f"weight dtype {weight.dtype} is not fp32, bf16 or fp16")
    for state in states:
        if not isinstance(state, Node) or state.op != "placeholder":
            raise Rejection(explain.NOT_AN_INPUT, "an optimizer state is created inside the graph, not passed in")
        if state.meta["val"].dtype not in _FUSABLE_DTYPES + ((torch.int8, torch.uint8) if quantized_states else ()):
            raise Rejection(explain.UNSUPPORTED_DTYPE, f"state dtype {state.meta['val'].dtype} is not fp32/bf16/fp16")


def _copies_back(update: Node, targets: list[Node]) -> list[Node]:
    """The copy_ of each output into its input; rejects other readers of the new values."""
    outputs: dict[int, Node] = {}
    for user in update.users:
        if user.target is not operator.getitem:
            raise Rejection(explain.UPDATED_VALUE_READ, "the update's result is used as a whole")
        outputs[user.args[1]] = user
    copies = []
    for index, target in enumerate(targets):
        what = "weight" if index == 0 else "optimizer state"
        out = outputs.get(index)
        users = list(out.users) if out is not None else []
        if (
            len(users) != 1
            or users[0].target is not aten.copy_.default
            or users[0].args[0] is not target
            or users[0].args[1] is not out
        ):
            raise Rejection(explain.UPDATED_VALUE_READ, f"the updated {what} is read again in the same graph")
        copies.append(users[0])
    return copies


def _shape(node: Node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def _is_2d_transpose(node: Node) -> bool:
    if node.target is aten.t.default:
        return True
    if node.target is aten.permute.default:
        return list(node.args[1]) in ([1, 0], [-1, -2], [-1, 0], [1, -2])
    if node.target is aten.transpose.int:
        return len(_shape(node)) == 2 and {d % 2 for d in node.args[1:3]} == {0, 1}
    return False


def _is_plain_cast(node: Node) -> bool:
    if node.target is prims.convert_element_type.default:
        return True
    return node.target is aten._to_copy.default and set(node.kwargs) <= {"dtype"}


_FOREACH_CLAMPS = {
    aten._foreach_clamp_min.Scalar: aten.clamp_min.default,
    aten._foreach_clamp_max.Scalar: aten.clamp_max.default,
}
_CLAMPS = (aten.clamp_min.default, aten.clamp_max.default, aten.clamp.default)


def _split_foreach_clamps(graph: fx.Graph) -> None:
    """One clamp per tensor in place of clip_grad_value_'s foreach clamps, so that each
    gradient's chain back to its matmul is its own (Inductor fuses the pieces again)."""
    for node in [n for n in graph.nodes if n.target in _FOREACH_CLAMPS]:
        tensors, bound = node.args[0], node.args[1]
        if not all(u.target is operator.getitem for u in node.users) or not isinstance(bound, (int, float)):
            continue
        for item in list(node.users):
            with graph.inserting_before(node):
                clamp = graph.call_function(_FOREACH_CLAMPS[node.target], (tensors[item.args[1]], bound))
            clamp.meta = dict(item.meta)
            item.replace_all_uses_with(clamp)
            graph.erase_node(item)
        graph.erase_node(node)


def _clamp_bounds(node: Node) -> tuple[float | None, float | None]:
    """(low, high) of a clamp with constant bounds; a Rejection for tensor bounds."""
    if node.target is aten.clamp_min.default:
        bounds = (node.args[1], None)
    elif node.target is aten.clamp_max.default:
        bounds = (None, node.args[1])
    else:
        bounds = (node.args[1] if len(node.args) > 1 else node.kwargs.get("min"),
                  node.args[2] if len(node.args) > 2 else node.kwargs.get("max"))  # fmt: skip
    if not all(b is None or isinstance(b, (int, float)) for b in bounds):
        raise Rejection(explain.NOT_A_MATMUL, "gradient clamped to tensor bounds before the update")
    return tuple(None if b is None else float(b) for b in bounds)


def _walk_gradient(grad: Node):
    """From the update's gradient back through views, casts, 2-D transposes and at most one
    lower and one upper clamp (clip_grad_value_, which the fused op applies to the fp32
    gradient tile) to the first other node. Returns ``(chain, that node, transposed, (low,
    high))``; ``chain`` ends with that node when it is a node of the graph."""
    chain: list[Node] = []
    transposed = False
    low = high = None
    node = grad
    while isinstance(node, Node) and node.op == "call_function":
        if _is_plain_cast(node) or (node.target in _SAME_SHAPE_OPS and _shape(node) == _shape(node.args[0])):
            pass
        elif node.target in _TRANSPOSES and _is_2d_transpose(node):
            transposed = not transposed
        elif node.target in _CLAMPS:
            node_low, node_high = _clamp_bounds(node)
            if (node_low is not None and low is not None) or (node_high is not None and high is not None):
                raise Rejection(explain.NOT_A_MATMUL, "gradient clamped more than once before the update")
            low = node_low if node_low is not None else low
            high = node_high if node_high is not None else high
        else:
            break
        chain.append(node)
        node = node.args[0]
    if isinstance(node, Node):
        chain.append(node)
    return chain, node, transposed, (low, high)


def _check_clamp_bounds(low: float | None, high: float | None) -> None:
    if low is not None and high is not None and low > high:
        # min(max(g, low), high) is then not what the graph's order of clamps computes
        raise Rejection(explain.NOT_A_MATMUL, f"gradient clamped to crossed bounds [{low}, {high}]")


def _trace_gradient(grad: Node, weight_shape: tuple[int, ...]):
    """The update's gradient back to its matmul (:func:`_walk_gradient`)."""
    chain, node, transposed, bounds = _walk_gradient(grad)
    if not isinstance(node, Node):
        raise Rejection(explain.NOT_A_MATMUL, "the gradient is not a tensor computed in the graph")
    if node.op == "placeholder":
        raise Rejection(
            explain.GRADIENT_FROM_OUTSIDE,
            "the gradient was computed outside this graph (backward ran in another graph or eagerly)",
        )
    if node.target is aten.add.Tensor:
        raise _shared_or_accumulated(node)
    if node.target is not aten.mm.default:
        raise _transformed_gradient(node)
    expected = weight_shape[::-1] if transposed else weight_shape
    if _shape(node) != expected:
        raise Rejection(explain.NOT_A_MATMUL, f"the matmul's shape {_shape(node)} does not match the weight's")
    _check_clamp_bounds(*bounds)
    return chain, tuple(node.args), transposed, bounds


def _gradient_sources(node: Node) -> list[Node]:
    """Terminal producers of a sum of gradients (tied weights add one term per use)."""
    while isinstance(node, Node) and node.op == "call_function" and (
        _is_plain_cast(node) or (node.target in _TRANSPOSES and _is_2d_transpose(node))
        or (node.target in _SAME_SHAPE_OPS and _shape(node) == _shape(node.args[0]))
    ):  # fmt: skip
        node = node.args[0]
    if isinstance(node, Node) and node.target is aten.add.Tensor:
        return [s for arg in node.args[:2] for s in _gradient_sources(arg)]
    return [node]


def _shared_or_accumulated(add: Node) -> Rejection:
    sources = _gradient_sources(add)
    if any(isinstance(s, Node) and s.op == "placeholder" for s in sources):
        return Rejection(
            explain.ACCUMULATED,
            "gradient added to an existing .grad (accumulation, or zero_grad(set_to_none=False))",
        )
    ops_ = [f"aten.{s.target.__name__.split('.')[0]}" if isinstance(s, Node) and s.op == "call_function" else "?"
            for s in sources]  # fmt: skip
    return Rejection(
        explain.SUMMED_GRADIENT,
        f"weight used by {len(sources)} ops ({', '.join(ops_)}): its gradient is a sum, as for tied or shared "
        "weights or several backward() calls",
    )


# Functional collectives (DTensor, compiled DDP/FSDP): a gradient they produce was reduced
# across ranks, so no rank's matmul alone computes it.
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d")
_OP_HINTS = {
    "embedding_dense_backward": "an embedding's gradient (a scatter of rows), not a matmul",
    "_unsafe_masked_index_put_accumulate": "an embedding's gradient (a scatter of rows), not a matmul",
    "index_put": "an embedding's gradient (a scatter of rows), not a matmul",
    "scatter_add": "a scatter's gradient, not a matmul",
    "clamp": "gradient clamped before the update (clip_grad_value_?)",
    "mul": "gradient scaled before the update (clip_grad_norm_ or loss scaling?)",
    "div": "gradient divided before the update (loss scaling?)",
    "sum": "a sum over tokens (bias-like), not a matmul",
    "bmm": "a batched matmul's gradient (aten.bmm)",
    "convolution_backward": "a convolution's gradient",
}


def _op_name(node: Node | torch._ops.OpOverload) -> str:
    """The short name of a node's op, or of an op overload itself."""
    target = node.target if isinstance(node, Node) else node
    name = target.__name__.split(".")[0] if hasattr(target, "__name__") else str(target)
    return name.removeprefix("_foreach_")


def _transformed_gradient(node: Node) -> Rejection:
    """Why a gradient that is not a plain matmul output cannot be fused."""
    producer, element = node, None
    if node.target is operator.getitem and isinstance(node.args[0], Node):
        producer, element = node.args[0], node.args[1]  # one tensor of a foreach op
    inputs = producer.args[0] if producer.args else None
    if element is not None and isinstance(inputs, (list, tuple)) and element < len(inputs):
        inputs = inputs[element]
    matmul = _gradient_sources(inputs)[0] if isinstance(inputs, Node) else None
    if matmul is not None and matmul.target is aten.mm.default:
        if any(u.target in _NORMS for u in matmul.users):
            return Rejection(
                explain.GRADIENT_READ_ELSEWHERE,
                "gradient read by a global norm and rescaled (clip_grad_norm_): the norm needs every gradient "
                "before any update",
            )
    # A decomposed op (forge's embedding gradient is a gather) is known by the op it came from.
    name = _op_name(producer.meta.get("original_aten") or producer)
    if getattr(producer.target, "namespace", None) in _COLLECTIVE_NAMESPACES:
        return Rejection(
            explain.REDUCED_ACROSS_RANKS,
            f"gradient reduced across ranks ({name}) before the update: data parallelism, or a parameter "
            "replicated over a tensor/sequence-parallel mesh; the update runs on the reduced gradient",
        )
    return Rejection(explain.NOT_A_MATMUL, _OP_HINTS.get(name, f"gradient computed by aten.{name}, not by a single matmul"))


def _check_single_consumer(chain: list[Node]) -> None:
    for i, node in enumerate(chain):
        expected = chain[i - 1] if i else None
        others = [u for u in node.users if u is not expected and not (i == 0 and u.target is _UPDATE)]
        if others:
            raise Rejection(explain.GRADIENT_READ_ELSEWHERE, _describe_readers(others))


def _describe_readers(readers: list[Node]) -> str:
    descriptions = []
    for r in readers:
        if r.op == "output":
            text = "returned from the compiled function or kept in .grad (call opt.zero_grad() inside it)"
        elif r.target in _NORMS:
            text = "read by a norm (clip_grad_norm_?)"
        elif r.op == "call_function" and _op_name(r) in _STATISTICS:
            text = f"read by a norm or statistic (aten.{_op_name(r)}: logging or clipping?)"
        elif r.target is aten.copy_.default:
            text = "copied into another tensor"
        elif hasattr(r.target, "__name__"):
            text = f"read by aten.{r.target.__name__.split('.')[0]}"
        else:
            text = f"read by {r.target}"
        if text not in descriptions:
            descriptions.append(text)
    return "gradient " + "; ".join(descriptions)


def _gradient_bytes(candidate: _Candidate) -> int:
    mm = candidate.chain[-1].meta["val"]
    return mm.numel() * mm.element_size()


# --- the chunked head loss (head_loss.py) ------------------------------------------------------

_HEAD_BACKWARD = torch.ops.forge.linear_cross_entropy_backward.default
_HEAD_BACKWARD_UPDATE = torch.ops.forge.linear_cross_entropy_backward_update_.default


@dataclass
class _ChunkedHead:
    update: Node
    backward: Node
    """``forge.linear_cross_entropy_backward``: (grad_hidden, grad_weight)."""
    copies: list[Node]
    chain: list[Node]
    """The weight gradient's nodes from the update back to (and including) its getitem."""
    grad_min: float | None
    grad_max: float | None
    quantized_states: bool
    rounding_seed: int | None


def _bytes(node: Node) -> int:
    value = node.meta["val"]
    return value.numel() * value.element_size()


def _match_chunked_head(update: Node) -> _ChunkedHead | None:
    """The update of a head weight whose gradient is the chunked head loss's, when the update
    can run chunk by chunk inside that backward. None when the gradient is not that op's; a
    Rejection when it is but cannot be fused (the update then reads the whole gradient)."""
    param, grad, states = update.args[:3]
    quantized_states, rounding_seed = _storage_arguments(update)
    chain, node, _, (low, high) = _walk_gradient(grad)
    if not isinstance(node, Node) or node.target is not operator.getitem or any(n.target in _TRANSPOSES for n in chain):
        return None
    backward = node.args[0]
    if not isinstance(backward, Node) or backward.target is not _HEAD_BACKWARD or node.args[1] != 1:
        return None
    if not isinstance(param, Node) or param.op != "placeholder" or backward.args[2] is not param:
        raise Rejection(explain.NOT_AN_INPUT, "the head loss's weight is not the updated graph input")
    weight = param.meta["val"]
    _check_dtypes(weight, states, quantized_states)
    for state in states:
        value = state.meta["val"]
        if value.dim() != 2 or value.shape[0] != weight.shape[0]:
            raise Rejection(explain.UNSUPPORTED_DTYPE, "an optimizer state is not laid out by the weight's rows")
    _check_clamp_bounds(low, high)
    copies = _copies_back(update, [param, *states])
    _check_single_consumer(chain)
    return _ChunkedHead(update, backward, copies, chain, low, high, quantized_states, rounding_seed)


def _rewrite_chunked_head(graph: fx.Graph, head: _ChunkedHead) -> None:
    """``forge.linear_cross_entropy_backward_update_`` in place of the backward, the update
    and the copies back; the step's scalars move up to it."""
    update, backward = head.update, head.backward
    param, _, states, step, hyperparameters, rule, options = update.args[:7]
    removed = {*head.chain, update, *head.copies, *update.users, backward}
    order = {n: i for i, n in enumerate(graph.nodes)}
    for base in [param, *states]:
        aliases = _aliases(base)
        for alias in aliases:
            for user in alias.users:
                if user not in removed and user not in aliases and order[user] > order[backward]:
                    raise Rejection(explain.ORDERING, "the head's weight or a state is read after the loss's backward")
    grad_loss, hidden, _, labels, lse, ignore_index, reduction = backward.args[:7]
    with graph.inserting_after(backward):
        fused = graph.call_function(_HEAD_BACKWARD_UPDATE, (grad_loss, hidden, param, labels, lse, ignore_index,
                                                            reduction, list(states), step, list(hyperparameters),
                                                            rule, list(options), head.grad_min, head.grad_max,
                                                            head.quantized_states, head.rounding_seed))  # fmt: skip
    fused.meta["val"] = backward.meta["val"][0]
    fused.meta["stack_trace"] = update.meta.get("stack_trace")
    for needed in [step, *hyperparameters]:
        order = {n: i for i, n in enumerate(graph.nodes)}
        if order[needed] > order[fused] and not _hoist_ordered(needed, fused, order):
            graph.erase_node(fused)
            raise Rejection(explain.ORDERING, "the optimizer's step scalars are computed after the head loss's backward")
    for item in list(backward.users):
        if item.args[1] == 0:
            item.replace_all_uses_with(fused)
            graph.erase_node(item)
    _erase_update(graph, update, head.copies, head.chain)
    graph.erase_node(backward)

# --- rewriting --------------------------------------------------------------------------------


def _aliases(base: Node) -> list[Node]:
    """``base`` and every node whose output is a view of it."""
    found, todo = [base], [base]
    while todo:
        node = todo.pop()
        for user in node.users:
            if user not in found and _is_view(user, node):
                found.append(user)
                todo.append(user)
    return found


def _is_view(node: Node, of: Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return _is_view(node.args[0], of) if isinstance(node.args[0], Node) and node.args[0] is not of else False
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    if alias is None or alias.is_write:
        return False
    return bool(node.args) and node.args[0] is of


def _views_its_input(node: Node) -> bool:
    """Whether ``node``'s output is a view of its first argument (``split`` too: its list)."""
    return node.op == "call_function" and bool(node.args) and isinstance(node.args[0], Node) \
        and _is_view(node, node.args[0])  # fmt: skip


def _rewrite(graph: fx.Graph, c: _Candidate) -> None:
    order = {n: i for i, n in enumerate(graph.nodes)}
    removed = set(c.chain) | {c.update, *c.copies} | set(c.update.users)
    first_write = min(order[copy] for copy in c.copies)
    read_before, read_after = [], []
    for base in [c.weight, *c.states]:
        aliases = _aliases(base)
        for alias in aliases:
            for user in alias.users:
                if user in removed or user in aliases:
                    continue
                (read_before if order[user] < first_write else read_after).append(user)
    operands = [c.left, c.right]
    # The matmul's operands are often views made just before it, at the graph's end:
    # place the fused op after what they view and move the views (and the step's
    # scalars) up to it.
    producers = [_view_base(n) for n in operands]
    anchor = max(read_before + producers, key=order.__getitem__)
    if anchor.op == "placeholder":
        anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
    args = (c.weight, c.left, c.right, c.states, c.step, c.hyperparameters, c.rule, c.options)
    kwargs = {}
    if c.grad_min is not None or c.grad_max is not None:
        kwargs.update(grad_min=c.grad_min, grad_max=c.grad_max)
    if c.quantized_states:
        kwargs["quantized_states"] = True
    if c.rounding_seed is not None:
        kwargs["rounding_seed"] = c.rounding_seed
    with graph.inserting_after(anchor):
        fused = graph.call_function(_FUSED, args, kwargs)
    fused.meta["val"] = None
    fused.meta["stack_trace"] = c.update.meta.get("stack_trace")
    for needed in [*operands, c.step, *c.hyperparameters]:
        order = {n: i for i, n in enumerate(graph.nodes)}
        if order[needed] > order[fused] and not _hoist_ordered(needed, fused, order):
            needed.append(fused)  # cannot move it up: the fused op waits for it
    order = {n: i for i, n in enumerate(graph.nodes)}
    if read_after and order[fused] > min(order[r] for r in read_after):
        graph.erase_node(fused)
        raise Rejection(explain.ORDERING, "the new weight is read before the old one's last reader")
    if c.transposed:
        with graph.inserting_before(fused):
            fused.update_arg(1, _transpose(graph, c.right))
            fused.update_arg(2, _transpose(graph, c.left))
    _erase_update(graph, c.update, c.copies, c.chain)


def _erase_update(graph: fx.Graph, update: Node, copies: list[Node], chain: list[Node]) -> None:
    """Remove a replaced update: its copies back, its outputs, itself and the gradient's
    nodes nothing reads any more."""
    for copy in copies:
        graph.erase_node(copy)
    for out in list(update.users):
        graph.erase_node(out)
    graph.erase_node(update)
    for node in chain:
        if not node.users:
            graph.erase_node(node)


def keep_fused_updates_after_reads(graph: fx.Graph) -> int:
    """Move each fused op after every later reader of the weight and states it overwrites.

    :func:`_rewrite` places a fused op after the old weight's last reader, but Inductor's
    own post-grad patterns run after this pass and may rebuild a reader further down: its
    ``mm + add -> addmm`` puts the matmul where the add was, so a layer's ``dX = dY @ W``
    plus the residual's gradient came after the update of ``W`` and read the new weight
    (a two-block residual MLP: block 0's gradient off by 3% at lr 1). Run as Inductor's
    ``post_grad_custom_post_pass``; reads stop at a later write of the same tensor. Returns
    how many fused ops moved."""
    moved = 0
    order = {n: float(i) for i, n in enumerate(graph.nodes)}
    for fused in [n for n in graph.nodes if n.target is _FUSED]:
        later = set()
        for base in [fused.args[0], *fused.args[3]]:
            aliases = _aliases(base)
            for alias in aliases:
                later.update(user for user in alias.users
                             if user is not fused and user not in aliases and user.op != "output"
                             and order[user] > order[fused])  # fmt: skip
        last = None
        for user in sorted(later, key=order.__getitem__):
            if user.is_impure():  # a write of the same tensor: the reads after it are of the fused op's result
                break
            last = user
        if last is not None:
            last.append(fused)
            order[fused] = order[last] + 0.5  # between it and its successor, as _hoist_ordered keeps order
            moved += 1
    return moved


def _view_base(node: Node) -> Node:
    while _views_its_input(node):
        node = node.args[0]
    return node


def _transpose(graph: fx.Graph, node: Node) -> Node:
    t = graph.call_function(aten.permute.default, (node, [1, 0]))
    t.meta["val"] = node.meta["val"].permute(1, 0)
    return t


def _hoist_ordered(node: Node, before: Node, order: dict[Node, float]) -> bool:
    if order[node] < order[before]:
        return True
    if node.op != "call_function" or node.is_impure():
        return False
    if not _views_its_input(node) and _elements(node) > _MAX_HOISTED_ELEMENTS:
        return False
    # What ``node`` reads, directly or through views, must not be written between its new
    # place and its old one.
    for arg in node.all_input_nodes:
        base = _view_base(arg)
        if base.op == "placeholder" and _written_between(base, order[before], order[node], order):
            return False
    if not all(_hoist_ordered(arg, before, order) for arg in node.all_input_nodes):
        return False
    before.prepend(node)
    order[node] = order[before] - 0.5
    return True


def _written_between(placeholder: Node, start: float, end: float, order: Mapping[Node, float]) -> bool:
    """Whether an op at a position in [start, end) writes the input (an optimizer's update
    of a weight, a buffer's in-place update) through any of its views."""
    for alias in _aliases(placeholder):
        for user in alias.users:
            if start <= order[user] < end and user.is_impure():
                return True
    return False


def _elements(node: Node) -> int:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    total = 0
    for v in vals:
        if not isinstance(v, torch.Tensor):
            return _MAX_HOISTED_ELEMENTS + 1
        total += v.numel()
    return total


# --- the unfused path: the rule's decomposition for Inductor ----------------------------------


def decompose_update(graph: fx.Graph, update: Node, traced: dict) -> None:
    """Replace one ``forge.optimizer_update`` by the rule's aten ops, for Inductor to fuse.

    ``traced``: decompositions already traced for this graph, by what a trace depends on
    (rule, options, storage, the operands' shapes, strides, dtypes and devices). make_fx
    took ~0.36 s an update on a 2-core CPU, once for each norm weight, bias and embedding;
    updates alike in all that share one trace, copied into the graph once for each.
    A stochastically rounded update reads its seed from a constant of the graph
    (:func:`ops.rounding_seed_tensor`), so its trace and its Inductor kernels are the same
    for every same-shaped parameter.
    """
    from torch._guards import detect_fake_mode

    param, grad, states, step, hyperparameters, rule_name, options = update.args[:7]
    quantized_states, rounding_seed = _storage_arguments(update)
    flat = [param, grad, *states, step, *hyperparameters]
    fake_args = [a.meta["val"] for a in flat]
    fake_mode = detect_fake_mode(fake_args)
    # apply_rule rounds bf16 parameters only: another dtype's seed draws nothing.
    seeded = rounding_seed is not None and fake_args[0].dtype == torch.bfloat16
    if seeded:
        seed = _rounding_seed_constant(graph, update, rounding_seed, fake_args[0].device, fake_mode)
        flat.append(seed)
        fake_args.append(seed.meta["val"])
    signature = _trace_signature(rule_name, options, quantized_states, fake_args)
    decomposition = traced.get(signature) if signature is not None else None
    if decomposition is None:
        decomposition = _trace_update(rules.get(rule_name), len(states), tuple(options), quantized_states, seeded,
                                      fake_args, fake_mode)  # fmt: skip
        if signature is not None:
            traced[signature] = decomposition
    outputs = _inline(graph, update, decomposition, flat)
    for user in list(update.users):
        user.replace_all_uses_with(outputs[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(update)


def _trace_update(rule: rules.Rule, n_states: int, options: tuple[int, ...], quantized_states: bool, seeded: bool,
                  fake_args: list, fake_mode) -> fx.GraphModule:  # fmt: skip
    """make_fx of the rule on ``fake_args`` (param, grad, states, step, hyperparameters,
    then the seed tensor if ``seeded``), decomposed as Inductor decomposes."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    def update_fn(*tensors):
        p, g = tensors[0], tensors[1]
        old_states = list(tensors[2 : 2 + n_states])
        hyperparameters = list(tensors[3 + n_states : len(tensors) - 1 if seeded else len(tensors)])
        new_p, new_states = ops.apply_rule(
            rule, p, g, old_states, tensors[2 + n_states], hyperparameters, options,
            quantized_states, tensors[-1] if seeded else None,
        )  # fmt: skip
        return [new_p.to(p.dtype)] + [n.to(s.dtype) for n, s in zip(new_states, old_states)]

    with fake_mode:
        return make_fx(update_fn, decomposition_table=select_decomp_table())(*fake_args)


def _trace_signature(rule_name: str, options, quantized_states: bool, fake_args: list) -> tuple | None:
    """What a decomposition's trace depends on; None where a size is symbolic (such a trace
    is not shared: symbols of one parameter's sizes could end up in another's graph)."""
    layouts = []
    for t in fake_args:
        sizes, strides = tuple(t.shape), tuple(t.stride())
        if not all(isinstance(d, int) for d in sizes + strides):
            return None
        layouts.append((sizes, strides, t.dtype, t.device))
    return rule_name, tuple(options), quantized_states, tuple(layouts)


def _rounding_seed_constant(graph: fx.Graph, before: Node, seed: int | Node, device: torch.device, fake_mode) -> Node:
    """A ``get_attr`` node of ``seed`` as :func:`ops.rounding_seed_tensor`, a buffer of the
    graph's module: one per seed and device, inserted before its first reader ``before``.
    Under ``dynamic=True`` Dynamo passes the seed as a symbolic int, a graph input: then the
    tensor is filled from it in the graph, with the value each call is given."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if isinstance(seed, Node):
        with fake_mode:
            val = ops.rounding_seed_tensor(seed.meta["val"], device)
        with graph.inserting_before(before):
            node = graph.call_function(aten.full.default, (list(val.shape), seed), {"dtype": val.dtype, "device": device})
        node.meta["val"] = val
        return node
    module = graph.owning_module
    if module is None:
        raise RuntimeError("forge: decompose_update needs a graph owned by a GraphModule (the seed is its buffer)")
    name = f"_forge_rounding_seed_{seed}_{device.type}{'' if device.index is None else device.index}"
    for node in graph.find_nodes(op="get_attr", target=name):
        return node
    if not hasattr(module, name):
        with unset_fake_temporarily():
            module.register_buffer(name, ops.rounding_seed_tensor(seed, device))
    with graph.inserting_before(before):
        node = graph.get_attr(name)
    node.meta["val"] = fake_mode.from_tensor(getattr(module, name), static_shapes=True)
    return node


def _inline(graph: fx.Graph, before: Node, gm: fx.GraphModule, args: list[Node]) -> list[Node]:
    env: dict[Node, Node] = {}
    placeholders = iter(args)
    outputs = None
    with graph.inserting_before(before):
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(placeholders)
            elif node.op == "output":
                outputs = [env[n] for n in node.args[0]]
            else:
                env[node] = graph.node_copy(node, lambda n: env[n])
    return outputs
