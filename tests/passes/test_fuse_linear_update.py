"""The rewrite pass: graph snapshots before and after, and the reason for each rejection."""

import re

import expecttest
import pytest
import torch
from helpers import MLP, mse_step
from torch import nn
from torch._inductor.utils import run_and_get_code

import forge_compile
import forge_compile.backend as backend


def _capture_graphs(monkeypatch):
    """Record the post-grad graph's code before and after forge's pass."""
    captured = {}
    original = backend.fuse_linear_updates

    def recording(graph, *args, **kwargs):
        captured["before"] = graph.python_code("self").src
        decisions = original(graph, *args, **kwargs)
        captured["after"] = graph.python_code("self").src
        return decisions

    monkeypatch.setattr(backend, "fuse_linear_updates", recording)
    return captured


def _tidy(code: str) -> str:
    """FX's code without the ``x = None`` lifetime annotations and blank lines."""
    lines = []
    for line in code.strip().splitlines():
        line = re.sub(r";\s+[\w_ =]+ = None$", "", line.rstrip())
        if line.strip() and not line.strip().startswith("#"):
            lines.append(line)
    return "\n".join(lines)


def _two_layer_step():
    model = nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU(), nn.Linear(8, 3, bias=False))
    opt = forge_compile.optim.AdamW(model.parameters(), lr=1e-2)
    return mse_step(model, opt), (torch.randn(5, 4), torch.randn(5, 3))


