"""tests/hf need the optional extra lantern[hf] (transformers); without it they are not collected."""
import importlib.util

import pytest

if importlib.util.find_spec("transformers") is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Neighbour tables and cost models go to a directory of the test's own."""
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))
