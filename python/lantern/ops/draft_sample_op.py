"""draft_sample (SPEC §5, "Sampled drafts"): a drafter's sampled children of tree nodes in one call: each node's
draft distribution (§1; greedy rows one-hot) and its draws without replacement by the exponential race."""
from __future__ import annotations

from typing import Optional

import torch

from .. import _backend
from . import checks as c
from . import library
from .reference.draft_sample import DraftSample
from .reference.draft_sample import draft_sample as reference
from .verify_op import check_row_keys

# logits [B, N, V] (float32/bfloat16/float16/float64); uncond_logits like logits or None; per-row settings
# cfg_scale, temperature [B] in the compute type (float64 for float64 logits, else float32), top_k int64 [B],
# top_p float64 [B]; draws in [1, V]; seed, offset one-element int64 (the seed's 64 bits; offset modulo 2^32);
# node_ids int64 [B, N] and rows int64 [B] or None: the Philox counter's node and row words (modulo 2^32; rows
# None: b). Returns (probs [B, N, V] in the compute type, tokens [B, N, draws] int64).
SCHEMA = ("(Tensor logits, Tensor? uncond_logits, Tensor cfg_scale, Tensor temperature, Tensor top_k, "
          "Tensor top_p, int draws, Tensor seed, Tensor node_ids, Tensor offset, Tensor? rows=None) "
          "-> (Tensor, Tensor)")


def fake(logits, uncond_logits, cfg_scale, temperature, top_k, top_p, draws, seed, node_ids, offset, rows=None):
    B, N, V = logits.shape
    real = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return logits.new_empty((B, N, V), dtype=real), logits.new_empty((B, N, draws), dtype=torch.int64)


def to_schema(backend: str, logits, uncond_logits=None, cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0, *,
              draws=1, seed=0, node_ids, offset=0, rows=None) -> tuple:
    B, dev = logits.shape[0], logits.device
    real = library.compute_dtype(logits, backend)
    return (logits, uncond_logits, library.row_setting(cfg_scale, B, real, dev),
            library.row_setting(temperature, B, real, dev), library.row_setting(top_k, B, torch.int64, dev),
            library.row_setting(top_p, B, torch.float64, dev), int(draws), library.seed_tensor(seed, dev),
            node_ids.to(torch.int64), library.offset_tensor(offset, dev),
            None if rows is None else rows.to(device=dev, dtype=torch.int64).contiguous())


def _reference_kernel(logits, uncond_logits, cfg_scale, temperature, top_k, top_p, draws, seed, node_ids, offset,
                      rows=None):
    return tuple(reference(logits, uncond_logits, cfg_scale, temperature, top_k, top_p, draws=draws,
                           seed=library.unsigned(seed), node_ids=node_ids, offset=int(offset), rows=rows))


def _result(out) -> DraftSample:
    return DraftSample(*out)


OP = library.Op("draft_sample", SCHEMA, fake, to_schema=to_schema, from_schema=_result,
                reference_kernel=_reference_kernel, backends={
                    "reference": reference,      # ops/reference/draft_sample.py
                    "cpu": library.EXTENSION,    # csrc/cpu/draft_sample.cpp
                })


def draft_sample(logits, uncond_logits=None, cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0, *, draws: int = 1,
                 seed=0, node_ids: torch.Tensor, offset=0, rows: Optional[torch.Tensor] = None,
                 backend: Optional[str] = None) -> DraftSample:
    """SPEC §5 "Sampled drafts": logits [B, N, V] of N tree nodes per row -> (probs [B, N, V] each node's draft
    distribution, tokens [B, N, draws] its draws without replacement). node_ids [B, N] and rows [B] (default
    b) are the Philox counter's node and row words; seed, offset as for ``verify``. ``backend``: which backend
    runs it (default: the one ``lantern.enable_fused`` / ``lantern.fused`` chose)."""
    cfg_scale, temperature, top_k, top_p, draws, seed, offset = map(
        c.plain, (cfg_scale, temperature, top_k, top_p, draws, seed, offset))
    check(logits, uncond_logits, cfg_scale, temperature, top_k, top_p, draws, seed, node_ids, offset, rows)
    impl = _backend.dispatch("draft_sample", logits.device, backend)
    return impl(logits, uncond_logits, cfg_scale, temperature, top_k, top_p, draws=draws, seed=seed,
                node_ids=node_ids, offset=offset, rows=rows)


def check(logits, uncond_logits, cfg_scale, temperature, top_k, top_p, draws, seed, node_ids, offset, rows) -> None:
    ranges = c.check_logits_pair(logits, uncond_logits, ndim=3)
    B, N, V = logits.shape
    c.check_sampling_settings(cfg_scale, temperature, top_k, top_p, B, logits.device)
    c.check_processed_logits(logits, uncond_logits, cfg_scale, temperature, ranges)
    c.int_arg("draws", draws, 1, V)
    c.tensor("node_ids", node_ids, shape=[B, N], dtypes=c.INT_DTYPES, device=logits.device)
    if c.scan_values() and node_ids.numel():
        c.in_range("node_ids", node_ids, 0, 2**32)
    c.check_counter("seed", seed, 64)
    c.check_counter("offset", offset, 32)
    if rows is not None:
        check_row_keys(rows, B, logits.device)
