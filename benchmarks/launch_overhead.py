"""Host time of one fused-op call, with the Triton launch itself stubbed out, or real.

What forge adds per fused weight and step before Triton's launcher runs: the op's
dispatch (``torch.ops.forge.fused_linear_update_``) and forge's own launcher code
(``kernels.linear_update.fused_linear_update``). Runs on any machine; the kernel never
executes, so no GPU is needed. ``--device cuda`` launches the real kernel on a weight so
small that its GPU time is a few microseconds: calls per second are then the host's,
Triton's launch included (results/launch_overhead_cuda.json), beside the same calls with
Triton's JIT function launching each time instead of the compiled kernel's launcher.

``--warp-specialized`` times the Hopper kernel's launch path the same way on any machine:
its descriptors, arguments and launch up to the compiled kernel's launcher, which is stubbed.

    PYTHONPATH=. python benchmarks/launch_overhead.py [--device cuda | --warp-specialized]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class _NoLaunch:
    """Stands in for the autotuned Triton kernel (and its JIT function, ``fn``):
    ``kernel[grid](...)`` does nothing."""

    def __init__(self):
        import triton

        self.best_config = triton.Config({})
        self.fn = self

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class _NeverKeeps(dict):
    """A launch cache that keeps nothing: every launch goes through the JIT function."""

    def __setitem__(self, key, value):
        pass


def _microseconds(fn, calls: int = 3000) -> float:
    for _ in range(100):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def on_gpu() -> int:
    """Host microseconds a call with the real launch, a 256x256 weight (tuned first)."""
    import forge_compile  # noqa: F401  (registers the ops)

    from benchmarks.utils import write_result

    device = torch.device("cuda")
    weight = torch.randn(256, 256, device=device)
    grad_output_t, input = torch.randn(64, 256, device=device).t(), torch.randn(64, 256, device=device)
    states = [torch.zeros_like(weight), torch.zeros_like(weight)]
    step = torch.tensor(1.0, device=device)
    hyperparameters = [torch.tensor(h, dtype=torch.float64, device=device) for h in (1e-3, 0.9, 0.999, 1e-8, 0.01)]
    op = torch.ops.forge.fused_linear_update_.default

    def call():
        op(weight, grad_output_t, input, states, step, hyperparameters, "adam", [1, 0, 0, 1])

    @torch.no_grad()  # as in forge's compiled backward
    def per_call_us(calls=2000):
        call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / calls * 1e6

    host_us = min(per_call_us() for _ in range(3))
    # The same calls with the JIT function launching each time, as before forge kept each
    # variant's compiled kernel (linear_update._LAUNCHES) to call its launcher directly.
    from forge_compile.kernels import linear_update

    kept, linear_update._LAUNCHES = linear_update._LAUNCHES, _NeverKeeps()
    try:
        through_jit_us = min(per_call_us() for _ in range(3))
    finally:
        linear_update._LAUNCHES = kept
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(per_call_us, 500)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    write_result("launch_overhead_cuda", {"host_us_per_call": host_us, "host_us_per_call_through_jit": through_jit_us,
                                          "weight": [256, 256], "tokens": 64,
                                          "profile_of_500_calls_by_own_time": text.getvalue()[-12000:]})  # fmt: skip
    print(f"fused_linear_update_ on {torch.cuda.get_device_name()}: {host_us:.1f} us of host time per call "
          f"({through_jit_us:.1f} us with the JIT function launching each time)")
    return 0


class _StubbedCompiledKernel:
    """Stands in for a compiled Gluon kernel: its launcher does nothing."""

    function = packed_metadata = None

    def run(self, *args):
        pass

    def launch_metadata(self, *args):
        return None


def warp_specialized_launch() -> int:
    """Host microseconds of the warp-specialised kernel's launch path (operand descriptors,
    arguments, the compiled-kernel lookup), a 4096x4096 bf16 weight at T = 1024, its
    compiled kernel's launcher stubbed out: runs without a GPU."""
    import triton

    from forge_compile import rules
    from forge_compile.kernels import common, linear_update
    from forge_compile.kernels import linear_update_hopper as hopper

    class _Driver:  # the current CUDA stream, as the launch asks for it
        class active:
            get_current_stream = staticmethod(lambda device: 0)
            get_current_device = staticmethod(lambda: 0)

    class _Jit:  # the JIT function, compiling nothing
        arg_names = hopper._hopper_linear_update_kernel.arg_names

        def __getitem__(self, grid):
            return lambda *args, **kwargs: _StubbedCompiledKernel()

    common.driver, hopper._hopper_linear_update_kernel = _Driver, _Jit()
    hopper.multiprocessors = lambda index: 132
    hopper.shared_memory_bytes = lambda index: 232448 - 1024  # an H100's, as the card reports it
    torch.cuda.current_device = lambda: None
    grad_output_t = torch.randn(1024, 4096, dtype=torch.bfloat16).t()
    input = torch.randn(1024, 4096, dtype=torch.bfloat16)
    weight = torch.randn(4096, 4096, dtype=torch.bfloat16)
    moments = [torch.zeros_like(weight), torch.zeros_like(weight)]
    step = torch.tensor(1.0)
    hyperparameters = [torch.tensor(h, dtype=torch.float64) for h in (1e-3, 0.9, 0.999, 1e-8, 0.01)]
    scalars = [step, *hyperparameters] + [step] * (rules.MAX_HYPERPARAMETERS - len(hyperparameters))
    plan = linear_update._launch_plan("adam", (1, 0, 0, 1), False, True, False, False, False, "ieee")

    def call():
        descriptors = hopper.operand_descriptors(grad_output_t, input, *linear_update.HOPPER_TILE[:3])
        linear_update._launch_warp_specialized(descriptors, weight, *moments, weight, scalars, 4096, 4096, 1024,
                                               None, None, 7, 0, plan, False)  # fmt: skip

    print(f"warp-specialised launch path: {_microseconds(call):.1f} us per call (triton {triton.__version__}, "
          "the compiled kernel's launcher stubbed out)")
    return 0


