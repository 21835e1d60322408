"""The GPU benchmarks' own code paths, run small on the CPU so that a broken harness shows
here and not on the device: benchmarks/step.py's worker with a two-layer Llama, and
benchmarks/tensor_parallel.py on two gloo ranks."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def test_tensor_parallel_benchmark_is_exact_on_two_cpu_ranks(tmp_path):
    """benchmarks/tensor_parallel.py over gloo with a tiny Llama: every projection shard
    and the head fused, the weights equal to the unsharded forge step's."""
    root = Path(__file__).resolve().parent.parent
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "benchmarks/tensor_parallel.py", "--device", "cpu", "--model", "tiny", "--seq", "16", "--steps", "2",
               "--results-dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "tensor_parallel_cpu.json").read_text())
    assert result["exactness"]["fused"] == 15, result["exactness"]
    assert result["exactness"]["relative_l2_vs_unsharded_forge"] < 1e-6, result["exactness"]
    assert all(m["status"] == "ok" for m in result["modes"].values()), result["modes"]


def test_kernel_counters_reads_ncu_raw_csv():
    """benchmarks/kernel_counters.py's reading of ``ncu --csv --page raw``: a header row, a
    units row, a row per launch; the summary keeps the named metrics and ranks the stalls."""
    from benchmarks.kernel_counters import _parse, _summary

    text = "\n".join([
        "==PROF== Connected to process 12",
        '"ID","Kernel Name","gpu__time_duration.sum","launch__registers_per_thread",'
        '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",'
        '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"',
        '"","","us","register/thread","",""',
        '"0","_fused_linear_update_kernel","365.2","128","3.2","1.1"',
        '"1","nvjet_sm90_tst_256x128","99.0","168","0.2","4.5"',
    ])  # fmt: skip
    launches = _parse(text)
    assert [launch["kernel"] for launch in launches] == ["_fused_linear_update_kernel", "nvjet_sm90_tst_256x128"]
    assert launches[0]["gpu__time_duration.sum [us]"] == "365.2"
    first, second = (_summary(launch) for launch in launches)
    assert first["launch__registers_per_thread"] == "128"
    assert list(first["top_stalls"]) == ["long_scoreboard", "barrier"]
    assert list(second["top_stalls"]) == ["barrier", "long_scoreboard"]
    assert _parse("==PROF== no kernels were profiled") == []


def test_kernel_sass_counts_the_rule_on_the_cpu():
    """benchmarks/kernel_sass.py compiles the fused kernel for sm_90 without a GPU and counts
    its SASS (in a process of its own: the tests' kernels are interpreted): Adam's
    epilogue costs more instructions than plain SGD's."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parent.parent
    code = ("from benchmarks.kernel_sass import sass_instructions\n"
            "tile = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, EPILOGUE_SPLIT=2)\n"
            "print(sass_instructions('sgd', (0, 0, 0, 0), False, tile, 8, 4),"
            " sass_instructions('adam', (1, 0, 0, 1), False, tile, 8, 4))\n"
            "from benchmarks.kernel_sass import resources\n"
            "print(*resources('adam', (1, 0, 0, 1), False, tile, 8, 4).values())\n"
            "print(resources('adam', (1, 0, 0, 1), True, tile, 8, 4, registers=96)['registers'])")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                          env={**env, "PYTHONPATH": str(root)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts, usage, capped = proc.stdout.strip().splitlines()[-3:]
    sgd, adam = map(int, counts.split())
    assert 0 < sgd < adam
    # registers, spill stack, shared memory: 4 stages of 64x64 + 64x128 bf16 operand tiles;
    # programs an SM by registers, by shared memory, overall
    registers, _, shared, by_registers, by_shared, programs = map(int, usage.split())
    assert 32 < registers <= 255 and shared >= 4 * (64 * 64 + 64 * 128) * 2
    assert by_shared == 233472 // (shared + 1024) and programs == min(by_registers, by_shared) >= 1
    assert int(capped) <= 96  # a config's register cap reaches ptxas


def test_kernel_config_names_round_trip_with_a_register_cap():
    pytest.importorskip("triton")
    from benchmarks.kernel_configs import _config, config_name, kernel_candidate_names

    capped = _config("64x128x64_w8_s4_e2_r128")
    assert (capped.maxnreg, capped.num_warps, capped.num_stages, capped.kwargs["EPILOGUE_SPLIT"]) == (128, 8, 4, 2)
    assert _config("128x128x64_w16_s4_e2").maxnreg is None
    assert config_name(64, 128, 64, 8, 4, 2, 128) == "64x128x64_w8_s4_e2_r128"
    assert all(_config(name) for name in kernel_candidate_names())
    with pytest.raises(ValueError, match="MxNxK_wW_sS_eE"):
        _config("64x128x64_w8_s4_e2_x3")


@pytest.mark.parametrize("gpu,expected", [("NVIDIA H200", "step"), ("NVIDIA H100 80GB HBM3", "step_h100"),
                                          ("NVIDIA A100-SXM4-80GB", "step_a100"), (None, "step")])  # fmt: skip
def test_results_of_each_card_go_to_their_own_file(gpu, expected, monkeypatch):
    """step.json and kernel.json hold the H200's figures; another card's runs get their own
    file, so that a run on an H100 cannot join cases the summary reads as the H200's."""
    import torch

    from benchmarks.utils import for_this_card

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu is not None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: gpu)
    assert for_this_card("step") == expected


