"""The fused kernel's storage formats: bf16 weights rounded stochastically and 8-bit states.

Against a float64 reference of the same quantized algorithm (dequantize the old codes,
the rule, then the new values): the stored weight is one of the two bf16 neighbours of
the float64 result, and each dequantized new state is within the code's round-trip
bound of it (:mod:`forge_compile.rules.storage`). Under the interpreter the kernel and
the torch path must also agree to the bit, but for the few values that the two matmuls'
summation orders put on either side of a rounding boundary. bf16 operands run on the
GPU only (the interpreter's bf16 tl.dot is wrong).
"""

import contextlib

import pytest
import torch

from forge_compile import ops, rules
from forge_compile.config import config

from helpers import KERNEL_DEVICE as DEVICE
from helpers import ON_GPU, block_absmax, needs_triton, root_code_bound, signed_code_bound

pytestmark = needs_triton
OPERANDS = [
    pytest.param(torch.float32, id="fp32-operands"),
    pytest.param(torch.bfloat16, id="bf16-operands",
                 marks=pytest.mark.skipif(not ON_GPU, reason="the interpreter's bf16 tl.dot is wrong")),
]  # fmt: skip
SHAPES = [(37, 200, 23), (16, 64, 16), (70, 130, 9)]
# (decoupled_weight_decay, amsgrad, maximize, weight_decay): AdamW, and AMSGrad's third state
OPTIONS = [pytest.param((1, 0, 0, 1), id="adamw"), pytest.param((1, 1, 0, 1), id="adamw-amsgrad")]
HYPERPARAMETERS = (1e-2, 0.9, 0.999, 1e-8, 0.1)
STEP = 5.0


def _problem(shape, operand_dtype, weight_dtype, n_states):
    M, N, T = shape
    g = torch.Generator().manual_seed(M * 1000 + N)
    weight = torch.randn(M, N, generator=g).to(weight_dtype)
    grad_output_t = (torch.randn(M, T, generator=g) * 0.1).to(operand_dtype)
    input = torch.randn(T, N, generator=g).to(operand_dtype)
    m = torch.randn(M, N, generator=g) * 1e-2 * torch.exp(torch.randn(M, N, generator=g))
    v = m * m * (1 + torch.rand(M, N, generator=g))
    moments = [m, v, v * 1.5][:n_states]
    signed = [True, False, False][:n_states]
    codes = [ops.quantize_state(s, sg) for s, sg in zip(moments, signed)]
    states = [c for c, _ in codes] + [a for _, a in codes]
    return [t.to(DEVICE) for t in (weight, grad_output_t, input)], [s.to(DEVICE) for s in states], signed


def _run(kernel, weight, grad_output_t, input, states, options, seed):
    step = torch.tensor(STEP, device=DEVICE)
    hyperparameters = [torch.tensor(h, dtype=torch.float64, device=DEVICE) for h in HYPERPARAMETERS]
    before, config.kernel = config.kernel, kernel
    try:
        torch.ops.forge.fused_linear_update_(weight, grad_output_t, input, states, step, hyperparameters, "adam",
                                             list(options), quantized_states=True, rounding_seed=seed)  # fmt: skip
    finally:
        config.kernel = before


def _dequantize64(codes, scales, signed):
    c = codes.double()
    unit = c * c.abs() / 127**2 if signed else (c / 255) ** 4
    cols = codes.shape[1]
    return unit * scales.double().repeat_interleave(64, dim=1)[:, :cols]


def _reference(weight, grad_output_t, input, states, options, signed):
    """Float64: dW, the old states dequantized, the rule; returns (weight, new states)."""
    n = len(signed)
    old = [_dequantize64(c, a, sg) for c, a, sg in zip(states[:n], states[n:], signed)]
    grad = grad_output_t.double() @ input.double()
    rule = rules.get("adam")
    step = torch.tensor(STEP, dtype=torch.float64)
    coefficients = rule.torch_coefficients(step, *[torch.tensor(h, dtype=torch.float64) for h in HYPERPARAMETERS],
                                           *[step] * (rules.MAX_HYPERPARAMETERS - len(HYPERPARAMETERS)))  # fmt: skip
    w = weight.double()
    slots = old + [w] * (rules.MAX_STATES - n)
    out = rule.torch_elementwise(w, grad, *slots, *coefficients, *options)
    return out[0], list(out[1 : 1 + n])


