"""`make gpu-check`: validate lantern on a machine with a CUDA GPU, in one command, and write a JSON summary.

Uses the machine's own python, torch, triton and CUDA toolkit (no network, nothing pinned or installed
besides lantern itself). Steps, in order (each one's output goes to <out>/<step>.log):

  build            pip install --no-build-isolation --no-deps --no-index -e .  (lantern._C with its CUDA
                   kernels; TORCH_CUDA_ARCH_LIST defaults to 8.0;9.0 plus this GPU's architecture)
  build-checks     pytest tests/ops/test_build.py tests/ops/test_cuda_build.py with the CUDA build required
                   (SASS for sm_80 + sm_90, no register spills)
  pytest-gpu       pytest -m gpu (every test that needs the GPU)
  bench            python -m bench --json <out>/bench.json (GPU rows included)
  memcheck         compute-sanitizer --tool memcheck  python -m tools.sanitize_cuda_ops
  racecheck        compute-sanitizer --tool racecheck python -m tools.sanitize_cuda_ops
                   (both skipped, not failed, where compute-sanitizer is not installed)

Every step runs even when an earlier one fails (except that nothing runs after a failed build: it would test
an old extension). The summary (<out>/summary.json) holds each step's status, wall time and key figures, the
device and the versions; the exit status is 1 if any step failed, 2 without a CUDA device (checked first, in
seconds), else 0.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from tools.cuda_resources import cuda_home, find_tool  # noqa: E402

DEFAULT_OUT = os.path.join("bench", "results", "gpu-check")
STEPS = ("build", "build-checks", "pytest-gpu", "bench", "memcheck", "racecheck")


# ---- running steps ----------------------------------------------------------------------------------------

def run_step(name: str, argv: List[str], out_dir: str, timeout_s: float, env: Optional[Dict[str, str]] = None) -> Dict:
    """Run one step's command from the repository root, its stdout and stderr into <out_dir>/<name>.log.
    Returns {name, status: passed | failed, returncode, wall_s, command, log[, reason]}."""
    log = os.path.join(out_dir, f"{name}.log")
    result = dict(name=name, command=shlex.join(argv), log=log)
    print(f"gpu-check: {name}: {result['command']}", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            proc = subprocess.run(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  env=None if env is None else {**os.environ, **env})
            result.update(returncode=proc.returncode, status="passed" if proc.returncode == 0 else "failed")
            if proc.returncode != 0:
                result["reason"] = f"exit status {proc.returncode}"
        except subprocess.TimeoutExpired:
            result.update(returncode=None, status="failed", reason=f"timed out after {timeout_s:.0f} s")
        except OSError as e:  # the command itself could not start
            result.update(returncode=None, status="failed", reason=f"could not run: {e}")
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    print(f"gpu-check: {name}: {result['status']} in {result['wall_s']:.1f} s"
          + (f" ({result['reason']})" if "reason" in result else ""), flush=True)
    return result


def skipped(name: str, reason: str) -> Dict:
    print(f"gpu-check: {name}: skipped ({reason})", flush=True)
    return dict(name=name, status="skipped", reason=reason, wall_s=0.0)


def fail(step: Dict, reason: str) -> None:
    """Mark a step that exited 0 as failed on what its output says."""
    if step["status"] == "passed":
        step.update(status="failed", reason=reason)


# ---- key figures ------------------------------------------------------------------------------------------

def junit_counts(path: str) -> Dict[str, int]:
    """Test counts from pytest's --junitxml file: tests, passed, failed, errors, skipped."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    return dict(tests=counts["tests"], passed=counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
                failed=counts["failures"], errors=counts["errors"], skipped=counts["skipped"])


def bench_figures(path: str) -> Dict:
    """From bench's JSON rows: how many timings and ratios, and every ratio measured on the GPU."""
    with open(path) as f:
        rows = json.load(f)
    ratios = [r for r in rows if "ratio" in r]
    gpu = [dict(bench=r["bench"], case=r["case"], ratio=r["ratio"], value=round(r["value"], 4))
           for r in ratios if "cuda" in r["case"]]
    return dict(timings=len(rows) - len(ratios), ratios=len(ratios), gpu_ratios=gpu)


_ERROR_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error")
_RACECHECK_SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")


