"""The decision record: what forge did with every parameter update, and ``explain()``.

forge's pass records one :class:`Decision` per parameter update it sees: fused into the
weight-gradient matmul, or rejected with a reason a user can act on. Each compiled graph
keeps its decisions in a :class:`GraphRecord`, with Dynamo's reason for ending the graph
there. ``explain(fn, *args)`` runs ``fn`` compiled with forge and gathers the records of
the graphs that ran into a :class:`Report`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

# Reason codes: stable, machine-readable names of why an update was not fused.
FUSED = "fused"
NOT_A_MATRIX = "not_a_matrix"
NOT_A_MATMUL = "not_a_matmul"
SUMMED_GRADIENT = "summed_gradient"
ACCUMULATED = "accumulated"
GRADIENT_READ_ELSEWHERE = "gradient_read_elsewhere"
GRADIENT_FROM_OUTSIDE = "gradient_from_outside"
REDUCED_ACROSS_RANKS = "reduced_across_ranks"
UPDATED_VALUE_READ = "updated_value_read"
NOT_AN_INPUT = "not_an_input"
UNSUPPORTED_DTYPE = "unsupported_dtype"
ORDERING = "ordering"
DISABLED = "disabled"
PASS_FAILED = "pass_failed"


@dataclass
class Decision:
    """forge's decision about one parameter's update in one compiled graph."""

    name: str
    """The parameter as the model names it (``layers.0.mlp.up_proj.weight``)."""
    shape: tuple[int, ...]
    dtype: str
    rule: str
    """The optimizer rule (``adam``)."""
    fused: bool
    code: str
    """``fused`` or a reason code (``summed_gradient``, ``gradient_read_elsewhere``, ...)."""
    reason: str = ""
    """Why it was not fused, in plain words; empty when fused."""
    gradient_bytes: int = 0
    """Bytes of the weight gradient: never materialized when fused."""
    graph: int = 0
    chain: list[str] = field(default_factory=list)
    """Post-grad graph nodes of the candidate: the update, then its gradient back to the matmul
    (as far as forge followed it), by the names the dumped graphs show."""

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Decision":
        return cls(**{**d, "shape": tuple(d["shape"])})


@dataclass
class GraphRecord:
    """One graph that forge compiled."""

    graph: int
    """forge's number for the graph, in compile order within the process."""
    nodes: int
    break_reason: str | None = None
    """Dynamo's reason for ending the graph here, when it was a graph break."""
    has_backward: bool = False
    """The graph computes gradients (the backward was captured in it)."""
    decisions: list[Decision] = field(default_factory=list)
    pass_ran: bool = False
    from_cache: bool = False
    """Inductor served the compiled graph from its cache; decisions came from forge's record of it."""
    fallback: str | None = None
    """forge's pass failed and the graph was compiled without it; the error."""
    input_ids: dict[str, int] = field(default_factory=dict, repr=False)
    """id() of the tensor behind each input name, for naming parameters (not serialized)."""

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("input_ids")
        d["decisions"] = [x.to_json() for x in self.decisions]
        return d


_STOCK_STEP_HINT = (
    "step() not captured: {cls} is not traceable; use forge_compile.optim.{name} or forge_compile.attach(opt)"
)


