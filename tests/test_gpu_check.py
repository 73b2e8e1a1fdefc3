"""`make gpu-check` (tools/gpu_check.py, tools/gpu_check_steps.py) and its compute-sanitizer driver
(tools/sanitize_cuda_ops.py) without a GPU: the budget, the step runner and its verdicts, the output files,
the targets, the no-GPU exit, the driver's cases, and the whole script rehearsed on the CPU."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from tools import gpu_check, sanitize_cuda_ops  # noqa: E402

FAKE_GPU = dict(python="3", executable=sys.executable, device="Fake GPU", capability="9.0", torch="2.0",
                torch_cuda="13.0", cuda_available=True, triton="3.0", nvcc=None, driver=None, compute_sanitizer=None)


def test_each_step_gets_its_weights_share_of_the_time_left():
    a, b, c = (gpu_check.Step(n, w, 1.0) for n, w in (("a", 3.0), ("b", 1.0), ("c", 2.0)))
    assert gpu_check.step_limit(a, [b, c], 120.0) == pytest.approx(60.0)
    assert gpu_check.step_limit(b, [c], 60.0) == pytest.approx(20.0)  # a ended early: more for the rest
    assert gpu_check.step_limit(c, [], 40.0) == pytest.approx(40.0)
    assert gpu_check.step_limit(c, [], -5.0) == 0.0
    assert [s.name for s in gpu_check.STEPS] == ["build", "selfcheck", "ops", "e2e", "cost_curve", "microbench",
                                                 "memcheck", "sample"]


def test_run_command_records_exit_time_and_log(tmp_path):
    log = str(tmp_path / "x.log")
    ok = gpu_check.run_command("ok", [sys.executable, "-c", "print('hello')"], log, 60)
    assert ok["returncode"] == 0 and "reason" not in ok and ok["wall_s"] >= 0 and open(log).read() == "hello\n"
    bad = gpu_check.run_command("bad", [sys.executable, "-c", "import sys; sys.exit(3)"], log, 60)
    assert bad["returncode"] == 3 and bad["reason"] == "exit status 3"
    slow = gpu_check.run_command("slow", [sys.executable, "-c", "import time; time.sleep(30)"], log, 1.0)
    assert slow["returncode"] is None and slow["reason"].startswith("stopped at its time limit") and slow["wall_s"] < 20
    missing = gpu_check.run_command("missing", [str(tmp_path / "no-such-tool")], log, 60)
    assert "could not run" in missing["reason"]
    env = gpu_check.run_command("env", [sys.executable, "-c", "import os; print(os.environ['GC_X'])"],
                                str(tmp_path / "env.log"), 60, dict(GC_X="42"))
    assert env["returncode"] == 0 and open(tmp_path / "env.log").read() == "42\n"


def test_first_error_lines_start_at_the_first_error():
    log = "setting up\ncompiling\nTraceback (most recent call last):\n  File x\nValueError: bad\n" + "more\n" * 20
    assert gpu_check.first_error_lines(log, n=3) == ["Traceback (most recent call last):", "  File x",
                                                     "ValueError: bad"]
    assert gpu_check.first_error_lines("a\nb\nc\n", n=2) == ["b", "c"]  # no error line: the end


def test_judge_passes_only_a_step_that_passed_a_check_and_failed_none():
    ok = dict(returncode=0, wall_s=1.0)
    assert gpu_check.judge("s", ok, dict(passed=3, failed=0, figures=dict(x=1)), "")["status"] == "passed"
    none = gpu_check.judge("s", ok, dict(passed=0, failed=0), "log line\n")
    assert none["status"] == "failed" and none["reason"] == "the step passed no check"
    failed = gpu_check.judge("s", ok, dict(passed=5, failed=1, errors=["verify cuda == cpu: 0.98 of rows"]), "")
    assert failed["status"] == "failed" and failed["errors"] == ["verify cuda == cpu: 0.98 of rows"]
    crashed = gpu_check.judge("s", dict(returncode=1, wall_s=1.0, reason="exit status 1"), None,
                              "start\nRuntimeError: CUDA error: an illegal memory access\nmore")
    assert crashed["status"] == "failed" and crashed["errors"][0].startswith("RuntimeError: CUDA error")
    stopped = gpu_check.judge("s", dict(returncode=None, wall_s=9.0, reason="stopped at its time limit (9 s)"),
                              dict(passed=2, failed=0, figures=dict(partial=True)), "a\nb\nstill timing B=64\n")
    assert stopped["status"] == "failed" and stopped["figures"] == dict(partial=True)
    assert stopped["log_tail"][-1] == "still timing B=64"
    skip = gpu_check.judge("s", ok, dict(passed=0, failed=0, skip="compute-sanitizer not found"), "")
    assert skip["status"] == "skipped" and skip["reason"] == "compute-sanitizer not found"


def test_output_files_are_written_whole(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "a.log").write_text("log a")
    out = tmp_path / "out"
    gpu_check.write_summary(str(out / "summary.json"), dict(steps=[]))
    gpu_check.write_tarball(str(out / "logs.tar.gz"), str(work))
    assert sorted(os.listdir(out)) == ["logs.tar.gz", "summary.json"]  # no temporary file left behind
    assert json.load(open(out / "summary.json")) == dict(steps=[])
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert tar.extractfile("gpu-check/a.log").read() == b"log a"
    assert gpu_check.overall_status([dict(status="passed"), dict(status="skipped")]) == "passed"
    assert gpu_check.overall_status([dict(status="passed"), dict(status="failed")]) == "failed"


def test_targets_read_the_steps_figures():
    steps = [dict(name="memcheck", figures=dict(errors=0)), dict(name="e2e", figures=dict(
        greedy=dict(equal=True), speedups={"B=1": {"lantern graphs": 1.2}},
        vs_reference={"B=1": {"lantern graphs": 1.6}, "B=8": {"lantern graphs": 1.1}})),
        dict(name="cost_curve", figures={"GPT-XL": {"B=1": dict(t16_over_t1=1.1)}})]
    found = gpu_check.targets(steps)
    assert found["memcheck errors"]["met"] is True
    assert found["greedy tokens on the GPU equal the CPU path's"]["met"] is True
    assert found["LANTERN with CUDA graphs / compiled AR, tiny model, batch 1 (speed-up)"] == dict(
        value=1.2, limit=1.5, met=False)
    assert found["LANTERN with CUDA graphs / the compiled reference AR loop (bench/reference_ar.py), batch 1"] == dict(
        value=1.6, limit=1.5, met=True)
    assert found["LANTERN with CUDA graphs / the compiled reference AR loop, batch 8"]["met"] is False
    assert found["GPT-XL shape, batch 1: 16-node tree forward / 1-node forward"]["met"] is True
    assert found["verify B=1 T=59 V=16384 time / one read of its logits at copy bandwidth"]["met"] is None


def test_arch_list_is_this_gpu_unless_set(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    assert gpu_check.arch_list("9.0") == "9.0"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    assert gpu_check.arch_list("9.0") == "8.0;9.0"


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
    assert sorted(os.listdir(tmp_path)) == ["logs.tar.gz", "summary.json"]


def test_a_failed_build_skips_the_steps_that_need_it(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "environment", lambda: dict(FAKE_GPU))
    monkeypatch.setattr(gpu_check, "build_step", lambda work_dir, env, limit_s: dict(
        name="build", status="failed", reason="exit status 1", wall_s=1.0))
    assert gpu_check.main(["--out", str(tmp_path)]) == 1
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["status"] == "failed" and summary["environment"]["device"] == "Fake GPU"
    assert [(s["name"], s["status"]) for s in summary["steps"]] == [("build", "failed")] + [
        (name, "skipped") for name in gpu_check.STEP_NAMES[1:]]
    assert all(s["reason"] == "the build failed" for s in summary["steps"][1:])


def test_a_step_without_time_is_skipped_and_the_summary_survives_a_crash(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "environment", lambda: dict(FAKE_GPU))

    def crash(step, work_dir, limit_s, rehearse):
        raise RuntimeError("a bug in gpu-check")

    monkeypatch.setattr(gpu_check, "run_step", crash)
    skip = [arg for name in gpu_check.STEP_NAMES[:-1] for arg in ("--skip", name)]
    assert gpu_check.main(["--out", str(tmp_path), "--budget", "1000", *skip]) == 1
    last = json.load(open(tmp_path / "summary.json"))["steps"][-1]
    assert last["status"] == "failed" and "a bug in gpu-check" in last["reason"]
    assert gpu_check.main(["--out", str(tmp_path), "--budget", "20", *skip]) == 0  # 10 s left < sample's 20
    last = json.load(open(tmp_path / "summary.json"))["steps"][-1]
    assert last["status"] == "skipped" and last["reason"].startswith("no time left")


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


@pytest.mark.slow
def test_rehearsal_runs_every_step_on_the_cpu(tmp_path):
    """`make gpu-check` rehearsed (--rehearse: device cpu, tiny sizes, no build, Triton under the interpreter,
    gloo): every step but the build passes its checks, within its budget, into two files."""
    budget = 900
    run = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--rehearse", "--budget", str(budget), "--out",
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=budget + 120)
    summary = json.load(open(tmp_path / "summary.json"))
    failed = {s["name"]: (s.get("reason"), s.get("errors")) for s in summary["steps"] if s["status"] != "passed"}
    assert run.returncode == 0, (failed, run.stdout[-3000:], run.stderr[-3000:])
    assert sorted(os.listdir(tmp_path)) == ["logs.tar.gz", "summary.json"]
    assert summary["rehearse"] is True and summary["wall_s"] <= budget
    steps = {s["name"]: s for s in summary["steps"]}
    assert list(steps) == list(gpu_check.STEP_NAMES)
    assert steps["build"]["status"] == "skipped"
    for name in gpu_check.STEP_NAMES[1:]:
        assert steps[name]["status"] == "passed" and steps[name]["checks"]["passed"] > 0, name
    assert steps["e2e"]["figures"]["greedy"]["equal"] is True
    assert "lantern eager" in steps["e2e"]["figures"]["seconds"]["B=1"]
    assert steps["e2e"]["figures"]["vs_reference"]["B=1"]["reference graphs"] == 1.0  # the anchor ran
    assert steps["cost_curve"]["figures"]["GPT-XL"]["B=1"]["T=16"] > 0
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert all(f"gpu-check/{name}.log" in names for name in gpu_check.STEP_NAMES[1:])
