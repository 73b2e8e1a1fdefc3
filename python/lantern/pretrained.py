"""The shipped tiny default model (trained by ``python -m lantern.tiny.train``, weights committed)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

TINY_DIR = Path(__file__).resolve().parent / "weights" / "tiny"
MAX_DRAFTER_LAYERS = 16  # layers of the drafter a file may ask for (the shipped one has 1)


@dataclass
class TinyModels:
    gpt: torch.nn.Module
    vq: torch.nn.Module
    meta: dict  # configs, class names, sampling defaults, training figures


def tiny_meta(directory: Path = TINY_DIR) -> dict:
    path = directory / "tiny.json"
    if not path.exists():
        raise FileNotFoundError(f"the tiny default model is missing: {path} "
                                "(train it with python -m lantern.tiny.train)")
    return json.loads(path.read_text())


def load_tiny(device: str = "cpu", dtype: Optional[torch.dtype] = None, directory: Path = TINY_DIR) -> TinyModels:
    """The tiny GPT (its weights are stored in bfloat16) in ``dtype``, default ``models.decode_dtype(device)``,
    and its VQ (float32)."""
    from .models import decode_dtype, load_gpt, load_vq

    meta = tiny_meta(directory)
    gpt = load_gpt(str(directory / "gpt.safetensors"), meta.get("gpt_name", "GPT-tiny"), device=device,
                   dtype=dtype or decode_dtype(device)).eval()
    vq = load_vq(str(directory / "vq.safetensors"), meta.get("vq_name", "VQ-tiny"), device=device).eval()
    return TinyModels(gpt, vq, meta)


def load_tiny_drafter(gpt, directory: Path = TINY_DIR):
    """The shipped EAGLE drafter of the tiny model (trained by python -m lantern.train_drafter), on the
    target's device and in its dtype."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from .models.drafter import EagleDrafter
    from .models.loading import check_finite

    path = directory / "drafter.safetensors"
    if not path.exists():
        raise FileNotFoundError(f"the tiny drafter is missing: {path} (train it with python -m lantern.train_drafter)")
    with safe_open(str(path), "pt") as f:
        n_layer = (f.metadata() or {}).get("n_layer", "1")
    if not (n_layer.isascii() and n_layer.isdigit() and 1 <= int(n_layer) <= MAX_DRAFTER_LAYERS):
        raise ValueError(f"{path}: its metadata n_layer must be an int in [1, {MAX_DRAFTER_LAYERS}], got {n_layer!r}")
    drafter = EagleDrafter(gpt.config, n_layer=int(n_layer))
    state = load_file(str(path))
    check_finite(state, str(path))
    drafter.load_state_dict(state, strict=True)
    weight = gpt.tok_embeddings.weight
    return drafter.to(device=weight.device, dtype=weight.dtype).bind(gpt).eval()
