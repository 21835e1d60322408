"""How many machine instructions each rule adds to the fused kernel's epilogue, on Hopper,
counted without a GPU: Triton compiles the kernel for sm_90 and its bundled cuobjdump
lists the SASS.

For one tile config (default 64x128x64, 8 warps, 4 stages, the rule on column halves)
and each rule with its usual options, in bf16 with round-to-nearest and with stochastic
rounding, the kernel's SASS instruction count is compared with plain SGD's (no momentum,
no states: loads, stores and the matmul loop with next to no rule). The epilogue has no
loop, so the difference over the elements a thread owns (BLOCK_M x BLOCK_N / threads) is
the rule's cost per weight element, executed once each.

Why it matters: the epilogue alone (T = 16) ran no faster than torch's fused AdamW
(results/kernel_anatomy.json). At ~100 instructions per element, 58.7 M elements of a
14336x4096 weight are ~0.2 ms of instruction issue on an H100 (132 SMs x 4 schedulers x
1.755 GHz), about its 0.235 ms memory floor: the epilogue is issue-bound as well as
memory-bound. About half of Adam's count is the IEEE division and square root
(``tl.div_rn``, ``tl.sqrt_rn``) that keep its fp32 update equal to torch's to the bit:
the same rule with approximate ones compiled to 36.8 instructions per element instead of
75.8 (a trial edit of rules/adam.py, not kept).

    PYTHONPATH=. python benchmarks/kernel_sass.py      # writes results/kernel_sass.json
    PYTHONPATH=. python benchmarks/kernel_sass.py --resources kernel   # results/kernel_resources.json
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.utils import write_result  # noqa: E402

# (rule, options) with the options of a usual run: AdamW, SGD with momentum, ...
RULES = [
    ("sgd", (0, 0, 0, 0)), ("sgd", (1, 0, 0, 1)), ("adam", (1, 0, 0, 1)), ("adam", (1, 1, 0, 1)),
    ("nadam", (1, 0, 1)), ("radam", (1, 0, 1)), ("adagrad", (0, 1)), ("rmsprop", (0, 1, 0, 1)), ("lion", (0, 1)),
]  # fmt: skip
REFERENCE = ("sgd", (0, 0, 0, 0), False)
_POINTERS = {"w_ptr", "a_ptr", "b_ptr", "s0_ptr", "s1_ptr", "s2_ptr", "q0_ptr", "q1_ptr", "q2_ptr"}
_UNIT_STRIDES = ("stride_wn", "stride_s0n", "stride_s1n", "stride_s2n", "stride_am", "stride_bn")
_ALIGNED = ("M", "N", "K", "stride_wm", "stride_s0m", "stride_s1m", "stride_s2m", "stride_ak", "stride_bk")


def compiled_cubin(rule: str, options: tuple, stochastic: bool, tile: dict, warps: int, stages: int,
                   registers: int | None = None):  # fmt: skip
    """The fused kernel for ``rule`` compiled for sm_90: (cubin bytes, shared memory bytes).
    bf16 weight, states and operands, strides as a contiguous launch specialises them;
    ``registers`` caps ptxas's registers a thread (the config's maxnreg)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from forge_compile.kernels import linear_update

    fn = linear_update._fused_linear_update_kernel.fn
    names = fn.arg_names
    plan = linear_update._launch_plan(rule, options, False, stochastic, False, False, False, "ieee")
    constants = dict(INDEX_64=False, **plan.constexprs, **tile, **{name: 1 for name in _UNIT_STRIDES})
    signature = {}
    for name in names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in _POINTERS:
            signature[name] = "*bf16"
        elif name == "step_ptr":
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):  # the hyperparameters, fp64 tensors
            signature[name] = "*fp64"
        else:
            signature[name] = "fp32" if name in ("grad_min", "grad_max") else "i32"
    aligned = [n for n in names if signature[n].startswith("*") or n in _ALIGNED]
    source = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})  # fmt: skip
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages, "maxnreg": registers})  # fmt: skip
    return kernel.asm["cubin"], kernel.metadata.shared