def sanitizer_figures(text: str) -> Dict:
    """compute-sanitizer's summary lines: errors (and racecheck's hazards); None when no summary was printed
    (the tool did not get to the end)."""
    errors = [int(m) for m in _ERROR_SUMMARY.findall(text)]
    figures: Dict = dict(errors=sum(errors) if errors else None)
    races = _RACECHECK_SUMMARY.findall(text)
    if races:
        figures.update(hazards=sum(int(h) for h, _, _ in races), race_warnings=sum(int(w) for _, _, w in races))
    figures["ops_ran"] = re.findall(r"sanitize_cuda_ops: (\w+) ran", text)
    figures["driver_ok"] = "sanitize_cuda_ops: OK" in text
    return figures


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _first_line(argv: List[str], pattern: str = ".") -> Optional[str]:
    """The first output line of a command matching ``pattern``, None if it cannot run."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return next((line.strip() for line in out.splitlines() if re.search(pattern, line)), None)


# ---- environment ------------------------------------------------------------------------------------------

def environment() -> Dict:
    """Python, torch (and its CUDA), triton, nvcc, driver and the device; device=None without a GPU. Never
    raises: a failing import is recorded as its error."""
    env: Dict = dict(python=sys.version.split()[0], executable=sys.executable, device=None)
    try:
        import torch
    except Exception as e:  # noqa: BLE001 (any import failure is reported, not raised)
        env["torch"] = f"import failed: {e}"
        return env
    env.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        env["triton"] = f"import failed: {e}"
    nvcc = os.path.join(cuda_home(), "bin", "nvcc")
    env["nvcc"] = _first_line([nvcc, "--version"], "release") if os.path.exists(nvcc) else None
    env["driver"] = _first_line(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    sanitizer = find_tool("compute-sanitizer")
    env["compute_sanitizer"] = sanitizer and _first_line([sanitizer, "--version"], "Version")
    if env["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, capability=f"{props.major}.{props.minor}",
                   device_memory_gib=round(props.total_memory / 2**30, 1), device_count=torch.cuda.device_count())
    return env


def arch_list(capability: str) -> str:
    """TORCH_CUDA_ARCH_LIST for the build: the caller's, else 8.0;9.0 plus this GPU's (so the kernels load)."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    archs = ["8.0", "9.0"]
    return ";".join(archs + ([capability] if capability not in archs else []))


# ---- the steps --------------------------------------------------------------------------------------------

def step_build(out_dir: str, env: Dict, timeout_s: float) -> Dict:
    build_env = dict(CUDA_HOME=cuda_home(), MAX_JOBS=os.environ.get("MAX_JOBS", str(os.cpu_count() or 4)),
                     TORCH_CUDA_ARCH_LIST=arch_list(env["capability"]))
    step = run_step("build", [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                              "--no-index", "-e", "."], out_dir, timeout_s, build_env)
    step["figures"] = dict(TORCH_CUDA_ARCH_LIST=build_env["TORCH_CUDA_ARCH_LIST"])
    return step


def step_pytest(name: str, args: List[str], out_dir: str, timeout_s: float, env: Optional[Dict[str, str]] = None) -> Dict:
    junit = os.path.join(out_dir, f"{name}.xml")
    step = run_step(name, [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
                           f"--junitxml={junit}", *args], out_dir, timeout_s, env)
    if os.path.exists(junit):
        step["figures"] = junit_counts(junit)
    if step.get("returncode") == 5:
        step["reason"] = "no tests collected"
    return step


def step_bench(out_dir: str, quick: bool, timeout_s: float) -> Dict:
    results = os.path.join(out_dir, "bench.json")
    if os.path.exists(results):
        os.remove(results)
    step = run_step("bench", [sys.executable, "-m", "bench", "--json", results, *(["--quick"] if quick else [])],
                    out_dir, timeout_s)
    if os.path.exists(results):
        step["figures"] = dict(bench_figures(results), json=results)
        if not step["figures"]["gpu_ratios"]:
            fail(step, "bench wrote no GPU rows")
    else:
        fail(step, f"bench wrote no {results}")
    return step


