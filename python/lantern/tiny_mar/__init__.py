"""The tiny continuous-token default: a KL-tiny autoencoder (32 x 32 RGB -> 8 x 8 x 16 latents), a MAR-tiny
target and a smaller MAR-tiny-drafter, each with its diffusion head, trained on the procedural shapes by
``python -m lantern.tiny_mar.train`` and shipped in python/lantern/weights/tiny_mar/."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

TINY_MAR_DIR = Path(__file__).resolve().parent.parent / "weights" / "tiny_mar"
META_FILE = "tiny_mar.json"
WEIGHT_FILES = ("vae.safetensors", "mar.safetensors", "drafter.safetensors", META_FILE)


@dataclass
class TinyMAR:
    mar: torch.nn.Module
    drafter: torch.nn.Module
    vae: torch.nn.Module
    meta: dict  # configs, latent scale, sampling defaults, training figures


def tiny_mar_meta(directory: Optional[Path] = None) -> dict:
    directory = Path(directory or TINY_MAR_DIR)
    missing = [name for name in WEIGHT_FILES if not (directory / name).exists()]
    if missing:
        raise FileNotFoundError(
            f"the tiny MAR default model is not there: {directory} lacks {', '.join(missing)}. Train it with "
            f"`python -m lantern.tiny_mar.train` (about an hour on 2 CPU cores; --out DIR to write elsewhere), "
            f"or sample official checkpoints with `lantern generate --model mar-checkpoint --mar PATH --vae PATH`.")
    return json.loads((directory / META_FILE).read_text())


def load_tiny_mar(device="cpu", directory: Optional[Path] = None) -> TinyMAR:
    """The shipped models (directory None: ``TINY_MAR_DIR``, read at call time)."""
    from ..models import load_mar, load_vae

    directory = Path(directory or TINY_MAR_DIR)
    meta = tiny_mar_meta(directory)
    mar = load_mar(str(directory / "mar.safetensors"), meta["mar_name"], device=device, **meta["mar_overrides"])
    drafter = load_mar(str(directory / "drafter.safetensors"), meta["drafter_name"], device=device,
                       **meta["drafter_overrides"])
    vae = load_vae(str(directory / "vae.safetensors"), meta["vae_name"], device=device, scale=meta["vae_scale"])
    return TinyMAR(mar, drafter, vae, meta)
