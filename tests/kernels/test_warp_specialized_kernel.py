"""The warp-specialised Hopper kernel (kernels/linear_update_hopper.py) against float64,
against the torch path's stochastic-rounding bits, and its fallback where TMA cannot
read the operands. Hopper GPUs only: Gluon kernels have no CPU interpreter."""

import pytest
import torch

from forge_compile import ops, rules
from forge_compile.config import config
from forge_compile.kernels import linear_update
from forge_compile.kernels import linear_update_hopper as hopper

from helpers import ON_GPU

ON_HOPPER = ON_GPU and hopper.AVAILABLE and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not ON_HOPPER, reason="the warp-specialised kernel runs on Hopper GPUs only")

# (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, EPILOGUE_ROWS, EPILOGUE_WARPS, EPILOGUE_REGISTERS, ASYNC_SLICES)
# With fp32 weight and states two cp.async slots fit beside a 3-stage ring and the accumulator
# (none beside forge's 4-stage one); with bf16 ones, four.
TILES = [(*linear_update.HOPPER_TILE[:7], 0), (128, 128, 64, 3, 16, 8, 112, 0), (64, 128, 64, 6, 16, 4, 192, 0),
         (128, 128, 64, 3, 16, 8, 112, 2), (128, 128, 64, 4, 32, 8, 160, 0)]  # fmt: skip
BF16_TILES = [linear_update.HOPPER_TILE, (128, 128, 64, 3, 16, 8, 112, 3), (128, 128, 64, 3, 16, 8, 112, 4),
              (128, 128, 64, 2, 32, 8, 160, 3)]  # fmt: skip
tile_id = "{}x{}x{}_s{}_rows{}_w{}_r{}_async{}".format


def _adamw_reference(w, m, v, g, step, lr, beta1, beta2, eps, wd):
    w, m, v, g = (t.double() for t in (w, m, v, g))
    w = w * (1 - lr * wd)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = v.sqrt() / (1 - beta2**step) ** 0.5 + eps
    return w - lr / (1 - beta1**step) * m / denom, m, v


@pytest.fixture
def warp_specialized(monkeypatch):
    monkeypatch.setattr(config, "warp_specialize", "always")
    launches = []
    original = hopper.launch
    monkeypatch.setattr(hopper, "launch", lambda *a, **k: (launches.append(a), original(*a, **k)))
    return launches