@dataclass
class Report:
    """What ``explain`` found: fused and rejected weights, graph breaks, notes."""

    graphs: list[GraphRecord]
    notes: list[str] = field(default_factory=list)

    @property
    def decisions(self) -> list[Decision]:
        return [d for g in self.graphs for d in g.decisions]

    @property
    def fused(self) -> list[Decision]:
        return [d for d in self.decisions if d.fused]

    @property
    def rejected(self) -> list[Decision]:
        return [d for d in self.decisions if not d.fused]

    @property
    def graph_breaks(self) -> list[str]:
        return [g.break_reason for g in self.graphs if g.break_reason]

    @property
    def gradient_bytes_eliminated(self) -> int:
        return sum(d.gradient_bytes for d in self.fused)

    def to_json(self) -> dict[str, Any]:
        return {
            "graphs": [g.to_json() for g in self.graphs],
            "fused": [d.to_json() for d in self.fused],
            "rejected": [d.to_json() for d in self.rejected],
            "graph_breaks": self.graph_breaks,
            "notes": self.notes,
            "gradient_bytes_eliminated": self.gradient_bytes_eliminated,
        }

    def __str__(self) -> str:
        lines = [
            f"forge: {len(self.fused)} weight updates fused, {len(self.rejected)} not fused, "
            f"{len(self.graphs)} graph(s), {len(self.graph_breaks)} graph break(s); "
            f"gradient memory never materialized: {_bytes(self.gradient_bytes_eliminated)}"
        ]
        rows = [("parameter", "shape", "rule", "result")]
        vectors = [d for d in self.decisions if d.code == NOT_A_MATRIX]
        for d in self.decisions:
            if d.code != NOT_A_MATRIX:
                rows.append((d.name, "x".join(map(str, d.shape)) or "scalar", d.rule, "fused" if d.fused else d.reason))
        if len(rows) > 1:
            widths = [max(len(r[i]) for r in rows) for i in range(3)]
            for i, r in enumerate(rows):
                lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
                if i == 0:
                    lines.append("  " + "  ".join("-" * w for w in widths) + "  " + "-" * 6)
        if vectors:
            lines.append(f"  ({len(vectors)} biases, norms and other non-matrix parameters: updated by Inductor kernels)")
        for reason in self.graph_breaks:
            lines.append("graph break: " + reason.strip().splitlines()[0])
        for note in self.notes:
            lines.append("note: " + note)
        return "\n".join(lines)


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# --- sessions: explain() collects the records of the graphs that run while it is active ---------
_sessions_lock = threading.Lock()
_active_sessions: list[list[GraphRecord]] = []
run_listeners: list[Callable[[GraphRecord], None]] = []
"""Called with a graph's record each time it starts to run (``python -m forge_compile memory``)."""


def graph_ran(record: GraphRecord) -> None:
    """Called by forge's compiled graphs when they run; cheap when no explain() is active."""
    for listener in run_listeners:
        listener(record)
    if not _active_sessions:
        return
    with _sessions_lock:
        for session in _active_sessions:
            if not any(r is record for r in session):
                session.append(record)


def explain(fn: Callable, *args, **kwargs) -> Report:
    """Run ``fn(*args, **kwargs)`` compiled with forge and report what was fused.

    Like ``torch._dynamo.explain``, this runs the function once: a training step passed
    here takes a real step. ``fn`` may be a plain function or one already wrapped by
    ``torch.compile(..., backend="forge")``.

    Example::

        report = forge_compile.explain(train_step, x, y)
        print(report)                      # table of fused and rejected weights
        assert not report.rejected
    """
    import torch

    compiled = fn if hasattr(fn, "_torchdynamo_orig_callable") else torch.compile(fn, backend="forge")
    session: list[GraphRecord] = []
    with _sessions_lock:
        _active_sessions.append(session)
    try:
        compiled(*args, **kwargs)
    finally:
        with _sessions_lock:
            _active_sessions.remove(session)
    original = getattr(fn, "_torchdynamo_orig_callable", fn)
    _name_parameters_seen_through_the_optimizer(session, original, args, kwargs)
    return Report(graphs=sorted(session, key=lambda r: r.graph), notes=_notes(session, original, args, kwargs))


_OPTIMIZER_PATH = re.compile(r"^(\w+)\._forge_groups\.(\d+)\.params\.(\d+)$")


def _name_parameters_seen_through_the_optimizer(records: list[GraphRecord], fn: Callable, args, kwargs) -> None:
    """A graph that meets a parameter only through the optimizer (the step's graph after a
    graph break; DDP, FSDP) names it by that path, ``opt._forge_groups.0.params.3``: give
    it the model's name for it where a module reachable from ``fn`` holds that very tensor,
    and mark the weights DDP/FSDP reduce as such."""
    import torch

    pending = [(r, d) for r in records for d in r.decisions if _OPTIMIZER_PATH.match(d.name) and d.name in r.input_ids]
    if not pending:
        return
    names = {}
    for module in _reachable_from(fn, args, kwargs, torch.nn.Module):
        for name, p in module.named_parameters():
            names.setdefault(id(p), name)
    reducers = {id(p): label for cls, label, _ in _data_parallel_wrappers()
                for module in _reachable_from(fn, args, kwargs, cls) for p in module.parameters()}  # fmt: skip
    for record, decision in pending:
        identity = record.input_ids[decision.name]
        decision.name = names.get(identity, decision.name)
        if identity in reducers and decision.code == GRADIENT_FROM_OUTSIDE:
            decision.code = REDUCED_ACROSS_RANKS
            decision.reason = f"gradient reduced across ranks by {reducers[identity]} in backward hooks, before the update"