def test_peak_composition_replays_an_allocator_trace():
    """benchmarks/peak_composition.py's replay on a hand-written trace: the peak is the
    largest live sum (not the last or the largest block), frees of blocks from before the
    trace are ignored, and allocations from one line are summed."""
    from benchmarks.peak_composition import composition, peak_of

    kernel = [{"filename": "/tmp/torchinductor_x/ab/cab.py", "line": 7, "name": "call"}]
    loss = [{"filename": "/site-packages/transformers/loss.py", "line": 3, "name": "f"}]

    def alloc(addr, size, frames):
        return {"action": "alloc", "addr": addr, "size": size, "frames": frames}

    def free(addr):
        return {"action": "free_completed", "addr": addr, "size": 0, "frames": []}

    trace = [alloc(1, 100, kernel), free(99), alloc(2, 50, kernel), alloc(3, 30, loss), free(1),
             alloc(4, 60, loss), free(2), free(3), free(4), alloc(5, 170, loss)]  # fmt: skip
    best, alive, reached_by = peak_of(trace)
    assert best == 180 and set(alive) == {1, 2, 3} and reached_by["addr"] == 3
    rows = composition(alive)
    assert [(row["bytes"], row["allocations"]) for row in rows] == [(150, 2), (30, 1)]
    assert rows[0]["source"].startswith("cab.py:7") and rows[1]["source"].endswith("loss.py:3")


def test_peak_composition_sums_what_generated_code_allocated_by_shape():
    from benchmarks.peak_composition import by_shape

    def row(source, size, count=1):
        return {"source": source, "bytes": size, "allocations": count}

    rows = [row("c.py:10  buf1 = empty_strided_cuda((1024, 14336), (14336, 1), torch.bfloat16)", 28),
            row("c.py:20  buf9 = empty_strided_cuda((1024, 14336), (14336, 1), torch.bfloat16)", 28, 2),
            row("c.py:30  buf4 = empty_strided_cuda((1024, 128256), (128256, 1), torch.bfloat16)", 250),
            row("c.py:40  buf5 = empty_strided_cuda((1024, 14336), (14336, 1), torch.float32)", 56),
            row("loss.py:3", 7)]  # fmt: skip
    assert [(g["shape"], g["bytes"], g["allocations"]) for g in by_shape(rows)] == [
        ("(1024, 128256) bfloat16", 250, 1), ("(1024, 14336) bfloat16", 56, 3),
        ("(1024, 14336) float32", 56, 1), ("other", 7, 1)]  # fmt: skip