def _problem(M, N, T, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(M, N, generator=g).to(dtype).cuda()
    m = (0.1 * torch.randn(M, N, generator=g)).to(dtype).cuda()
    v = (0.01 * torch.rand(M, N, generator=g)).to(dtype).cuda()
    grad_output_t = torch.randn(T, M, generator=g).to(torch.bfloat16).cuda().t()
    x = torch.randn(T, N, generator=g).to(torch.bfloat16).cuda()
    return w, m, v, grad_output_t, x


HYPER = (1e-2, 0.9, 0.999, 1e-8, 0.1)


def _run_adamw(w, m, v, grad_output_t, x, step=3.0):
    hyper = [torch.tensor(h, dtype=torch.float64, device="cuda") for h in HYPER]
    weight, states = w.clone(), [m.clone(), v.clone()]
    linear_update.fused_linear_update(rules.get("adam"), weight, grad_output_t, x, states,
                                      torch.tensor(step, device="cuda"), hyper, (1, 0, 0, 1))  # fmt: skip
    return weight, states


@pytest.mark.parametrize("tile", TILES, ids=lambda t: tile_id(*t))
@pytest.mark.parametrize("tokens", [9, 265])
def test_matches_float64_reference(tile, tokens, warp_specialized, monkeypatch):
    """bf16 operands, fp32 weight and AdamW states, a weight of several tiles with partial
    tiles on both axes (rows and columns multiples of 8, as TMA needs), more programs' tiles
    than SMs in the large case, and a token count that is not a whole number of blocks."""
    monkeypatch.setattr(linear_update, "HOPPER_TILE", tile)
    shapes = [(2 * tile[0] + 40, 3 * tile[1] + 8), (4096 + 8, 2048)]
    for M, N in shapes:
        w, m, v, grad_output_t, x = _problem(M, N, tokens)
        weight, (m1, v1) = _run_adamw(w, m, v, grad_output_t, x)
        ref_w, ref_m, ref_v = _adamw_reference(w, m, v, grad_output_t.double() @ x.double(), 3.0, *HYPER)
        torch.testing.assert_close(m1.double(), ref_m, atol=2e-6, rtol=1e-3)
        torch.testing.assert_close(v1.double(), ref_v, atol=2e-7, rtol=1e-3)
        # Adam divides by sqrt(v): where a gradient sums to nearly zero, the fp32 sum's
        # rounding moves the update by up to ~1e-4 (torch's own compiled AdamW differs from
        # its eager one as much). All but a few in 10^6 elements hold 2e-6, all hold 1e-4.
        error = (weight.double() - ref_w).abs()
        assert (error > 2e-6).float().mean().item() < 1e-6 * max(1, weight.numel() / 1e6), error.max()
        assert error.max().item() < 1e-4
    assert len(warp_specialized) == 2, "the launches did not take the warp-specialised kernel"
    # cp.async copies 16-byte pieces: rows of 3 * 128 + 8 columns are loaded into registers instead.
    expected = [tile[7] if N % 16 == 0 else 0 for _, N in shapes]
    assert [launch[4]["ASYNC_SLICES"] for launch in warp_specialized] == expected


@pytest.mark.parametrize("columns,async_slices", [(272, 4), (264, 0)])
def test_rows_cp_async_cannot_copy_in_16_bytes_are_loaded_into_registers(columns, async_slices, warp_specialized,
                                                                         monkeypatch):  # fmt: skip
    """bf16 weight and states, whose four cp.async slots fit: 272 columns are copied by cp.async,
    264 (not a multiple of 16) are loaded into registers instead; both right to a bf16 ulp."""
    monkeypatch.setattr(linear_update, "HOPPER_TILE", (128, 128, 64, 3, 16, 8, 112, 4))
    w, m, v, grad_output_t, x = _problem(136, columns, 77, dtype=torch.bfloat16)
    weight, _ = _run_adamw(w, m, v, grad_output_t, x)
    ref_w, _, _ = _adamw_reference(w, m, v, grad_output_t.double() @ x.double(), 3.0, *HYPER)
    ulp = ref_w.abs() * 2.0**-8 + 1e-30
    assert ((weight.double() - ref_w).abs() <= ulp).float().mean().item() > 0.999
    assert [launch[4]["ASYNC_SLICES"] for launch in warp_specialized] == [async_slices]


def test_unaligned_operands_fall_back_to_the_portable_kernel(warp_specialized):
    """dY with 293 rows: its row stride (586 bytes) is not 16-byte aligned, so TMA cannot
    read it; the portable kernel runs and the result is still right."""
    w, m, v, grad_output_t, x = _problem(293, 136, 40)
    weight, (m1, v1) = _run_adamw(w, m, v, grad_output_t, x)
    ref_w, _, _ = _adamw_reference(w, m, v, grad_output_t.double() @ x.double(), 3.0, *HYPER)
    torch.testing.assert_close(weight.double(), ref_w, atol=2e-6, rtol=0)
    assert not warp_specialized


@pytest.mark.parametrize("several_tiles_a_program", [False, True])
@pytest.mark.parametrize("tile", BF16_TILES, ids=lambda t: tile_id(*t))
def test_rounds_stochastically_with_the_torch_paths_bits(tile, several_tiles_a_program, warp_specialized,
                                                         monkeypatch):  # fmt: skip
    """bf16 weight and bf16 states, stochastic rounding: each element's random bits come from
    its row-major index, as on the torch path. Operands in {-1, 0, 1} keep dW exact on both
    paths, so the fp32 updates agree to an ulp; bits drawn for another element would change
    about half of the weights that the rounding moves."""
    monkeypatch.setattr(linear_update, "HOPPER_TILE", tile)
    M, N, T = (4096 + 8, 2048, 265) if several_tiles_a_program else (2 * tile[0] + 40, 3 * tile[1] + 16, 4 * tile[2] + 9)
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(M, N, generator=g).to(torch.bfloat16).cuda()
    moments = [(0.1 * torch.randn(M, N, generator=g)).to(torch.bfloat16).cuda(),
               (0.01 * torch.rand(M, N, generator=g)).to(torch.bfloat16).cuda()]  # fmt: skip
    grad_output_t = torch.randint(-1, 2, (T, M), generator=g).to(torch.bfloat16).cuda().t()
    x = torch.randint(-1, 2, (T, N), generator=g).to(torch.bfloat16).cuda()
    step = torch.tensor(3.0, device="cuda")
    hyper = [torch.tensor(h, dtype=torch.float64, device="cuda") for h in (1e-3, 0.9, 0.999, 1e-8, 0.1)]
    results = []
    for kernel in ("triton", "torch"):
        w, states = weight.clone(), [s.clone() for s in moments]
        monkeypatch.setattr(config, "kernel", kernel)
        ops.fused_linear_update_(w, grad_output_t, x, states, step, hyper, "adam", [1, 0, 0, 1], rounding_seed=1234)
        results.append((w, states))
    (fused, fused_states), (torch_path, torch_states) = results
    assert len(warp_specialized) == 1 and warp_specialized[0][4]["ASYNC_SLICES"] == tile[7]
    moved = (torch_path != weight).float().mean().item()
    differing = (fused != torch_path).float().mean().item()
    assert moved > 0.05, f"only {moved:.1%} of the weights moved: the test cannot see the rounding's bits"
    assert differing < 1e-3, f"{differing:.2%} of the weights differ from the torch path's ({moved:.1%} moved)"
    for a, b in zip(fused_states, torch_states):
        assert (a != b).float().mean().item() < 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tokens", [4096, 1024, 512, 256])
def test_auto_takes_the_warp_specialized_kernel_where_it_measured_faster(tokens, dtype, monkeypatch):
    """"auto" (the default) runs it for a 2048x2048 weight (256 tiles) from 512 tokens on, and
    the portable kernel at 256 tokens, where that measured faster. bf16 weight and states
    take HOPPER_TILE's two cp.async slices; fp32 ones leave no room for them beside its
    four-stage ring, and load into registers."""
    monkeypatch.setattr(config, "warp_specialize", "auto")
    launches = []
    original = hopper.launch
    monkeypatch.setattr(hopper, "launch", lambda *a, **k: (launches.append(a), original(*a, **k)))
    w, m, v, grad_output_t, x = _problem(2048, 2048, tokens, dtype=dtype)
    weight, _ = _run_adamw(w, m, v, grad_output_t, x)
    ref_w, _, _ = _adamw_reference(w, m, v, grad_output_t.double() @ x.double(), 3.0, *HYPER)
    if dtype == torch.float32:
        # The fp32 sum of T bf16 products misses the exact dW by an error that grows with T,
        # and AdamW passes it on where m / sqrt(v) depends on g. cuBLAS's own fp32 sum of the
        # same products sizes that share: each weight may miss float64 by 2e-6 plus four times
        # what the update from cuBLAS's gradient misses by.
        cublas_w, _, _ = _adamw_reference(w, m, v, linear_update._fp32_matmul(grad_output_t, x), 3.0, *HYPER)
        allowed = 2e-6 + 4 * (cublas_w - ref_w).abs()
        beyond = ((weight.double() - ref_w).abs() > allowed).float().mean().item()
        assert beyond < 1e-5, f"{beyond:.2e} of the weights miss float64 by more than fp32 sums explain"
    else:  # rounded to nearest bf16: within half a bf16 ulp of the exact result, but for ties and fp32 sums
        assert ((weight.double() - ref_w).abs() <= ref_w.abs() * 2.0**-8 + 1e-30).float().mean().item() > 0.999
    if tokens < 512:
        assert not launches
        return
    async_slices = linear_update.HOPPER_TILE[7] if dtype == torch.bfloat16 else 0
    assert [(launch[4]["STAGES"], launch[4]["ASYNC_SLICES"]) for launch in launches] == [(4, async_slices)]
