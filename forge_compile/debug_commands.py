"""``python -m forge_compile explain | diff | memory``: forge's debugging commands.

* ``explain SCRIPT.py [args]`` runs a script with forge's dumps on and prints the report
  of every forge graph that ran, at exit (``--json`` for JSON, ``--dump-dir`` to keep files);
* ``diff DUMP_DIR`` shows each dumped graph before and after forge's rewrite side by side,
  with the decisions, and writes ``DUMP_DIR/diff.html`` with the fused ops highlighted;
* ``memory SCRIPT.py [args]`` (CUDA) runs the script twice, fused and with
  ``FORGE_FUSE=0`` (what backend="inductor" compiles), records allocations with
  ``torch.cuda.memory._record_memory_history`` from the second run of a forge graph on
  (the first compiles and tunes) and plots allocated bytes against allocation order for
  both as a PNG, with each run's warm-up peak in the legend.
"""

from __future__ import annotations

import argparse
import difflib
import html
import json
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path


def _run_script(script: str, args: list[str]) -> None:
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


def explain_script(argv: list[str]) -> int:
    """Run SCRIPT with forge's dumps on and print what forge fused, at exit."""
    parser = argparse.ArgumentParser(prog="python -m forge_compile explain", description=explain_script.__doc__)
    parser.add_argument("--dump-dir", help="keep the dump files here (default: a temporary folder)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)

    from .config import config
    from .explain import GraphRecord, Report, _active_sessions, _sessions_lock, dumps

    dump_dir = options.dump_dir or tempfile.mkdtemp(prefix="forge_dump_")
    config.dump_dir = dump_dir
    session: list[GraphRecord] = []
    with _sessions_lock:
        _active_sessions.append(session)
    try:
        _run_script(options.script, options.args)
    finally:
        with _sessions_lock:
            _active_sessions.remove(session)
        report = Report(graphs=sorted(session, key=lambda r: r.graph))
        if not session:
            report.notes.append("no forge graph ran: does the script call torch.compile(..., backend='forge')?")
        print(dumps(report) if options.json else f"\n{report}\n(dumps of each graph: {dump_dir})")
    return 0


def _graph_numbers(dump_dir: Path) -> list[str]:
    return sorted(p.name.split(".")[0] for p in dump_dir.glob("graph*.decisions.json"))


def side_by_side(before: str, after: str, width: int = 80) -> str:
    """Two FX listings side by side, changed lines marked ``|``, removed ``<``, added ``>``."""
    left, right = before.splitlines(), after.splitlines()
    rows = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=left, b=right, autojunk=False).get_opcodes():
        a, b = left[i1:i2], right[j1:j2]
        mark = {"equal": " ", "replace": "|", "delete": "<", "insert": ">"}[tag]
        for k in range(max(len(a), len(b))):
            x = a[k] if k < len(a) else ""
            y = b[k] if k < len(b) else ""
            rows.append(f"{x[:width]:<{width}} {mark if (x or y) else ' '} {y[:width]}")
    return "\n".join(rows)


def diff(argv: list[str]) -> int:
    """Show each dumped graph before and after forge's rewrite, side by side."""
    parser = argparse.ArgumentParser(prog="python -m forge_compile diff", description=diff.__doc__)
    parser.add_argument("dump_dir")
    parser.add_argument("--width", type=int, default=80, help="characters per side")
    options = parser.parse_args(argv)
    dump_dir = Path(options.dump_dir)
    graphs = _graph_numbers(dump_dir)
    if not graphs:
        print(f"forge: no graph*.decisions.json in {dump_dir}: run with FORGE_DUMP_DIR={dump_dir}", file=sys.stderr)
        return 2
    pages = []
    for graph in graphs:
        decisions = json.loads((dump_dir / f"{graph}.decisions.json").read_text())
        before = (dump_dir / f"{graph}.before.py").read_text()
        after = (dump_dir / f"{graph}.after.py").read_text()
        print(f"=== {graph}: before forge's rewrite (left), after (right)")
        for d in decisions["decisions"]:
            if len(d["shape"]) == 2:
                print(f"  {d['name']} {'x'.join(map(str, d['shape']))}: {'fused' if d['fused'] else d['reason']}")
        print(side_by_side(before, after, options.width))
        table = difflib.HtmlDiff(wrapcolumn=options.width).make_table(
            before.splitlines(), after.splitlines(), "before", "after", context=True, numlines=2
        )
        # the fused ops are the point of the page
        table = table.replace("fused_linear_update_", '<span class="fused">fused_linear_update_</span>')
        pages.append(f"<h2>{html.escape(graph)}</h2>{table}")
    page = dump_dir / "diff.html"
    page.write_text(
        "<html><head><meta charset='utf-8'><style>.fused{background:#ffd54f;font-weight:bold}"
        "table.diff{font-family:monospace;font-size:12px}.diff_add{background:#c8f7c5}"
        ".diff_chg{background:#fff3b0}.diff_sub{background:#f7c5c5}</style></head><body>"
        + "".join(pages)
        + "</body></html>"
    )
    print(f"\n(side-by-side HTML: {page})")
    return 0


