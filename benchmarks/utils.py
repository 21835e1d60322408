"""Shared pieces of the benchmarks: environment, result files, one process per measured mode."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def environment() -> dict:
    import triton

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "forge_source": forge_source_hash(),
        # forge's settings from the environment (FORGE_<NAME>, forge_compile/config.py) the run had
        "forge_settings": {k: v for k, v in sorted(os.environ.items()) if k.startswith("FORGE_")},
    }


def forge_source_hash() -> str:
    """A short hash of forge_compile's sources: which version of the code a result measured
    (the device gets the working tree without its git history)."""
    import hashlib

    digest = hashlib.sha256()
    package = Path(__file__).resolve().parent.parent / "forge_compile"
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def for_this_card(name: str) -> str:
    """The results name of a benchmark whose figures depend on the GPU: ``name`` itself on
    the H200 (the card the headline figures and results/h200_summary.json are of) or
    without a GPU, ``name_h100`` and so on elsewhere, so that one card's cases never join
    another's in a file."""
    if not torch.cuda.is_available():
        return name
    gpu = torch.cuda.get_device_name()
    if "H200" in gpu:
        return name
    model = next((word for word in gpu.replace("NVIDIA", "").replace("-", " ").split() if any(c.isdigit() for c in word)),
                 gpu)
    return f"{name}_{''.join(c for c in model.lower() if c.isalnum())}"


def write_result(name: str, payload: dict, out_dir: str | None = None) -> Path:
    """Write ``payload`` (with the environment) to results/NAME.json and, if set, to $OUT."""
    payload = {"environment": environment(), **payload}
    text = json.dumps(payload, indent=2, default=str)
    paths = [RESULTS / f"{name}.json"]
    if out_dir or os.environ.get("OUT"):
        paths.append(Path(out_dir or os.environ["OUT"]) / f"{name}.json")
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return paths[0]


def gpu_ms_by_kernel(prof, runs: int) -> dict[str, float]:
    """GPU milliseconds per run of each kernel, by its full name, in a ``torch.profiler``
    trace (CUDA activity) of ``runs`` runs."""
    from collections import defaultdict

    by_kernel = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            microseconds = getattr(event, "device_time", None) or getattr(event, "cuda_time", 0.0)
            by_kernel[event.name] += microseconds / 1e3 / runs
    return dict(by_kernel)


def run_in_subprocess(module: str, args: list[str], timeout: float = 900) -> dict:
    """Run ``python -m module args`` in a fresh process; it prints one JSON line last."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=Path(__file__).parent.parent)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def build_causal_lm(cls, config, device, dtype):
    """``cls(config)`` with seed-0 random weights created in ``dtype`` directly on ``device``
    (an 8B model never exists in fp32 or on the host)."""
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls(config)
    finally:
        torch.set_default_dtype(previous)


def causal_lm_train_step(model, optimizer):
    """A Hugging Face causal LM's training step on its own tokens as labels, loss detached."""

    def train_step(input_ids):
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return train_step