def test_capacity_search_finds_the_largest_fitting_micro_batch():
    """Doubling from 2, then bisection; every size tried is recorded in order."""
    from benchmarks.capacity import largest_fitting

    for limit, max_batch in [(11, 256), (2, 256), (1, 256), (0, 256), (256, 256), (40, 33), (100, 1)]:
        tried = []

        def fits(batch, limit=limit):
            tried.append(batch)
            return batch <= limit

        assert largest_fitting(fits, max_batch) == min(limit, max_batch), (limit, max_batch, tried)
        assert len(tried) == len(set(tried)) and len(tried) <= 2 * max_batch.bit_length() + 1, tried
    tried = []
    largest_fitting(lambda b: tried.append(b) or b <= 11, 256)
    assert tried == [2, 4, 8, 16, 12, 10, 11]


@pytest.mark.parametrize("mode", ["eager_fused", "forge"])
def test_capacity_worker_trains_a_tiny_llama_at_each_size(mode):
    """On the CPU nothing runs out of memory: the search climbs to the cap, and forge's step,
    compiled with a dynamic batch, trains at every size."""
    from benchmarks import capacity

    result = capacity.worker("tiny-llama", mode, seq=8, max_batch=5, device="cpu")
    assert result["largest_micro_batch"] == 5, result
    assert [t["batch"] for t in result["trials"]] == [2, 4, 5] and all(t["fits"] for t in result["trials"])


def test_capacity_worker_recovers_from_a_step_that_runs_out_of_memory(monkeypatch):
    """A step that fails past 3 sequences after its backward (gradients written): the search
    records the failures, drops the gradients they left and settles on 3."""
    from benchmarks import capacity

    real = step.optimizer_step
    clean_at_start = []

    def failing_past_three(model, mode):
        train = real(model, mode)

        def run(tokens):
            clean_at_start.append(all(p.grad is None for p in model.parameters()))
            if tokens.shape[0] > 3:
                model(input_ids=tokens, labels=tokens).loss.backward()
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return train(tokens)

        return run

    monkeypatch.setattr(step, "optimizer_step", failing_past_three)
    result = capacity.worker("tiny-llama", "eager_fused", seq=8, max_batch=64, device="cpu")
    assert result["largest_micro_batch"] == 3, result
    assert [(t["batch"], t["fits"]) for t in result["trials"]] == [(2, True), (4, False), (3, True)]
    assert "simulated" in result["trials"][1]["error"]
    assert clean_at_start == [True] * 5, clean_at_start  # 2 twice, 4 once (it fails), 3 twice
    clean_at_start.clear()
    resumed = capacity.worker("tiny-llama", "eager_fused", seq=8, max_batch=64, device="cpu", known=result["trials"][:2])
    assert resumed["largest_micro_batch"] == 3 and resumed["resumed_from_trials"] == 2
    assert resumed["trials"][:2] == result["trials"][:2] and len(clean_at_start) == 2  # only 3 ran, twice


def test_capacity_keeps_the_sizes_a_stopped_worker_had_printed():
    from benchmarks.capacity import trials_printed

    stderr = b'warmup\n{"batch": 2, "fits": true, "seconds": 1.5, "peak_bytes": 10}\n{"batch": 4, "fits": false, "error": "CUDA out of memory"}\n{"batch": 3, "fi'
    assert trials_printed(stderr) == [
        {"batch": 2, "fits": True, "seconds": 1.5, "peak_bytes": 10},
        {"batch": 4, "fits": False, "error": "CUDA out of memory"},
    ]
    assert trials_printed(None) == []


def test_a_stopped_capacity_search_keeps_its_answer_where_its_trials_settle_it():
    """The H100's forge search was stopped after its last trial: 2, 4, 8 fit, 16, 12, 10 did
    not, 9 fit, so 9 is the answer. A search stopped before it knows stays failed."""
    import subprocess

    from benchmarks.capacity import settled_by, timed_out_case

    def trial(batch, fits):
        return {"batch": batch, "fits": fits}

    finished = [trial(2, True), trial(4, True), trial(8, True), trial(16, False), trial(12, False),
                trial(10, False), trial(9, True)]  # fmt: skip
    assert settled_by(finished, 256) == 9
    assert settled_by(finished[:-1], 256) is None  # 9 not yet tried
    assert settled_by([trial(2, False), trial(1, True)], 256) == 1
    assert settled_by([trial(2, False), trial(1, False)], 256) == 0
    assert settled_by([], 256) is None
    stderr = "\n".join(json.dumps(t) for t in finished).encode()
    case = timed_out_case("llama-8b", "forge", 1024, subprocess.TimeoutExpired("worker", 480, stderr=stderr), 256)
    assert case["status"] == "ok" and case["largest_micro_batch"] == 9 and "timed out after 480 s" in case["note"]
    partial = "\n".join(json.dumps(t) for t in finished[:2]).encode()
    stopped = timed_out_case("llama-8b", "forge", 1024, subprocess.TimeoutExpired("worker", 240, stderr=partial), 256)
    assert stopped["status"] == "failed" and stopped["error"] == "timed out after 240 s"
    assert stopped["trials"] == finished[:2] and "largest_micro_batch" not in stopped