def _split_epilogue_tiles():
    """A tile of two 64-column halves, each updated in turn (``EPILOGUE_SPLIT=2``)."""
    import triton

    from forge_compile.kernels import linear_update

    rows = 64 if ON_GPU else 16
    return linear_update.only_config(triton.Config(
        {"BLOCK_M": rows, "BLOCK_N": 128, "BLOCK_K": 16, "GROUP_M": 2, "EPILOGUE_SPLIT": 2},
        num_warps=4 if ON_GPU else 1))  # fmt: skip


def _eight_bit_candidate_tiles():
    """The first of the autotuner's candidates for 8-bit states alone (EIGHT_BIT_STATE_TILES)."""
    from forge_compile.kernels import linear_update

    return linear_update.only_config(linear_update.tile_config(linear_update.EIGHT_BIT_STATE_TILES[0], 2))


_TILES = {"tuned": contextlib.nullcontext, "split-epilogue": _split_epilogue_tiles,
          "eight-bit-candidate": _eight_bit_candidate_tiles}  # fmt: skip


@pytest.mark.parametrize("operand_dtype", OPERANDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("tiles", ["tuned", "split-epilogue",
                                   pytest.param("eight-bit-candidate", marks=pytest.mark.skipif(
                                       not ON_GPU, reason="a GPU candidate: 64x128x64 tiles, slow in the interpreter"))])  # fmt: skip
def test_bf16_weights_and_int8_states_against_float64(operand_dtype, shape, options, tiles):
    n_states = 3 if options[1] else 2
    (weight, grad_output_t, input), states, signed = _problem(shape, operand_dtype, torch.bfloat16, n_states)
    ref_weight, ref_states = _reference(weight.cpu(), grad_output_t.cpu(), input.cpu(),
                                        [s.cpu() for s in states], options, signed)  # fmt: skip
    with _TILES[tiles]():
        _run("triton", weight, grad_output_t, input, states, options, seed=1234)
    # The weight: a bf16 neighbour of the float64 result (fp32 math adds a few fp32 ULPs).
    w = weight.cpu().double()
    ulp = torch.finfo(torch.bfloat16).eps * ref_weight.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    assert ((w - ref_weight).abs() <= ulp * 1.01 + 1e-6 * ref_weight.abs() + 1e-12).all()
    # Both neighbours occur: the rounding is stochastic, not to nearest.
    nearest = ref_weight.to(torch.bfloat16).double()
    assert (w != nearest).any() and (w == nearest).any()
    n = n_states
    new = [_dequantize64(c.cpu(), a.cpu(), sg) for c, a, sg in zip(states[:n], states[n:], signed)]
    for value, expected, is_signed in zip(new, ref_states, signed):
        absmax = block_absmax(expected)
        if is_signed:
            bound = signed_code_bound(expected, absmax)
            assert ((value - expected).abs() <= bound * 1.01 + 1e-6 * absmax).all()
        else:
            bound = root_code_bound(expected, absmax)
            assert ((value.sqrt() - expected.sqrt()).abs() <= bound * 1.01 + 1e-6 * absmax.sqrt()).all()


@pytest.mark.skipif(ON_GPU, reason="bit equality with the torch path holds for the interpreter's arithmetic")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("weight_dtype, seed", [(torch.bfloat16, 77), (torch.float32, None)])
def test_kernel_and_torch_path_store_the_same_values(shape, weight_dtype, seed):
    options = (1, 1, 0, 1)
    results = []
    for kernel in ("triton", "torch"):
        (weight, grad_output_t, input), states, _ = _problem(shape, torch.float32, weight_dtype, 3)
        _run(kernel, weight, grad_output_t, input, states, options, seed)
        results.append([weight, *states])
    for a, b in zip(*results):
        # The interpreter's tl.dot (numpy) and torch's matmul may sum in different orders:
        # a gradient one ulp apart moves a value across a rounding boundary now and then.
        if a.dtype in (torch.int8, torch.uint8):
            code_steps = (a.int() - b.int()).abs()
            assert code_steps.max() <= 1 and (code_steps > 0).float().mean() < 1e-3
        elif a.dtype == torch.bfloat16:
            assert (a != b).float().mean() < 1e-3
            torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=0)
        else:
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-9)
