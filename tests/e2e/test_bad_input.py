"""Input forge cannot take, and input it must take without being wrong, against torch.optim eager."""

import pytest
import torch
from helpers import MLP, assert_close_params, assert_matches_torch_optim, mse_step, train_side_by_side, twin
from torch import nn

import forge_compile


def _side_by_side(model, make_batch, steps=3, lr=1e-2):
    reference = twin(model)
    step = torch.compile(mse_step(model, forge_compile.optim.AdamW(model.parameters(), lr=lr)), backend="forge")
    reference_step = mse_step(reference, torch.optim.AdamW(reference.parameters(), lr=lr))
    report = train_side_by_side(step, reference_step, [make_batch() for _ in range(steps)])
    return model, reference, report


def test_stock_optimizer_that_is_not_element_wise_is_named_in_explain():
    model = MLP()
    opt = torch.optim.Adadelta(model.parameters())
    report = forge_compile.explain(torch.compile(mse_step(model, opt), backend="forge"), torch.randn(4, 5, 12),
                                   torch.randn(4, 5, 6))  # fmt: skip
    assert not report.fused
    assert any("torch.optim.adadelta.Adadelta" in n and "backend='inductor'" in n for n in report.notes), report.notes


def test_step_with_a_closure_runs_as_torchs_step():
    """Dynamo breaks the graph at step(closure); the closure and torch's step then run as
    they would under backend="inductor", unfused, and explain says no backward was captured."""

    def make(model, opt):
        def train_step(x, y):
            def closure():
                opt.zero_grad()
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                return loss

            return opt.step(closure).detach()

        return train_step

    model = MLP()
    reference = twin(model)
    step = torch.compile(make(model, forge_compile.optim.AdamW(model.parameters(), lr=1e-2)), backend="forge")
    reference_step = make(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2))
    x, y = torch.randn(4, 5, 12), torch.randn(4, 5, 6)
    report = forge_compile.explain(step, x, y)
    reference_step(x, y)
    for _ in range(2):
        torch.testing.assert_close(step(x, y), reference_step(x, y))
    assert_matches_torch_optim(model, reference, lr=1e-2, steps=3)
    assert not report.fused


def test_sparse_gradients_are_refused_clearly():
    embedding = nn.Embedding(10, 4, sparse=True)
    opt = forge_compile.optim.AdamW(embedding.parameters())
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()  # torch's own message, as with torch.optim.AdamW


def test_nan_in_the_data_gives_torchs_nan_pattern():
    def batch():
        x = torch.randn(4, 5, 12)
        x[0, 0, 3] = float("nan")
        return x, torch.randn(4, 5, 6)

    model, reference, report = _side_by_side(MLP(), batch)
    assert len(report.fused) == 3
    assert torch.isnan(reference.net[0].weight).any()
    assert_close_params(model, reference, atol=1e-5)  # NaN where torch has NaN, close elsewhere


def test_inf_in_the_targets_gives_torchs_nan_pattern():
    def batch():
        y = torch.randn(4, 5, 6)
        y[1, 2, 0] = float("inf")
        return torch.randn(4, 5, 12), y

    model, reference, _ = _side_by_side(MLP(), batch)
    assert_close_params(model, reference, atol=1e-5)


def test_non_contiguous_weight_is_fused_and_right():
    model = MLP()
    with torch.no_grad():
        layer = model.net[2]
        layer.weight = nn.Parameter(layer.weight.detach().t().contiguous().t())  # column-major storage
    assert not model.net[2].weight.is_contiguous()
    model, reference, report = _side_by_side(model, lambda: (torch.randn(4, 5, 12), torch.randn(4, 5, 6)))
    assert "model.net.2.weight" in {d.name for d in report.fused}
    assert_matches_torch_optim(model, reference, lr=1e-2, steps=3)
    assert model.net[2].weight.stride() == reference.net[2].weight.stride()


def test_channels_last_convolution_is_right():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 6)).to(
        memory_format=torch.channels_last)
    model, reference, report = _side_by_side(model, lambda: (torch.randn(2, 3, 8, 8).to(
        memory_format=torch.channels_last), torch.randn(2, 6)))  # fmt: skip
    assert {d.name for d in report.fused} == {"model.2.weight"}
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert_matches_torch_optim(model, reference, lr=1e-2, steps=3)


def test_float64_weights_stay_unfused_and_right():
    def batch():
        return torch.randn(4, 5, 12, dtype=torch.float64), torch.randn(4, 5, 6, dtype=torch.float64)

    model, reference, report = _side_by_side(MLP().double(), batch)
    weights = [d for d in report.rejected if len(d.shape) == 2]
    assert not report.fused and len(weights) == 3
    assert all(d.code == "unsupported_dtype" and "float64" in d.reason for d in weights), weights
    assert_close_params(model, reference, atol=1e-12)


def test_a_layer_with_zero_rows_works():
    model = nn.Sequential(nn.Linear(12, 6), nn.Linear(6, 0))

    def batch():
        return torch.randn(4, 12), torch.randn(4, 0)

    model, reference, _ = _side_by_side(model, batch)
    assert_close_params(model, reference, atol=1e-6)
