"""Timing helpers: medians over repeats, ratios measured in the same run (this machine is shared and
noisy, so absolute times mean little)."""
from __future__ import annotations

import json
import os
import statistics
import time
from typing import Callable, Dict, List


def header() -> str:
    """The first line of a bench's printout: torch's version and when it ran."""
    import torch

    return f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}"


def median_seconds(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_medians(fns: Dict[str, Callable[[], object]], repeats: int = 7, warmup: int = 1,
                        clock: Callable[[], float] = time.perf_counter) -> Dict[str, float]:
    """Median seconds of each function, timed in alternation (a, b, c, a, b, c, ...) so that a change in the
    machine's load during the run hits every contender alike. ``clock``: time.perf_counter (wall), or
    time.process_time (this process's CPU time: with one thread, the wall time of an idle machine)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


class Report:
    """Collects rows {bench, case, impl, median_s, ...} and ratios against a named baseline."""

    def __init__(self) -> None:
        self.rows: List[Dict] = []

    def add(self, bench: str, case: str, impl: str, median_s: float, **extra) -> None:
        self.rows.append(dict(bench=bench, case=case, impl=impl, median_s=median_s, **extra))
        print(f"{bench:>18} {case:<34} {impl:<22} {1e3 * median_s:10.3f} ms", flush=True)

    def check(self, bench: str, case: str, check: str, value, shown: str) -> None:
        """A correctness figure beside the timings: a row {bench, case, check, value}, printed as ``shown``."""
        self.rows.append(dict(bench=bench, case=case, check=check, value=value))
        print(f"{bench:>18} {case:<34} {check} = {shown}", flush=True)

    def ratio(self, bench: str, case: str, slow: str, fast: str) -> float:
        times = {r["impl"]: r["median_s"] for r in self.rows
                 if r["bench"] == bench and r["case"] == case and "impl" in r}
        value = times[slow] / times[fast]
        self.rows.append(dict(bench=bench, case=case, ratio=f"{slow}/{fast}", value=value))
        print(f"{bench:>18} {case:<34} {slow} / {fast} = {value:.2f}x", flush=True)
        return value

    def write(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.rows, f, indent=2)
        print(f"wrote {path}")


def cuda_median_seconds(fn: Callable[[], object], repeats: int = 20, warmup: int = 3) -> float:
    """Median seconds of a GPU call: CUDA events around each call (the first calls compile / autotune)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def triton_rows_skipped(bench: str) -> bool:
    """True (after printing why) when the Triton rows of ``bench`` cannot run: they need a CUDA device
    (the interpreter would time Python, not the kernels) and triton."""
    import torch

    reason = None
    if not torch.cuda.is_available():
        reason = "no CUDA device"
    else:
        try:
            import triton  # noqa: F401
        except ImportError:
            reason = "triton is not installed"
    if reason is not None:
        print(f"{bench:>18} triton rows skipped: {reason}", flush=True)
    return reason is not None
