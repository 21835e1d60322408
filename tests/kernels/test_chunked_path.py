"""The chunked path of the fused op (cuBLAS writes an fp32 gradient block, the kernel
consumes it) and the measured choice between it and the fused kernel.

Under the interpreter the chunked path must store the same bits as the torch path (the
same fp32 gradient, the same rule, the same rounding bits by global element index); on
the GPU it must agree with the fused kernel to fp32 rounding.
"""

import pytest
import torch

from forge_compile import ops, rules
from forge_compile.config import config
from forge_compile.kernels import linear_update

from helpers import KERNEL_DEVICE as DEVICE
from helpers import ON_GPU, needs_triton

pytestmark = needs_triton

# (rule, options, hyperparameters, state count, fp32 tolerance against the fused kernel on
# the GPU: rtol, atol). cuBLAS and the kernel sum the 24 products in different orders:
# partial sums near 5 differ by a few ulps, and an update that cancels most of a weight
# (|w| 1 -> 0.03) keeps that absolute error (1.4e-6 measured on the H200). Centered
# RMSprop divides by sqrt(v - mean(g)^2), which magnifies those ulps: 6 of 15000 values
# differed by up to 1.5e-5 (relative 5.3e-5) on an H100.
RULES = [
    pytest.param("adam", (1, 0, 0, 1), (1e-2, 0.9, 0.999, 1e-8, 0.1), 2, (1e-5, 5e-6), id="adamw"),
    pytest.param("sgd", (1, 1, 0, 1), (0.1, 0.9, 0.0, 1e-2), 1, (1e-5, 5e-6), id="sgd-nesterov"),
    pytest.param("rmsprop", (1, 1, 0, 0), (1e-2, 0.99, 1e-8, 0.0, 0.9), 3, (2e-4, 5e-5),
                 id="rmsprop-centered-momentum"),
]  # fmt: skip
STORAGE = [
    pytest.param(torch.float32, False, None, id="fp32"),
    pytest.param(torch.bfloat16, True, 5, id="bf16-sr-int8"),
]


def _problem(rule_name, n_states, weight_dtype, quantized, M=150, N=100, T=24):
    g = torch.Generator().manual_seed(M + N + n_states)
    weight = torch.randn(M, N, generator=g).to(weight_dtype)
    grad_output_t = torch.randn(M, T, generator=g)
    input = torch.randn(T, N, generator=g)
    rule = rules.get(rule_name)
    # Second moments above the squared first ones, as a real run keeps them (centered RMSprop's variance > 0).
    values = [(torch.rand(M, N, generator=g) + 0.1) * 1e-2 if nonnegative else torch.randn(M, N, generator=g) * 1e-3
              for nonnegative in rule.nonnegative_states[:n_states]]  # fmt: skip
    if quantized:
        pairs = [ops.quantize_state(v, not nn) for v, nn in zip(values, rule.nonnegative_states)]
        states = [c for c, _ in pairs] + [a for _, a in pairs]
    else:
        states = values
    return [t.to(DEVICE) for t in (weight, grad_output_t, input, *states)]


def _update(tensors, rule_name, options, hyperparameters, quantized, seed, kernel, path):
    weight, grad_output_t, input, *states = tensors
    step = torch.tensor(4.0, device=DEVICE)
    hp = [torch.tensor(h, dtype=torch.float64, device=DEVICE) for h in hyperparameters]
    before = (config.kernel, config.linear_update_path)
    config.kernel, config.linear_update_path = kernel, path
    try:
        torch.ops.forge.fused_linear_update_(weight, grad_output_t, input, states, step, hp, rule_name, list(options),
                                             -0.8, 0.8, quantized, seed)  # fmt: skip
    finally:
        config.kernel, config.linear_update_path = before
    return [weight, *states]


@pytest.fixture
def three_blocks(monkeypatch):
    # 64-row blocks of a 150-row weight: three launches, the last one partial.
    monkeypatch.setattr(linear_update, "_CHUNK_ELEMENTS", 64 * 100)
    assert linear_update._chunk_rows(150, 100) == 64


