"""The parts of `make gpu-check` (tools/gpu_check.py) and its compute-sanitizer driver
(tools/sanitize_cuda_ops.py) that run without a GPU: the step runner, the figures read from pytest / bench /
compute-sanitizer output, the summary, the no-GPU exit, and the driver's cases (run here on the CPU backend)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from tools import gpu_check, sanitize_cuda_ops  # noqa: E402


def test_run_step_records_status_time_and_log(tmp_path):
    ok = gpu_check.run_step("ok", [sys.executable, "-c", "print('hello')"], str(tmp_path), 60)
    assert ok["status"] == "passed" and ok["returncode"] == 0 and ok["wall_s"] >= 0
    assert open(ok["log"]).read() == "hello\n"
    bad = gpu_check.run_step("bad", [sys.executable, "-c", "import sys; sys.exit(3)"], str(tmp_path), 60)
    assert bad["status"] == "failed" and bad["returncode"] == 3 and bad["reason"] == "exit status 3"
    slow = gpu_check.run_step("slow", [sys.executable, "-c", "import time; time.sleep(30)"], str(tmp_path), 0.5)
    assert slow["status"] == "failed" and "timed out" in slow["reason"] and slow["wall_s"] < 20
    missing = gpu_check.run_step("missing", [str(tmp_path / "no-such-tool")], str(tmp_path), 60)
    assert missing["status"] == "failed" and "could not run" in missing["reason"]
    env = gpu_check.run_step("env", [sys.executable, "-c", "import os; print(os.environ['GC_X'])"], str(tmp_path),
                             60, dict(GC_X="42"))
    assert open(env["log"]).read() == "42\n"


def test_junit_counts(tmp_path):
    path = tmp_path / "r.xml"
    path.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="1" failures="2" '
                    'skipped="3" tests="10" time="1.0"></testsuite></testsuites>')
    assert gpu_check.junit_counts(str(path)) == dict(tests=10, passed=4, failed=2, errors=1, skipped=3)


def test_bench_figures_keep_the_gpu_ratios(tmp_path):
    rows = [dict(bench="verify", case="B=1 cpu", impl="cpu kernel", median_s=0.1),
            dict(bench="verify", case="B=1 cpu", ratio="reference/cpu kernel", value=900.0),
            dict(bench="verify", case="B=1 T=59 V=16384 k=1000 cuda", impl="triton kernel", median_s=1e-4),
            dict(bench="verify", case="B=1 T=59 V=16384 k=1000 cuda", ratio="reference (cuda)/triton kernel",
                 value=12.345678)]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(rows))
    assert gpu_check.bench_figures(str(path)) == dict(timings=2, ratios=2, gpu_ratios=[
        dict(bench="verify", case="B=1 T=59 V=16384 k=1000 cuda", ratio="reference (cuda)/triton kernel",
             value=12.3457)])


def test_sanitizer_figures():
    clean = ("sanitize_cuda_ops: compact_kv ran\nsanitize_cuda_ops: verify ran\nsanitize_cuda_ops: OK (2 ops)\n"
             "========= ERROR SUMMARY: 0 errors\n")
    assert gpu_check.sanitizer_figures(clean) == dict(errors=0, ops_ran=["compact_kv", "verify"], driver_ok=True)
    racy = ("========= RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warning)\n"
            "========= ERROR SUMMARY: 2 errors\n")
    assert gpu_check.sanitizer_figures(racy) == dict(errors=2, hazards=3, race_warnings=1, ops_ran=[],
                                                     driver_ok=False)
    assert gpu_check.sanitizer_figures("Segmentation fault\n")["errors"] is None


def test_summary_is_written_whole_and_status_follows_the_steps(tmp_path):
    path = str(tmp_path / "out" / "summary.json")
    steps = [dict(name="a", status="passed"), dict(name="b", status="skipped")]
    gpu_check.write_summary(path, dict(steps=steps))
    assert json.load(open(path)) == dict(steps=steps) and os.listdir(tmp_path / "out") == ["summary.json"]
    assert gpu_check.overall_status(steps) == "passed"
    assert gpu_check.overall_status(steps + [dict(name="c", status="failed")]) == "failed"


def test_arch_list_adds_this_gpu(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    assert gpu_check.arch_list("9.0") == "8.0;9.0"
    assert gpu_check.arch_list("8.9") == "8.0;9.0;8.9"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "10.0")
    assert gpu_check.arch_list("9.0") == "10.0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without a GPU")
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_without_a_gpu_fails_fast_with_a_clear_message(tmp_path):
    t0 = time.perf_counter()
    run = subprocess.run(["make", "--no-print-directory", "gpu-check", f"PYTHON={sys.executable}",
                          f"GPU_CHECK_ARGS=--out {tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0, run.stdout + run.stderr
    assert "needs a CUDA GPU" in run.stderr and "is_available() is False" in run.stderr
    assert time.perf_counter() - t0 < 120
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["status"] == "failed" and [s["name"] for s in summary["steps"]] == ["device"]
    assert summary["environment"]["torch"] == torch.__version__


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without a GPU")
def test_sanitizer_driver_without_a_gpu_says_so(capsys):
    assert sanitize_cuda_ops.main() == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_sanitizer_driver_has_a_case_for_every_cuda_source():
    assert sanitize_cuda_ops.cuda_ops(), "no csrc/cuda/*.cu"
    assert sanitize_cuda_ops.missing_cases(sanitize_cuda_ops.cuda_ops()) == []
    assert sanitize_cuda_ops.missing_cases(["compact_kv", "new_op"]) == ["new_op"]


@pytest.mark.parametrize("op", sorted(sanitize_cuda_ops.CASES))
def test_sanitizer_cases_are_valid_calls(op):
    """Each case's calls pass the public op's checks and run through the fused wrappers (the cpu backend on CPU
    tensors; on the GPU the same calls reach the CUDA kernels)."""
    import lantern

    calls = sanitize_cuda_ops.CASES[op](torch.device("cpu"))
    assert calls
    with lantern.fused("cpu"):
        for call in calls:
            call()


FAKE_GPU = dict(python="3", executable=sys.executable, device="Fake GPU", capability="9.0", torch="2.0",
                torch_cuda="13.0", cuda_available=True, triton="3.0", nvcc=None, driver=None, compute_sanitizer=None)


def test_a_failed_build_skips_the_rest_and_fails_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "environment", lambda: dict(FAKE_GPU))
    monkeypatch.setattr(gpu_check, "step_build", lambda out_dir, env, timeout_s: dict(
        name="build", status="failed", reason="exit status 1", wall_s=1.0))
    assert gpu_check.main(["--out", str(tmp_path)]) == 1
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["status"] == "failed" and summary["environment"]["device"] == "Fake GPU"
    assert [(s["name"], s["status"]) for s in summary["steps"]] == [("build", "failed")] + [
        (name, "skipped") for name in gpu_check.STEPS[1:]]


def test_missing_compute_sanitizer_is_a_skip_not_a_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "environment", lambda: dict(FAKE_GPU))
    monkeypatch.setattr(gpu_check, "find_tool", lambda name: None)
    skip = [arg for name in ("build", "build-checks", "pytest-gpu", "bench") for arg in ("--skip", name)]
    assert gpu_check.main(["--out", str(tmp_path), *skip]) == 0
    steps = json.load(open(tmp_path / "summary.json"))["steps"]
    assert [s["status"] for s in steps] == ["skipped"] * len(gpu_check.STEPS)
    assert "compute-sanitizer not found" in steps[-1]["reason"]
