"""The on-disk neighbour-table cache: built once, then read back identical; keyed by codebook, K, norm."""
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
