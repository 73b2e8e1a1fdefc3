"""The tiny default model's quality metric: a small CNN that classifies the procedural shapes
(``lantern.tiny.data``), its penultimate-layer features, and the Frechet distance between feature sets.

``ShapeClassifier`` takes images float [B, 3, 32, 32] in [-1, 1] (the VQ decoder's range; values outside
are clamped) and returns logits [B, 10]; ``features`` returns the 128-d penultimate activations that the
Frechet distance is computed on (an FID analogue for this dataset).
"""
from __future__ import annotations

import os
from typing import Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .data import NUM_CLASSES

FEATURE_DIM = 128


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class ShapeClassifier(nn.Module):
    """conv 3->16 (32x32), 16->32 (16x16), 32->64 (8x8), 64->128 (4x4), each conv-BN-ReLU followed by a 2x2
    max-pool except the last; global average pool; fc 128->128 + ReLU (the features); fc 128->10."""

    def __init__(self, num_classes: int = NUM_CLASSES, feature_dim: int = FEATURE_DIM):
        super().__init__()
        self.convs = nn.Sequential(
            _block(3, 16), nn.MaxPool2d(2),
            _block(16, 32), nn.MaxPool2d(2),
            _block(32, 64), nn.MaxPool2d(2),
            _block(64, 128),
        )
        self.fc = nn.Linear(128, feature_dim)
        self.head = nn.Linear(feature_dim, num_classes)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """images [B, 3, 32, 32] in [-1, 1] -> penultimate features [B, 128] (float32)."""
        x = self.convs(images.float().clamp(-1.0, 1.0))
        return F.relu(self.fc(x.mean(dim=(2, 3))))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images [B, 3, 32, 32] in [-1, 1] -> logits [B, num_classes]"""
        return self.head(self.features(images))

    @torch.no_grad()
    def predict(self, images: torch.Tensor, batch: int = 500):
        """-> (predicted classes [B] int64, features [B, 128] float32), in eval mode, batched."""
        was_training = self.training
        self.eval()
        preds, feats = [], []
        for i in range(0, images.shape[0], batch):
            f = self.features(images[i : i + batch])
            preds.append(self.head(f).argmax(dim=1))
            feats.append(f)
        self.train(was_training)
        if not preds:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, FEATURE_DIM)
        return torch.cat(preds), torch.cat(feats)


def load_classifier(path_or_state_dict: Union[str, os.PathLike, dict, None] = None, device="cpu") -> ShapeClassifier:
    """Load the classifier strictly (default: the shipped python/lantern/weights/tiny/classifier.safetensors).
    Eval mode, float32."""
    if path_or_state_dict is None:
        from ..pretrained import TINY_DIR

        path_or_state_dict = TINY_DIR / "classifier.safetensors"
    if isinstance(path_or_state_dict, dict):
        state = path_or_state_dict
    else:
        from safetensors.torch import load_file

        path = os.fspath(path_or_state_dict)
        if not os.path.exists(path):
            raise FileNotFoundError(f"classifier weights missing: {path} "
                                    "(train them with python -m lantern.tiny.train)")
        state = load_file(path, device="cpu")
    model = ShapeClassifier()
    model.load_state_dict(state, strict=True)
    return model.to(device).float().eval()


# ---------------------------------------------------------------------------------------------------
# Frechet distance


def feature_stats(feats) -> tuple:
    """feats [N, D] -> (mean [D] float64, covariance [D, D] float64, unbiased)."""
    f = np.asarray(feats.detach().cpu().numpy() if isinstance(feats, torch.Tensor) else feats, dtype=np.float64)
    if f.ndim != 2 or f.shape[0] < 2:
        raise ValueError(f"need features [N >= 2, D], got shape {list(f.shape)}")
    return f.mean(axis=0), np.cov(f, rowvar=False)


def _sqrt_psd(m: np.ndarray) -> np.ndarray:
    """Symmetric PSD square root by eigh (negative eigenvalues from round-off clipped to 0)."""
    w, v = np.linalg.eigh((m + m.T) / 2)
    return (v * np.sqrt(np.clip(w, 0, None))) @ v.T


def frechet_distance_from_stats(mu_a, cov_a, mu_b, cov_b) -> float:
    """||mu_a - mu_b||^2 + tr(A + B - 2 (A^1/2 B A^1/2)^1/2): the Frechet distance of two Gaussians,
    symmetric formulation computed with eigh only (no scipy)."""
    mu_a, mu_b = np.asarray(mu_a, np.float64), np.asarray(mu_b, np.float64)
    cov_a, cov_b = np.asarray(cov_a, np.float64), np.asarray(cov_b, np.float64)
    root_a = _sqrt_psd(cov_a)
    middle = root_a @ cov_b @ root_a
    w = np.linalg.eigvalsh((middle + middle.T) / 2)
    tr_covmean = np.sqrt(np.clip(w, 0, None)).sum()
    fd = float(((mu_a - mu_b) ** 2).sum() + np.trace(cov_a) + np.trace(cov_b) - 2.0 * tr_covmean)
    return max(fd, 0.0)


def frechet_distance(feats_a, feats_b) -> float:
    """Frechet distance between two feature sets [N, D] and [M, D] (numpy or torch), Gaussian fits."""
    return frechet_distance_from_stats(*feature_stats(feats_a), *feature_stats(feats_b))
