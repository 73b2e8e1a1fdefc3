"""process_logits (SPEC §1): guidance, temperature, top-k and top-p, from logits to the probabilities the
verification samples from."""
from __future__ import annotations

from typing import Optional

import torch

from .. import _backend
from . import checks as c
from . import library
from .reference.process_logits import process_logits as reference

# logits [..., V] (float), uncond_logits like logits or None; cfg_scale, temperature (the compute type), top_k
# int64 and top_p float64: 0-d or per-row -> probabilities [..., V], float32 (float64 for float64 logits)
SCHEMA = ("(Tensor logits, Tensor? uncond_logits, Tensor cfg_scale, Tensor temperature, Tensor top_k, "
          "Tensor top_p) -> Tensor")


def fake(logits, uncond_logits, cfg_scale, temperature, top_k, top_p):
    return logits.new_empty(logits.shape, dtype=torch.float64 if logits.dtype == torch.float64 else torch.float32)


def to_schema(backend: str, logits, uncond_logits=None, cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0) -> tuple:
    real, dev = library.compute_dtype(logits, backend), logits.device
    return (logits, uncond_logits, library.setting(cfg_scale, real, dev), library.setting(temperature, real, dev),
            library.setting(top_k, torch.int64, dev), library.setting(top_p, torch.float64, dev))


OP = library.Op("process_logits", SCHEMA, fake, to_schema=to_schema, backends={
    "reference": reference,                      # ops/reference/process_logits.py (no fused kernel)
})


def process_logits(logits, uncond_logits=None, cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0, *,
                   backend: Optional[str] = None):
    """§1: guidance, temperature, top-k, top-p -> float32 probabilities ``[..., V]``."""
    cfg_scale, temperature, top_k, top_p = map(c.plain, (cfg_scale, temperature, top_k, top_p))
    check(logits, uncond_logits, cfg_scale, temperature, top_k, top_p)
    impl = _backend.dispatch("process_logits", logits.device, backend)
    return impl(logits, uncond_logits, cfg_scale, temperature, top_k, top_p)


def check(logits, uncond_logits, cfg_scale, temperature, top_k, top_p) -> None:
    ranges = c.check_logits_pair(logits, uncond_logits)
    rows = logits.shape[0] if logits.dim() >= 2 else 1
    c.check_sampling_settings(cfg_scale, temperature, top_k, top_p, rows, logits.device)
    c.check_processed_logits(logits, uncond_logits, cfg_scale, temperature, ranges)
