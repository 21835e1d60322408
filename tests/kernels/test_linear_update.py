"""The fused Triton kernel against a float64 reference of "dW = dY^T X, then the rule".

On the CPU these run under TRITON_INTERPRET=1 (tests/conftest.py sets it). The
interpreter's bf16 tl.dot is wrong, so bf16 operands are tested on the GPU only.
"""

import pytest
import torch

from forge_compile import rules
from forge_compile.kernels.linear_update import GIVEN_GRADIENT_TILES, GPU_TILES, fused_linear_update

from helpers import KERNEL_DEVICE as DEVICE
from helpers import ON_GPU, needs_triton

pytestmark = needs_triton

# (weight dtype, state dtype, operand dtype, atol on the weight, atol on the states)
DTYPES = [
    pytest.param(torch.float32, torch.float32, torch.float32, 2e-6, 2e-6, id="fp32"),
    pytest.param(torch.float16, torch.float32, torch.float16, 2e-3, 2e-5, id="fp16-weights-fp32-states"),
    pytest.param(torch.float32, torch.bfloat16, torch.float32, 2e-6, 2e-2, id="fp32-weights-bf16-states"),
    pytest.param(torch.bfloat16, torch.float32, torch.bfloat16, 2e-2, 2e-4, id="bf16",
                 marks=pytest.mark.skipif(not ON_GPU, reason="the interpreter's bf16 tl.dot is wrong")),
    pytest.param(torch.bfloat16, torch.bfloat16, torch.bfloat16, 2e-2, 2e-2, id="bf16-states",
                 marks=pytest.mark.skipif(not ON_GPU, reason="the interpreter's bf16 tl.dot is wrong")),
]  # fmt: skip
SHAPES = [(37, 29, 23), (16, 16, 16), (33, 70, 5), (1, 17, 40)]
# (decoupled_weight_decay, amsgrad, maximize, weight_decay) and the values of the run
OPTIONS = [
    pytest.param((1, 0, 0, 1), 0.1, id="adamw"),
    pytest.param((0, 0, 0, 1), 0.05, id="adam-l2"),
    pytest.param((1, 1, 0, 1), 0.1, id="adamw-amsgrad"),
    pytest.param((0, 0, 1, 0), 0.0, id="adam-maximize"),
]


def _reference(w, m, v, vmax, g, step, lr, beta1, beta2, eps, wd, options):
    """Adam/AdamW in float64, written from torch.optim's documented algorithm."""
    decoupled, amsgrad, maximize, has_wd = options
    w, m, v, vmax, g = (t.double() for t in (w, m, v, vmax, g))
    if maximize:
        g = -g
    if has_wd:
        if decoupled:
            w = w * (1 - lr * wd)
        else:
            g = g + wd * w
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    vmax = torch.maximum(vmax, v) if amsgrad else vmax
    denom = (vmax if amsgrad else v).sqrt() / (1 - beta2**step) ** 0.5 + eps
    w = w - lr / (1 - beta1**step) * m / denom
    return w, m, v, vmax


