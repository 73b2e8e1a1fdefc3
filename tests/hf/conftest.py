"""tests/hf need the optional extra lantern[hf] (transformers); without it they are not collected."""
import importlib.util

import pytest

if importlib.util.find_spec("transformers") is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Neighbour tables and cost models go to a directory of the test's own."""
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))


@pytest.fixture(autouse=True)
def _one_thread():
    """The tiny models' matrix products are microseconds of work: on a loaded machine, torch's thread pool
    spends 100x that waiting for its second thread (measured: 12.7 ms vs 0.07 ms per linear)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def janus_dir(tmp_path_factory):
    """A model directory (weights, configs, tokenizer, processor) of the tiny random Janus, built in-process."""
    from hf_models import save_janus_dir

    directory = tmp_path_factory.mktemp("janus")
    save_janus_dir(directory)
    return directory
