"""Recompute cheap activations in the backward instead of keeping them from the forward.

Under ``backend="inductor"`` a training graph is split by AOTAutograd's min-cut partitioner,
which keeps only what is costly to recompute (matmul and attention outputs, reductions) for
the backward and recomputes the pointwise rest there. forge compiles forward, backward and
optimizer as one graph, which is never partitioned: every value the backward reads stays
alive from the forward, so RMSNorm outputs, activation products and their float32 casts all
count at the step's peak (a Llama-3.1-8B layer at 1 x 1024 tokens keeps about 200 MiB).

This pass does the partitioner's job on the one graph. The backward starts at the first node
Dynamo traced inside ``torch.autograd.grad`` (``meta["autograd_backward"]``). Each forward
value the backward reads that a pointwise op, cast or view produced is rebuilt right before
its first backward use, from values alive there anyway (or rebuilt the same way), so that
the forward's copy dies at its last forward use; Inductor fuses the rebuilt ops into their
consumers. The graph's memory is simulated (each tensor from its producer to its last
reader, views with their base) for the log and the tests.

What is never recomputed: random ops, ops that write, anything reading a graph input that is
written in place between the forward use and the recompute (a weight updated by the
optimizer), and values the graph returns.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import fx
from torch.fx import Node

try:  # reads a symbol's hint without adding a guard
    from torch.fx.experimental.symbolic_shapes import optimization_hint  # torch 2.13
except ImportError:
    from torch.fx.experimental.symbolic_shapes import hint_int as optimization_hint  # torch 2.11

from .fuse_linear_update import _aliases, _is_view

log = logging.getLogger(__name__)
aten = torch.ops.aten
prims = torch.ops.prims

_CASTS = {prims.convert_element_type.default, aten._to_copy.default, aten.clone.default}
# A rebuilt value may itself be rebuilt from rebuilt inputs, this many ops deep: SiLU in
# bfloat16 is six (cast, neg, exp, add, div, cast) under the product that feeds down_proj.
_MAX_DEPTH = 16


def recompute_activations(graph: fx.Graph) -> int:
    """Rebuild the pointwise forward values the backward reads right before their backward
    uses (see the module docstring). Returns how many tensors the forward no longer keeps
    for the backward."""
    plan = _Liveness(graph)
    if plan.cut is None:
        return 0
    chosen = _rebuildable_set(plan.saved_for_backward(), plan)
    if not chosen:
        return 0
    _rebuild_backward_uses(graph, chosen, plan)
    graph.eliminate_dead_code()
    log.debug("forge: recomputed %d forward values in the backward; simulated peak %.1f -> %.1f MiB",
              len(chosen), plan.peak_bytes / 2**20, simulated_peak_bytes(graph) / 2**20)  # fmt: skip
    return len(chosen)


def simulated_peak_bytes(graph: fx.Graph) -> int:
    """Bytes of the graph's own tensors (inputs not counted) alive at its peak, each tensor
    from its producer to its last reader: what the pass lowers, for tests and logs."""
    return _Liveness(graph).peak_bytes


class _Liveness:
    """Each storage's last reader, the simulated peak, and where the backward starts."""

    def __init__(self, graph: fx.Graph):
        self.order = {node: i for i, node in enumerate(graph.nodes)}
        self.root = {}
        self.last: dict[Node, int] = {}
        self.returned: set[Node] = set()
        self.cut = None
        self.kept: set[Node] = set()  # forward values kept for the backward in place of larger ones
        for node in graph.nodes:
            root = _storage_root(node, self.root)
            self.root[node] = root
            if self.cut is None and node.meta.get("autograd_backward", False):
                self.cut = self.order[node]
            for user in node.users:
                if user.op == "output":
                    self.returned.add(root)
                self.last[root] = max(self.last.get(root, -1), self.order[user])
        change = [0] * (len(self.order) + 1)
        for root, last in self.last.items():
            if root.op != "call_function":
                continue  # graph inputs are held by the caller for the whole call
            size = _bytes(root)
            change[self.order[root]] += size
            change[last + 1] -= size
        self.peak_bytes = _maximum(change)

    def saved_for_backward(self) -> list[Node]:
        """Pointwise forward storages read after the backward starts."""
        return [root for root, last in self.last.items()
                if root.op == "call_function" and self.order[root] < self.cut < last
                and root not in self.returned and _recomputable(root)]  # fmt: skip

    def first_backward_use(self, root: Node) -> int:
        return min(self.order[user] for alias in _aliases(root) for user in alias.users
                   if self.order[user] > self.cut)  # fmt: skip


def _maximum(change: list[int]) -> int:
    live = best = 0
    for delta in change:
        live += delta
        best = max(best, live)
    return best


def _storage_root(node: Node, roots: dict[Node, Node]) -> Node:
    if node.op == "call_function" and node.target is not operator.getitem and node.args:
        base = node.args[0]
        if isinstance(base, Node) and _is_view(node, base):
            return roots.get(base, base)
    return node