@pytest.mark.parametrize("weight_dtype,state_dtype,operand_dtype,atol_w,atol_s", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("transposed_grad_output", [True, False], ids=["dY-view", "dYt-contiguous"])
@pytest.mark.parametrize("options,weight_decay", OPTIONS)
def test_kernel_matches_float64_reference(weight_dtype, state_dtype, operand_dtype, atol_w, atol_s, shape,
                                          transposed_grad_output, options, weight_decay):  # fmt: skip
    M, N, T = shape
    w = torch.randn(M, N, device=DEVICE).to(weight_dtype)
    m = (0.1 * torch.randn(M, N, device=DEVICE)).to(state_dtype)
    v = (0.01 * torch.rand(M, N, device=DEVICE)).to(state_dtype)
    vmax = (v.float() + 0.005 * torch.rand(M, N, device=DEVICE)).to(state_dtype)
    if transposed_grad_output:
        grad_output_t = torch.randn(T, M, device=DEVICE).to(operand_dtype).t()  # the graph's permute of dY
    else:
        grad_output_t = torch.randn(M, T, device=DEVICE).to(operand_dtype)
    x = torch.randn(T, N, device=DEVICE).to(operand_dtype)
    lr, beta1, beta2, eps, step = 1e-2, 0.9, 0.999, 1e-8, 4.0
    hyper = [torch.tensor(h, dtype=torch.float64, device=DEVICE) for h in (lr, beta1, beta2, eps, weight_decay)]
    states = [m.clone(), v.clone()] + ([vmax.clone()] if options[1] else [])
    W = w.clone()
    g = grad_output_t.double() @ x.double()
    ref_w, ref_m, ref_v, ref_vmax = _reference(w, m, v, vmax, g, step, lr, beta1, beta2, eps, weight_decay, options)

    fused_linear_update(rules.get("adam"), W, grad_output_t, x, states, torch.tensor(step, device=DEVICE),
                        hyper, options)  # fmt: skip

    torch.testing.assert_close(W.double(), ref_w, atol=atol_w, rtol=0)
    torch.testing.assert_close(states[0].double(), ref_m, atol=atol_s, rtol=1e-3)
    torch.testing.assert_close(states[1].double(), ref_v, atol=atol_s * 0.1, rtol=1e-3)
    if options[1]:
        torch.testing.assert_close(states[2].double(), ref_vmax, atol=atol_s * 0.1, rtol=1e-3)


def test_kernel_writes_every_element_and_only_the_weight_and_states():
    M, N, T = 45, 38, 9
    w = torch.full((M, N), float("nan"), device=DEVICE)  # poisoned: every element must be rewritten
    w_valid = torch.randn(M, N, device=DEVICE)
    m, v = torch.zeros(M, N, device=DEVICE), torch.zeros(M, N, device=DEVICE)
    grad_output_t, x = torch.randn(M, T, device=DEVICE), torch.randn(T, N, device=DEVICE)
    x_before, g_before = x.clone(), grad_output_t.clone()
    hyper = [torch.tensor(h, dtype=torch.float64, device=DEVICE) for h in (1e-2, 0.9, 0.999, 1e-8, 0.0)]
    w.copy_(w_valid)
    fused_linear_update(rules.get("adam"), w, grad_output_t, x, [m, v], torch.tensor(1.0, device=DEVICE), hyper,
                        (1, 0, 0, 0))  # fmt: skip
    assert torch.isfinite(w).all() and (m != 0).all() and (v != 0).all()
    assert torch.equal(x, x_before) and torch.equal(grad_output_t, g_before)
    # step 1 of Adam moves each weight by lr * sign(g) (up to eps): a check that needs no reference
    g = grad_output_t.double() @ x.double()
    torch.testing.assert_close((w_valid.double() - w.double()), 1e-2 * torch.sign(g), atol=1e-6, rtol=1e-4)


def test_kernel_rejects_mismatched_shapes():
    w = torch.zeros(4, 5, device=DEVICE)
    hyper = [torch.tensor(0.1, dtype=torch.float64, device=DEVICE)] * 5
    with pytest.raises(ValueError, match="grad_output_t"):
        fused_linear_update(rules.get("adam"), w, torch.zeros(4, 3, device=DEVICE), torch.zeros(2, 5, device=DEVICE),
                            [w.clone(), w.clone()], torch.tensor(1.0, device=DEVICE), hyper, (1, 0, 0, 0))  # fmt: skip


@pytest.mark.parametrize("split", [1, 2, 4], ids=["whole-tile", "split-epilogue", "quartered-epilogue"])
def test_tile_configs_match_float64_reference(split):
    """An explicit tile config, with the rule on the whole tile or on its two or four
    column slices in turn, computes Adam: several tiles and edge tiles on both axes."""
    import triton

    from forge_compile.kernels import linear_update

    block = 16 if not ON_GPU else 64
    M, N, T = 5 * block + 3, 3 * block + 7, 2 * block + 5
    w = torch.randn(M, N, device=DEVICE)
    m, v = 0.1 * torch.randn(M, N, device=DEVICE), 0.01 * torch.rand(M, N, device=DEVICE)
    grad_output_t, x = torch.randn(T, M, device=DEVICE).t(), torch.randn(T, N, device=DEVICE)
    lr, beta1, beta2, eps, wd, step = 1e-2, 0.9, 0.999, 1e-8, 0.1, 3.0
    hyper = [torch.tensor(h, dtype=torch.float64, device=DEVICE) for h in (lr, beta1, beta2, eps, wd)]
    ref_w, ref_m, ref_v, _ = _reference(w, m, v, v, grad_output_t.double() @ x.double(), step, lr, beta1, beta2, eps,
                                        wd, (1, 0, 0, 1))  # fmt: skip
    tile = triton.Config({"BLOCK_M": block, "BLOCK_N": block, "BLOCK_K": 16, "GROUP_M": 2, "EPILOGUE_SPLIT": split},
                         num_warps=4 if ON_GPU else 1)  # fmt: skip
    states = [m.clone(), v.clone()]
    with linear_update.only_config(tile):
        fused_linear_update(rules.get("adam"), w, grad_output_t, x, states, torch.tensor(step, device=DEVICE), hyper,
                            (1, 0, 0, 1))  # fmt: skip
    torch.testing.assert_close(w.double(), ref_w, atol=2e-6, rtol=0)
    torch.testing.assert_close(states[0].double(), ref_m, atol=2e-6, rtol=1e-3)
    torch.testing.assert_close(states[1].double(), ref_v, atol=2e-7, rtol=1e-3)


class _Bf16OperandAdamWProblem:
    """bf16 dY^T (a transposed view) and X, fp32 weight and AdamW states, and the float64
    result of one step; :meth:`check_update` runs the op on copies and compares."""

    def __init__(self, M, N, T):
        self.w = torch.randn(M, N, device=DEVICE)
        self.m, self.v = 0.1 * torch.randn(M, N, device=DEVICE), 0.01 * torch.rand(M, N, device=DEVICE)
        self.grad_output_t = torch.randn(T, M, device=DEVICE).to(torch.bfloat16).t()
        self.x = torch.randn(T, N, device=DEVICE).to(torch.bfloat16)
        lr, beta1, beta2, eps, wd, self.step = 1e-2, 0.9, 0.999, 1e-8, 0.1, 3.0
        self.hyper = [torch.tensor(h, dtype=torch.float64, device=DEVICE) for h in (lr, beta1, beta2, eps, wd)]
        self.expected = _reference(self.w, self.m, self.v, self.v, self.grad_output_t.double() @ self.x.double(),
                                   self.step, lr, beta1, beta2, eps, wd, (1, 0, 0, 1))[:3]  # fmt: skip

    def check_update(self):
        weight, states = self.w.clone(), [self.m.clone(), self.v.clone()]
        fused_linear_update(rules.get("adam"), weight, self.grad_output_t, self.x, states,
                            torch.tensor(self.step, device=DEVICE), self.hyper, (1, 0, 0, 1))  # fmt: skip
        ref_w, ref_m, ref_v = self.expected
        torch.testing.assert_close(weight.double(), ref_w, atol=2e-6, rtol=0)
        torch.testing.assert_close(states[0].double(), ref_m, atol=2e-6, rtol=1e-3)
        torch.testing.assert_close(states[1].double(), ref_v, atol=2e-7, rtol=1e-3)


@pytest.mark.skipif(not ON_GPU, reason="the chunked path's GPU tiles are tuned for CUDA (cuBLAS writes the gradient)")
@pytest.mark.parametrize("tile", GIVEN_GRADIENT_TILES, ids=lambda t: "{}x{}x{}_w{}_s{}_r{}".format(*t))
def test_every_chunked_path_candidate_matches_float64_reference(tile, monkeypatch):
    """Each candidate of the chunked path's kernel (the rule on the fp32 gradient block cuBLAS
    wrote), on blocks of rows with edge tiles on both axes and a partial last block, against
    float64: the rows' offsets into the weight and states must land each block in place."""
    from forge_compile.config import config
    from forge_compile.kernels import linear_update

    m, n = tile[:2]
    M, N, T = 5 * m + 3, 2 * n + 37, 77
    monkeypatch.setattr(linear_update, "_CHUNK_ELEMENTS", 2 * m * N)  # blocks of 2m rows: three, the last partial
    monkeypatch.setattr(config, "linear_update_path", "chunked")
    problem = _Bf16OperandAdamWProblem(M, N, T)
    with linear_update.only_config(linear_update.tile_config(tile, 1)):
        problem.check_update()


@pytest.mark.skipif(not ON_GPU, reason="the GPU's tile configs (16 warps, 64-column halves) compile for CUDA only")
@pytest.mark.parametrize("tile", GPU_TILES, ids=lambda t: "{}x{}x{}_w{}_s{}_r{}".format(*t))
def test_every_gpu_candidate_config_matches_float64_reference(tile):
    """Each of the autotuner's GPU candidates (bf16 operands, fp32 weight and states) on a
    weight of several tiles with edge tiles on both axes, against float64."""
    from forge_compile.kernels import linear_update

    m, n, k = tile[:3]
    M, N, T = 2 * m + 37, 3 * n + 5, 4 * k + 9
    problem = _Bf16OperandAdamWProblem(M, N, T)
    for split in linear_update.EPILOGUE_SPLITS:
        with linear_update.only_config(linear_update.tile_config(tile, split)):
            problem.check_update()


@pytest.mark.skipif(not ON_GPU, reason="the GPU's tile configs (16 warps, 64-column halves) compile for CUDA only")
@pytest.mark.parametrize("tile", GPU_TILES, ids=lambda t: "{}x{}x{}_w{}_s{}_r{}".format(*t))
def test_every_gpu_candidate_rounds_stochastically_with_the_torch_paths_bits(tile):
    """bf16 weight, stochastic rounding: each GPU candidate draws each element's random
    bits from its row-major index, as the torch path does, on a weight with edge tiles on
    both axes. Operands in {-1, 0, 1} keep dW exact on both paths, so the fp32 updates
    agree to an ulp; bits drawn for another element would change about half of the
    weights that the rounding moves."""
    from forge_compile import ops
    from forge_compile.config import config
    from forge_compile.kernels import linear_update

    m, n, k = tile[:3]
    M, N, T = 2 * m + 37, 3 * n + 5, 4 * k + 9
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(M, N, generator=g).to(torch.bfloat16).to(DEVICE)
    moments = [0.1 * torch.randn(M, N, generator=g).to(DEVICE), 0.01 * torch.rand(M, N, generator=g).to(DEVICE)]
    grad_output_t = torch.randint(-1, 2, (T, M), generator=g).to(torch.bfloat16).to(DEVICE).t()
    x = torch.randint(-1, 2, (T, N), generator=g).to(torch.bfloat16).to(DEVICE)
    step = torch.tensor(3.0, device=DEVICE)
    hyper = [torch.tensor(h, dtype=torch.float64, device=DEVICE) for h in (1e-3, 0.9, 0.999, 1e-8, 0.1)]
    kernel_config = linear_update.tile_config(tile, 2)
    results = []
    for kernel in ("triton", "torch"):
        w, states = weight.clone(), [s.clone() for s in moments]
        before, config.kernel = config.kernel, kernel
        try:
            with linear_update.only_config(kernel_config):
                ops.fused_linear_update_(w, grad_output_t, x, states, step, hyper, "adam", [1, 0, 0, 1],
                                         rounding_seed=1234)  # fmt: skip
        finally:
            config.kernel = before
        results.append(w)
    fused, torch_path = results
    moved = (torch_path != weight).float().mean().item()
    differing = (fused != torch_path).float().mean().item()
    assert moved > 0.05, f"only {moved:.1%} of the weights moved: the test cannot see the rounding's bits"
    assert differing < 1e-3, f"{differing:.2%} of the weights differ from the torch path's ({moved:.1%} moved)"


@pytest.mark.skipif(not ON_GPU, reason="compiled launches exist on the GPU only (the interpreter has none)")
def test_later_launches_go_straight_to_the_compiled_kernel_and_stay_exact():
    """A variant's first launch tunes, its second compiles through the JIT function, later
    ones call the compiled kernel's launcher: every step (new activations each time) matches
    float64, and an activation view that is not 16-byte aligned, which the JIT function
    specializes differently, gets a compiled kernel of its own instead of the aligned one."""
    from forge_compile.kernels import linear_update

    M, N, T = 200, 136, 40
    lr, beta1, beta2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.1
    hyper = [torch.tensor(h, dtype=torch.float64, device=DEVICE) for h in (lr, beta1, beta2, eps, wd)]
    weight = torch.randn(M, N, device=DEVICE)
    states = [torch.zeros(M, N, device=DEVICE), torch.zeros(M, N, device=DEVICE)]
    with linear_update.only_config(linear_update.tile_config(GPU_TILES[0], 2)):
        for step in range(1, 7):
            grad_output_t = torch.randn(T, M, device=DEVICE).to(torch.bfloat16).t()
            x = torch.randn(T, N, device=DEVICE).to(torch.bfloat16)
            if step == 5:  # the same values one bf16 element into a buffer: 2-byte aligned
                x = torch.cat([x.new_zeros(1), x.flatten()])[1:].view(T, N)
                assert x.data_ptr() % 16 != 0
            ref_w, ref_m, ref_v, _ = _reference(weight, *states, states[1], grad_output_t.double() @ x.double(),
                                                float(step), lr, beta1, beta2, eps, wd, (1, 0, 0, 1))  # fmt: skip
            fused_linear_update(rules.get("adam"), weight, grad_output_t, x, states,
                                torch.tensor(float(step), device=DEVICE), hyper, (1, 0, 0, 1))  # fmt: skip
            torch.testing.assert_close(weight.double(), ref_w, atol=2e-6, rtol=0, msg=f"step {step}")
            torch.testing.assert_close(states[0].double(), ref_m, atol=2e-6, rtol=1e-3, msg=f"step {step}")
            torch.testing.assert_close(states[1].double(), ref_v, atol=2e-7, rtol=1e-3, msg=f"step {step}")
            # step 1 tunes; steps 2 (aligned) and 5 (unaligned) compile through the JIT function
            assert len(linear_update._LAUNCHES) == (0 if step == 1 else 1 if step < 5 else 2), step
