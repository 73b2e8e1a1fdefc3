"""`make gpu-check`: validate lantern on a machine with a CUDA GPU in one budgeted run, from a bare machine.

    python -m tools.gpu_check [--budget SECONDS] [--out DIR] [--skip STEP]... [--rehearse]

Uses the machine's own python, torch, triton and CUDA toolkit (no network, nothing installed besides lantern
itself). The steps, most important first (tools/gpu_check_steps.py runs each in a subprocess of its own):

  build        pip install --no-build-isolation --no-deps --no-index -e .  (MAX_JOBS = cores; TORCH_CUDA_ARCH_LIST
               defaults to this GPU's architecture only, which halves nvcc's work)
  selfcheck    import lantern and lantern.kernels, lantern.build_info(), every fused kernel's self-check on the GPU
  ops          every CUDA and Triton op against the CPU kernels on a bounded, representative set of cases (one
               autotune configuration per Triton kernel: LANTERN_TRITON_CONFIGS=first)
  e2e          the tiny model on the GPU: greedy tokens equal the CPU path's; AR vs LANTERN vs SJD at batch 1 / 8 /
               64, eager and CUDA graphs (torch.compile mode reduce-overhead), against compiled AR; a profile of
               one batch-1 LANTERN run with CUDA graphs (host ops, launches and kernels per step)
  cost_curve   LlamaGen GPT-B and GPT-XL shapes, random bf16 weights: the target's forward time over 1..64 tree
               nodes at batch 1, 8, 32 (CUDA graphs), and the speed-up it projects with the tiny model's tau
  microbench   each op at LlamaGen shapes: time and achieved bandwidth against the device's measured copy
               bandwidth
  memcheck     compute-sanitizer --tool memcheck on one call of each CUDA op (tools/sanitize_cuda_ops.py)
  sample       one `lantern sample` inside an nccl process group (torchrun; one rank per GPU)

Budget: each step's time limit is its share (by weight) of the time left when it starts, so a step that ends
early leaves more to the ones after it; a step whose share is below its minimum is skipped, and a step that
runs out of time is stopped with what it measured so far. Every step catches its own failure; a step that
passed no check is "failed". A failed build skips the steps that need it.

Output (--out, default bench/results/gpu-check): two files, each rewritten atomically after every step:
summary.json (status, environment, per step: status, wall and limit seconds, checks passed / failed, key
figures, the first error lines of a failure; the issue's targets with their measured values) and
logs.tar.gz (each step's log and full results). Exit status: 0 all passed, 1 a step failed, 2 no GPU.

--rehearse runs the same script on the CPU: device cpu, tiny sizes, no build, the Triton kernels under the
interpreter, no compute-sanitizer (the driver's calls on the cpu backend), gloo instead of nccl; CI runs it
(tests/test_gpu_check.py) so that the script meets its bugs there, not on the GPU machine.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from tools.cuda_resources import cuda_home, find_tool  # noqa: E402

DEFAULT_OUT = os.path.join("bench", "results", "gpu-check")
DEFAULT_BUDGET_S = 480.0
RESERVE_S = 10.0  # kept back for the last summary and tarball


@dataclass(frozen=True)
class Step:
    name: str
    weight: float  # share of the time left, against the steps still to run
    min_s: float  # below this share the step is skipped rather than started
    needs_build: bool = True


# Weights from the first H200 runs (2026-11-27, docs/gpu/): build 23-33 s, selfcheck 13-22 s, ops 46-50 s,
# cost_curve 14-20 s, microbench 14-21 s, memcheck 13-17 s; e2e needed more than its 139 s for batch 8 with
# CUDA graphs (each graph contender's first call compiles for 25-55 s) and sample more than 48 s. Triton's
# cache is shared by the steps, so selfcheck and ops compile the kernels the later steps use.
STEPS = (
    Step("build", 2.0, 60.0, needs_build=False),
    Step("selfcheck", 0.8, 20.0),
    Step("ops", 1.2, 30.0),
    Step("e2e", 4.0, 40.0),
    Step("cost_curve", 0.6, 30.0),
    Step("microbench", 0.6, 20.0),
    Step("memcheck", 0.5, 20.0),
    Step("sample", 1.2, 20.0),
)
STEP_NAMES = tuple(s.name for s in STEPS)
ERROR_LINE = re.compile(r"(Traceback|Error|error:|FAILED|failed|Exception|assert|Killed|Segmentation)")


# ---- budget ---------------------------------------------------------------------------------------------

def step_limit(step: Step, remaining: List[Step], time_left: float) -> float:
    """Seconds allowed to ``step``: its weight's share of the time left among itself and ``remaining`` (the
    steps after it that will run)."""
    weights = step.weight + sum(s.weight for s in remaining)
    return max(0.0, time_left) * step.weight / weights


# ---- running one step -------------------------------------------------------------------------------------

def first_error_lines(text: str, n: int = 12) -> List[str]:
    """The first ``n`` lines of a log from its first error-looking line (else its last ``n`` lines)."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if ERROR_LINE.search(line):
            return lines[i:i + n]
    return lines[-n:]


