"""Test set-up: CPU runs use Triton's interpreter; every test starts with a fresh Dynamo."""

import os
import sys
from pathlib import Path

# The kernel tests run Triton kernels on the CPU through the interpreter, which must be
# chosen before triton is imported. A machine with a GPU runs them natively.
if "TRITON_INTERPRET" not in os.environ and not Path("/dev/nvidia0").exists():
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))  # benchmarks/, for the README check

import pytest  # noqa: E402
import torch  # noqa: E402

import forge_compile  # noqa: E402, F401


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def seeded():
    # FORGE_TEST_SEED reruns the suite on other data: no test may depend on a lucky seed.
    torch.manual_seed(int(os.environ.get("FORGE_TEST_SEED", "0")))


@pytest.fixture
def no_inductor_cache():
    """Compile for real: Inductor's caches would serve graphs without running forge's pass."""
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield
