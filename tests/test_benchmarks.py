"""The GPU benchmarks' own code paths, run small on the CPU so that a broken harness shows
here and not on the device: benchmarks/step.py's worker with a two-layer Llama."""

import pytest

from benchmarks import step


@pytest.mark.parametrize("mode", ["eager_fused", "hooks", "forge"])
def test_step_worker_measures_a_tiny_llama(mode):
    result = step.worker("tiny-llama", mode, batch=2, seq=16, device="cpu")
    assert result["status"] == "ok", result
    assert len(result["step_ms_all"]) == step.TIMED and result["step_ms_median"] > 0
    assert len(result["losses"]) == step.TIMED
    if mode == "forge":
        # every projection and the head: 2 layers x 7 + lm_head; the embedding and norms are not matmuls
        assert result["fused_weights"] == 15, result
        assert set(result["unfused"].values()) == {"not_a_matmul", "not_a_matrix"}, result["unfused"]
