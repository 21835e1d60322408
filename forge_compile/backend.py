"""forge's torch.compile backend: the Dynamo graph goes to Inductor with forge's pass.

``forge_backend(gm, example_inputs)`` calls ``torch._inductor.compile_fx.compile_fx`` with
:class:`FuseLinearUpdatePass` installed as Inductor's ``post_grad_custom_pre_pass``; the
pass rewrites the post-grad ATen graph that AOTAutograd builds from forward, backward
and the optimizer's ops. Everything else is Inductor's, but for one decomposition: an
embedding's gradient is traced as a gather of its summed rows, which Inductor fuses into
the update instead of storing a dense fp32 gradient (:mod:`forge_compile.decompositions`).

Around that call the backend keeps a :class:`forge_compile.explain.GraphRecord` per graph:

* parameter names come from Dynamo's sources for the graph's inputs;
* Inductor may serve a graph from its FX/AOT caches without running any pass, so the
  pass also stores its decisions on disk under a key of the Dynamo graph, which the
  backend reads back on such a hit (or, lacking them, compiles once without caches);
* if the pass itself fails, the graph is compiled again with every update left to
  Inductor, and a warning says so: slower, never wrong;
* the returned callable tells ``explain()`` sessions that the graph ran.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import logging
import os
import re
import unittest.mock
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import decompositions, dtensor, dump, explain, lowerings, ops, scheduling  # noqa: F401  (torch.ops.forge.* and their Inductor lowerings)
from .config import config
from .passes.chunk_head_loss import chunk_head_losses
from .passes.fuse_linear_update import decompose_update, fuse_linear_updates, keep_fused_updates_after_reads
from .passes.recompute_activations import recompute_activations

log = logging.getLogger(__name__)

_graph_numbers = itertools.count()
_UPDATE_TARGETS = (torch.ops.forge.optimizer_update.default, torch.ops.forge.optimizer_update)
_PACKAGE = Path(__file__).parent


@dataclass
class _Compilation:
    """What the pass needs to know about the graph being compiled."""

    record: explain.GraphRecord
    input_names: list[str]
    key: str
    fuse: bool
    failed: BaseException | None = None
    recompute: bool = False
    recompute_failed: BaseException | None = None


_compilations: list[_Compilation] = []


@functools.cache
def _source_hash() -> str:
    """Hash of the code that decides the rewrite and its lowering: a change invalidates Inductor's cache."""
    digest = hashlib.sha256()
    for path in sorted([*_PACKAGE.glob("passes/*.py"), *_PACKAGE.glob("rules/*.py"), _PACKAGE / "ops.py", _PACKAGE / "head_loss.py",
                        _PACKAGE / "lowerings.py", _PACKAGE / "decompositions.py", _PACKAGE / "backend.py",
                        _PACKAGE / "scheduling.py"]):  # fmt: skip
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _forge_decompositions():
    """Inductor's decompositions with an embedding's gradient traced by rows (decompositions.py),
    for this compilation only. The patch is process-wide while it lasts; Dynamo runs one
    compilation at a time (its compile lock), so a backend="inductor" graph never sees it."""
    import torch._inductor.compile_fx

    return unittest.mock.patch.object(torch._inductor.compile_fx, "select_decomp_table",
                                      decompositions.select_decomp_table)  # fmt: skip


