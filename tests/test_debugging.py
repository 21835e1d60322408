"""forge's debugging tools: dump files, TORCH_LOGS, tlparse artifacts, the explain/diff commands.

(Each rejection reason is checked where its case is built: tests/e2e and tests/passes.)
"""

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import expecttest
import pytest
import torch
from helpers import MLP, mse_step
from torch import nn

import forge_compile
from forge_compile.config import config
from forge_compile.debug_commands import allocated_timeline, side_by_side
from forge_compile.explain import run_listeners

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    import forge_compile
    from helpers import MLP, mse_step
    torch.manual_seed(0)
    model = MLP()
    opt = forge_compile.optim.AdamW(model.parameters(), lr=1e-3)
    step = torch.compile(mse_step(model, opt), backend="forge")
    for _ in range(2):
        step(torch.randn(4, 5, 12), torch.randn(4, 5, 6))
    """
).format(tests=str(ROOT / "tests"))


class _TiedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(12, 12, bias=False), nn.Linear(12, 6)

    def forward(self, x):
        return self.out(self.inp(self.inp(x)))  # inp used twice: its gradient is a sum


def _run(args, tmp_path, env=None):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run([sys.executable, *args(script)], capture_output=True, text=True, env=full_env,
                          cwd=tmp_path, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_dump_files_parse_and_match_explain(tmp_path):
    config.dump_dir = str(tmp_path)
    try:
        model = _TiedMLP()
        step = torch.compile(mse_step(model, forge_compile.optim.AdamW(model.parameters(), lr=1e-3)), backend="forge")
        report = forge_compile.explain(step, torch.randn(4, 5, 12), torch.randn(4, 5, 6))
    finally:
        config.dump_dir = None
    [graph] = report.graphs
    stem = tmp_path / f"graph{graph.graph:03d}"
    before, after = Path(f"{stem}.before.py").read_text(), Path(f"{stem}.after.py").read_text()
    ast.parse(before), ast.parse(after)
    assert "forge.optimizer_update" in before and "fused_linear_update_" not in before
    assert after.count("forge.fused_linear_update_") == 1 and "forge.optimizer_update" not in after
    assert "fused_linear_update_" in Path(f"{stem}.output_code.py").read_text()
    dumped = json.loads(Path(f"{stem}.decisions.json").read_text())
    assert dumped["decisions"] == [d.to_json() for d in report.decisions]
    assert dumped["gradient_bytes_eliminated"] == report.gradient_bytes_eliminated == 6 * 12 * 4
    tied = next(d for d in dumped["decisions"] if d["name"] == "model.inp.weight")
    assert tied["code"] == "summed_gradient" and tied["chain"][0].startswith("optimizer_update")
    fused = next(d for d in dumped["decisions"] if d["fused"])
    assert fused["chain"][-1].startswith("mm") and fused["shape"] == [6, 12]


def test_torch_logs_forge_prints_decisions_and_plus_forge_adds_graphs(tmp_path):
    info = _run(lambda s: [str(s)], tmp_path, {"TORCH_LOGS": "forge"}).stderr
    decision_lines = [line for line in info.splitlines() if "forge: graph" in line and "net." in line]
    assert len(decision_lines) == 6, info[-2000:]  # one per parameter: 3 fused weights, 3 biases
    assert "post-grad graph before" not in info
    debug = _run(lambda s: [str(s)], tmp_path, {"TORCH_LOGS": "+forge"}).stderr
    assert "post-grad graph before forge's rewrite" in debug and "fused_linear_update_" in debug


def test_structured_trace_has_forges_artifacts_for_tlparse(tmp_path):
    trace = tmp_path / "trace"
    _run(lambda s: [str(s)], tmp_path, {"TORCH_TRACE": str(trace)})
    text = "".join(p.read_text() for p in trace.glob("*.log"))
    for name in ("forge_post_grad_before", "forge_post_grad_after", "forge_decisions"):
        assert f'"{name}"' in text, name
    assert "inductor_output_code" in text  # next to Inductor's own artifacts


def test_explain_and_diff_commands(tmp_path):
    dump_dir = tmp_path / "dump"
    out = _run(lambda s: ["-m", "forge_compile", "explain", "--dump-dir", str(dump_dir), str(s)], tmp_path).stdout
    assert "forge: 3 weight updates fused" in out and "model.net.0.weight" in out
    as_json = _run(lambda s: ["-m", "forge_compile", "explain", "--json", str(s)], tmp_path).stdout
    assert len(json.loads(as_json)["fused"]) == 3
    shown = _run(lambda s: ["-m", "forge_compile", "diff", str(dump_dir)], tmp_path).stdout
    assert "model.net.4.weight 6x20: fused" in shown and "fused_linear_update_" in shown
    assert '<span class="fused">fused_linear_update_</span>' in (dump_dir / "diff.html").read_text()


class TestTextForms(expecttest.TestCase):
    def test_explain_table(self):
        torch.manual_seed(0)
        model = _TiedMLP()
        step = torch.compile(mse_step(model, forge_compile.optim.AdamW(model.parameters(), lr=1e-3)), backend="forge")
        report = forge_compile.explain(step, torch.randn(4, 5, 12), torch.randn(4, 5, 6))
        self.assertExpectedInline(str(report), """\