def _cuobjdump(cubin: bytes, flag: str) -> str:
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(cuobjdump), flag, str(path)], capture_output=True, text=True, check=True).stdout


def sass_instructions(rule: str, options: tuple, stochastic: bool, tile: dict, warps: int, stages: int) -> int:
    """The SASS instruction count of the fused kernel for ``rule`` (see :func:`compiled_cubin`)."""
    cubin, _ = compiled_cubin(rule, options, stochastic, tile, warps, stages)
    sass = _cuobjdump(cubin, "-sass")
    return sum(1 for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line))


# Hopper's per-SM limits: 64K 32-bit registers, allocated per warp in units of 256; 228 KiB
# of shared memory, of which each program reserves 1 KiB; 64 warps.
_REGISTERS_PER_SM, _SHARED_PER_SM, _WARPS_PER_SM = 65536, 233472, 64


def resources(rule: str, options: tuple, stochastic: bool, tile: dict, warps: int, stages: int,
              registers: int | None = None) -> dict:  # fmt: skip
    """Registers a thread, spill stack, shared memory and how many programs an SM holds."""
    cubin, shared = compiled_cubin(rule, options, stochastic, tile, warps, stages, registers)
    usage = _cuobjdump(cubin, "-res-usage")
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = _REGISTERS_PER_SM // (per_warp * warps)
    by_shared = _SHARED_PER_SM // (shared + 1024)
    return {"registers": registers, "spill_stack_bytes": stack, "shared_bytes": shared,
            "programs_per_sm_by_registers": by_registers, "programs_per_sm_by_shared": by_shared,
            "programs_per_sm": min(by_registers, by_shared, _WARPS_PER_SM // warps)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tile", default="64x128x64", help="BLOCK_MxBLOCK_NxBLOCK_K")
    parser.add_argument("--warps", type=int, default=8)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--resources", default=None, metavar="CONFIGS",
                        help="instead: registers, spills, shared memory and programs an SM of these configs "
                             "(kernel_configs.py names; \"kernel\": the autotuning candidates), AdamW with "
                             "round-to-nearest and stochastic rounding -> results/kernel_resources.json")
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)  # compiled, not interpreted
    if args.resources:
        return _resources_main(args.resources)
    m, n, k = map(int, args.tile.split("x"))
    tile = dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=8, EPILOGUE_SPLIT=2)
    elements_per_thread = m * n / (32 * args.warps)
    reference = sass_instructions(*REFERENCE, tile, args.warps, args.stages)
    rows = []
    for rule, options in RULES:
        for stochastic in (False, True):
            count = sass_instructions(rule, options, stochastic, tile, args.warps, args.stages)
            rows.append({"rule": rule, "options": list(options), "rounding": "stochastic" if stochastic else "nearest",
                         "sass_instructions": count,
                         "per_element_over_plain_sgd": (count - reference) / elements_per_thread})  # fmt: skip
            print(f"{rule:8} {str(options):14} {rows[-1]['rounding']:10} {count:6} instructions, "
                  f"{rows[-1]['per_element_over_plain_sgd']:6.1f} per element over plain SGD", flush=True)
    write_result("kernel_sass", {"tile": args.tile, "warps": args.warps, "stages": args.stages,
                                 "reference": "sgd without momentum, round-to-nearest",
                                 "reference_instructions": reference, "rows": rows})  # fmt: skip
    return 0


def _resources_main(spec: str) -> int:
    from benchmarks.kernel_configs import candidates

    rows = []
    for name, config in candidates(spec):
        for stochastic in (False, True):
            row = {"config": name, "rule": "adamw", "rounding": "stochastic" if stochastic else "nearest",
                   **resources("adam", (1, 0, 0, 1), stochastic, dict(config.kwargs), config.num_warps,
                               config.num_stages, config.maxnreg)}  # fmt: skip
            rows.append(row)
            print(f"{name:26} {row['rounding']:10} {row['registers']:4} registers, spill stack "
                  f"{row['spill_stack_bytes']:3} B, shared {row['shared_bytes'] // 1024:4} KiB, "
                  f"{row['programs_per_sm']} programs an SM", flush=True)
    write_result("kernel_resources", {"target": "sm_90", "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
