"""forge's settings: one dataclass, each field overridable as ``FORGE_<NAME>``.

Example::

    forge_compile.config.kernel = "torch"      # or FORGE_KERNEL=torch in the environment
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

_KERNELS = ("auto", "triton", "torch")
_PATHS = ("auto", "fused", "chunked")
_WARP_SPECIALIZE = ("auto", "always", "never")


@dataclass(kw_only=True)
class ForgeConfig:
    fuse: bool = True
    """Rewrite linear weight updates into the fused op. False compiles exactly what
    backend="inductor" would (the update still runs as Inductor pointwise kernels),
    which is the A/B baseline for benchmarks and a switch for debugging."""

    kernel: str = "auto"
    """Implementation of the fused op: "auto" (Triton on CUDA, torch ops elsewhere),
    "triton" (also on CPU under TRITON_INTERPRET=1, for tests), or "torch"."""

    autotune: bool = True
    """Tune the fused kernel's tile shapes per weight shape. Read when the kernel module is
    first imported; FORGE_AUTOTUNE=0 runs one fixed config (quick tests)."""

    linear_update_path: str = "fused"
    """How the Triton op computes on a GPU: "fused" (the gradient tile lives in registers),
    "chunked" (cuBLAS writes the fp32 gradient of a block of rows, which a Triton kernel
    consumes at once, so no more than that block ever exists), or "auto": whichever the
    first call for a shape measures faster, remembered on disk."""

    warp_specialize: str = "auto"
    """On Hopper GPUs, where the warp-specialised kernel applies (kernels/linear_update_hopper.py:
    bf16/fp16 operands TMA can read, states not 8-bit), whether to run it instead of the
    portable Triton kernel: "auto" for the weights and token counts where it measured faster
    (see linear_update.warp_specialized_kernel_wins), "always", or "never"."""

    recompute_activations: bool = True
    """In a compiled step with a backward, recompute the pointwise values the backward reads
    (norm outputs, activation products, casts) there instead of keeping them from the
    forward, as AOTAutograd's partitioner does for ``backend="inductor"`` training graphs
    (forge's one-graph step is never partitioned). Lowers the step's peak memory; see
    passes/recompute_activations.py."""

    chunk_head_loss: bool = True
    """In a compiled step, compute ``cross_entropy(linear(hidden, weight).float())`` (a
    causal LM's head and loss) over chunks of the vocabulary, so that the logits and their
    gradient never exist whole, and fuse the head's update chunk by chunk; see head_loss.py
    and passes/chunk_head_loss.py."""

    head_chunk_columns: int = 0
    """Vocabulary columns per chunk of the chunked head loss; 0 takes forge's choice
    (head_loss.chunk_columns: 4096, whatever the number of tokens)."""

    dump_dir: str | None = None
    """A folder for each compiled graph's post-grad graph before and after the rewrite,
    its decisions (JSON) and Inductor's output code (see forge_compile.dump). Graphs are
    compiled without Inductor's caches while it is set, so every file is written."""

    decision_cache: bool = True
    """Keep each compiled graph's fusion decisions on disk beside Inductor's cache, so
    that explain() reports them when Inductor serves the graph from its cache."""

    def __setattr__(self, name, value):
        if name not in {f.name for f in fields(self)}:
            raise AttributeError(f"forge: unknown setting {name!r}; settings: {[f.name for f in fields(self)]}")
        super().__setattr__(name, value)
        if name == "kernel" and value not in _KERNELS:
            raise ValueError(f"forge: config.kernel must be one of {_KERNELS}, got {value!r}")
        if name == "warp_specialize" and value not in _WARP_SPECIALIZE:
            raise ValueError(f"forge: config.warp_specialize must be one of {_WARP_SPECIALIZE}, got {value!r}")
        if name == "linear_update_path" and value not in _PATHS:
            raise ValueError(f"forge: config.linear_update_path must be one of {_PATHS}, got {value!r}")
        if name == "head_chunk_columns" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"forge: config.head_chunk_columns must be a whole number of columns, 0 to choose them "
                             f"from the tokens, got {value!r}")  # fmt: skip


def _from_environment() -> ForgeConfig:
    overrides = {}
    for f in fields(ForgeConfig):
        raw = os.environ.get(f"FORGE_{f.name.upper()}")
        if raw is None:
            continue
        if f.type in ("bool", bool):
            if raw.lower() not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(f"forge: FORGE_{f.name.upper()}={raw!r} is not a boolean (use 0 or 1)")
            overrides[f.name] = raw.lower() in ("1", "true", "yes", "on")
        elif f.type in ("int", int):
            if not raw.strip().isdigit():
                raise ValueError(f"forge: FORGE_{f.name.upper()}={raw!r} is not a whole number")
            overrides[f.name] = int(raw)
        else:
            overrides[f.name] = raw
    return ForgeConfig(**overrides)


config = _from_environment()