def step_sanitizer(tool: str, out_dir: str, timeout_s: float) -> Dict:
    sanitizer = find_tool("compute-sanitizer")
    if sanitizer is None:
        return skipped(tool, f"compute-sanitizer not found in {cuda_home()}/bin or on PATH")
    # without the caching allocator every tensor is its own allocation, so memcheck sees any overrun past it
    env = dict(PYTORCH_NO_CUDA_MEMORY_CACHING="1") if tool == "memcheck" else None
    step = run_step(tool, [sanitizer, "--tool", tool, "--error-exitcode", "99", "--print-limit", "200",
                           sys.executable, "-m", "tools.sanitize_cuda_ops"], out_dir, timeout_s, env)
    step["figures"] = figures = sanitizer_figures(_read(step["log"]))
    if figures["errors"]:
        fail(step, f"{figures['errors']} sanitizer errors")
    elif figures["errors"] is None:
        fail(step, "no ERROR SUMMARY in the output")
    elif not figures["driver_ok"]:
        fail(step, "the driver did not finish (no 'sanitize_cuda_ops: OK')")
    return step


# ---- summary ----------------------------------------------------------------------------------------------

def write_summary(path: str, summary: Dict) -> None:
    """Write the summary JSON (atomically: a reader never sees half a file)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def overall_status(steps: List[Dict]) -> str:
    return "failed" if any(s["status"] == "failed" for s in steps) else "passed"


def no_gpu_message(env: Dict) -> str:
    if not env.get("torch", "").startswith(tuple("0123456789")):
        found = f"{env['executable']} cannot import torch ({env.get('torch')})"
    else:
        found = (f"torch {env['torch']} (CUDA build {env.get('torch_cuda')}) says torch.cuda.is_available() is "
                 f"{env.get('cuda_available')}")
    return (f"gpu-check needs a CUDA GPU and a CUDA build of torch: {found}. Run `make gpu-check` on a machine "
            f"with an NVIDIA GPU, its driver, a CUDA toolkit and torch (PYTHON=... picks the python to use).")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT_OUT, help="folder for summary.json, the logs and bench.json")
    parser.add_argument("--skip", action="append", default=[], choices=STEPS, help="leave a step out (repeatable)")
    parser.add_argument("--quick-bench", action="store_true", help="python -m bench --quick")
    parser.add_argument("--step-timeout", type=float, default=3600, help="seconds allowed to each step")
    args = parser.parse_args(argv)
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    summary_path = os.path.join(out_dir, "summary.json")
    t0 = time.perf_counter()
    summary: Dict = dict(status="running", started_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                         environment=environment(), steps=[])
    env, steps = summary["environment"], summary["steps"]
    if env["device"] is None:
        print(no_gpu_message(env), file=sys.stderr)
        steps.append(dict(name="device", status="failed", reason=no_gpu_message(env), wall_s=0.0))
        summary.update(status="failed", wall_s=round(time.perf_counter() - t0, 2))
        write_summary(summary_path, summary)
        return 2
    print(f"gpu-check: {env['device']} (sm {env['capability']}), torch {env['torch']} (CUDA {env['torch_cuda']}), "
          f"triton {env.get('triton')}, {env.get('nvcc')}; results in {out_dir}", flush=True)

    runners = {
        "build": lambda: step_build(out_dir, env, args.step_timeout),
        "build-checks": lambda: step_pytest("build-checks", ["tests/ops/test_build.py", "tests/ops/test_cuda_build.py"],
                                            out_dir, args.step_timeout, dict(LANTERN_REQUIRE_CUDA_BUILD="1")),
        "pytest-gpu": lambda: step_pytest("pytest-gpu", ["-m", "gpu"], out_dir, args.step_timeout),
        "bench": lambda: step_bench(out_dir, args.quick_bench, args.step_timeout),
        "memcheck": lambda: step_sanitizer("memcheck", out_dir, args.step_timeout),
        "racecheck": lambda: step_sanitizer("racecheck", out_dir, args.step_timeout),
    }
    for name in STEPS:
        if name in args.skip:
            steps.append(skipped(name, "--skip"))
        elif steps and steps[0]["name"] == "build" and steps[0]["status"] == "failed":
            steps.append(skipped(name, "the build failed"))
        else:
            steps.append(runners[name]())
        summary["wall_s"] = round(time.perf_counter() - t0, 2)
        write_summary(summary_path, summary)  # a partial summary survives an interrupted run
    summary["status"] = overall_status(steps)
    write_summary(summary_path, summary)
    print(f"gpu-check: {summary['status']} in {summary['wall_s']:.0f} s; summary in {summary_path}")
    for step in steps:
        print(f"  {step['name']:<13} {step['status']:<8} {step['wall_s']:8.1f} s  {step.get('reason', '')}")
    return 1 if summary["status"] == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