def test_a_stopped_capacity_search_resumes_from_its_trials(tmp_path, monkeypatch):
    """The second run passes the stopped search's trials to its worker, which runs only the
    sizes they lack; the case is then replaced, not added beside the stopped one."""
    from benchmarks import capacity

    stopped = {"model": "tiny-llama", "mode": "forge", "seq": 8, "status": "failed", "error": "timed out after 9 s",
               "trials": [{"batch": 2, "fits": True}, {"batch": 4, "fits": True}, {"batch": 8, "fits": False}]}  # fmt: skip
    (tmp_path / "capacity.json").write_text(json.dumps({"cases": [stopped]}))
    monkeypatch.setattr(capacity, "RESULTS", tmp_path)
    monkeypatch.setattr(capacity, "for_this_card", lambda name: name)
    monkeypatch.setattr(capacity, "environment", lambda: {"date": "now"})
    ran = []

    def worker_in_this_process(module, arguments, timeout):
        known = json.loads(arguments[arguments.index("--known") + 1])
        tried = []

        def fits(batch):  # sizes up to 6 fit
            outcome = {t["batch"]: t["fits"] for t in known}.get(batch)
            if outcome is None:
                tried.append(batch)
                outcome = batch <= 6
            return outcome

        ran.append(tried)
        return {"model": "tiny-llama", "mode": "forge", "seq": 8, "status": "ok",
                "largest_micro_batch": capacity.largest_fitting(fits, 64)}  # fmt: skip

    monkeypatch.setattr(capacity, "run_in_subprocess", worker_in_this_process)
    monkeypatch.setattr(sys, "argv", ["capacity.py", "--models", "tiny-llama", "--modes", "forge", "--seq", "8"])
    assert capacity.main() == 0
    assert ran == [[6, 7]]  # 2, 4 and 8 came from the stopped search
    cases = json.loads((tmp_path / "capacity.json").read_text())["cases"]
    assert [(c["status"], c.get("largest_micro_batch")) for c in cases] == [("ok", 6)]


def test_step_buffers_replays_the_triton_wrapper_of_a_tiny_llama():
    """benchmarks/step_buffers.py on a 64-wide two-layer Llama (Triton code written in a child
    process without the interpreter). With 8192 words the unchunked step's peak holds the
    [16, 8192] logits (256 KiB); the chunked head loss holds none."""
    from helpers import last_line_outside_the_interpreter

    script = str(Path(__file__).resolve().parent.parent / "benchmarks" / "step_buffers.py")
    chunked, whole = (json.loads(last_line_outside_the_interpreter(script, "--worker", variant, "--layers", "2", "--tiny"))
                      for variant in ("forge", "forge_unchunked_head"))  # fmt: skip
    assert chunked["launches"] > 0 and chunked["alive_at_peak"]
    assert any("(16, 8192)" in alive for alive in whole["alive_at_peak"]), whole
    assert not any("8192)" in alive for alive in chunked["alive_at_peak"]), chunked
    assert chunked["peak_bytes"] < whole["peak_bytes"] / 3, (chunked, whole)