forge: 1 weight updates fused, 2 not fused, 1 graph(s), 0 graph break(s); gradient memory never materialized: 288 B
  parameter         shape  rule  result
  ----------------  -----  ----  ------
  model.inp.weight  12x12  adam  weight used by 2 ops (aten.mm, aten.mm): its gradient is a sum, as for tied or shared weights or several backward() calls
  model.out.weight  6x12   adam  fused
  (1 biases, norms and other non-matrix parameters: updated by Inductor kernels)""")  # noqa: E501

    def test_side_by_side(self):
        before = "a = mm(x, y)\nb = update(w, a)\ncopy_(w, b)\nreturn ()"
        after = "fused_linear_update_(w, x, y)\nreturn ()"
        self.assertExpectedInline(side_by_side(before, after, width=30), """\
a = mm(x, y)                   | fused_linear_update_(w, x, y)
b = update(w, a)               | \n\
copy_(w, b)                    | \n\
return ()                        return ()""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_memory_command_without_cuda_says_what_to_do(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "forge_compile", "memory", str(script)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)  # fmt: skip
    assert proc.returncode == 2 and "needs a GPU" in proc.stderr and "explain" in proc.stderr


def test_run_listeners_see_every_run_of_a_graph():
    """`memory` starts recording at a graph's second run, found through these listeners."""
    runs = []
    model = MLP()
    step = torch.compile(mse_step(model, forge_compile.optim.AdamW(model.parameters(), lr=1e-3)), backend="forge")
    run_listeners.append(runs.append)
    try:
        for _ in range(3):
            step(torch.randn(4, 5, 12), torch.randn(4, 5, 6))
    finally:
        run_listeners.remove(runs.append)
    assert len(runs) == 3 and len({r.graph for r in runs}) == 1


def test_allocated_timeline_follows_allocs_and_completed_frees():
    events = [{"action": "alloc", "size": 100}, {"action": "free_requested", "size": 100},
              {"action": "alloc", "size": 50}, {"action": "free_completed", "size": 100},
              {"action": "segment_alloc", "size": 4096}]  # fmt: skip
    assert allocated_timeline(events, start_bytes=1000) == [1100, 1150, 1050]


def test_mlp_helpers_still_train(tmp_path):
    """The script the command tests run trains (guards the tests above against a no-op script)."""
    model = MLP()
    before = [p.detach().clone() for p in model.parameters()]
    step = torch.compile(mse_step(model, forge_compile.optim.AdamW(model.parameters(), lr=1e-3)), backend="forge")
    step(torch.randn(4, 5, 12), torch.randn(4, 5, 6))
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_weights_seen_only_through_the_optimizer_get_the_models_names():
    """A graph break between backward and step leaves the step's graph meeting the weights
    through the optimizer only; explain still names each by the model's name for that very
    tensor (the optimizer holds them in reverse, so a name by position would be wrong)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.ReLU(), torch.nn.Linear(8, 4, bias=False))
    optimizer = forge_compile.optim.AdamW(list(model.parameters())[::-1], lr=1e-2)

    def step(model, optimizer, x):
        loss = model(x).square().mean()
        loss.backward()
        torch._dynamo.graph_break()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    report = forge_compile.explain(step, model, optimizer, torch.randn(4, 8))
    assert {d.name: d.shape for d in report.decisions} == {"0.weight": (8, 8), "2.weight": (4, 8)}, report
