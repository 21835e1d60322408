"""The Triton code Inductor generates from forge's lowerings compiles for a Hopper GPU,
checked on any host: Inductor writes the kernels for the CPU (``cpu_backend="triton"``),
and Triton's NVIDIA front end and ptxas, which need no GPU, compile each for sm_90.

The H100 found the first failure of this kind: Triton rejected the constant of an int64
element index that Inductor 2.11 printed in an int32 kernel ("Scalar 2348810240 is out of
range for type int32"). Torch 2.13's code casts after the sum and fails the same way.

Inductor compiles Triton kernels only outside Triton's interpreter, which the suite turns
on for the CPU (conftest.py), so each check runs in a child process without it.
"""

import json
import sys
import unittest.mock

import pytest
import torch
from helpers import last_line_outside_the_interpreter

import forge_compile  # noqa: F401  (torch.ops.forge.*)
from forge_compile import ops

triton = pytest.importorskip("triton")


def _compiled_for_hopper(function, *args) -> list[str]:
    """Compile ``function`` with Inductor's Triton code for the CPU; each kernel goes to
    Triton for an sm_90 target instead. Returns "ok" or the error of each kernel."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401  (the NVIDIA back end is there)
    except ImportError:
        return ["skip: this Triton has no NVIDIA back end"]
    import torch.utils._triton as triton_utils

    real_compile, outcomes = triton.compile, []

    class _Stop(Exception):  # the host has no Triton CPU back end to run the kernel
        pass

    def compile_for_hopper(source, target=None, options=None, **kwargs):
        try:
            kernel = real_compile(source, target=GPUTarget("cuda", 90, 32), options={})
            outcomes.append("ok" if "cubin" in kernel.asm else f"no cubin: {sorted(kernel.asm)}")
        except Exception as error:  # noqa: BLE001 - the outcome is what the test checks
            outcomes.append(f"{type(error).__name__}: {error}")
        raise _Stop

    # Without a Triton CPU back end there is no active driver to name in Inductor's cache keys.
    with unittest.mock.patch.object(triton, "compile", compile_for_hopper), \
            unittest.mock.patch.object(triton_utils, "triton_hash_with_backend", lambda: "forge-hopper-check"), \
            torch._inductor.config.patch(cpu_backend="triton", compile_threads=1, fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):  # fmt: skip
        torch._dynamo.reset()
        try:
            torch.compile(function, backend="inductor")(*args)
        except Exception:  # noqa: BLE001 - _Stop, wrapped by Inductor
            pass
    return outcomes


def _rounding_outcomes(first_row: int) -> list[str]:
    rows, step = torch.randn(37, 70), torch.tensor(7.0)
    seed = ops.rounding_seed_tensor(1, rows.device)

    def update_then_round(rows, step, seed):
        return torch.ops.forge.round_bfloat16_stochastically(rows * 0.5, step, seed, first_row)

    return _compiled_for_hopper(update_then_round, rows, step, seed)


@pytest.mark.parametrize("first_row", [0, 2**25], ids=["first-rows", "rows-2-to-the-25-in"])
def test_the_stochastic_rounding_lowering_compiles_for_hopper(first_row):
    outcomes = json.loads(last_line_outside_the_interpreter(__file__, str(first_row)))
    if outcomes and outcomes[0].startswith("skip:"):
        pytest.skip(outcomes[0][5:])
    assert outcomes == ["ok"]


if __name__ == "__main__":
    print(json.dumps(_rounding_outcomes(int(sys.argv[1]))))
