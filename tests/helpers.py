"""Shared pieces of the tests: models, a training step, and a comparison with a tolerance."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn


class MLP(nn.Module):
    """Linear layers with biases on 3-D inputs (batch, sequence, features)."""

    def __init__(self, sizes=(12, 24, 20, 6), bias=True):
        super().__init__()
        layers = []
        for a, b in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(a, b, bias=bias), nn.GELU()]
        self.net = nn.Sequential(*layers[:-1])

    def forward(self, x):
        return self.net(x)


def mse_step(model, optimizer, detach=True):
    def train_step(x, y):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach() if detach else loss

    return train_step


def sgd_at_lr_1_side_by_side(model: nn.Module, x: torch.Tensor, steps: int = 3):
    """``model`` (whose forward returns its loss) trained ``steps`` times on ``x`` by forge's
    SGD at lr 1 in a compiled step, and a twin by torch.optim's SGD in eager: at lr 1 each
    weight moves by its whole gradient, so a wrong gradient or update shows far above
    rounding. Returns the compiled step's explain report and the twin."""
    import forge_compile

    def train_step(net, opt, batch):
        loss = net(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    reference = twin(model)
    optimizer = forge_compile.optim.SGD(model.parameters(), lr=1.0)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=1.0)
    step = torch.compile(lambda batch: train_step(model, optimizer, batch), backend="forge")
    report = forge_compile.explain(step, x)
    train_step(reference, reference_optimizer, x)
    for _ in range(steps - 1):
        step(x)
        train_step(reference, reference_optimizer, x)
    return report, reference


def causal_lm_step(net, opt, tokens):
    """A transformers causal LM's training step on its own tokens as labels, loss detached."""
    loss = net(input_ids=tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def train_side_by_side(step, reference_step, batches):
    """Both on each batch, the losses equal each step (NaN where torch's is NaN); the first
    step through ``forge_compile.explain``, whose report is returned."""
    import forge_compile

    report = forge_compile.explain(step, *batches[0])
    reference_step(*batches[0])
    for batch in batches[1:]:
        torch.testing.assert_close(step(*batch), reference_step(*batch), rtol=1e-5, atol=1e-6, equal_nan=True)
    return report


def train_mlp_side_by_side(step, reference_step, steps: int):
    """:func:`train_side_by_side` on ``steps`` random MLP batches."""
    return train_side_by_side(step, reference_step, [(torch.randn(4, 5, 12), torch.randn(4, 5, 6))
                                                     for _ in range(steps)])  # fmt: skip


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def assert_close_params(actual: nn.Module, expected: nn.Module, atol: float = 1e-5, context: str = ""):
    """Every parameter within ``atol`` of the reference (absolute, element-wise)."""
    for (name, a), (_, e) in zip(actual.named_parameters(), expected.named_parameters()):
        err = (a.detach().double() - e.detach().double()).abs().nan_to_num(0.0).max().item() if a.numel() else 0.0
        assert err <= atol, f"{context} {name}: max abs error {err:.3g} > {atol}"
        assert torch.isnan(a).eq(torch.isnan(e)).all(), f"{context} {name}: NaN pattern differs"


def assert_matches_torch_optim(actual: nn.Module, expected: nn.Module, lr: float, steps: int, atol: float = 1e-5,
                               outlier_fraction: float = 0.02):
    """forge's weights against torch.optim's after ``steps`` Adam-family steps.

    Adam divides by ``sqrt(v) + eps``, so where a gradient is near zero a 1e-7 rounding
    difference (a different matmul blocking) moves that weight by up to ``lr`` per step;
    torch's own compiled step differs from its eager step in the same way (seen: 16 of
    938 weights of a small MLP by 7e-4). So: all but ``outlier_fraction`` of the elements
    within ``atol``, and every element within ``2 * lr * steps``, Adam's largest possible
    disagreement, with the same NaN pattern everywhere.
    """
    diffs = []
    for (name, a), (_, e) in zip(actual.named_parameters(), expected.named_parameters()):
        assert torch.isnan(a).eq(torch.isnan(e)).all(), f"{name}: NaN pattern differs"
        diffs.append((a.detach().double() - e.detach().double()).abs().nan_to_num(0.0).flatten())
    diff = torch.cat(diffs)
    beyond = (diff > atol).double().mean().item()
    assert beyond <= outlier_fraction, f"{beyond:.2%} of weights differ by more than {atol} (max {diff.max():.3g})"
    assert diff.max().item() <= 2 * lr * steps, f"max abs error {diff.max():.3g} > 2 * lr * steps"


def max_param_error(actual: nn.Module, expected: nn.Module) -> float:
    return max(
        (a.detach().double() - e.detach().double()).abs().max().item()
        for a, e in zip(actual.parameters(), expected.parameters())
        if a.numel()
    )


# --- the kernel tests' device: the GPU where there is one, else Triton's interpreter ---------
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = KERNEL_DEVICE == "cuda"
TRITON_AVAILABLE = ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not TRITON_AVAILABLE, reason="needs a GPU or TRITON_INTERPRET=1")


def last_line_outside_the_interpreter(script: str, *arguments: str) -> str:
    """Run ``script`` in a child process without Triton's interpreter, which the suite turns
    on for the CPU (conftest.py) and under which Inductor writes no Triton kernels, with
    tests/ importable; the last line it printed."""
    import subprocess
    import sys

    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tests = os.path.dirname(os.path.abspath(__file__))
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, environment.get("PYTHONPATH")]))
    child = subprocess.run([sys.executable, script, *arguments], env=environment, capture_output=True, text=True,
                           timeout=300)  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    return child.stdout.strip().splitlines()[-1]


def triton_wrapper_written_for_the_cpu(run, *patches) -> str:
    """The last wrapper Inductor writes while ``run()`` compiles, with Triton kernels for the
    CPU, written and not built (benchmarks/step_buffers.py's ``written_wrapper``)."""
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.append(root)
    from benchmarks.step_buffers import written_wrapper

    return written_wrapper(run, *patches)


# --- the 8-bit code's round-trip bounds (forge_compile/rules/storage.py), stated independently ---
def block_absmax(x: torch.Tensor) -> torch.Tensor:
    """Each element's block scale: the largest |x| of its run of 64 along the row."""
    rows, cols = x.shape
    padded = torch.nn.functional.pad(x.abs(), (0, -cols % 64))
    return padded.reshape(rows, -1, 64).amax(dim=2).repeat_interleave(64, dim=1)[:, :cols]


def signed_code_bound(x: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """Bound on |x - x'| for the signed square-root code on 127 levels."""
    s = 127 * torch.sqrt(x.abs() / absmax)
    return absmax * (s + 0.25) / 127**2


def root_code_bound(x: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """Bound on |sqrt(x) - sqrt(x')| for the non-negative code on 255 levels."""
    s = 255 * (x / absmax) ** 0.25
    return absmax.sqrt() * (s + 0.25) / 255**2