def main() -> int:
    if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cuda":
        return on_gpu()
    if "--warp-specialized" in sys.argv:
        return warp_specialized_launch()
    import forge_compile  # noqa: F401  (registers the ops)
    from forge_compile import rules
    from forge_compile.config import config
    from forge_compile.kernels import linear_update

    linear_update._fused_linear_update_kernel = _NoLaunch()
    config.kernel = "triton"
    weight = torch.randn(1024, 1024, requires_grad=True)
    grad_output_t, input = torch.randn(1024, 512), torch.randn(512, 1024)
    states = [torch.zeros(1024, 1024), torch.zeros(1024, 1024)]
    step = torch.tensor(1.0)
    hyperparameters = [torch.tensor(h, dtype=torch.float64) for h in (1e-3, 0.9, 0.999, 1e-8, 0.01)]
    op = torch.ops.forge.fused_linear_update_.default
    rule = rules.get("adam")
    def call():
        op(weight, grad_output_t, input, states, step, hyperparameters, "adam", [1, 0, 0, 1])

    with torch.no_grad():  # as in forge's compiled backward: the op's kernel runs from its Autograd kernel
        through_op = _microseconds(call)
    redispatched = _microseconds(call)  # grad mode on: the Autograd kernel redispatches
    launcher = _microseconds(lambda: linear_update.fused_linear_update(rule, weight, grad_output_t, input, states,
                                                                       step, hyperparameters, (1, 0, 0, 1)))  # fmt: skip
    print(f"torch.ops.forge.fused_linear_update_: {through_op:.1f} us per call with grad mode off, "
          f"{redispatched:.1f} us with it on (redispatched); forge's launcher alone: {launcher:.1f} us "
          "(Triton's launch stubbed out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
