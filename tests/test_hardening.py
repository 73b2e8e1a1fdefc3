"""Regression tests of issue 16 ("Hardening"): each test is named after the defect number it covers
(docs/hardening.md lists them)."""
import hashlib
import threading
import warnings

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


# -- 4 / 7: the neighbour-table cache -------------------------------------------------------------------

def _cache_file(directory, codebook, K, normalize=True):
    from lantern.neighbours import codebook_key

    return directory / (codebook_key(codebook, K, normalize) + ".safetensors")


def test_4_cache_records_codebook_V_K_dtype(tmp_path):
    from safetensors import safe_open

    from lantern.neighbours import neighbour_table

    codebook = torch.randn(32, 4)
    neighbour_table(codebook, 3, directory=tmp_path)
    with safe_open(str(_cache_file(tmp_path, codebook, 3)), "pt") as f:
        meta = f.metadata() or {}
    assert meta.get("V") == "32" and meta.get("K") == "3" and meta.get("dtype") == "int32"
    assert meta.get("normalize") == "True"
    assert meta["codebook_sha256"] == hashlib.sha256(codebook.numpy().tobytes()).hexdigest()


def _swap_in(tmp_path, src_codebook, src_K, dst_codebook, dst_K, **save_kwargs):
    """Build src's table, then put a file at dst's key: src's file, or one saved with save_kwargs."""
    from safetensors.torch import save_file

    from lantern.neighbours import neighbour_table

    table = neighbour_table(src_codebook, src_K, directory=tmp_path)
    dst = _cache_file(tmp_path, dst_codebook, dst_K)
    if save_kwargs:
        save_file(save_kwargs["tensors"], str(dst), metadata=save_kwargs.get("metadata"))
    else:
        dst.write_bytes(_cache_file(tmp_path, src_codebook, src_K).read_bytes())
    return table


@pytest.mark.parametrize("case", ["other_codebook", "other_K", "other_dtype", "no_record", "corrupt", "bad_ids"])
def test_4_mismatching_or_corrupt_cache_entry_is_rebuilt_with_a_warning(tmp_path, case):
    from lantern import ops
    from lantern.neighbours import neighbour_table

    torch.manual_seed(0)
    codebook, other = torch.randn(24, 4), torch.randn(24, 4)
    want = ops.latent_neighbours(codebook, 5, normalize=True)
    record = {"format": "lantern-neighbours-1", "V": "24", "K": "5", "normalize": "True", "dtype": "int32",
              "codebook_sha256": hashlib.sha256(codebook.numpy().tobytes()).hexdigest()}
    if case == "other_codebook":
        _swap_in(tmp_path, other, 5, codebook, 5)
    elif case == "other_K":
        _swap_in(tmp_path, codebook, 4, codebook, 5)
    elif case == "other_dtype":  # the right record, a table of another dtype
        _swap_in(tmp_path, codebook, 5, codebook, 5, tensors={"neighbours": want.to(torch.int64)}, metadata=record)
    elif case == "no_record":  # a file as the old cache wrote it: no metadata
        _swap_in(tmp_path, codebook, 5, codebook, 5, tensors={"neighbours": (want + 1) % 24})
    elif case == "bad_ids":
        _swap_in(tmp_path, codebook, 5, codebook, 5, tensors={"neighbours": want + 100}, metadata=record)
    else:
        _cache_file(tmp_path, codebook, 5).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.warns(RuntimeWarning, match="rebuilding"):
        got = neighbour_table(codebook, 5, directory=tmp_path)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rebuilt entry is now served as is
        assert torch.equal(neighbour_table(codebook, 5, directory=tmp_path), want)


def _hammer(fn, seconds, errors):
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - collected for the assertion
            errors.append(repr(e))
            return


def test_7_concurrent_writers_and_readers(tmp_path):
    from lantern import ops
    from lantern.neighbours import neighbour_table

    torch.manual_seed(0)
    codebook = torch.randn(64, 4)
    want = ops.latent_neighbours(codebook, 8, normalize=True)
    neighbour_table(codebook, 8, directory=tmp_path)
    errors = []

    def write():
        assert torch.equal(neighbour_table(codebook, 8, directory=tmp_path, rebuild=True), want)

    def read():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a reader that saw half a file would warn and rebuild
            assert torch.equal(neighbour_table(codebook, 8, directory=tmp_path), want)

    workers = [threading.Thread(target=_hammer, args=(fn, 2.0, errors)) for fn in (write, write, write, write, read, read)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert errors == []
    assert [p.name for p in tmp_path.iterdir()] == [_cache_file(tmp_path, codebook, 8).name]  # no temporaries left


# -- 9: verify on an empty batch ------------------------------------------------------------------------

@pytest.mark.parametrize("T", [1, 3])
def test_9_reference_verify_of_no_rows_matches_cpu(T):
    import lantern
    from lantern import ops

    V = 8
    logits, tokens = torch.randn(0, T, V), torch.zeros(0, T, dtype=torch.int64)
    parents = torch.arange(-1, T - 1).expand(0, T)
    with lantern.fused("reference"):
        got = ops.verify(logits, tokens, parents, temperature=1.0)
        greedy = ops.verify(logits, tokens, parents, temperature=0.0)
    with lantern.fused("cpu"):
        want = ops.verify(logits, tokens, parents, temperature=1.0)
    assert isinstance(got, ops.VerifyResult) and isinstance(greedy, ops.VerifyResult)
    for result in (got, greedy):
        for name, a, b in zip(want._fields, result, want):
            assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device, name
    assert [tuple(a.shape) for a in want] == [(0,), (0, T - 1), (0,), (0, T)]
