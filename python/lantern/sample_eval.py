"""`lantern eval`: quality figures of a `lantern sample` folder (or any ADM-layout .npz, arr_0 uint8 [N, H, W, 3]).

- tiny models (the folder's config says model tiny / tiny-mar): class accuracy of the shape classifier and
  the Frechet distance in its feature space (``lantern.tiny.evaluate.evaluate_samples``, the figures
  ``lantern generate`` prints).
- official models: FID, Inception Score, precision and recall through torch-fidelity (its TF-compatible
  Inception-v3, features "2048" for FID and precision/recall, k = 3 as the ADM suite, logits for IS), against
  a reference batch the user gives (an .npz with arr_0 uint8 images, e.g. the ADM suite's
  VIRTUAL_imagenet256_labeled.npz) and the Inception weights file the user gives. Nothing is downloaded.
"""
from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

INCEPTION = "inception-v3-compat"
CHECKED_INCEPTION = "lantern-inception-v3-compat"  # the same network, its weights' names and shapes checked
MAX_INCEPTION_BYTES = 512 * 2**20  # Inception-v3's weights take about 91 MiB
MAX_EVAL_BATCH = 4096
INCEPTION_FILE = "pt_inception-2015-12-05-6726825d.pth"
EXTRA_HINT = "pip install 'lantern[eval]' (or: pip install torch-fidelity==0.4.0 torchvision==0.29.1)"
REFERENCE_HINT = ("the reference batch: an .npz whose arr_0 holds uint8 reference images [M, H, W, 3] (the ADM "
                  "evaluation suite's, e.g. VIRTUAL_imagenet256_labeled.npz)")
INCEPTION_HINT = (f"torch-fidelity's Inception-v3 weights ({INCEPTION_FILE}, a state dict saved by torch.save); "
                  f"lantern never downloads it")


def load_samples(path) -> Tuple[np.ndarray, Optional[dict]]:
    """A sample folder (its samples.npz and config.json) or an .npz -> (uint8 [N, H, W, 3], the folder's
    settings or None). SystemExit naming the path for anything else."""
    from .sample_folder import CONFIG_FILE, NPZ_FILE, read_config

    path = Path(path)
    settings = None
    if path.is_dir():
        settings = read_config(path / CONFIG_FILE)
        path = path / NPZ_FILE
        if not path.exists():
            raise SystemExit(f"{path} does not exist: the sample run is not finished (lantern sample ... --resume "
                             f"completes it)")
    images = read_npz_images(path, "samples")
    return images, settings


def read_npz_images(path, what: str) -> np.ndarray:
    """arr_0 of an .npz, checked to be uint8 [N, H, W, 3] (from its header, before anything is allocated);
    SystemExit naming ``what`` and the path otherwise."""
    from .npz_io import NpzError, images_check, open_npz, read_member

    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"{what}: {str(path)!r} is not a file")
    try:
        with open_npz(path) as zf:
            return read_member(zf, "arr_0", images_check())
    except NpzError as e:
        raise SystemExit(f"{what}: {e}") from e


def settings_classes(settings: Optional[dict]) -> Optional[list]:
    """The classes of a sample folder's config.json, checked: a non-empty list of class ids."""
    if settings is None or "classes" not in settings:
        return None
    classes = settings["classes"]
    if not isinstance(classes, list) or not classes or \
            not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in classes):
        raise SystemExit(f"config.json: classes must be a non-empty list of class ids, got {str(classes)[:80]}")
    return classes


def to_model_range(images: np.ndarray) -> torch.Tensor:
    """uint8 [N, H, W, 3] -> float [N, 3, H, W] about [-1, 1]: the middle of the range that to_uint8
    (clamp(127.5 x + 128), truncated) maps to each value."""
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float()
    return (x - 127.5) / 127.5


def tiny_figures(images: np.ndarray, classes: Sequence[int]) -> dict:
    """Class accuracy and FD of tiny-model samples; image i's class is classes[i mod len(classes)]."""
    from .sampling import labels_of
    from .tiny.evaluate import NUM_CLASSES, evaluate_samples

    outside = [c for c in classes if not 0 <= c < NUM_CLASSES]
    if outside:
        raise SystemExit(f"classes must be ids of the tiny models' {NUM_CLASSES} classes, got {outside[:10]}")
    if images.shape[1:3] != (32, 32):
        raise SystemExit(f"the tiny models' classifier reads 32 x 32 images, got {images.shape[1]} x {images.shape[2]}")
    labels = labels_of(torch.arange(len(images)), classes)
    return evaluate_samples(to_model_range(images), labels)


