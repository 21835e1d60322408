"""Recompute cheap activations in the backward instead of keeping them from the forward.

Under ``backend="inductor"`` a training graph is split by AOTAutograd's min-cut partitioner,
which keeps only what is costly to recompute (matmul and attention outputs, reductions) for
the backward and recomputes the pointwise rest there. forge compiles forward, backward and
optimizer as one graph, which is never partitioned: every value the backward reads stays
alive from the forward, so RMSNorm outputs, activation products and their float32 casts all
count at the step's peak (a Llama-3.1-8B layer at 1 x 1024 tokens keeps about 200 MiB).

This pass does the partitioner's job on the one graph. The backward starts at the first node
Dynamo traced inside ``torch.autograd.grad`` (``meta["autograd_backward"]`` in torch 2.13;
in 2.11, the first node whose provenance is that call). Each forward value the backward
reads that a pointwise op, cast, view or size-made constant produced is rebuilt right
before its backward uses, so that the forward's copy dies at its last forward use. It is
rebuilt from values alive there anyway, from values rebuilt for that use alone, or from
inputs kept for the backward in its place, at most half its size in all (a bfloat16
residual instead of its float32 cast). Inductor fuses the rebuilt ops into their
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

from .fuse_linear_update import _aliases, _views_its_input, _written_between

log = logging.getLogger(__name__)
aten = torch.ops.aten
prims = torch.ops.prims

_CASTS = {prims.convert_element_type.default, aten._to_copy.default, aten.clone.default}
# Constants made from sizes alone (an attention mask's fill values, position indices).
_FACTORIES = {aten.full.default, aten.scalar_tensor.default, aten.zeros.default, aten.ones.default,
              aten.arange.default, aten.arange.start, aten.arange.start_step, prims.iota.default}
# A value is rebuilt from values at most this many ops up: SiLU in bfloat16 is six (cast, neg,
# exp, add, div, cast) under the product that feeds down_proj. The bound also bounds the
# recursion of the analysis, whatever the graph.
_MAX_DEPTH = 16
# The analysis drops the storages that cannot be rebuilt, round by round; a graph that has not
# settled after this many rounds keeps what could be rebuilt in the last one.
_MAX_ROUNDS = 8


def recompute_activations(graph: fx.Graph, backward_sources: frozenset[str] = frozenset()) -> int:
    """Rebuild the pointwise forward values the backward reads right before their backward
    uses (see the module docstring). ``backward_sources``: names of the Dynamo graph's
    ``torch.autograd.grad`` nodes, which find the backward where torch (2.11) does not mark
    its nodes. Returns how many tensors the forward no longer keeps for the backward."""
    plan = _Liveness(graph, backward_sources)
    if plan.cut is None:
        return 0
    forward = [node for node, position in plan.order.items() if position < plan.cut]
    chosen = _rebuildable_set(plan)
    if chosen:
        _rebuild_backward_uses(graph, chosen, plan)
        graph.eliminate_dead_code()
    _mark_backward(graph, forward)
    if not chosen:
        return 0
    if log.isEnabledFor(logging.DEBUG):  # the simulation after the rewrite is for this line alone
        log.debug("forge: recomputed %d forward values in the backward; simulated peak %.1f -> %.1f MiB",
                  len(chosen), plan.peak_bytes / 2**20, simulated_peak_bytes(graph) / 2**20)  # fmt: skip
    return len(chosen)


# Set on every node after the cut, the rebuilt values included: the scheduler keeps Inductor
# from fusing them with forward nodes (scheduling.keep_backward_work_in_the_backward).
IN_BACKWARD = "forge_in_backward"


def _mark_backward(graph: fx.Graph, forward: list[Node]) -> None:
    before_cut = set(forward)
    for node in graph.nodes:
        node.meta[IN_BACKWARD] = node not in before_cut


def simulated_peak_bytes(graph: fx.Graph) -> int:
    """Bytes of the graph's own tensors (inputs not counted) alive at its peak, each tensor
    from its producer to its last reader: what the pass lowers, for tests and logs."""
    return _Liveness(graph).peak_bytes


class _Liveness:
    """Each storage's last reader, the simulated peak, and where the backward starts."""

    def __init__(self, graph: fx.Graph, backward_sources: frozenset[str] = frozenset()):
        self.order = {node: i for i, node in enumerate(graph.nodes)}
        self.root: dict[Node, Node] = {}
        self.last: dict[Node, int] = {}
        self.returned: set[Node] = set()
        self.cut = None
        self.kept: set[Node] = set()  # forward values kept for the backward in place of larger ones
        for node in graph.nodes:
            root = _storage_root(node, self.root)
            self.root[node] = root
            if self.cut is None and _in_backward(node, backward_sources):
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
        self._backward_uses: dict[Node, list[tuple[int, Node, Node]]] = {}

    def backward_uses(self, root: Node) -> list[tuple[int, Node, Node]]:
        """``(position, user, alias)`` for each op after the cut that reads ``root`` through
        ``alias`` (itself or a view of it) and is not itself a view of it: where the rebuilt
        value is needed, in graph order."""
        if root not in self._backward_uses:
            self._backward_uses[root] = sorted(
                ((self.order[user], user, alias) for alias in _aliases(root) for user in alias.users
                 if self.order[user] > self.cut and self.root.get(user) is not root), key=lambda use: use[0])  # fmt: skip
        return self._backward_uses[root]

    def first_backward_use(self, root: Node) -> int:
        return self.backward_uses(root)[0][0]

    def saved_for_backward(self) -> list[Node]:
        """Pointwise forward storages that ops after the cut read, in graph order."""
        return [root for root, last in self.last.items()
                if root.op == "call_function" and self.order[root] < self.cut < last
                and root not in self.returned and _recomputable(root) and self.backward_uses(root)]  # fmt: skip

    def alive_at(self, root: Node, position: int) -> bool:
        return root in self.kept or self.order[root] < position <= self.last.get(root, -1)


