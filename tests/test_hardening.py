"""Regression tests of issue 16 ("Hardening"): each test is named after the defect number it covers
(docs/hardening.md lists them)."""
import threading

import pytest
import torch

from lantern.cli import main
from lantern.models import load_gpt, load_vq
from lantern.models.loading import read_state_dict


def within(seconds, fn, *args, **kwargs):
    """fn's return value, or its exception re-raised; fails (instead of hanging the run) if it is still
    running after ``seconds``."""
    box = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"{getattr(fn, '__name__', fn)} still running after {seconds}s (a hang)"
    if "error" in box:
        raise box["error"]
    return box.get("value")


# -- 2: a checkpoint whose wrapper contains itself -------------------------------------------------------

@pytest.fixture
def cyclic_checkpoint(tmp_path):
    path = tmp_path / "cycle.pt"
    d = {}
    d["model"] = d
    torch.save(d, path)
    return path


def test_2_self_containing_wrapper_raises(cyclic_checkpoint):
    with pytest.raises(ValueError, match="contains itself"):
        within(30, read_state_dict, cyclic_checkpoint)
    with pytest.raises(ValueError, match="contains itself"):
        within(30, load_gpt, cyclic_checkpoint, "GPT-B")
    with pytest.raises(ValueError, match="contains itself"):
        within(30, load_vq, cyclic_checkpoint, "VQ-16", decoder_only=True)


def test_2_neighbours_cli_on_a_cyclic_vq_raises(cyclic_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="contains itself"):
        within(30, main, ["neighbours", "--vq", str(cyclic_checkpoint), "--K", "4"])


def test_2_two_level_cycle_and_deep_chains_raise():
    a, b = {}, {}
    a["state_dict"], b["module"] = b, a
    with pytest.raises(ValueError, match="contains itself"):
        within(30, read_state_dict, a)
    deep = {"w": torch.zeros(1)}
    for _ in range(40):
        deep = {"model": deep}
    with pytest.raises(ValueError, match="nest more than"):
        read_state_dict(deep)
    shallow = {"w": torch.zeros(1)}
    for _ in range(3):
        shallow = {"model": shallow}
    assert list(read_state_dict(shallow)) == ["w"]  # ordinary nesting still unwraps