class _Images(torch.utils.data.Dataset):
    """uint8 [N, H, W, 3] -> items uint8 [3, H, W] (torch-fidelity's input)."""

    def __init__(self, images: np.ndarray):
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(self.images[i])).permute(2, 0, 1)


def require_fidelity():
    """The torch_fidelity module, or SystemExit saying how to install it."""
    try:
        import torch_fidelity
    except ImportError as e:
        raise SystemExit(f"FID / IS / precision / recall need torch-fidelity, which is not installed: {EXTRA_HINT} "
                         f"({e})") from e
    return torch_fidelity


def check_inception_weights(path) -> None:
    """SystemExit unless ``path`` is a file of at most MAX_INCEPTION_BYTES that loads as a plain state dict of
    tensors with weights_only=True (so the library's own torch.load of it runs no pickled code; torch's zip
    format is memory-mapped, so no tensor is allocated from the file's claims). Its names and shapes are
    checked against the network when torch-fidelity builds it (``CheckedInceptionV3``)."""
    if path is None:
        raise SystemExit(f"--inception PATH is needed: {INCEPTION_HINT}")
    if not Path(path).is_file():
        raise SystemExit(f"--inception {str(path)!r} is not a file: give {INCEPTION_HINT}")
    size = Path(path).stat().st_size
    if size > MAX_INCEPTION_BYTES:
        raise SystemExit(f"--inception {path} holds {size} bytes, far more than Inception-v3's weights (about "
                         f"91 MiB); give {INCEPTION_HINT}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same message
        raise SystemExit(f"--inception {path} cannot be read as a weights file ({type(e).__name__}: "
                         f"{str(e)[:300]}); give {INCEPTION_HINT}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise SystemExit(f"--inception {path} is not a state dict of tensors; give {INCEPTION_HINT}")


def state_dict_mismatch(expected: dict, given: dict) -> Optional[str]:
    """None when ``given`` has exactly the names and shapes of ``expected`` (state dicts), else a short account."""
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    reshaped = [f"{k} {list(given[k].shape)} (needs {list(expected[k].shape)})" for k in expected
                if k in given and tuple(getattr(given[k], "shape", ())) != tuple(expected[k].shape)]
    problems = [f"{len(found)} {what}, e.g. {found[:3]}" for what, found in (
        ("missing tensors", missing), ("unexpected tensors", unexpected), ("tensors of another shape", reshaped))
        if found]
    return "; ".join(problems) or None


def _register_checked_inception(fidelity) -> None:
    """torch-fidelity's Inception-v3 under CHECKED_INCEPTION, refusing (SystemExit, a short message) a state dict
    whose names or shapes are not the network's instead of torch's error listing every key."""
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    if CHECKED_INCEPTION in fidelity.registry.FEATURE_EXTRACTORS_REGISTRY:
        return

    class CheckedInceptionV3(FeatureExtractorInceptionV3):
        def load_state_dict(self, state_dict, strict=True, assign=False):
            mismatch = state_dict_mismatch(self.state_dict(), state_dict)
            if mismatch:
                raise SystemExit(f"--inception: the file is not Inception-v3's weights ({mismatch}); give "
                                 f"{INCEPTION_HINT}")
            return super().load_state_dict(state_dict, strict=strict, assign=assign)

    fidelity.register_feature_extractor(CHECKED_INCEPTION, CheckedInceptionV3)


def inception_figures(images: np.ndarray, reference: np.ndarray, weights_path: Optional[str], *,
                      device: str = "cpu", batch: int = 64, feature_extractor: str = CHECKED_INCEPTION,
                      layers: Optional[dict] = None) -> dict:
    """FID, IS (mean, std over 10 splits), precision and recall (k = 3) of images against reference (both
    uint8 [N, H, W, 3]) by torch-fidelity. feature_extractor / layers: another registered extractor and its
    feature names per metric (tests use a small stand-in)."""
    fidelity = require_fidelity()
    _register_checked_inception(fidelity)
    layers = layers or {"fid": "2048", "prc": "2048", "isc": "logits_unbiased"}
    metrics = fidelity.calculate_metrics(
        input1=_Images(images), input2=_Images(reference), fid=True, isc=True, prc=True,
        feature_extractor=feature_extractor, feature_extractor_weights_path=weights_path,
        feature_layer_fid=layers["fid"], feature_layer_prc=layers["prc"], feature_layer_isc=layers["isc"],
        cuda=torch.device(device).type == "cuda", batch_size=batch, cache=False, verbose=False,
        datasets_download=False)
    return dict(fid=metrics["frechet_inception_distance"], inception_score=metrics["inception_score_mean"],
                inception_score_std=metrics["inception_score_std"], precision=metrics["precision"],
                recall=metrics["recall"], n=len(images), reference_n=len(reference))
