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


@pytest.fixture(scope="module")
def emu3_dir(tmp_path_factory):
    """A model directory of the tiny random Emu3 and its tokenizer and processor, built in-process."""
    from hf_models import save_emu3_dir

    directory = tmp_path_factory.mktemp("emu3")
    save_emu3_dir(directory)
    return directory


@pytest.fixture
def emu3_generation_size(monkeypatch):
    """Emu3Processor's generation size set to the tiny Emu3's image (hf_models.EMU3_GENERATION_SIZE)."""
    from transformers import Emu3Processor

    from hf_models import EMU3_GENERATION_SIZE

    for name, value in EMU3_GENERATION_SIZE.items():
        monkeypatch.setattr(Emu3Processor, name, value)