def allocated_timeline(events: list[dict], start_bytes: int) -> list[int]:
    """Allocated bytes after each alloc/free of a CUDA memory history, from ``start_bytes``."""
    allocated, timeline = start_bytes, []
    for event in events:
        if event["action"] == "alloc":
            allocated += event["size"]
        elif event["action"] == "free_completed":
            allocated -= event["size"]
        else:
            continue
        timeline.append(allocated)
    return timeline


class _StepWindow:
    """Starts the allocation history when a forge graph starts its second run: the first run
    compiled, autotuned and warmed up, which is not what a training step costs."""

    def __init__(self):
        self.runs: dict[int, int] = {}
        self.start_bytes: int | None = None
        self.warm_up_peak_bytes = 0
        self.graph: int | None = None

    def __call__(self, record) -> None:
        import torch

        self.runs[record.graph] = self.runs.get(record.graph, 0) + 1
        if self.start_bytes is None and self.runs[record.graph] == 2:
            torch.cuda.synchronize()
            self.graph = record.graph
            self.warm_up_peak_bytes = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            self.start_bytes = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)


def _memory_child(argv: list[str]) -> int:
    """Run a script and write its allocated-bytes timeline from the second run of a forge graph on."""
    out, script, *args = argv
    import torch

    from .explain import run_listeners

    window = _StepWindow()
    run_listeners.append(window)
    try:
        _run_script(script, args)
    finally:
        run_listeners.remove(window)
    if window.start_bytes is None:
        print("forge: no forge graph ran twice; `memory` shows the steps after the first: run 2 or more steps",
              file=sys.stderr)  # fmt: skip
        return 2
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = [e for trace in snapshot["device_traces"] for e in trace]
    Path(out).write_text(json.dumps({
        "allocated_bytes": allocated_timeline(events, window.start_bytes),
        "peak_bytes": torch.cuda.max_memory_allocated(),
        "warm_up_peak_bytes": window.warm_up_peak_bytes,
        "window": f"from the second run of forge graph {window.graph} to the end of the script",
    }))  # fmt: skip
    return 0


def memory(argv: list[str]) -> int:
    """Plot CUDA allocated bytes over a script's run, fused vs FORGE_FUSE=0 (PNG)."""
    parser = argparse.ArgumentParser(prog="python -m forge_compile memory", description=memory.__doc__)
    parser.add_argument("--output", default="forge_memory.png", help="the PNG to write")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("forge: `memory` records CUDA allocations and needs a GPU; on the CPU use `explain` for the "
              "gradient bytes forge never materializes", file=sys.stderr)  # fmt: skip
        return 2
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, fuse in (("forge", "1"), ("inductor (FORGE_FUSE=0)", "0")):
            out = Path(tmp) / f"{fuse}.json"
            env = dict(os.environ, FORGE_FUSE=fuse)
            child = subprocess.run([sys.executable, "-m", "forge_compile", "_memory_child", str(out), options.script,
                                    *options.args], env=env)  # fmt: skip
            if child.returncode:
                return child.returncode
            runs[label] = json.loads(out.read_text())
    series_file = Path(options.output).with_suffix(".json")
    series_file.write_text(json.dumps({"script": options.script, "args": options.args, "runs": runs}))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for label, run in runs.items():
        series = [b / 2**30 for b in run["allocated_bytes"]]
        ax.plot(range(len(series)), series, lw=1, label=f"{label}: peak {run['peak_bytes'] / 2**30:.2f} GiB "
                f"(first step, compiling and tuning: {run['warm_up_peak_bytes'] / 2**30:.2f} GiB)")  # fmt: skip
    ax.set_xlabel("allocation event from the start of the second step (kernel order)")
    ax.set_ylabel("allocated GiB")
    ax.set_title(f"CUDA memory over {Path(options.script).name}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(options.output, dpi=120)
    print(json.dumps({label: {k: run[k] for k in ("peak_bytes", "warm_up_peak_bytes", "window")}
                      for label, run in runs.items()}))  # fmt: skip
    print(f"wrote {options.output}")
    return 0
