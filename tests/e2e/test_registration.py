"""backend="forge" resolves in a process that never imports forge_compile (the entry point)."""

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

SCRIPT = """
import sys, torch
def f(x):
    return (x * 2).sum()
out = torch.compile(f, backend="forge")(torch.ones(3))
assert out.item() == 6.0
print("forge_compile imported by torch:", "forge_compile" in sys.modules)
"""


@pytest.mark.skipif(
    not any(e.name == "forge" for e in entry_points(group="torch_dynamo_backends")),
    reason="forge-compile is not pip-installed here (no entry point)",
)
def test_backend_name_resolves_without_importing_forge_compile():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "forge_compile imported by torch: True" in proc.stdout


def test_importing_twice_registers_once():
    import importlib

    import forge_compile

    importlib.reload(forge_compile)  # a second registration would raise "duplicate name: forge"
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("forge") is not None
