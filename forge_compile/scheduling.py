"""Adjustments to Inductor's scheduler and lowering for the graph of a training step.

**Keep the recompute pass's order** (:func:`settings_for_step_graphs`). Inductor's last
scheduling pass, ``reorder_for_peak_memory``, tries three topological orders and keeps the
one whose *estimated* peak is lowest. Its estimate counts every scheduler buffer, including
the intermediates of a fused kernel that are never stored: in a step graph the unfused
updates' intermediates dominate it (an 8B-wide Llama's embedding AdamW alone lists more than
14 fp32 [128256, 4096] buffers, 2 GiB each; 42 GiB in all for a 2-layer model whose step
really allocates 0.7 GiB). The order it picks is therefore unrelated to the real peak, and
it moves the values that ``passes/recompute_activations`` rebuilds for the backward back
into the forward, next to their inputs, where they are alive at the step's peak again: in
that step, the key and value repeated to all 32 heads for grouped-query attention's
backward (8 MiB each), the attention masks, the last layer's SiLU product and the
embedding gradient's zeroed fp32 rows (16 MiB, which only the backward writes). With the
pass's order kept, the 2-layer 8B-wide step's own buffers peak at 0.657 GiB instead of
0.733 GiB in torch 2.11's Triton code generated on a CPU host (torch 2.13: 0.436 instead
of 0.504), 38 MiB less per layer. forge turns the reordering off for graphs with a
backward or an update; ``options={"reorder_for_peak_memory": True}`` turns it back on.

**Let Inductor write a value over a buffer whose only later "user" is an ordering
constraint** (:func:`reuse_buffers_past_ordering_deps`).

A fused update (``forge::fused_linear_update_``) overwrites its weight. Inductor's scheduler
orders it after every earlier reader of the old weight by giving it a ``WeakDep`` on each
reader's *output* buffer: for the forward matmul that made the logits, a dependency on the
logits. That dependency is marked ``is_fake`` (ordering only, it reads nothing and does not
keep the buffer alive), but the scheduler still lists the update among the logits' users,
and its in-place rule (``decide_inplace_update``) counts every listed user that has not run.
So the cross-entropy backward, the logits' last real reader, writes their gradient to a new
[tokens, vocabulary] buffer instead of over the logits: 1024 x 128256 bf16 is 0.245 GiB
alive at the start of an 8B backward for nothing. The same holds for every output of a
matmul whose weight forge updates in the step.

:func:`reuse_buffers_past_ordering_deps` drops those users after the scheduler has computed
its dependencies, for the compilation it wraps: a user of buffer ``B`` goes when each of its
reads of ``B`` is a fake ``WeakDep``. The dependency itself stays on the node
(``unmet_dependencies``, from which the schedule and the memory planner's reordering take
their order), so the update still runs after the reader. What no longer sees it are the
checks of who reads ``B``: the in-place rule, and whether a fused kernel that writes ``B``
must store it. Overwriting ``B``, or not storing it, cannot change what such a user
computes: it never reads ``B``.

That is enough for torch 2.13. Torch 2.11's Triton code (the H100's and H200's) needs two
more (:func:`reuse_buffers_read_by_a_later_gather`), each alone changes nothing there:

* **No fusion that puts a gather's reader after the overwrite.** Inductor fuses the
  cross-entropy backward into the kernel of the forward's log-sum-exp reduction. The loss,
  which reads the logits at the labels (a gather), needs that reduction, so it runs after
  the fused kernel, which therefore cannot write over the logits. A fusion is refused when
  one of the pair could write an output over a buffer that a reader outside the pair reads
  only through a gather, and that reader depends on the other of the pair but not on the
  writer: apart, the reduction runs, then the loss, then the backward over the logits. The
  gather bound keeps the rule to that pattern: in the 2-layer 8B-wide step it refuses one
  fusion, and the step keeps its 55 kernel launches.
* **Store the cast, not its input.** Inductor stores a pointwise value whose expression
  has grown past ``realize_opcount_threshold`` operations (30 on a GPU) as a buffer of
  its own. The cross-entropy backward passes it in fp32, one node before its cast to
  bf16, so the bf16 gradient is computed from that fp32 node, not from the logits, and the
  in-place rule, which looks at a node's direct inputs, finds no buffer of its size to
  write over. A value whose only use is a dtype cast (through views) is not stored; the
  cast, the next node, is stored instead, in the dtype that leaves the kernel anyway.

Together, in torch 2.11's Triton code for the 2-layer 8B-wide step (generated on a CPU
host), the step's own buffers peak at 0.446 GiB instead of 0.657 GiB: the logits'
gradient is written over the logits. There the cast rule skips the gradient's two fp32
nodes, an fp32 [1, 1024, 4096] sum, and the fp32 results of the stochastic rounding of
the unfused updates (embedding, norms) before their bf16 casts. On an H100 the 8B step's
peak went from 48.27 to 48.05 GiB with both adjustments.

**Keep backward work in the backward** (:func:`keep_backward_work_in_the_backward`). The
recompute pass rebuilds, right before the attention backward, the key and value repeated
to every head. Both the rebuild and the forward's kernel that repeats them for the forward
attention read the same key and value, and Inductor may fuse the two: the backward's
copies are then computed in the forward and kept across the step's peak. The recompute
pass marks every node after its cut (``meta["forge_in_backward"]``, rebuilt values
included), and a fusion of a node whose origins all come before the cut with one that has
an origin after it is refused. In torch 2.11's Triton code for the 2-layer 8B-wide step,
Inductor had fused the last layer's rebuild this way once the logits' gradient went in
place: with the rule, the step's own buffers peak at 0.436 GiB instead of 0.446 GiB, with
56 kernels instead of 55. In the 8-layer step no such fusion happens, with or without the
rule (0.940 GiB, 182 kernels, the same kernels), so the 8B step is not expected to change.

**Write over the inputs a fused pointwise kernel reads last**
(:func:`write_over_inputs_a_pointwise_kernel_reads_last`). A SwiGLU MLP's backward is one
pointwise kernel of three fused nodes: from the gate and up matmuls' outputs and the down
projection's input gradient (three [tokens, 14336] buffers at 8B, none read afterwards) it
makes the product the down projection's update reads, the up gradient and the gate
gradient. Inductor's in-place rule lets a node write over an input only when no other
pending node reads it, and the kernel's other nodes count, so the three outputs got new
buffers: 84 MiB at the top of the 8B backward. Inside a pointwise Triton kernel every load
of a block comes before any store (the body is loads, compute, stores), so forge counts the
kernel's own other nodes as done for that check, keeps Inductor's requirement that every
node reads the buffer at the output's index, and hides an input another output already
goes over. In torch 2.11's Triton code for the 8-layer 8B-wide step the outputs go over
the inputs, and the step's own buffers peak at 0.707 GiB instead of 0.789 GiB
(``benchmarks/step_buffers.py``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import unittest.mock

log = logging.getLogger(__name__)


def _drop_ordering_only_users(scheduler) -> int:
    from torch._inductor.dependencies import WeakDep

    dropped = 0
    for name, buffer in scheduler.name_to_buf.items():
        users = getattr(buffer, "users", None)
        if not users:
            continue
        kept = []
        for user in users:
            node = user.node
            reads = getattr(getattr(node, "read_writes", None), "reads", None)
            ordering_only = (
                user.is_weak
                and reads is not None
                and any(dep.name == name for dep in reads)
                and all(isinstance(dep, WeakDep) and dep.is_fake for dep in reads if dep.name == name)
            )
            if ordering_only:
                dropped += 1
            else:
                kept.append(user)
        if len(kept) != len(users):
            buffer.users = kept
    return dropped


def settings_for_step_graphs() -> dict[str, object]:
    """Inductor config patches for a graph with a backward or an optimizer update: keep the
    graph's order (see the module docstring). Empty where Inductor has no such pass."""
    import torch._inductor.config as inductor_config

    return {"reorder_for_peak_memory": False} if hasattr(inductor_config, "reorder_for_peak_memory") else {}


