"""The tiny default model: procedural dataset, shipped weights (classifier, VQ, GPT) and the Frechet
distance. Fast (no training): a few seconds on CPU."""
import json

import numpy as np
import pytest
import torch

from lantern.pretrained import TINY_DIR
from lantern.tiny.classifier import FEATURE_DIM, frechet_distance, load_classifier
from lantern.tiny.data import CLASS_NAMES, NUM_CLASSES, make_class_batch, make_dataset

WEIGHT_FILES = ("vq.safetensors", "gpt.safetensors", "classifier.safetensors", "fd_reference.safetensors", "tiny.json")
VQ_MSE_BOUND = 0.03  # per-pixel MSE on [-1, 1] images (PSNR >= 21 dB); the shipped VQ measures 0.019 (23.1 dB)


# -- dataset --------------------------------------------------------------------------------------------


def test_dataset_deterministic():
    a, la = make_dataset(40, seed=3)
    b, lb = make_dataset(40, seed=3)
    assert torch.equal(a, b) and torch.equal(la, lb)
    c, lc = make_dataset(40, seed=4)
    assert not torch.equal(a, c)
    short, ls = make_dataset(15, seed=3)  # a shorter set is a prefix of a longer one
    assert torch.equal(short, a[:15]) and torch.equal(ls, la[:15])
    x, y = make_class_batch(3, seed=5)
    x2, y2 = make_class_batch(3, seed=5)
    assert torch.equal(x, x2) and torch.equal(y, y2)


def test_dataset_format_and_balance():
    images, labels = make_dataset(100, seed=0)
    assert images.shape == (100, 3, 32, 32) and images.dtype == torch.float32
    assert labels.dtype == torch.int64
    assert float(images.min()) >= -1.0 and float(images.max()) <= 1.0
    assert torch.bincount(labels, minlength=NUM_CLASSES).tolist() == [10] * NUM_CLASSES
    counts = torch.bincount(make_dataset(95, seed=1)[1], minlength=NUM_CLASSES)
    assert int(counts.max() - counts.min()) <= 1
    assert len(CLASS_NAMES) == NUM_CLASSES == 10
    # variety within a class: two images of the same class differ
    same = images[labels == 0]
    assert float((same[0] - same[1]).abs().mean()) > 0.05


# -- shipped weights -------------------------------------------------------------------------------------


def test_weights_exist_and_fit():
    sizes = {name: (TINY_DIR / name).stat().st_size for name in WEIGHT_FILES}
    assert sum(sizes.values()) <= 40 * 1024 * 1024, sizes  # the 16-layer GPT is 27 MB in bf16
    meta = json.loads((TINY_DIR / "tiny.json").read_text())
    assert meta["gpt_name"] == "GPT-tiny-deep" and meta["vq_name"] == "VQ-tiny"
    assert meta["class_names"] == list(CLASS_NAMES)
    assert {"cfg_scale", "top_k"} <= set(meta["sampling"])


def test_shipped_models_load():
    from lantern.models import load_gpt, load_vq

    gpt = load_gpt(str(TINY_DIR / "gpt.safetensors"), "GPT-tiny-deep")
    assert gpt.config.n_layer == 16 and gpt.config.block_size == 64
    assert gpt.config.num_classes == 10 and gpt.config.vocab_size == 1024
    vq = load_vq(str(TINY_DIR / "vq.safetensors"), "VQ-tiny")
    assert vq.config.codebook_size == 1024
    vq_dec = load_vq(str(TINY_DIR / "vq.safetensors"), "VQ-tiny", decoder_only=True)
    codes = torch.randint(0, 1024, (2, 64))
    with torch.no_grad():
        assert torch.allclose(vq.decode_codes(codes, 8, 8), vq_dec.decode_codes(codes, 8, 8))
        logits = gpt.forward_full(codes[:, :-1], torch.tensor([0, 9]))
    assert logits.shape == (2, 64, 1024) and torch.isfinite(logits).all()


@pytest.fixture(scope="module")
def fresh_batch():
    return make_class_batch(30, seed=20240)  # 300 images never seen in training (a different stream)


def test_classifier_accuracy(fresh_batch):
    images, labels = fresh_batch
    clf = load_classifier()
    preds, feats = clf.predict(images)
    assert feats.shape == (len(labels), FEATURE_DIM)
    assert float((preds == labels).float().mean()) >= 0.95


def test_vq_reconstructs(fresh_batch):
    from lantern.models import load_vq

    images, labels = fresh_batch
    vq = load_vq(str(TINY_DIR / "vq.safetensors"), "VQ-tiny")
    with torch.no_grad():
        codes = vq.encode_codes(images)
        recon = vq.decode_codes(codes, 8, 8)
    assert codes.shape == (len(labels), 64)
    mse = float(((recon - images) ** 2).mean())
    assert mse <= VQ_MSE_BOUND, mse
    # reconstructions keep their class
    preds, _ = load_classifier().predict(recon)
    assert float((preds == labels).float().mean()) >= 0.95


# -- Frechet distance ------------------------------------------------------------------------------------


def test_frechet_distance():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(2000, 16)) @ rng.normal(size=(16, 16))
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-6)
    assert frechet_distance(torch.from_numpy(a), a.copy()) == pytest.approx(0.0, abs=1e-6)
    b = rng.normal(size=(2000, 16)) @ rng.normal(size=(16, 16))
    assert frechet_distance(a, b) == pytest.approx(frechet_distance(b, a), rel=1e-6)
    # a mean shift by s in every dimension adds exactly 16 s^2
    for s in (0.5, 1.0, 2.0):
        assert frechet_distance(a, a + s) == pytest.approx(16 * s * s, rel=1e-6)
    d1, d2, d3 = (frechet_distance(a, a * k) for k in (1.1, 1.5, 3.0))
    assert 0 < d1 < d2 < d3
    # Gaussians with known stats: N(0, I) vs N(0, 4 I) in D dims -> D (1 + 4 - 2*2) = D
    x = rng.normal(size=(200000, 4))
    assert frechet_distance(x, 2 * x[::-1].copy()) == pytest.approx(4.0, rel=0.02)


def test_grow_depth_keeps_the_function():
    from lantern.models import build_gpt
    from lantern.tiny.train import grow_depth

    torch.manual_seed(0)
    base = build_gpt("GPT-tiny", n_layer=2, dim=64, n_head=2).eval()
    with torch.no_grad():  # trained-looking output projections (LlamaGen initialises the head at zero), so
        base.output.weight.normal_(std=0.2)  # that a copy that is not silenced shows
        for layer in base.layers:
            layer.attention.wo.weight.normal_(std=0.2)
            layer.feed_forward.w2.weight.normal_(std=0.2)
    deep = grow_depth(base, 6).eval()
    assert deep.config.n_layer == 6 and len(deep.layers) == 6
    tokens, labels = torch.randint(0, 1024, (3, 20)), torch.tensor([0, 4, 10])
    with torch.no_grad():
        want = base.forward_full(tokens, labels)
        assert want.std() > 0.1
        assert torch.equal(deep.forward_full(tokens, labels), want)
        # layer 1 is a copy of layer 0; its silenced projections are what keeps the function
        assert torch.equal(deep.layers[1].attention.wqkv.weight, base.layers[0].attention.wqkv.weight)
        deep.layers[1].feed_forward.w2.weight.copy_(base.layers[0].feed_forward.w2.weight)
        assert not torch.allclose(deep.forward_full(tokens, labels), want, atol=1e-3)
    with pytest.raises(ValueError, match="multiple"):
        grow_depth(base, 5)
