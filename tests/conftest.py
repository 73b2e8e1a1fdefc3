"""Shared pytest setup. Puts tests/ on sys.path so test modules can import helpers kept here
(e.g. ``from neighbour_check import assert_neighbours_valid``)."""
import os
import sys

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

# Without a GPU the Triton kernels run under Triton's interpreter on CPU tensors. triton reads this when a
# kernel is defined, so it must be set before lantern_kernels is imported.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


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