class FuseLinearUpdatePass(CustomGraphPass):
    """Inductor post-grad pass: fuse linear weight updates, decompose the rest."""

    def __init__(self, fuse: bool = True):
        self.fuse = fuse

    def __call__(self, graph: torch.fx.Graph) -> None:
        compilation = _compilations[-1] if _compilations else None
        # Tensors only, on both sides: symbolic sizes come and go between Dynamo's graph and
        # this one (AOTAutograd adds a subclass's outer sizes as inputs of their own).
        placeholders = [n for n in graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
        names = compilation.input_names if compilation else []
        by_node = dict(zip(placeholders, names)) if len(names) == len(placeholders) else {}
        # The graph printed as code is for dumps, graph logs and traces only: skip it without them.
        dumping = dump.wanted()
        before = dump.graph_code(graph) if dumping else None
        try:
            decisions = fuse_linear_updates(graph, lambda node: by_node.get(node, node.name), fuse=self.fuse)
        except Exception as error:  # noqa: BLE001 - any failure falls back to plain Inductor
            if compilation is None:
                raise
            compilation.failed = error
            raise
        if compilation is None:
            return
        for d in decisions:
            d.graph = compilation.record.graph
        compilation.record.decisions.extend(decisions)
        compilation.record.pass_ran = True
        _store_decisions(compilation.key, compilation.record.decisions)
        if dumping:
            dump.graph_compiled(compilation.record, before, dump.graph_code(graph))

    def uuid(self) -> str:
        return f"forge-{_source_hash()}-fuse{int(self.fuse)}"


class _DecomposeOnlyPass(CustomGraphPass):
    """The fallback: every forge update becomes Inductor pointwise code, nothing is fused."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        traced: dict = {}
        for node in [n for n in graph.nodes if n.target is torch.ops.forge.optimizer_update.default]:
            decompose_update(graph, node, traced)

    def uuid(self) -> str:
        return f"forge-decompose-{_source_hash()}"


class ForgePostPass(CustomGraphPass):
    """Inductor post-grad pass, after Inductor's own patterns: each fused op runs after every
    read of the old weight and states (see keep_fused_updates_after_reads); then, in a step
    with a backward, the pointwise values the backward reads are recomputed there
    (recompute_activations). A post pass the user configured runs first."""

    def __init__(self, previous=None, recompute: bool = False, backward_sources: frozenset[str] = frozenset()):
        self.previous = previous
        self.recompute = recompute
        self.backward_sources = backward_sources

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.previous is not None:
            self.previous(graph)
        moved = keep_fused_updates_after_reads(graph)
        if moved:
            log.debug("forge: %d fused updates moved after a later reader of their weight", moved)
        if self.recompute:
            try:
                recomputed = recompute_activations(graph, self.backward_sources)
            except Exception as error:  # noqa: BLE001 - the graph is compiled again without this pass
                if _compilations:
                    _compilations[-1].recompute_failed = error
                raise
            if recomputed:
                log.debug("forge: %d forward values recomputed in the backward", recomputed)

    def uuid(self) -> str:
        previous = getattr(self.previous, "uuid", lambda: repr(self.previous))() if self.previous else ""
        return f"forge-post-{_source_hash()}-recompute{int(self.recompute)}-{previous}"


def forge_backend(gm: torch.fx.GraphModule, example_inputs, *, mode: str | None = None, options: dict | None = None,
                  **kwargs):  # fmt: skip
    """The ``torch.compile`` backend registered as ``"forge"``.

    ``mode`` and ``options`` mean what they mean for ``backend="inductor"`` (Inductor
    compiles the graph, forge's pass inside it): ``mode="max-autotune"``,
    ``options={"max_autotune": True}`` and so on.

    Example::

        step = torch.compile(train_step, backend="forge")
        step = torch.compile(train_step, backend="forge", mode="max-autotune-no-cudagraphs")
    """
    from torch._inductor.compile_fx import compile_fx

    if mode is not None or options is not None:
        # torch.compile hands a custom backend its mode and options as they were given;
        # Inductor's own wrapper turns them into config patches (with its errors for an
        # unknown mode or option), and forge passes those on to the same compile_fx.
        inductor_settings = torch._TorchCompileInductorWrapper(mode, options, dynamic=None).config
        kwargs["config_patches"] = {**inductor_settings, **kwargs.get("config_patches", {})}

    # The Dynamo nodes of torch.autograd.grad: where the backward comes from (see recompute_activations).
    backward_sources = frozenset(n.name for n in gm.graph.nodes if n.target is torch.autograd.grad)
    record = explain.GraphRecord(
        graph=next(_graph_numbers),
        nodes=len(gm.graph.nodes),
        break_reason=_break_reason(gm),
        has_backward=bool(backward_sources),
    )
    has_updates = any(n.target in _UPDATE_TARGETS for n in gm.graph.nodes)
    # Before AOTAutograd traces the backward from it: the head's loss in vocabulary chunks.
    if record.has_backward and config.chunk_head_loss and chunk_head_losses(gm.graph):
        gm.recompile()
    names, record.input_ids = _input_names(gm)
    compilation = _Compilation(record, names, _decision_key(gm, example_inputs), config.fuse,
                               recompute=record.has_backward and config.recompute_activations)

    def run(custom_pass, **patches):
        _compilations.append(compilation)
        try:
            post_pass = ForgePostPass(torch._inductor.config.post_grad_custom_post_pass, recompute=compilation.recompute,
                                      backward_sources=backward_sources)  # fmt: skip
            # Options the user gave (kwargs' config_patches) are applied inside compile_fx, over these.
            step_settings = scheduling.settings_for_step_graphs() if record.has_backward or has_updates else {}
            with torch._inductor.config.patch(post_grad_custom_pre_pass=custom_pass, post_grad_custom_post_pass=post_pass,
                                              **{**step_settings, **patches}), _dumping(record), _forge_decompositions(), \
                    scheduling.reuse_buffers_past_ordering_deps(), \
                    scheduling.reuse_buffers_read_by_a_later_gather(), \
                    scheduling.keep_backward_work_in_the_backward(), \
                    scheduling.write_over_inputs_a_pointwise_kernel_reads_last():  # fmt: skip
                return compile_fx(gm, example_inputs, **kwargs)
        finally:
            _compilations.pop()

    try:
        try:
            compiled = run(FuseLinearUpdatePass(fuse=config.fuse))
        except Exception as error:
            if compilation.recompute_failed is None:
                raise
            warnings.warn(
                f"forge: recomputing activations failed on graph {record.graph} ({type(error).__name__}: "
                f"{compilation.recompute_failed}); compiled it keeping them, as with "
                "forge_compile.config.recompute_activations = False. Please report this with the traceback above.",
                stacklevel=2,
            )
            log.warning("forge: recompute_activations failed on graph %d", record.graph, exc_info=error)
            compilation.recompute, record.decisions = False, []
            compiled = run(FuseLinearUpdatePass(fuse=config.fuse), fx_graph_cache=False)
    except Exception as error:
        if compilation.failed is None:
            raise
        record.fallback = f"{type(compilation.failed).__name__}: {compilation.failed}"
        warnings.warn(
            f"forge: the fusion pass failed on graph {record.graph} ({record.fallback}); compiled it without "
            "fusion, every update runs as Inductor kernels. Please report this with the traceback above.",
            stacklevel=2,
        )
        log.warning("forge: pass failed on graph %d", record.graph, exc_info=error)
        record.decisions = []
        compiled = run(_DecomposeOnlyPass(), fx_graph_cache=False)
    if has_updates and not record.pass_ran and record.fallback is None:
        cached = _load_decisions(compilation.key)
        if cached is not None:
            for d in cached:
                d.graph = record.graph
            record.decisions = cached
            record.from_cache = True
        else:
            with torch._functorch.config.patch(enable_autograd_cache=False):
                compiled = run(FuseLinearUpdatePass(fuse=config.fuse), fx_graph_cache=False)
    for d in record.decisions:
        log.info("forge: graph %d: %s %s", record.graph, d.name, "fused" if d.fused else f"not fused: {d.reason}")
    return _RecordingCallable(compiled, record)


@contextlib.contextmanager
def _dumping(record: explain.GraphRecord):
    """With a dump folder or graph logs: compile for real (caches would skip the pass and
    the code generation) and keep Inductor's output code for the graph."""
    if not dump.wanted():
        yield
        return
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    previous = GraphLowering.save_output_code

    def save_output_code(code: str) -> None:
        codes.append(code)
        if previous is not None:
            previous(code)

    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(
        enable_autograd_cache=False
    ), unittest.mock.patch.object(GraphLowering, "save_output_code", save_output_code):
        yield
    if codes:
        dump.output_code(record, "\n\n".join(codes))


class _RecordingCallable:
    """The compiled graph, telling explain() sessions when it runs."""

    def __init__(self, compiled, record: explain.GraphRecord):
        self.compiled = compiled
        self.record = record
        if getattr(compiled, "_boxed_call", False):
            self._boxed_call = True

    def __call__(self, *args):
        explain.graph_ran(self.record)
        return self.compiled(*args)

    def __getattr__(self, name):
        return getattr(self.compiled, name)


def _break_reason(gm: torch.fx.GraphModule) -> str | None:
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    return str(reason.reason)


_SOURCE_TOKEN = re.compile(r"\['([^']*)'\]|\[(\d+)\]|\.([A-Za-z_]\w*)")
# ``__dict__``: Dynamo reaches attributes that nn.Module.__getattr__ would not find (peft's
# ``base_model``) through the instance dict; the user's name has no such step.
_SKIPPED_TOKENS = {"_modules", "_parameters", "_buffers", "__dict__"}


def _input_names(gm: torch.fx.GraphModule) -> tuple[list[str], dict[str, int]]:
    """The names of the graph's tensor inputs as the post-grad graph will see them, and
    the id() of the tensor behind each (explain names parameters by identity)."""
    names, ids = [], {}
    for node in gm.graph.nodes:
        if node.op != "placeholder" or not isinstance(node.meta.get("example_value"), torch.Tensor):
            continue
        grapharg = node.meta.get("grapharg")
        source = getattr(grapharg, "source", None)
        text = getattr(source, "name", None)
        text = text() if callable(text) else text
        name = _readable(text) if text else node.name
        try:
            example = grapharg.example
        except Exception:  # noqa: BLE001 - no example kept (a graph Dynamo built otherwise)
            example = None
        if example is not None:
            ids[name] = id(example)
        # A DTensor reaches the post-grad graph as its inner tensors: one name each.
        names += dtensor.leaf_names(name, node.meta.get("example_value"))
    return names, ids


def _readable(source_name: str) -> str:
    """``L['model']._modules['0']._parameters['weight']`` -> ``model.0.weight``."""
    tokens = [a or b or c for a, b, c in _SOURCE_TOKEN.findall(source_name)]
    kept = [t for t in tokens if t not in _SKIPPED_TOKENS]
    return ".".join(kept) if kept else source_name


def _decision_key(gm: torch.fx.GraphModule, example_inputs) -> str:
    digest = hashlib.sha256()
    digest.update(f"{torch.__version__}|{_source_hash()}|fuse={config.fuse}|".encode())
    digest.update(gm.code.encode())
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            digest.update(f"{tuple(x.shape)}{x.stride()}{x.dtype}{x.device.type}{x.requires_grad};".encode())
        else:
            digest.update(f"{type(x).__name__};".encode())
    return digest.hexdigest()


def _decisions_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "forge_decisions"


def _store_decisions(key: str, decisions: list[explain.Decision]) -> None:
    if not config.decision_cache:
        return
    try:
        directory = _decisions_dir()
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f"{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps([d.to_json() for d in decisions]))
        tmp.replace(directory / f"{key}.json")
    except OSError as error:  # a read-only cache only costs a recompile on the next cache hit
        log.info("forge: could not store decisions: %s", error)


def _load_decisions(key: str) -> list[explain.Decision] | None:
    if not config.decision_cache:
        return None
    path = _decisions_dir() / f"{key}.json"
    try:
        return [explain.Decision.from_json(d) for d in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError):
        return None
