"""``image_ids`` of lantern.generate for the discrete methods (docs/sampling.md "Seeds"): every draw (verify, the
drafter's sampled drafts, sjd's window) is keyed by the image id, so an image's tokens do not depend on the
batch it is generated in. Small random models, eager; each method with a fixed tree.

The batch tests run the models in float64 under one-ulp rounding by the call's row count in every product
(tests/rounding.py), so they do not rely on batch-invariant matrix products (AVX-512 / AMX CPUs and GPUs do
not give them): a row's logits then differ between batch sizes by ~1e-16 relative, and a sampling decision (a
float32 uniform against a float64 probability, or the race's argmin) changes only if a uniform or a competing
key falls within that of its threshold: ~1e-16 x 2^24 < 1e-8 per decision, < 1e-5 over the file."""
import copy

import pytest
import torch

from lantern import ops
from lantern.decoding import generate
from lantern.models import build_gpt
from lantern.models.drafter import GPTDrafter
from rounding import shape_dependent_rounding
from test_spec import sharpen

IDS = torch.tensor([7, 0, 123456, 2**32 - 1, 42])
METHODS = {
    "ar": dict(),
    "spec-chain": dict(method="spec", tree="chain", depth=3),
    "lantern-static": dict(method="lantern", tree="static", static_widths=(3, 2, 1), k=4, delta=0.2),
    "sjd": dict(method="sjd", tree="chain", window=4),
    "sjd-coupled-sample": dict(method="sjd", tree="chain", window=3, coupling=True, init="sample"),
}


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    target = sharpen(build_gpt("GPT-tiny", block_size=16, n_layer=2)).double()
    torch.manual_seed(1)
    drafter = GPTDrafter(sharpen(build_gpt("GPT-tiny", block_size=16, n_layer=1)).double())
    table = ops.latent_neighbours(torch.randn(target.config.vocab_size, 8), 8)
    return target, drafter, table


def _run(models, name, labels, ids):
    target, drafter, table = models
    options = dict(METHODS[name])
    method = options.pop("method", "ar")
    if method in ("spec", "lantern"):
        options["drafter"] = copy.deepcopy(drafter)
    if method == "lantern":
        options["neighbours"] = table
    return generate(target, labels, method=method, cfg_scale=2.0, seed=9, image_ids=ids, **options)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(METHODS))
def test_an_image_depends_on_its_id_not_on_its_batch(models, name):
    """Ids in one batch, one by one and reordered give the same tokens per id. Negative control: keyed by row
    (no image_ids), the reordered batch gives other tokens."""
    labels = torch.tensor([1, 3, 3, 8, 5])
    with shape_dependent_rounding():
        _check_batches(models, name, labels)


def _check_batches(models, name, labels):
    whole = _run(models, name, labels, IDS)
    alone = torch.cat([_run(models, name, labels[i:i + 1], IDS[i:i + 1]) for i in range(len(IDS))])
    assert torch.equal(whole, alone)
    perm = torch.tensor([3, 1, 4, 0, 2])
    assert torch.equal(_run(models, name, labels[perm], IDS[perm]), whole[perm])
    by_row = _run(models, name, labels, None)
    assert not torch.equal(_run(models, name, labels[perm], None), by_row[perm])


def test_default_ids_are_the_rows(models):
    labels = torch.tensor([2, 4, 6])
    for name in ("ar", "spec-chain", "sjd"):
        assert torch.equal(_run(models, name, labels, None), _run(models, name, labels, torch.arange(3)))


@pytest.mark.parametrize("ids,fragment", [
    (torch.tensor([0, 1]), "shape"),
    (torch.tensor([0.0, 1.0, 2.0]), "integer"),
    (torch.tensor([0, -1, 2]), r"\[0, 2\^32\)"),
    (torch.tensor([0, 2**32, 2]), r"\[0, 2\^32\)"),
])
@pytest.mark.parametrize("name", ["ar", "spec-chain"])
def test_bad_image_ids_are_refused(models, name, ids, fragment):
    with pytest.raises(ValueError, match=f"image_ids.*{fragment}|{fragment}.*image_ids|image_ids must"):
        _run(models, name, torch.tensor([1, 2, 3]), ids)