@contextlib.contextmanager
def reuse_buffers_past_ordering_deps():
    """Within the block, Inductor's ``Scheduler.compute_dependencies`` drops the users that
    only order a node after a buffer's producer (see the module docstring). The patch is
    process-wide while it lasts, like forge's decompositions: Dynamo compiles one graph at a
    time. Where Inductor's internals differ (no ``is_fake`` on ``WeakDep``), nothing changes."""
    try:
        from torch._inductor.dependencies import WeakDep
        from torch._inductor.scheduler import Scheduler
    except ImportError:
        yield
        return
    original = getattr(Scheduler, "compute_dependencies", None)
    if original is None or "is_fake" not in getattr(WeakDep, "__dataclass_fields__", {}):
        yield
        return

    @functools.wraps(original)
    def compute_dependencies(self) -> None:
        original(self)
        dropped = _drop_ordering_only_users(self)
        if dropped:
            log.debug("forge: %d ordering-only buffer users left out of Inductor's in-place reuse", dropped)

    with unittest.mock.patch.object(Scheduler, "compute_dependencies", compute_dependencies):
        yield


def _fusion_keeps_a_buffer_from_reuse(scheduler, node1, node2) -> bool:
    """Whether one of ``node1``, ``node2`` could write an output over a buffer it reads at
    that output's index but, fused with the other, would run before a reader that reads
    the buffer only through a gather and depends on the other, not on the writer (see the
    module docstring)."""
    from torch._inductor.codegen.wrapper import can_match_buffer_size

    pair = node1.get_operation_names() | node2.get_operation_names()
    for writer, other in ((node1, node2), (node2, node1)):
        outputs = [buf for buf in writer.get_outputs() if _allocates(buf.node)]
        if not outputs:
            continue
        writer_ops, other_ops = writer.get_operation_names(), other.get_operation_names()
        for read in writer.read_writes.reads:
            source = scheduler.name_to_buf.get(read.name)
            if source is None or source.node is None or not source.users:
                continue
            if not any(user.can_inplace and _operations(user.node) & writer_ops for user in source.users):
                continue  # the writer does not read it at its own index
            try:
                if not any(can_match_buffer_size(source.node, out.node) for out in outputs):
                    continue
            except NotImplementedError:  # a layout without a size
                continue
            for user in source.users:
                node = user.node
                if not _operations(node) or _operations(node) & pair:
                    continue
                reads = [dep for dep in node.read_writes.reads if dep.name == read.name]
                if not reads or not all(getattr(dep, "is_indirect", lambda: False)() for dep in reads):
                    continue
                ancestors = getattr(node, "ancestors", None) or ()
                if ancestors & other_ops and not ancestors & writer_ops:
                    return True
    return False


