"""Shared pytest setup. Puts tests/ on sys.path so test modules can import helpers kept here
(e.g. ``from neighbour_check import assert_neighbours_valid``)."""
import os
import sys

import pytest

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)


def _share_the_cores():
    """Under pytest-xdist, each worker's torch (and every process it starts: the CLI tests, lantern sample)
    gets its share of the cores, cores // workers threads and at least one, unless OMP_NUM_THREADS is set.
    With torch's default (every core in every worker) the OpenMP pools of 2 workers on 2 cores spin against
    each other: tests/test_cli.py's runs took 90-100 s each instead of 11-19 s. Tests of thread counts set
    theirs explicitly (tests/ops/test_cpu_threads.py). Set before torch is imported: OpenMP reads it once."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // workers))


_share_the_cores()

# Without a GPU the Triton kernels run under Triton's interpreter on CPU tensors. triton reads this when a
# kernel is defined, so it must be set before lantern.kernels is imported.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

# lantern's decoding compiles by default (compile="auto"): a CPU compile of the tiny model takes minutes, so
# the suite decodes eagerly unless a test asks for compile=True (or sets LANTERN_COMPILE itself); the
# tests of the "auto" choice monkeypatch this variable. The CLI tests' subprocesses inherit it.
os.environ.setdefault("LANTERN_COMPILE", "0")


def _register_hypothesis_profiles():
    """"ci" (the default): hypothesis's usual 100 examples per test, derandomized, so that every run tries
    the same cases; "long" (``pytest --hypothesis-profile=long``): 20 times as many random examples, for a
    differential fuzzing session (tests/test_fuzz.py, docs/hardening.md). Both drop the per-example
    deadline (the first call of a kernel pays for its self-check, and the shared machine's load varies)."""
    from hypothesis import HealthCheck, settings

    slow = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
    settings.register_profile("ci", deadline=None, derandomize=True, suppress_health_check=slow)
    settings.register_profile("long", max_examples=2_000, deadline=None, suppress_health_check=slow,
                              print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


_register_hypothesis_profiles()


# The files that take longest on a CPU-only machine (worker-seconds of a 2-process `make test`, longest first):
# they are collected first so that pytest-xdist (--dist loadfile --no-loadscope-reorder: a whole file per
# process, handed out in collection order) starts them first and ends the run on short files, instead of one
# process still running a long file while the other waits. Every other file follows in its usual order.
# tests/test_ci_scripts.py checks that each of these files exists.
LONGEST_FILES = (
    "tests/decoding/test_triton_loop.py",
    "tests/test_sampling.py",
    "tests/test_cli.py",
    "tests/decoding/test_spec_statistics_tiny.py",
    "tests/ops/test_verify_cuda_emulated.py",
    "tests/ops/test_verify.py",
    "tests/test_cli_mar.py",
    "tests/ops/test_tree_attention_cuda_emulated.py",
    "tests/stats/test_cspd_laws.py",
    "tests/test_gpu_check.py",
    "tests/ops/test_sanitizers.py",
    "tests/decoding/test_compile_loop.py",
    "tests/decoding/test_aot.py",
    "tests/test_compile_step.py",
    "tests/hf/test_compile.py",
    "tests/decoding/test_compile_auto.py",
    "tests/ops/test_latent_neighbours.py",
)


def _longest_first(items):
    """items reordered, stably, so that the files of LONGEST_FILES come first, in its order (a file's tests keep
    their order: some tests read what the tests above them in the file recorded)."""
    rank = {path: i for i, path in enumerate(LONGEST_FILES)}

    def file_rank(item):
        return rank.get(item.nodeid.split("::", 1)[0], len(LONGEST_FILES))

    items[:] = sorted(items, key=file_rank)


def pytest_collection_modifyitems(config, items):
    """The longest files first (``_longest_first``). Tests marked ``gpu`` need a CUDA device: skip them cleanly
    without one. Without one, the triton backend's tests run under Triton's interpreter (every program in
    Python, 10-30x the cpu backend's time): they are marked ``slow``, so that ``make test-fast``
    (-m "not slow") leaves them to ``make test``."""
    import pytest
    import torch

    _longest_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not item.keywords: that also holds folder names
            item.add_marker(skip)
        elif _kernel_test_backend(item) == "triton":
            item.add_marker(pytest.mark.slow)


FUSED_BACKENDS = ("cpu", "cuda", "triton")


def _kernel_test_backend(item):
    """The fused backend a test runs on (its ``backend`` parameter, or the statistical harness's
    ``verify_backend``), None for any other test."""
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    backend = params.get("backend", params.get("verify_backend"))
    return backend if backend in FUSED_BACKENDS else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """No vacuous kernel tests: a test run on a fused backend (a ``backend`` or ``verify_backend`` parameter
    of cpu, cuda or triton) fails if a kernel it called had been disabled by its self-check (the reference ran
    in its place, so the test compared the reference with itself), or if it ran none of the backend's kernels
    at all (the kernels count their calls: ``lantern._backend.kernel_calls``). A test this cannot apply to says
    why with
    ``@pytest.mark.no_kernel_check(reason)``: its input is rejected before any kernel runs, or it calls
    torch.ops.lantern.* itself (opcheck, a compiled graph), which nothing could reroute and the counters do
    not see."""
    backend = _kernel_test_backend(item)
    exempt = item.get_closest_marker("no_kernel_check")
    if backend is None or exempt is not None:
        if exempt is not None and not exempt.args:
            raise AssertionError("no_kernel_check needs a reason")
        return (yield)
    from lantern import _backend

    before = _backend.kernel_calls()
    result = yield
    after = _backend.kernel_calls()

    def grown(kind):
        return sorted(op for (name, op), n in after[kind].items()
                      if name == backend and n > before[kind].get((name, op), 0))

    disabled = grown("disabled")
    if disabled:
        report = {key: why for key, why in _backend.self_check_report().items() if key[0] == backend and why}
        raise AssertionError(f"the self-check disabled the {backend} kernel of {', '.join(disabled)}, so this test ran "
                             f"the reference in its place: {report}")
    if not grown("ran"):
        raise AssertionError(f"this test ran no {backend} kernel (if that is its point, mark it no_kernel_check with "
                             f"the reason)")
    return result


@pytest.fixture(autouse=True)
def _simulated_rounding():
    """LANTERN_TEST_ROUNDING=shape (an audit, not CI): every test runs under tests/rounding.py's one-ulp
    rounding by call shape, as CPUs with AVX-512 / AMX and GPUs round; =threads: by shape and thread count. A
    test that then fails compares results of matrix products of different shapes (or thread counts) bit for
    bit. (torch.compile'd calls see the thread count the test started with: =threads misleads there.)"""
    mode = os.environ.get("LANTERN_TEST_ROUNDING")
    if mode not in ("shape", "threads"):
        yield
        return
    from rounding import shape_dependent_rounding

    with shape_dependent_rounding(threads=mode == "threads"):
        yield