def test_head_loss_modes_compute_the_same_loss_and_update_on_a_tiny_head(monkeypatch):
    """benchmarks/head_loss.py's modes on the CPU, small: every mode's loss is
    cross-entropy's, and the forge step's head update (fused, by chunks) moves the weight
    and states as torch's fused AdamW does from the whole gradient."""
    from benchmarks import head_loss
    from forge_compile.config import config

    monkeypatch.setattr(config, "head_chunk_columns", 128)
    tokens, vocabulary, width = 24, 300, 32
    expected = None
    updated = {}
    for mode in head_loss.MODES:
        if mode == "chunked_torch_ops":
            continue  # the CPU's chunked path is already the torch ops
        inputs = head_loss.head_inputs(tokens, vocabulary, width, "cpu", lr=1e-2)  # bf16: lr 1e-5 would round away
        loss = head_loss.runner(mode)(inputs)
        expected = loss if expected is None else expected
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
        if "adamw" in mode or "update" in mode:
            updated[mode] = [inputs["weight"].detach().float(), *(s.float() for s in inputs["states"])]
    fused, reference = updated["chunked_update_fused"], updated["whole_compiled_then_fused_adamw"]
    assert (fused[0] != head_loss.head_inputs(tokens, vocabulary, width, "cpu")["weight"].float()).float().mean() > 0.5
    for actual, wanted in zip(fused, reference):
        differing = (actual - wanted).abs() > 1e-2 * wanted.abs().amax()
        assert differing.float().mean() < 0.01, f"{int(differing.sum())} of {differing.numel()} elements differ"


def test_warp_specialized_launch_path_runs_without_a_gpu():
    """launch_overhead.py --warp-specialized times the Hopper kernel's launch path with the
    compiled kernel and the card's queries stubbed: a query the path gains must be stubbed too."""
    from forge_compile.kernels import linear_update_hopper

    if not linear_update_hopper.AVAILABLE:
        pytest.skip("this Triton has no Gluon Hopper API")
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "launch_overhead.py"
    result = subprocess.run([sys.executable, str(script), "--warp-specialized"], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"warp-specialised launch path: [\d.]+ us per call", result.stdout), result.stdout


def test_step_profile_keeps_the_cases_of_other_models_and_replaces_its_own(tmp_path, monkeypatch):
    from benchmarks import step_profile, utils

    monkeypatch.setattr(step_profile, "RESULTS", tmp_path)
    monkeypatch.setattr(utils, "RESULTS", tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    earlier = [{"model": "llama-8b", "layers": 4, "batch": 1, "seq": 1024, "mode": "forge", "step_ms": 28.0},
               {"model": "qwen3-0.6b", "layers": 4, "batch": 1, "seq": 1024, "mode": "forge", "step_ms": 12.0}]  # fmt: skip
    (tmp_path / "step_profile.json").write_text(json.dumps({"cases": earlier}))

    def measured(module, arguments, timeout):
        model = arguments[arguments.index("--model") + 1]
        return {"model": model, "layers": 4, "batch": 1, "seq": 1024, "mode": arguments[-1], "step_ms": 9.0}

    monkeypatch.setattr(step_profile, "run_in_subprocess", measured)
    monkeypatch.setattr(sys, "argv", ["step_profile.py", "--model", "qwen3-0.6b", "--modes", "forge,inductor"])
    assert step_profile.main() == 0
    cases = json.loads((tmp_path / "step_profile.json").read_text())["cases"]
    by_key = {(c["model"], c["mode"]): c["step_ms"] for c in cases}
    assert by_key == {("llama-8b", "forge"): 28.0, ("qwen3-0.6b", "forge"): 9.0, ("qwen3-0.6b", "inductor"): 9.0}
    assert all("environment" in c for c in cases if c["model"] == "qwen3-0.6b")


def test_gpu_ms_by_kernel_sums_each_kernels_device_time_per_run():
    """The profiler aggregation that step_profile.py and head_loss.py share: CUDA events only,
    each kernel's time summed over the runs and divided by them, microseconds to ms."""
    from types import SimpleNamespace

    from benchmarks.utils import gpu_ms_by_kernel

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(name="gemm", device_type=cuda, device_time=300.0),
              SimpleNamespace(name="gemm", device_type=cuda, device_time=500.0),
              SimpleNamespace(name="fold", device_type=cuda, device_time=100.0),
              SimpleNamespace(name="aten::mm", device_type=cpu, device_time=9000.0)]  # fmt: skip
    trace = SimpleNamespace(events=lambda: events)
    assert gpu_ms_by_kernel(trace, runs=2) == pytest.approx({"gemm": 0.4, "fold": 0.05})