def _in_backward(node: Node, backward_sources: frozenset[str]) -> bool:
    """torch 2.13 marks the nodes traced inside ``torch.autograd.grad``; in torch 2.11 they are
    known by their provenance, the Dynamo node of that call (``meta["from_node"]``)."""
    if node.meta.get("autograd_backward", False):
        return True
    sources = list(node.meta.get("from_node") or ()) if backward_sources else []
    while sources:
        source = sources.pop()
        if getattr(source, "name", None) in backward_sources:
            return True
        sources.extend(getattr(source, "from_node", None) or ())
    return False


def _maximum(change: list[int]) -> int:
    live = best = 0
    for delta in change:
        live += delta
        best = max(best, live)
    return best


def _storage_root(node: Node, roots: dict[Node, Node]) -> Node:
    """The node whose storage ``node``'s output lives in: a view's base, an element of a
    view-returning multi-output op (``split``, ``unbind``) its input's."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node):
        return node
    if node.target is operator.getitem:
        producer = node.args[0]
        return roots.get(producer, producer) if _views_its_input(producer) else node
    return roots.get(node.args[0], node.args[0]) if _views_its_input(node) else node


def _bytes(node: Node) -> int:
    """A tensor's size; with symbolic sizes, the size of the example the graph was traced
    with (reading a symbol's hint adds no guard, so no recompile)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0  # tuples are counted at their getitems; symbols and None take no memory
    return optimization_hint(val.numel(), fallback=0) * val.element_size()


def _recomputable(node: Node) -> bool:
    """A pure op whose output is a function of its inputs alone, cheap to compute again:
    pointwise, a cast, a view (an element of ``split`` too) or a constant made from sizes.
    Matmuls, reductions and attention stay saved, as the partitioner keeps them."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        producer = node.args[0]
        return isinstance(producer, Node) and _views_its_input(producer) and _recomputable(producer)
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    if node.is_impure() or torch.Tag.nondeterministic_seeded in node.target.tags:
        return False
    if _views_its_input(node):
        return True
    if not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    return node.target in _CASTS or node.target in _FACTORIES or torch.Tag.pointwise in node.target.tags


def _rebuildable_set(plan: _Liveness) -> set[Node]:
    """The saved storages to rebuild in the backward. Each is rebuilt right before each of its
    backward uses from values that are alive there anyway, graph inputs not written in
    between, values rebuilt there too, or values kept in its place: at most half its size
    in all (a bfloat16 residual kept instead of its float32 cast). A storage that cannot be
    rebuilt stays saved, which may let another read it; so each round drops only those that
    block a rebuild themselves, and fills ``plan.kept``."""
    chosen = set(plan.saved_for_backward())
    rebuildable: set[Node] = set()
    for _ in range(_MAX_ROUNDS):
        plan.kept = set()
        budget: dict[Node, int] = {}
        blockers, rebuildable = set(), set()
        for root in sorted(chosen, key=plan.order.__getitem__):
            blocker = _blocker(root, plan.first_backward_use(root), chosen, plan, 0, root, {}, budget)
            if blocker is None:
                rebuildable.add(root)
            else:
                blockers.add(blocker)
        if not blockers:
            return chosen
        chosen -= blockers
    # Not settled: each storage found rebuildable in the last round still is once the others
    # stay saved (a saved value is only more available), with the values kept for it.
    return rebuildable


def _blocker(node: Node, at: int, chosen: set[Node], plan: _Liveness, depth: int, owner: Node, seen: dict,
             budget: dict[Node, int]) -> Node | None:  # fmt: skip
    """None if ``node`` can be had at position ``at`` for rebuilding ``owner``; else the
    saved storage that must stay saved for that."""
    key = (node, at, owner)
    if key not in seen:
        seen[key] = _find_blocker(node, at, chosen, plan, depth, owner, seen, budget)
    return seen[key]


def _find_blocker(node: Node, at: int, chosen: set[Node], plan: _Liveness, depth: int, owner: Node, seen: dict,
                  budget: dict[Node, int]) -> Node | None:  # fmt: skip
    root = plan.root[node]
    if root.op in ("placeholder", "get_attr"):
        return owner if _written_between(root, plan.order[node], at, plan.order) else None
    if root not in chosen and plan.alive_at(root, at):
        return None  # alive there anyway: reading it costs nothing
    if depth >= _MAX_DEPTH:
        return owner
    if root in chosen and root is not owner:
        # Another saved storage, rebuilt here for ``owner``: if it cannot be rebuilt at its own
        # first backward use either, it is the one to keep saved.
        own = _blocker(root, plan.first_backward_use(root), chosen, plan, depth + 1, root, seen, budget)
        if own is not None:
            return own
    elif root is not owner and budget.get(owner, 0) + _bytes(root) <= _bytes(owner) // 2:
        # Keeping a small input is cheaper than rebuilding it, and ends the chain here.
        budget[owner] = budget.get(owner, 0) + _bytes(root)
        plan.kept.add(root)
        return None
    if not _recomputable(node):
        return owner
    for arg in node.all_input_nodes:
        blocker = _blocker(arg, at, chosen, plan, depth + 1, owner, seen, budget)
        if blocker is not None:
            return blocker
    return None


def _rebuild_backward_uses(graph: fx.Graph, chosen: set[Node], plan: _Liveness) -> None:
    uses = sorted((use for root in chosen for use in plan.backward_uses(root)), key=lambda use: use[0])
    own: dict[Node, Node] = {}
    # In graph order: a chosen storage is rebuilt once, before its first backward use, and
    # that copy serves its later uses; what another value needs rebuilt earlier than that,
    # and every value between, is rebuilt for that one use alone, so that none lives longer
    # than the value it serves.
    for position, user, alias in uses:
        rebuilt = _rebuild(graph, alias, user, position, chosen, plan, own, {})
        user.replace_input_with(alias, rebuilt)


def _rebuild(graph: fx.Graph, node: Node, before: Node, position: int, chosen: set[Node], plan: _Liveness,
             own: dict[Node, Node], here: dict[Node, Node]) -> Node:  # fmt: skip
    root = plan.root.get(node, node)
    if root.op in ("placeholder", "get_attr"):
        return node
    if root not in chosen and plan.alive_at(root, position):
        return node
    reuse = own.get(node) if root in chosen else None
    if reuse is None:
        reuse = here.get(node)
    if reuse is not None:
        return reuse
    if not _recomputable(node):  # the analysis admitted only recomputable ops here
        raise RuntimeError(f"forge: recompute_activations was to rebuild {node.format_node()}, which it cannot")
    args, kwargs = fx.map_arg((node.args, node.kwargs),
                              lambda arg: _rebuild(graph, arg, before, position, chosen, plan, own, here))  # fmt: skip
    with graph.inserting_before(before):
        copy = graph.call_function(node.target, args, kwargs)
    copy.meta.update(node.meta)
    if root in chosen and position >= plan.first_backward_use(root):
        own[node] = copy
    else:
        here[node] = copy
    return copy
