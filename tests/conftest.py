"""Shared pytest setup. Puts tests/ on sys.path so test modules can import helpers kept here
(e.g. ``from neighbour_check import assert_neighbours_valid``)."""
import os
import sys

import pytest

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

# Without a GPU the Triton kernels run under Triton's interpreter on CPU tensors. triton reads this when a
# kernel is defined, so it must be set before lantern_kernels is imported.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


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


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need a CUDA device: skip them cleanly without one."""
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
