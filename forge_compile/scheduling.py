"""Two adjustments to Inductor's scheduler for the graph of a training step.

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

Where this is not enough: torch 2.11's Triton code (generated on a CPU host for an 8B-wide
model) fuses the cross-entropy backward into the forward's log-sum-exp kernel, and the
loss, which reads the logits at the labels, runs after that kernel; the backward also goes
through an fp32 [tokens, vocabulary] node before its bf16 cast. No kernel there can
overwrite the logits, and the gradient keeps a buffer of its own. Torch 2.13 (CPU and
Triton code) writes it in place.
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
