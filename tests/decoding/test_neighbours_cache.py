"""The on-disk neighbour-table cache: built once, then read back identical; keyed by codebook, K, norm."""
import hashlib
import threading
import warnings

import pytest
import torch

from lantern import ops
from lantern.neighbours import neighbour_table


def test_cache_builds_once_and_reads_back(tmp_path, monkeypatch):
    codebook = torch.randn(64, 8)
    calls = []
    real = ops.latent_neighbours
    monkeypatch.setattr(ops, "latent_neighbours", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = neighbour_table(codebook, 5, directory=tmp_path)
    second = neighbour_table(codebook, 5, directory=tmp_path)
    assert len(calls) == 1
    assert torch.equal(first, second) and second.dtype == torch.int32
    assert torch.equal(first, real(codebook, 5, normalize=True))
    neighbour_table(codebook, 6, directory=tmp_path)  # another K -> another entry
    neighbour_table(codebook, 5, normalize=False, directory=tmp_path)
    neighbour_table(codebook + 1, 5, directory=tmp_path)  # another codebook
    assert len(calls) == 4 and len(list(tmp_path.glob("*.safetensors"))) == 4


# -- the cache's records, damaged entries, concurrent writers ------------------------------------------------------

def _cache_file(directory, codebook, K, normalize=True):
    from lantern.neighbours import codebook_key

    return directory / (codebook_key(codebook, K, normalize) + ".safetensors")


def test_cache_records_codebook_V_K_dtype(tmp_path):
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
def test_mismatching_or_corrupt_cache_entry_is_rebuilt_with_a_warning(tmp_path, case):
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


def test_concurrent_cache_writers_and_readers(tmp_path):
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

    calls = (write, write, write, write, read, read)
    workers = [threading.Thread(target=_hammer, args=(fn, 2.0, errors)) for fn in calls]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert errors == []
    assert [p.name for p in tmp_path.iterdir()] == [_cache_file(tmp_path, codebook, 8).name]  # no temporaries left