def _bytes(node: Node) -> int:
    """A tensor's size; with symbolic sizes, the size of the example the graph was traced
    with (reading a symbol's hint adds no guard, so no recompile)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0  # tuples are counted at their getitems; symbols and None take no memory
    return optimization_hint(val.numel(), fallback=0) * val.element_size()


def _recomputable(node: Node) -> bool:
    """A pure op whose output is a function of its inputs alone, cheap to compute again:
    pointwise, a cast or a view. Matmuls, reductions and attention stay saved, as the
    partitioner keeps them."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if node.is_impure() or torch.Tag.nondeterministic_seeded in node.target.tags:
        return False
    if not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    if node.target in _CASTS or torch.Tag.pointwise in node.target.tags:
        return True
    return bool(node.args) and isinstance(node.args[0], Node) and _is_view(node, node.args[0])


def _rebuildable_set(saved: list[Node], plan: _Liveness) -> set[Node]:
    """The saved storages that can all be rebuilt in the backward at once: a value one of
    them needs is either alive there anyway, a graph input not written in between, itself
    rebuilt, or kept for the backward in its place when it is at most half the size (a
    bfloat16 residual kept instead of its float32 cast). A storage that cannot be rebuilt
    stays alive, which may let others read it, so each round drops only the storages that
    block a rebuild themselves. Fills ``plan.kept`` with the values kept in place."""
    chosen = set(saved)
    while True:
        plan.kept = set()
        while True:  # a value kept for one storage lets another read it: settle ``kept`` first
            kept = len(plan.kept)
            blockers = {_blocker(root, plan.first_backward_use(root), chosen, plan, 0, root) for root in chosen} - {None}
            if len(plan.kept) == kept:
                break
        if not blockers:
            return chosen
        chosen -= blockers


def _blocker(node: Node, at: int, chosen: set[Node], plan: _Liveness, depth: int, owner: Node,
             seen: dict | None = None) -> Node | None:  # fmt: skip
    """None if ``node`` can be had at position ``at`` for rebuilding ``owner``; else the
    saved storage that must stay alive for that."""
    seen = {} if seen is None else seen  # pointwise graphs are diamonds: visit each node once
    key = (node, at, owner)
    if key not in seen:
        seen[key] = _find_blocker(node, at, chosen, plan, depth, owner, seen)
    return seen[key]


def _find_blocker(node: Node, at: int, chosen: set[Node], plan: _Liveness, depth: int, owner: Node,
                  seen: dict) -> Node | None:  # fmt: skip
    root = plan.root[node]
    if root.op in ("placeholder", "get_attr"):
        return owner if _written_between(root, plan.order[node], at, plan) else None
    if root not in chosen and (root in plan.kept or plan.last.get(root, -1) >= at):
        return None  # alive there anyway: reading it costs nothing
    if root in chosen and depth:
        # Another saved storage: if it cannot be rebuilt at its own first backward use it is
        # the one to keep; if only not this early, keeping ``owner`` is the fix.
        own = _blocker(root, plan.first_backward_use(root), chosen, plan, 0, root, seen)
        if own is not None:
            return own
    blocker = owner
    if depth < _MAX_DEPTH and _recomputable(node):
        blocker = next(filter(None, (_blocker(arg, at, chosen, plan, depth + 1, owner, seen)
                                     for arg in node.all_input_nodes)), None)  # fmt: skip
    if blocker is not None and root not in chosen and 2 * _bytes(root) <= _bytes(owner):
        plan.kept.add(root)
        return None
    return blocker


def _written_between(placeholder: Node, start: int, end: int, plan: _Liveness) -> bool:
    """Whether an op between the two positions writes the input (an optimizer's update of a
    weight, a buffer's in-place update) through any of its views."""
    for alias in _aliases(placeholder):
        for user in alias.users:
            if start <= plan.order[user] < end and user.is_impure():
                return True
    return False


def _rebuild_backward_uses(graph: fx.Graph, chosen: set[Node], plan: _Liveness) -> None:
    late = []
    for root in chosen:
        for alias in _aliases(root):
            for user in alias.users:
                if plan.order[user] > plan.cut and plan.root.get(user) is not root:
                    late.append((plan.order[user], user, alias))
    rebuilt: dict[Node, Node] = {}
    position = dict(plan.order)
    # In graph order, so that each value is rebuilt before its first backward use and reused
    # by the later ones.
    for _, user, alias in sorted(late, key=lambda item: item[0]):
        user.replace_input_with(alias, _rebuild(graph, alias, user, chosen, plan, rebuilt, position))


def _rebuild(graph: fx.Graph, node: Node, before: Node, chosen: set[Node], plan: _Liveness,
             rebuilt: dict[Node, Node], position: dict[Node, float]) -> Node:  # fmt: skip
    copy = rebuilt.get(node)
    if copy is not None and position[copy] < position[before]:
        return copy
    root = plan.root.get(node, node)
    if root.op in ("placeholder", "get_attr"):
        return node
    if root not in chosen and (root in plan.kept or plan.last.get(root, -1) >= position[before]):
        return node
    args, kwargs = fx.map_arg((node.args, node.kwargs),
                              lambda arg: _rebuild(graph, arg, before, chosen, plan, rebuilt, position))  # fmt: skip
    with graph.inserting_before(before):
        copy = graph.call_function(node.target, args, kwargs)
    copy.meta.update(node.meta)
    rebuilt[node] = copy
    position[copy] = position[before] - 0.5
    plan.root[copy] = copy
    return copy