@pytest.mark.skipif(not torch.__version__.startswith("2.13"), reason="snapshots are recorded on torch 2.13")
class TestSnapshots(expecttest.TestCase):
    @pytest.fixture(autouse=True)
    def _monkeypatch(self, monkeypatch, no_inductor_cache):
        self.monkeypatch = monkeypatch

    def test_post_grad_graph_before_and_after(self):
        captured = _capture_graphs(self.monkeypatch)
        step, args = _two_layer_step()
        torch.compile(step, backend="forge")(*args)
        self.assertExpectedInline(_tidy(captured["before"]), """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, arg6_1, arg7_1, arg8_1, arg9_1, arg10_1, arg11_1, arg12_1, arg13_1, arg14_1):
    permute = torch.ops.aten.permute.default(arg0_1, [1, 0])
    mm = torch.ops.aten.mm.default(arg1_1, permute)
    relu = torch.ops.aten.relu.default(mm)
    permute_1 = torch.ops.aten.permute.default(arg2_1, [1, 0])
    mm_1 = torch.ops.aten.mm.default(relu, permute_1)
    sub = torch.ops.aten.sub.Tensor(mm_1, arg3_1)
    pow_1 = torch.ops.aten.pow.Tensor_Scalar(sub, 2)
    mean = torch.ops.aten.mean.default(pow_1)
    full = torch.ops.aten.full.default([], 1, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
    expand = torch.ops.aten.expand.default(full, [5, 3])
    empty = torch.ops.aten.empty.memory_format([8, 4], dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
    empty_1 = torch.ops.aten.empty.memory_format([3, 8], dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
    _foreach_add = torch.ops.aten._foreach_add.Scalar([arg4_1, arg5_1], 1)
    getitem = _foreach_add[0]
    getitem_1 = _foreach_add[1]
    le = torch.ops.aten.le.Scalar(relu, 0)
    full_default_1 = torch.ops.aten.full.default([], 0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
    full_default = torch.ops.aten.full.default([5, 3], 0.06666667014360428, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
    pow_2 = torch.ops.aten.pow.Tensor_Scalar(sub, 1.0)
    mul = torch.ops.aten.mul.Scalar(pow_2, 2.0)
    mul_1 = torch.ops.aten.mul.Tensor(full_default, mul)
    permute_4 = torch.ops.aten.permute.default(permute_1, [1, 0])
    mm_3 = torch.ops.aten.mm.default(mul_1, permute_4)
    where = torch.ops.aten.where.self(le, full_default_1, mm_3)
    permute_6 = torch.ops.aten.permute.default(where, [1, 0])
    mm_4 = torch.ops.aten.mm.default(permute_6, arg1_1)
    optimizer_update = torch.ops.forge.optimizer_update.default(arg0_1, mm_4, [arg11_1, arg12_1], getitem, [arg6_1, arg7_1, arg8_1, arg9_1, arg10_1], 'adam', [1, 0, 0, 1])
    getitem_2 = optimizer_update[0]
    getitem_3 = optimizer_update[1]
    getitem_4 = optimizer_update[2]
    permute_2 = torch.ops.aten.permute.default(mul_1, [1, 0])
    mm_2 = torch.ops.aten.mm.default(permute_2, relu)
    optimizer_update_1 = torch.ops.forge.optimizer_update.default(arg2_1, mm_2, [arg13_1, arg14_1], getitem_1, [arg6_1, arg7_1, arg8_1, arg9_1, arg10_1], 'adam', [1, 0, 0, 1])
    getitem_5 = optimizer_update_1[0]
    getitem_6 = optimizer_update_1[1]
    getitem_7 = optimizer_update_1[2]
    copy_ = torch.ops.aten.copy_.default(arg0_1, getitem_2)
    copy__1 = torch.ops.aten.copy_.default(arg2_1, getitem_5)
    copy__2 = torch.ops.aten.copy_.default(arg4_1, getitem)
    copy__3 = torch.ops.aten.copy_.default(arg5_1, getitem_1)
    copy__4 = torch.ops.aten.copy_.default(arg11_1, getitem_3)
    copy__5 = torch.ops.aten.copy_.default(arg12_1, getitem_4)
    copy__6 = torch.ops.aten.copy_.default(arg13_1, getitem_6)
    copy__7 = torch.ops.aten.copy_.default(arg14_1, getitem_7)
    return (mean,)""")
        self.assertExpectedInline(_tidy(captured["after"]), """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, arg6_1, arg7_1, arg8_1, arg9_1, arg10_1, arg11_1, arg12_1, arg13_1, arg14_1):
    permute = torch.ops.aten.permute.default(arg0_1, [1, 0])
    mm = torch.ops.aten.mm.default(arg1_1, permute)
    relu = torch.ops.aten.relu.default(mm)
    permute_1 = torch.ops.aten.permute.default(arg2_1, [1, 0])
    mm_1 = torch.ops.aten.mm.default(relu, permute_1)
    sub = torch.ops.aten.sub.Tensor(mm_1, arg3_1)
    pow_1 = torch.ops.aten.pow.Tensor_Scalar(sub, 2)
    mean = torch.ops.aten.mean.default(pow_1)
    full = torch.ops.aten.full.default([], 1, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
    expand = torch.ops.aten.expand.default(full, [5, 3])
    empty = torch.ops.aten.empty.memory_format([8, 4], dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
    empty_1 = torch.ops.aten.empty.memory_format([3, 8], dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
    _foreach_add = torch.ops.aten._foreach_add.Scalar([arg4_1, arg5_1], 1)
    getitem = _foreach_add[0]
    getitem_1 = _foreach_add[1]
    le = torch.ops.aten.le.Scalar(relu, 0)
    full_default_1 = torch.ops.aten.full.default([], 0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
    full_default = torch.ops.aten.full.default([5, 3], 0.06666667014360428, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
    pow_2 = torch.ops.aten.pow.Tensor_Scalar(sub, 1.0)
    mul = torch.ops.aten.mul.Scalar(pow_2, 2.0)
    mul_1 = torch.ops.aten.mul.Tensor(full_default, mul)
    permute_4 = torch.ops.aten.permute.default(permute_1, [1, 0])
    mm_3 = torch.ops.aten.mm.default(mul_1, permute_4)
    permute_2 = torch.ops.aten.permute.default(mul_1, [1, 0])
    fused_linear_update__default_1 = torch.ops.forge.fused_linear_update_.default(arg2_1, permute_2, relu, [arg13_1, arg14_1], getitem_1, [arg6_1, arg7_1, arg8_1, arg9_1, arg10_1], 'adam', [1, 0, 0, 1])
    where = torch.ops.aten.where.self(le, full_default_1, mm_3)
    permute_6 = torch.ops.aten.permute.default(where, [1, 0])
    fused_linear_update__default = torch.ops.forge.fused_linear_update_.default(arg0_1, permute_6, arg1_1, [arg11_1, arg12_1], getitem, [arg6_1, arg7_1, arg8_1, arg9_1, arg10_1], 'adam', [1, 0, 0, 1])
    copy__2 = torch.ops.aten.copy_.default(arg4_1, getitem)
    copy__3 = torch.ops.aten.copy_.default(arg5_1, getitem_1)
    return (mean,)""")