@pytest.mark.parametrize("weight_dtype, quantized, seed", STORAGE)
@pytest.mark.parametrize("rule_name, options, hyperparameters, n_states, gpu_tolerance", RULES)
def test_chunked_path_matches(three_blocks, rule_name, options, hyperparameters, n_states, gpu_tolerance,
                              weight_dtype, quantized, seed):  # fmt: skip
    reference_path = ("triton", "fused") if ON_GPU else ("torch", "auto")
    expected = _update(_problem(rule_name, n_states, weight_dtype, quantized), rule_name, options, hyperparameters,
                       quantized, seed, *reference_path)  # fmt: skip
    actual = _update(_problem(rule_name, n_states, weight_dtype, quantized), rule_name, options, hyperparameters,
                     quantized, seed, "triton", "chunked")  # fmt: skip
    for a, e in zip(actual, expected):
        if not ON_GPU and a.dtype in (torch.int8, torch.uint8, torch.bfloat16):
            assert torch.equal(a, e)
        elif a.dtype in (torch.int8, torch.uint8):
            assert (a.int() - e.int()).abs().max() <= 1  # a code may flip where fp32 sums differ
        elif a.dtype == torch.bfloat16:
            ulp = torch.finfo(torch.bfloat16).eps * e.float().abs().clamp_min(1e-30)
            assert ((a.float() - e.float()).abs() <= ulp * 1.01 + 1e-6).all()
        elif ON_GPU:
            rtol, atol = gpu_tolerance
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol)
        else:
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def test_chunk_rows_never_hold_the_whole_gradient():
    for M, N in [(14336, 4096), (4096, 14336), (1024, 1024), (1, 64), (3, 5)]:
        rows = linear_update._chunk_rows(M, N)
        assert 1 <= rows and (rows < M or M == 1)
        assert rows * N <= max(linear_update._CHUNK_ELEMENTS, N)
    assert linear_update._chunk_rows(14336, 4096) == 4096


@pytest.mark.skipif(not ON_GPU, reason="the choice is measured on CUDA")
def test_path_choice_is_measured_once_and_remembered(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(config, "autotune", True)  # FORGE_AUTOTUNE=0 (quick GPU runs) skips the measuring
    monkeypatch.setattr(linear_update, "_PATHS", {})
    monkeypatch.setattr(linear_update, "_CHOSEN", {})
    weight = torch.randn(256, 256, device=DEVICE)
    calls = []
    candidates = {"fused": lambda: calls.append("fused"), "chunked": lambda: calls.append("chunked")}
    first = linear_update._chosen_path(("test-key",), weight, candidates, [weight])
    assert first in candidates and set(calls) == {"fused", "chunked"}
    assert (tmp_path / "linear_update_paths.json").exists()
    calls.clear()
    monkeypatch.setattr(linear_update, "_PATHS", {})  # a new process: read from disk
    monkeypatch.setattr(linear_update, "_CHOSEN", {})
    assert linear_update._chosen_path(("test-key",), weight, candidates, [weight]) == first
    assert calls == []


@pytest.mark.skipif(not ON_GPU, reason="the choice is measured on CUDA")
@pytest.mark.parametrize("slower", ["fused", "chunked"])
def test_path_choice_takes_the_faster_path(slower, tmp_path, monkeypatch):
    """Of two paths with the same host work, the one that keeps the GPU busy ~20 us a run
    loses to the one that keeps it busy under 1 us."""
    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(config, "autotune", True)
    monkeypatch.setattr(linear_update, "_PATHS", {})
    monkeypatch.setattr(linear_update, "_CHOSEN", {})
    weight = torch.randn(256, 256, device=DEVICE)
    busy = lambda cycles: lambda: torch.cuda._sleep(cycles)  # noqa: E731
    candidates = {name: busy(40_000 if name == slower else 1_000) for name in ("fused", "chunked")}
    chosen = linear_update._chosen_path((f"test-{slower}",), weight, candidates, [weight])
    assert chosen != slower