def _operations(node) -> set:
    return node.get_operation_names() if hasattr(node, "get_operation_names") else set()


def _allocates(node) -> bool:
    from torch._inductor import ir

    try:
        return node is not None and bool(node.should_allocate()) and not isinstance(node.get_output_spec(), ir.NoneLayout)
    except NotImplementedError:
        return False


def _only_a_cast_follows(node) -> bool:
    """Whether the FX ``node``'s value has one use, a dtype cast, through views at most."""
    import torch

    aten, prims = torch.ops.aten, torch.ops.prims
    views = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.squeeze.dim,
             aten.unsqueeze.default}  # fmt: skip
    while node is not None and len(node.users) == 1:
        (user,) = node.users
        if user.target is prims.convert_element_type.default:
            return True
        if user.target not in views:
            return False
        node = user
    return False


def _side_of_the_cut(node) -> str | None:
    """``"backward"`` when one of the scheduler node's FX origins comes after the recompute
    pass's cut (a forward value it inlines does not make it a forward node), ``"forward"``
    when all of them come before it, None when the graph was not marked."""
    from .passes.recompute_activations import IN_BACKWARD

    marks = {origin.meta.get(IN_BACKWARD) for part in node.get_nodes()
             for origin in (getattr(getattr(part, "node", None), "origins", None) or ())}  # fmt: skip
    if True in marks:
        return "backward"
    return "forward" if marks == {False} else None


@contextlib.contextmanager
def _fusions_refused_where(veto, reason: str):
    """Within the block, Inductor's ``Scheduler.can_fuse`` also refuses each pair of nodes for
    which ``veto(scheduler, node1, node2)`` holds."""
    try:
        from torch._inductor.scheduler import Scheduler
    except ImportError:
        yield
        return
    original_can_fuse = getattr(Scheduler, "can_fuse", None)
    if original_can_fuse is None:
        yield
        return

    @functools.wraps(original_can_fuse)
    def can_fuse(self, node1, node2, *args, **kwargs) -> bool:
        if not original_can_fuse(self, node1, node2, *args, **kwargs):
            return False
        if veto(self, node1, node2):
            log.debug("forge: %s and %s not fused: %s", node1.get_name(), node2.get_name(), reason)
            return False
        return True

    with unittest.mock.patch.object(Scheduler, "can_fuse", can_fuse):
        yield


