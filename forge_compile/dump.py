"""What forge shows of each graph it compiles: logs, tlparse artifacts, and dump files.

For every graph, forge's pass hands :func:`graph_compiled` the post-grad graph's code
before and after its rewrite and its decisions. They go to

* ``TORCH_LOGS="+forge"`` / ``"forge_graphs"``: the two graphs, as FX prints them;
* torch's structured trace (``TORCH_TRACE=dir``, read by ``tlparse``): artifacts
  ``forge_post_grad_before``, ``forge_post_grad_after`` and ``forge_decisions``, beside
  Dynamo's and Inductor's for the same compile;
* ``forge_compile.config.dump_dir`` (``FORGE_DUMP_DIR``): files named by forge's graph
  number, so that a multi-graph run reads in compile order::

      graph000.before.py        post-grad graph before the rewrite (FX code, node names kept)
      graph000.after.py         the same after it
      graph000.decisions.json   each candidate: parameter, shape, fused or why not, bytes saved
      graph000.output_code.py   Inductor's generated code for the graph
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch

from . import explain
from .config import config

log = logging.getLogger(__name__)


@functools.cache
def _graphs_log() -> logging.Logger:
    import forge_compile_torch_logs as names

    names.register()
    return torch._logging.getArtifactLogger(__name__, names.GRAPHS_ARTIFACT)


def wanted() -> bool:
    """Dumps, graph logs or a structured trace (TORCH_TRACE) are on: graphs must really be
    compiled, since a cache hit skips the pass."""
    from torch._logging._internal import trace_log

    return directory() is not None or _graphs_log().isEnabledFor(logging.DEBUG) or bool(trace_log.handlers)


def graph_code(graph: torch.fx.Graph) -> str:
    """The graph as FX prints it, node names kept."""
    return graph.python_code(root_module="self").src


def directory() -> Path | None:
    return Path(config.dump_dir) if config.dump_dir else None


def _path(graph_number: int, suffix: str) -> Path:
    folder = directory()
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"graph{graph_number:03d}.{suffix}"


def decisions_json(record: explain.GraphRecord) -> str:
    return json.dumps(
        {
            "graph": record.graph,
            "break_reason": record.break_reason,
            "fallback": record.fallback,
            "decisions": [d.to_json() for d in record.decisions],
            "gradient_bytes_eliminated": sum(d.gradient_bytes for d in record.decisions if d.fused),
        },
        indent=2,
    )


def graph_compiled(record: explain.GraphRecord, before: str, after: str) -> None:
    """Log, trace and dump one graph's rewrite (called by forge's pass)."""
    graphs = _graphs_log()
    graphs.debug("forge: graph %d, post-grad graph before forge's rewrite:\n%s", record.graph, before)
    graphs.debug("forge: graph %d, post-grad graph after forge's rewrite:\n%s", record.graph, after)
    for name, payload in (("forge_post_grad_before", before), ("forge_post_grad_after", after)):
        torch._logging.trace_structured(
            "artifact", metadata_fn=lambda name=name: {"name": name, "encoding": "string"},
            payload_fn=lambda payload=payload: payload,
        )  # fmt: skip
    torch._logging.trace_structured(
        "artifact", metadata_fn=lambda: {"name": "forge_decisions", "encoding": "json"},
        payload_fn=lambda: decisions_json(record),
    )  # fmt: skip
    if directory() is not None:
        _path(record.graph, "before.py").write_text(before)
        _path(record.graph, "after.py").write_text(after)
        _path(record.graph, "decisions.json").write_text(decisions_json(record))


def output_code(record: explain.GraphRecord, code: str) -> None:
    if directory() is not None:
        _path(record.graph, "output_code.py").write_text(code)