def run_command(name: str, argv: List[str], log: str, timeout_s: float, env: Optional[Dict[str, str]] = None) -> Dict:
    """Run ``argv`` from the repository root, stdout and stderr into ``log``. Returns {returncode, wall_s,
    command[, reason]}; never raises (a command that cannot start or runs out of time is a reason)."""
    result: Dict = dict(command=shlex.join(argv))
    print(f"gpu-check: {name}: {result['command']} (limit {timeout_s:.0f} s)", flush=True)
    t0 = time.perf_counter()
    with open(log, "a") as f:
        try:
            proc = subprocess.run(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=max(timeout_s, 1.0),
                                  env=None if env is None else {**os.environ, **env})
            result["returncode"] = proc.returncode
            if proc.returncode != 0:
                result["reason"] = f"exit status {proc.returncode}"
        except subprocess.TimeoutExpired:
            result.update(returncode=None, reason=f"stopped at its time limit ({timeout_s:.0f} s)")
        except OSError as e:
            result.update(returncode=None, reason=f"could not run: {e}")
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    return result


def read_json(path: str) -> Optional[Dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def judge(name: str, run: Dict, results: Optional[Dict], log_text: str) -> Dict:
    """A step's entry in the summary from its command's outcome and the results it wrote: passed only if the
    command succeeded, no check failed and at least one check passed."""
    entry: Dict = dict(name=name, wall_s=run["wall_s"])
    if results is not None and results.get("skip") and run.get("returncode") == 0:
        return dict(entry, status="skipped", reason=results["skip"])
    checks = dict(passed=0, failed=0)
    if results is not None:
        checks = dict(passed=int(results.get("passed", 0)), failed=int(results.get("failed", 0)))
        entry["figures"] = results.get("figures", {})
        if results.get("errors"):
            entry["errors"] = list(results["errors"])[:12]
        if results.get("left_out"):
            entry["left_out"] = list(results["left_out"])
    entry["checks"] = checks
    reason = run.get("reason")
    if reason is None and results is None:
        reason = "the step wrote no results"
    if reason is None and checks["failed"]:
        reason = f"{checks['failed']} check(s) failed"
    if reason is None and not checks["passed"]:
        reason = "the step passed no check"
    entry["status"] = "failed" if reason else "passed"
    if reason:
        entry["reason"] = reason
        if run.get("returncode") is None and run.get("reason", "").startswith("stopped"):
            entry["log_tail"] = [line.rstrip() for line in log_text.splitlines() if line.strip()][-8:]
        if "errors" not in entry:
            entry["errors"] = first_error_lines(log_text)
    return entry


def skipped(name: str, reason: str) -> Dict:
    print(f"gpu-check: {name}: skipped ({reason})", flush=True)
    return dict(name=name, status="skipped", reason=reason, wall_s=0.0)


# ---- environment ------------------------------------------------------------------------------------------

def _first_line(argv: List[str], pattern: str = ".") -> Optional[str]:
    """The first output line of a command matching ``pattern``, None if it cannot run."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return next((line.strip() for line in out.splitlines() if re.search(pattern, line)), None)


def environment() -> Dict:
    """Python, torch (and its CUDA), triton, nvcc, driver, cores and the device; device=None without a GPU.
    Never raises: a failing import is recorded as its error."""
    env: Dict = dict(python=sys.version.split()[0], executable=sys.executable, cores=os.cpu_count(), device=None)
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
    import numpy

    env["numpy"] = numpy.__version__
    nvcc = os.path.join(cuda_home(), "bin", "nvcc")
    env["nvcc"] = _first_line([nvcc, "--version"], "release") if os.path.exists(nvcc) else None
    env["driver"] = _first_line(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    sanitizer = find_tool("compute-sanitizer")
    env["compute_sanitizer"] = sanitizer and _first_line([sanitizer, "--version"], "Version")
    if env["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                   device_memory_gib=round(props.total_memory / 2**30, 1), device_count=torch.cuda.device_count())
    return env


def arch_list(capability: str) -> str:
    """TORCH_CUDA_ARCH_LIST for the build: the caller's, else this GPU's architecture alone."""
    return os.environ.get("TORCH_CUDA_ARCH_LIST") or capability


def no_gpu_message(env: Dict) -> str:
    if not str(env.get("torch", "")).startswith(tuple("0123456789")):
        found = f"{env['executable']} cannot import torch ({env.get('torch')})"
    else:
        found = (f"torch {env['torch']} (CUDA build {env.get('torch_cuda')}) says torch.cuda.is_available() is "
                 f"{env.get('cuda_available')}")
    return (f"gpu-check needs a CUDA GPU and a CUDA build of torch: {found}. Run `make gpu-check` on a machine "
            f"with an NVIDIA GPU, its driver, a CUDA toolkit and torch (PYTHON=... picks the python to use), or "
            f"`make gpu-check GPU_CHECK_ARGS=--rehearse` to rehearse it on the CPU.")


# ---- output -----------------------------------------------------------------------------------------------

def write_atomic(path: str, data: bytes) -> None:
    """Write ``path`` whole or not at all: a reader (or a run killed mid-write) never sees half a file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_summary(path: str, summary: Dict) -> None:
    write_atomic(path, (json.dumps(summary, indent=2, default=str) + "\n").encode())


def write_tarball(path: str, work_dir: str) -> None:
    """Every file of ``work_dir`` (the steps' logs and results) as one .tar.gz."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in sorted(os.listdir(work_dir)):
            tar.add(os.path.join(work_dir, name), arcname=os.path.join("gpu-check", name))
    write_atomic(path, buffer.getvalue())


def overall_status(steps: List[Dict]) -> str:
    return "failed" if any(s["status"] == "failed" for s in steps) else "passed"


# ---- targets ----------------------------------------------------------------------------------------------

def _figure(steps: List[Dict], step: str, *path):
    """steps[step].figures[path...], None where missing."""
    value = next((s.get("figures") for s in steps if s["name"] == step), None)
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def targets(steps: List[Dict]) -> Dict:
    """The issue's GPU targets, each {value, limit, met} (met None where the run did not measure it)."""
    def target(value, limit, ok):
        return dict(value=value, limit=limit, met=None if value is None else bool(ok(value)))

    return {
        "memcheck errors": target(_figure(steps, "memcheck", "errors"), 0, lambda v: v == 0),
        "greedy tokens on the GPU equal the CPU path's": target(
            _figure(steps, "e2e", "greedy", "equal"), True, lambda v: v is True),
        "verify B=1 T=59 V=16384 time / one read of its logits at copy bandwidth": target(
            _figure(steps, "microbench", "verify_over_logits_read"), 3.0, lambda v: v <= 3.0),
        "LANTERN with CUDA graphs / compiled AR, tiny model, batch 1 (speed-up)": target(
            _figure(steps, "e2e", "speedups", "B=1", "lantern graphs"), 1.5, lambda v: v >= 1.5),
        "LANTERN with CUDA graphs / the compiled reference AR loop (bench/reference_ar.py), batch 1": target(
            _figure(steps, "e2e", "vs_reference", "B=1", "lantern graphs"), 1.5, lambda v: v >= 1.5),
        "LANTERN with CUDA graphs / the compiled reference AR loop, batch 8": target(
            _figure(steps, "e2e", "vs_reference", "B=8", "lantern graphs"), 1.2, lambda v: v >= 1.2),
        "GPT-XL shape, batch 1: 16-node tree forward / 1-node forward": target(
            _figure(steps, "cost_curve", "GPT-XL", "B=1", "t16_over_t1"), 1.3, lambda v: v <= 1.3),
    }


# ---- the run ----------------------------------------------------------------------------------------------

def build_step(work_dir: str, env: Dict, limit_s: float) -> Dict:
    log = os.path.join(work_dir, "build.log")
    build_env = dict(CUDA_HOME=cuda_home(), MAX_JOBS=os.environ.get("MAX_JOBS", str(os.cpu_count() or 4)),
                     TORCH_CUDA_ARCH_LIST=arch_list(env["capability"]))
    run = run_command("build", [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                                "--no-index", "-e", "."], log, limit_s, build_env)
    info = None
    if run.get("returncode") == 0:  # what the new build says of itself, in a fresh process
        probe = subprocess.run([sys.executable, "-c", "import lantern; print(lantern.build_info())"], cwd=ROOT,
                               capture_output=True, text=True, timeout=120)
        info = probe.stdout.strip() or probe.stderr.strip()[-500:]
        if "with CUDA kernels" not in info:
            run["reason"] = f"the build has no CUDA kernels: {info}"
    results = dict(passed=0 if run.get("reason") else 1, failed=1 if run.get("reason") else 0,
                   figures=dict(build_env, build_info=info))
    with open(log, errors="replace") as f:
        return judge("build", run, results, f.read())


def run_step(step: Step, work_dir: str, limit_s: float, rehearse: bool) -> Dict:
    """Run ``step`` (tools/gpu_check_steps.py) in a subprocess with ``limit_s`` seconds; it writes its results
    to <work_dir>/<step>.json as it goes, so a stopped step keeps what it measured."""
    log = os.path.join(work_dir, f"{step.name}.log")
    results_path = os.path.join(work_dir, f"{step.name}.json")
    deadline = time.time() + limit_s - min(15.0, 0.1 * limit_s)  # the step's own deadline, before the kill
    argv = [sys.executable, "-m", "tools.gpu_check_steps", step.name, "--work", work_dir, "--deadline",
            f"{deadline:.1f}"] + (["--rehearse"] if rehearse else [])
    env = dict(LANTERN_TRITON_CONFIGS="first", PYTHONUNBUFFERED="1")
    if rehearse:
        # one thread: on a loaded CPU, OpenMP's threads wait on each other (100x slower tiny matmuls seen)
        env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    run = run_command(step.name, argv, log, limit_s, env)
    with open(log, errors="replace") as f:
        return judge(step.name, run, read_json(results_path), f.read())


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for the whole run")
    parser.add_argument("--out", default=DEFAULT_OUT, help="folder for summary.json and logs.tar.gz")
    parser.add_argument("--skip", action="append", default=[], choices=STEP_NAMES, help="leave a step out")
    parser.add_argument("--rehearse", action="store_true", help="run on the CPU: tiny sizes, no build")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    out_dir = os.path.abspath(args.out)
    summary_path, tar_path = os.path.join(out_dir, "summary.json"), os.path.join(out_dir, "logs.tar.gz")
    work_dir = tempfile.mkdtemp(prefix="lantern-gpu-check-")
    summary: Dict = dict(status="running", rehearse=args.rehearse, budget_s=args.budget,
                         started_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"), steps=[])
    steps: List[Dict] = summary["steps"]

    def save() -> None:
        summary["wall_s"] = round(time.perf_counter() - t0, 2)
        summary["targets"] = targets(steps)
        write_summary(summary_path, summary)
        try:
            write_tarball(tar_path, work_dir)
        except OSError as e:  # the summary matters more than the logs
            summary["logs_error"] = str(e)
            write_summary(summary_path, summary)

    try:
        summary["environment"] = env = environment()
        if env["device"] is None and not args.rehearse:
            print(no_gpu_message(env), file=sys.stderr)
            steps.append(dict(name="device", status="failed", reason=no_gpu_message(env), wall_s=0.0))
            summary["status"] = "failed"
            return 2
        where = "the CPU (rehearsal)" if args.rehearse else f"{env['device']} (sm {env['capability']})"
        print(f"gpu-check on {where}: torch {env['torch']}, triton {env.get('triton')}, {env.get('nvcc')}; "
              f"budget {args.budget:.0f} s; results in {out_dir}", flush=True)
        save()
        todo = [s for s in STEPS if s.name not in args.skip]
        for step in STEPS:
            if step.name in args.skip:
                steps.append(skipped(step.name, "--skip"))
                continue
            todo.remove(step)
            time_left = args.budget - (time.perf_counter() - t0) - RESERVE_S
            limit = step_limit(step, todo, time_left)
            build = next((s for s in steps if s["name"] == "build"), None)
            if step.needs_build and build is not None and build["status"] == "failed":
                steps.append(skipped(step.name, "the build failed"))
            elif step.name == "build" and args.rehearse:
                steps.append(skipped(step.name, "rehearsal: no build (the existing one is used)"))
            elif limit < step.min_s * (0.1 if args.rehearse else 1.0):
                steps.append(skipped(step.name, f"no time left: its share is {limit:.0f} s"))
            else:
                try:
                    entry = build_step(work_dir, env, limit) if step.name == "build" else \
                        run_step(step, work_dir, limit, args.rehearse)
                except Exception as e:  # noqa: BLE001 (a bug here must not lose the summary)
                    entry = dict(name=step.name, status="failed", wall_s=0.0, reason=f"gpu-check itself: {e!r}")
                entry["limit_s"] = round(limit, 1)
                steps.append(entry)
                print(f"gpu-check: {step.name}: {entry['status']} in {entry['wall_s']:.1f} s"
                      + (f" ({entry['reason']})" if "reason" in entry else ""), flush=True)
            save()
        summary["status"] = overall_status(steps)
    finally:
        if summary["status"] == "running":
            summary["status"] = "failed"
            summary.setdefault("reason", "gpu-check was interrupted")
        save()
        summary["work_dir"] = work_dir
        print(f"gpu-check: {summary['status']} in {summary['wall_s']:.0f} s; {summary_path}, {tar_path}", flush=True)
        for step in steps:
            print(f"  {step['name']:<11} {step['status']:<8} {step['wall_s']:7.1f} s  {step.get('reason', '')}")
    return 1 if summary["status"] == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
