"""Quality of tiny-model samples: class accuracy by the shape classifier and the Frechet distance (FD) of
its features to the procedural dataset's (an FID analogue).

    python -m lantern.tiny.evaluate [--per-class 100] [--cfg-scale 3] [--top-k 0] [--dtype bfloat16] [--png PATH]

samples ``per_class`` images of every class with ``lantern.decoding.generate_ar``, decodes them with the
VQ, and prints class accuracy, FD to the reference set, and the FD of the same number of fresh real images
(the floor: FD is biased upwards at small sample counts, so compare against it). ``--sweep`` tries
several guidance scales.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Dict, Optional

import torch

from .classifier import ShapeClassifier, feature_stats, frechet_distance_from_stats, load_classifier
from .data import CLASS_NAMES, NUM_CLASSES, make_class_batch, make_dataset

REFERENCE_SEED = 1  # reference images for FD: make_dataset(REFERENCE_SIZE, REFERENCE_SEED) (not the training seed)
REFERENCE_SIZE = 10000
REFERENCE_FILE = "fd_reference.safetensors"
_FLOOR_SEED = 2  # fresh real images for the FD floor

_cache: Dict[str, object] = {}


def _weights_dir() -> Path:
    from ..pretrained import TINY_DIR

    return TINY_DIR


def get_classifier(directory: Optional[Path] = None) -> ShapeClassifier:
    """The shipped classifier (cached per directory)."""
    directory = Path(directory or _weights_dir())
    key = f"classifier:{directory}"
    if key not in _cache:
        _cache[key] = load_classifier(directory / "classifier.safetensors")
    return _cache[key]


def compute_reference_stats(classifier: ShapeClassifier, n: int = REFERENCE_SIZE, seed: int = REFERENCE_SEED):
    """(mean [128], covariance [128, 128]) float64 of the classifier features of make_dataset(n, seed)."""
    images, _ = make_dataset(n, seed)
    _, feats = classifier.predict(images)
    return feature_stats(feats)


def save_reference_stats(path: Path, mu, cov) -> None:
    from safetensors.torch import save_file

    # no metadata: safetensors writes a metadata map in arbitrary order, which would make the bytes vary
    save_file({"mu": torch.from_numpy(mu), "cov": torch.from_numpy(cov)}, str(path))


def get_reference_stats(directory: Optional[Path] = None, classifier: Optional[ShapeClassifier] = None):
    """Reference (mean, covariance): read from ``fd_reference.safetensors`` next to the classifier when it is
    there (train.py writes it), else computed once from the dataset and cached in memory."""
    directory = Path(directory or _weights_dir())
    key = f"reference:{directory}"
    if key not in _cache:
        path = directory / REFERENCE_FILE
        if path.exists():
            from safetensors.torch import load_file

            st = load_file(str(path))
            _cache[key] = (st["mu"].double().numpy(), st["cov"].double().numpy())
        else:
            _cache[key] = compute_reference_stats(classifier or get_classifier(directory))
    return _cache[key]


def evaluate_samples(images: torch.Tensor, labels: torch.Tensor, *, classifier: Optional[ShapeClassifier] = None,
                     directory: Optional[Path] = None, with_floor: bool = True) -> dict:
    """images float [N, 3, 32, 32] about [-1, 1] (VQ decoder output), labels [N] int64 ->
    dict(class_accuracy (fraction), fd (to the reference set), n, per_class_accuracy [10],
    fd_real_floor (FD of N fresh real images: the best a perfect model gets at this N))."""
    classifier = classifier or get_classifier(directory)
    labels = labels.cpu().long()
    preds, feats = classifier.predict(images.cpu().float())
    correct = (preds == labels).float()
    per_class = [float(correct[labels == c].mean()) if bool((labels == c).any()) else float("nan")
                 for c in range(NUM_CLASSES)]
    mu_ref, cov_ref = get_reference_stats(directory, classifier)
    fd = frechet_distance_from_stats(*feature_stats(feats), mu_ref, cov_ref) if len(labels) > 1 else float("nan")
    out = dict(class_accuracy=float(correct.mean()), n=int(labels.numel()), per_class_accuracy=per_class, fd=fd)
    if with_floor and len(labels) > 1:
        key = f"floor:{directory}:{len(labels)}"
        if key not in _cache:
            real, _ = make_class_batch(-(-len(labels) // NUM_CLASSES), _FLOOR_SEED)
            _, real_feats = classifier.predict(real[: len(labels)])
            _cache[key] = frechet_distance_from_stats(*feature_stats(real_feats), mu_ref, cov_ref)
        out["fd_real_floor"] = _cache[key]
    return out


@torch.no_grad()
def sample_images(gpt, vq, per_class: int, *, cfg_scale: float = 3.0, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0, seed: int = 0, batch: int = 250):
    """per_class AR samples of every class (class-major) -> (images [10 * per_class, 3, 32, 32], labels)."""
    from ..decoding import generate_ar

    labels = torch.arange(NUM_CLASSES).repeat_interleave(per_class)
    side = gpt.config.grid_size
    images = []
    for i in range(0, len(labels), batch):
        tokens = generate_ar(gpt, labels[i : i + batch], cfg_scale=cfg_scale, temperature=temperature, top_k=top_k,
                             top_p=top_p, seed=seed + i)
        images.append(vq.decode_codes(tokens, side, side).float())
    return torch.cat(images), labels


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lantern.tiny.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="weights directory (default: python/lantern/weights/tiny)")
    p.add_argument("--per-class", type=int, default=100)
    p.add_argument("--cfg-scale", type=float, default=None, help="default: the model's recommended value")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None, help="default: the model's recommended value")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the GPT's compute dtype (its weights are stored in bfloat16)")
    p.add_argument("--sweep", type=float, nargs="*", default=None, metavar="CFG",
                   help="evaluate each of these guidance scales (default list if given without values)")
    p.add_argument("--png", default=None, help="write a grid of the samples (rows = classes, first 10 per class)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # see train.py --threads: one thread is faster on a shared machine

    from ..pretrained import TINY_DIR, load_tiny

    directory = Path(args.dir) if args.dir else TINY_DIR
    tiny = load_tiny(directory=directory, dtype=getattr(torch, args.dtype))
    defaults = tiny.meta.get("sampling", {})
    top_k = args.top_k if args.top_k is not None else defaults.get("top_k", 0)
    scales = ([args.cfg_scale if args.cfg_scale is not None else defaults.get("cfg_scale", 3.0)]
              if args.sweep is None else (args.sweep or [1.0, 1.5, 2.0, 3.0, 4.0, 6.0]))
    classifier = get_classifier(directory)
    real, real_labels = make_class_batch(100, 7)
    real_acc = float((classifier.predict(real)[0] == real_labels).float().mean())
    print(f"classifier accuracy on 1000 fresh real images: {100 * real_acc:.1f}%")
    results = []
    for scale in scales:
        t0 = time.perf_counter()
        images, labels = sample_images(tiny.gpt, tiny.vq, args.per_class, cfg_scale=scale, temperature=args.temperature,
                                       top_k=top_k, top_p=args.top_p, seed=args.seed)
        wall = time.perf_counter() - t0
        r = evaluate_samples(images, labels, directory=directory)
        r.update(cfg_scale=scale, temperature=args.temperature, top_k=top_k, top_p=args.top_p, seed=args.seed,
                 sample_s=wall, dtype=args.dtype)
        results.append(r)
        worst = min(range(NUM_CLASSES), key=lambda c: r["per_class_accuracy"][c])
        print(f"cfg {scale:<4} temp {args.temperature} top_k {top_k}: accuracy {100 * r['class_accuracy']:.1f}% "
              f"(worst {CLASS_NAMES[worst]} {100 * r['per_class_accuracy'][worst]:.0f}%)  FD {r['fd']:.2f} "
              f"(real-image floor at n={r['n']}: {r['fd_real_floor']:.2f})  [{wall:.1f}s]")
        if args.png:
            from ..images import save_grid
            from ..models import to_uint8

            k = min(10, args.per_class)
            pick = torch.cat([torch.arange(c * args.per_class, c * args.per_class + k) for c in range(NUM_CLASSES)])
            path = args.png if len(scales) == 1 else args.png.replace(".png", f"_cfg{scale:g}.png")
            save_grid(to_uint8(images[pick]), rows=NUM_CLASSES, path=path, scale=4)
            print(f"wrote {path}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
