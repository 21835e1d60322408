"""The buffers of forge's compiled step as a GPU would allocate them, measured without a GPU.

Inductor writes a GPU's Triton code for the CPU too (``cpu_backend="triton"``): the same
kernels and wrapper, the same allocations and frees, only for another device. This
compiles a training step of a Llama-3.1-8B-wide model of ``--layers`` layers (bf16 weights
and states, micro-batch 1 x 1024) that far, keeps the wrapper before its kernels would be
built (a host may have no Triton CPU back end), and replays its allocations: the peak of
the step's own buffers (weights, optimizer states and the batch are the caller's, not
counted), where it falls, what is alive there and how many kernels the step launches. The
8B step on an H100 moved as this predicted (2-layer step 0.657 -> 0.446 GiB with the
logits' gradient written in place, the H100's 8B peak 48.27 -> 48.05 GiB).

Buffers that an extern op returns (attention outputs, the chunked head loss's results) and
the temporaries inside such ops are not in the wrapper's allocations and not counted.

    python benchmarks/step_buffers.py --layers 8 --variants forge,forge_unchunked_head

Writes results/step_buffers_cpu.json (one case per torch version, layers and variant; a
case measured again replaces the old one). Each case runs in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.utils import RESULTS, environment  # noqa: E402

VARIANTS = {
    "forge": {},
    "forge_unchunked_head": {"chunk_head_loss": False},
}
_ALLOCATION = re.compile(r"^\s*(buf\w+) = empty_strided_\w+\(\(([^)]*)\), \(([^)]*)\), torch\.(\w+)\)")
_REUSE = re.compile(r"^\s*(buf\w+) = (?:reinterpret_tensor\()?(buf\w+)\b.*; del (buf\w+)\s+# reuse")
_DELETION = re.compile(r"^\s*del (buf\w+)\s*$")
_LAUNCH = re.compile(r"\.run\(|extern_kernels\.|torch\.ops\.")


def replay(code: str) -> dict:
    """The wrapper's own buffers replayed: each from its ``empty_strided`` to its ``del``,
    carried over where a buffer is reused under a new name. Returns the peak in bytes, the
    launch it falls at and the buffers alive there (largest first)."""
    lines = code[code.index("def call(self, args):"):].splitlines()
    alive: dict[str, tuple[int, str]] = {}
    current = peak = 0
    at, alive_at_peak = "", {}
    for line in lines:
        if match := _ALLOCATION.match(line):
            name, shape, stride, dtype = match.groups()
            sizes = [int(s) for s in shape.split(",") if s.strip()]
            strides = [int(s) for s in stride.split(",") if s.strip()]
            elements = 1 + sum((size - 1) * step for size, step in zip(sizes, strides)) if sizes else 1
            alive[name] = (elements * getattr(torch, dtype).itemsize, f"{tuple(sizes)} {dtype}")
            current += alive[name][0]
        elif match := _REUSE.match(line):
            new, old, _ = match.groups()
            if old in alive:
                alive[new] = alive.pop(old)
        elif (match := _DELETION.match(line)) and match.group(1) in alive:
            current -= alive.pop(match.group(1))[0]
        elif _LAUNCH.search(line) and not line.lstrip().startswith("#") and current > peak:
            peak, at, alive_at_peak = current, line.strip()[:120], dict(alive)
    largest = sorted(alive_at_peak.values(), key=lambda item: -item[0])
    return {"peak_bytes": peak, "peak_at": at, "alive_at_peak": [f"{b / 2**20:.1f} MiB {what}" for b, what in largest[:12]],
            "launches": sum(bool(_LAUNCH.search(line)) and not line.lstrip().startswith("#") for line in lines)}  # fmt: skip


def written_wrapper(run, *patches) -> str:
    """The last wrapper Inductor writes while ``run()`` compiles, with Triton kernels for the
    CPU (``cpu_backend="triton"``: a GPU's code for another device). The kernels are written,
    not built: the host may have no Triton CPU back end, and ``run`` failing on that is
    expected. ``patches``: context managers entered around the run."""
    import contextlib
    import unittest.mock

    import torch.utils._triton as triton_utils
    from torch._inductor.graph import GraphLowering

    codes = []
    original = GraphLowering.codegen

    def codegen(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        codes.append(getattr(result[0], "value", result[0]))
        return result

    with contextlib.ExitStack() as stack:
        stack.enter_context(unittest.mock.patch.object(GraphLowering, "codegen", codegen))
        stack.enter_context(unittest.mock.patch.object(triton_utils, "triton_hash_with_backend", lambda: "forge-triton-code"))
        stack.enter_context(torch._inductor.config.patch(cpu_backend="triton", compile_threads=1, fx_graph_cache=False))
        for patch in patches:
            stack.enter_context(patch)
        torch._dynamo.reset()
        try:
            run()
        except Exception:  # noqa: BLE001 - the kernels cannot be built here; the wrapper was written before
            pass
    if not codes:
        raise RuntimeError("Inductor wrote no wrapper")
    return codes[-1]


def wrapper_code(layers: int, settings: dict, tiny: bool = False) -> str:
    """Inductor's wrapper for the step, with Triton kernels for the CPU (written, not built)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import forge_compile
    from benchmarks.utils import build_causal_lm, causal_lm_train_step

    for name, value in settings.items():
        setattr(forge_compile.config, name, value)
    shape = (dict(hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=1, vocab_size=8192)
             if tiny else dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                               head_dim=128, vocab_size=128256))  # fmt: skip
    config = LlamaConfig(num_hidden_layers=layers, max_position_embeddings=2048, attn_implementation="sdpa",
                         tie_word_embeddings=False, use_cache=False, **shape)  # fmt: skip
    model = build_causal_lm(LlamaForCausalLM, config, torch.device("cpu"), torch.bfloat16)
    step = torch.compile(causal_lm_train_step(model, forge_compile.optim.AdamW(model.parameters(), lr=1e-5)),
                         backend="forge")  # fmt: skip
    return written_wrapper(lambda: step(torch.randint(0, config.vocab_size, (1, 16 if tiny else 1024))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--tiny", action="store_true", help="a 64-wide model: the smoke test's")
    parser.add_argument("--worker", metavar="VARIANT", help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, default=RESULTS / "step_buffers_cpu.json")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(replay(wrapper_code(args.layers, VARIANTS[args.worker], args.tiny))))
        return 0
    previous = json.loads(args.output.read_text()) if args.output.exists() else {"cases": []}
    for variant in args.variants.split(","):
        command = [sys.executable, __file__, "--worker", variant, "--layers", str(args.layers)] + (["--tiny"] * args.tiny)
        child = subprocess.run(command, capture_output=True, text=True, timeout=3000)
        if child.returncode != 0:
            raise RuntimeError(f"{variant}: {child.stderr[-3000:]}")
        result = {"variant": variant, "layers": args.layers, "tiny": args.tiny, **json.loads(child.stdout.splitlines()[-1]),
                  "environment": environment()}  # fmt: skip
        key = lambda case: (case["variant"], case["layers"], case["tiny"], case["environment"]["torch"])  # noqa: E731
        previous["cases"] = [case for case in previous["cases"] if key(case) != key(result)] + [result]
        args.output.write_text(json.dumps(previous, indent=1))
        print(json.dumps({k: result[k] for k in ("variant", "layers", "peak_bytes", "launches")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