@contextlib.contextmanager
def keep_backward_work_in_the_backward():
    """Within the block, Inductor does not fuse a node of the forward with one of the
    backward (as the recompute pass marked them): such a kernel computes the backward's
    part in the forward, and its outputs stay alive across the step's peak (see the module
    docstring). Process-wide while it lasts, like :func:`reuse_buffers_past_ordering_deps`."""

    def across_the_cut(scheduler, node1, node2) -> bool:
        return {_side_of_the_cut(node1), _side_of_the_cut(node2)} == {"forward", "backward"}

    with _fusions_refused_where(across_the_cut, "one is forward, the other backward work"):
        yield


@contextlib.contextmanager
def reuse_buffers_read_by_a_later_gather():
    """Within the block, Inductor refuses the fusions that would keep a buffer read by a
    later gather from being overwritten, and stores a dtype cast rather than a large
    pointwise value whose only use is that cast (see the module docstring). Process-wide
    while it lasts, like :func:`reuse_buffers_past_ordering_deps`."""
    try:
        from torch._inductor import ir
        from torch._inductor.virtualized import V
    except ImportError:
        yield
        return
    original_exceeded = getattr(ir.StorageBox, "has_exceeded_max_reads", None)
    if original_exceeded is None:
        yield
        return

    @functools.wraps(original_exceeded)
    def has_exceeded_max_reads(self) -> bool:
        return original_exceeded(self) and not _only_a_cast_follows(getattr(V.graph, "current_node", None))

    with _fusions_refused_where(_fusion_keeps_a_buffer_from_reuse, "a later gather would keep a buffer from reuse"), \
            unittest.mock.patch.object(ir.StorageBox, "has_exceeded_max_reads", has_exceeded_max_reads):  # fmt: skip
        yield


def _pointwise_siblings(node) -> set:
    """Names of the other nodes of the pointwise kernel ``node`` is fused into: all plain
    scheduler nodes, no reduction, template or mutation. Empty otherwise."""
    from torch._inductor.scheduler import FusedSchedulerNode, SchedulerNode

    try:
        fused = node.scheduler.get_fused_node(node)
    except (KeyError, AttributeError):
        return set()
    # Exactly one kernel: not a foreach/combo node, whose parts run as separate kernels in
    # one launch, concurrently, so that one's stores may come before another's loads.
    if fused is node or type(fused) is not FusedSchedulerNode or fused.is_foreach():
        return set()
    if fused.is_reduction() or fused.is_template():
        return set()
    parts = fused.get_nodes()
    for part in parts:
        if not isinstance(part, SchedulerNode) or part.is_reduction() or part.node.get_mutation_names():
            return set()
    return {part.get_name() for part in parts if part is not node}


@contextlib.contextmanager
def write_over_inputs_a_pointwise_kernel_reads_last():
    """Within the block, a pointwise Triton kernel of several fused nodes may write an
    output over an input that only the kernel itself still reads (see the module
    docstring). Process-wide while it lasts, like :func:`reuse_buffers_past_ordering_deps`."""
    try:
        from torch._inductor.codegen.triton import TritonKernel
        from torch._inductor.scheduler import SchedulerNode
        from torch._inductor.virtualized import V
    except ImportError:
        yield
        return
    original = getattr(SchedulerNode, "decide_inplace_update", None)
    if original is None:
        yield
        return

    @functools.wraps(original)
    def decide_inplace_update(self) -> None:
        kernel = V.kernel
        decided = getattr(kernel, "inplace_update_buffers", None)
        siblings = _pointwise_siblings(self) if isinstance(kernel, TritonKernel) and decided is not None else set()
        if not siblings or getattr(kernel, "inside_reduction", False):
            return original(self)
        outputs = {buf.get_name() for buf in self.get_outputs()}
        if outputs & decided.keys():
            return None  # decided when the kernel's nodes were first visited; codegen asks again
        # The siblings' reads count as done: a pointwise kernel loads every input of its
        # block before it stores any output (Inductor's Triton body is loads, compute,
        # stores), and the original check still requires each buffer to be read at the
        # output's index by every node of the kernel. An input another node's output already
        # goes over is hidden, so that no two outputs share one.
        completed, removed = self.scheduler.completed_operations, V.graph.removed_buffers
        hidden = set(decided.values()) - set(removed)
        marked = siblings - set(completed)
        completed.update(marked)
        removed.update(hidden)
        try:
            original(self)
        finally:
            for name in marked:
                completed.discard(name)
            for name in hidden:
                removed.discard(name)
        return None

    with unittest.mock.patch.object(SchedulerNode, "decide_inplace_update", decide_inplace_update):
        yield