def test_generated_code_has_fused_ops_and_no_weight_gradient_matmul():
    step, args = _two_layer_step()
    _, code = run_and_get_code(torch.compile(step, backend="forge"), *args)
    src = "\n".join(code)
    assert src.count("torch.ops.forge.fused_linear_update_.default(") == 2
    # forward: 2 matmuls; backward: dX of the second layer only. No dW matmul remains.
    assert len(re.findall(r"extern_kernels\.mm\(", src)) == 3, src
    assert "optimizer_update" not in src


def test_unfused_updates_compile_to_pointwise_kernels():
    model = MLP(sizes=(6, 5, 4))
    step = torch.compile(mse_step(model, forge_compile.optim.AdamW(model.parameters())), backend="forge")
    _, code = run_and_get_code(step, torch.randn(3, 6), torch.randn(3, 4))
    src = "\n".join(code)
    assert "optimizer_update" not in src  # the biases' updates are Inductor code, not an opaque call
    assert src.count("fused_linear_update_") == 2


def _biased_bf16_mlp_step():
    """Two bf16 layers whose same-shaped biases stay unfused and round stochastically."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)).to(torch.bfloat16)
    opt = forge_compile.optim.AdamW(model.parameters(), lr=1e-2, rounding_seed=1234)
    args = (torch.randn(5, 16, dtype=torch.bfloat16), torch.randn(5, 16, dtype=torch.bfloat16))
    return mse_step(model, opt), opt, args


def test_unfused_rounding_seeds_are_read_at_run_time_not_written_into_kernels(no_inductor_cache):
    step, opt, args = _biased_bf16_mlp_step()
    _, code = run_and_get_code(torch.compile(step, backend="forge"), *args)
    src = "\n".join(code)
    bias_seeds = [opt._forge_seed_for(0, 1), opt._forge_seed_for(0, 3)]
    for seed in bias_seeds:
        assert f"_forge_rounding_seed_{seed}_" in src  # the seed's buffer is an input of the compiled code
    without_buffer_names = re.sub(r"_forge_rounding_seed_\w+", "", src)
    for seed in bias_seeds:
        assert str(seed) not in without_buffer_names


def test_same_shaped_unfused_updates_share_one_trace(monkeypatch, no_inductor_cache):
    from forge_compile.passes import fuse_linear_update

    traces = []
    original = fuse_linear_update._trace_update

    def counting(*args, **kwargs):
        traces.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(fuse_linear_update, "_trace_update", counting)
    step, _, args = _biased_bf16_mlp_step()
    report = forge_compile.explain(torch.compile(step, backend="forge"), *args)
    assert sum(not d.fused for d in report.decisions) == 2  # the two (16,) biases
    assert len(traces) == 1


def _decisions(fn, *args):
    return {d.name.split(".", 1)[1]: d for d in forge_compile.explain(fn, *args).decisions}


def test_gradient_kept_in_grad_is_rejected():
    model = nn.Linear(4, 3)
    opt = forge_compile.optim.AdamW(model.parameters())

    def train_step(x):
        model(x).square().mean().backward()
        opt.step()  # no zero_grad(): .grad outlives the step
        return None

    decisions = _decisions(train_step, torch.randn(2, 4))
    assert decisions["weight"].code == "gradient_read_elsewhere"
    assert "kept in .grad" in decisions["weight"].reason
    assert model.weight.grad is not None  # it outlives the step, as with torch.optim


def test_logged_gradient_is_rejected_and_the_step_is_right():
    model, reference = nn.Linear(4, 3), nn.Linear(4, 3)
    reference.load_state_dict(model.state_dict())

    def make(m, o):
        def train_step(x):
            m(x).square().mean().backward()
            grad_norm = m.weight.grad.norm()  # logging reads the gradient
            o.step()
            o.zero_grad()
            return grad_norm

        return train_step

    step = make(model, forge_compile.optim.AdamW(model.parameters(), lr=1e-2))
    reference_step = make(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2))
    x = torch.randn(2, 4)
    decisions = _decisions(step, x)  # runs one compiled step
    reference_step(x)
    assert decisions["weight"].code == "gradient_read_elsewhere"
    assert "norm" in decisions["weight"].reason
    torch.testing.assert_close(model.weight, reference.weight, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.compile(step, backend="forge")(x), reference_step(x))
    torch.testing.assert_close(model.weight, reference.weight, atol=1e-6, rtol=0)


def test_a_read_is_not_hoisted_above_a_write_through_a_view_of_its_input():
    """The pass moves a fused op's operands up to where it goes. A read of an input must
    stay after an in-place write to that input, also when the write goes through a view
    (a row of a weight): moved above it, the read would see the old values."""
    from forge_compile.passes.fuse_linear_update import _hoist_ordered

    aten = torch.ops.aten
    graph = torch.fx.Graph()
    weight, other = graph.placeholder("weight"), graph.placeholder("other")
    row = graph.call_function(aten.select.int, (weight, 0, 0))
    anchor = graph.call_function(aten.mul.Tensor, (other, 2))
    graph.call_function(aten.add_.Tensor, (row, 1))
    read = graph.call_function(aten.mul.Tensor, (weight, 3))
    graph.output((anchor, read))
    for node, value in [(weight, torch.ones(2, 3)), (other, torch.ones(3)), (row, torch.ones(3)),
                        (anchor, torch.ones(3)), (read, torch.ones(2, 3))]:  # fmt: skip
        node.meta["val"] = value
    order = {n: float(i) for i, n in enumerate(graph.nodes)}
    before = list(graph.nodes)
    assert not _hoist_ordered(read, anchor, order)
    assert list(graph.nodes) == before
    # With the write gone the same read may move up.
    graph.erase_node(next(n for n in graph.nodes if n.target is aten.add_.Tensor))
    order = {n: float(i) for i, n in enumerate(graph.nodes)}
    assert _hoist_ordered(read, anchor, order)
    assert list(graph.nodes).index(read) < list(graph.nodes).index(anchor)


@pytest.mark.parametrize("view_before_anchor", [True, False])
def test_a_read_through_a_view_is_not_hoisted_above_a_write_through_another_view(view_before_anchor):
    """The read goes through a view of the input (its transpose), the write through
    another (a row): the read must stay after the write wherever the transpose is."""
    from forge_compile.passes.fuse_linear_update import _hoist_ordered

    aten = torch.ops.aten
    graph = torch.fx.Graph()
    weight, other = graph.placeholder("weight"), graph.placeholder("other")
    values = {weight: torch.ones(2, 3), other: torch.ones(3)}
    if view_before_anchor:
        transposed = graph.call_function(aten.permute.default, (weight, [1, 0]))
    anchor = graph.call_function(aten.mul.Tensor, (other, 2))
    if not view_before_anchor:
        transposed = graph.call_function(aten.permute.default, (weight, [1, 0]))
    row = graph.call_function(aten.select.int, (weight, 0, 0))
    graph.call_function(aten.add_.Tensor, (row, 1))
    read = graph.call_function(aten.mul.Tensor, (transposed, 3))
    graph.output((anchor, read))
    values.update({transposed: torch.ones(3, 2), anchor: torch.ones(3), row: torch.ones(3), read: torch.ones(3, 2)})
    for node, value in values.items():
        node.meta["val"] = value
    order = {n: float(i) for i, n in enumerate(graph.nodes)}
    assert not _hoist_ordered(read, anchor, order)
    nodes = list(graph.nodes)
    assert nodes.index(read) > nodes.index(next(n for n in nodes if n.target is aten.add_.Tensor))
