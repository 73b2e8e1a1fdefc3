"""Every benchmark module imports (a renamed helper in the package or another bench fails here, not on the
machine that runs the bench)."""
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
MODULES = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__main__")


def test_the_bench_folder_is_found():
    assert "bench_speedup" in MODULES and "common" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_bench_module_imports(name):
    importlib.import_module(f"bench.{name}")