def _data_parallel_wrappers() -> list[tuple[type, str, str]]:
    """(class, name, what it does to each gradient) of the wrappers that reduce gradients in hooks."""
    import torch

    wrappers = [(torch.nn.parallel.DistributedDataParallel, "DistributedDataParallel", "all-reduces")]
    try:
        from torch.distributed.fsdp import FSDPModule

        wrappers.append((FSDPModule, "FSDP (fully_shard)", "reduce-scatters"))
    except ImportError:  # a torch without FSDP2
        pass
    return wrappers


def _notes(records: list[GraphRecord], fn: Callable, args, kwargs) -> list[str]:
    notes = []
    breaks = " ".join(r.break_reason or "" for r in records)
    has_updates = any(r.decisions for r in records)
    data_parallel = _data_parallel_note(fn, args, kwargs)
    if data_parallel:
        notes.append(data_parallel)
    if "consumed returned tensor's grad_fn" in breaks or "consumed grad_fns" in breaks:
        notes.append(
            "loss returned without .detach(): Dynamo ran the backward outside the graph, so every gradient "
            "was materialized; return loss.detach()"
        )
    elif has_updates and records and not any(r.has_backward for r in records) and breaks.strip():
        # A graph break in the forward leaves the loss to an earlier graph: loss.backward() then
        # runs eagerly (forge_compile._dynamo_fix), and the step's graph gets finished gradients.
        first = next(r.break_reason for r in records if r.break_reason).strip().splitlines()[0]
        notes.append(
            f"loss.backward() ran outside forge's graphs after a graph break in the forward ({first}), so every "
            "gradient was materialized; remove the graph break (TORCH_LOGS=graph_breaks shows where)"
        )
    if not has_updates:
        from .optim import ForgeOptimizer, forge_class_for

        for optimizer in _optimizers_reachable_from(fn, args, kwargs):
            if not isinstance(optimizer, ForgeOptimizer):
                cls = type(optimizer)
                try:
                    forge_class_for(cls)
                except TypeError as unsupported:  # not element-wise, or a class forge does not know
                    notes.append("step() not captured: " + str(unsupported).removeprefix("forge: "))
                    continue
                notes.append(_STOCK_STEP_HINT.format(cls=f"{cls.__module__}.{cls.__qualname__}", name=cls.__name__))
        if not records:
            notes.append("no graph was compiled by forge (the function did not run under torch.compile?)")
        elif not any(r.has_backward for r in records):
            notes.append("no graph contains the backward: call loss.backward() inside the compiled function")
    return notes


def _reachable_from(fn: Callable, args, kwargs, cls: type) -> list[Any]:
    """Instances of ``cls`` among fn's globals, closure and arguments."""
    candidates = list(args) + list(kwargs.values())
    code = getattr(fn, "__code__", None)
    if code is not None:
        scope = getattr(fn, "__globals__", {})
        candidates += [scope[n] for n in code.co_names if n in scope]
        candidates += [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if _has_contents(c)]
    seen, found = set(), []
    for c in candidates:
        if isinstance(c, cls) and id(c) not in seen:
            seen.add(id(c))
            found.append(c)
    return found


def _optimizers_reachable_from(fn: Callable, args, kwargs) -> list[Any]:
    import torch

    return _reachable_from(fn, args, kwargs, torch.optim.Optimizer)


def _data_parallel_note(fn: Callable, args, kwargs) -> str | None:
    """DDP and FSDP2 reduce each gradient across ranks in backward hooks, before the
    optimizer sees it: why their weights cannot fuse, with their names."""
    for cls, label, collective in _data_parallel_wrappers():
        wrappers = _reachable_from(fn, args, kwargs, cls)
        if not wrappers:
            continue
        names = [name for module in wrappers for name, p in module.named_parameters() if p.requires_grad and p.dim() >= 2]
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        return (
            f"{label} {collective} every gradient across ranks in its backward hooks, before the optimizer sees it "
            f"({REDUCED_ACROSS_RANKS}): the updates of its weights ({shown}) cannot fuse and run on the reduced "
            "gradients, as torch's would"
        )
    return None


def _has_contents(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def dumps(report: Report) -> str:
    return json.dumps(report.to_json(), indent=2)
