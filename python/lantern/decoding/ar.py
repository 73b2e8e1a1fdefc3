"""Autoregressive sampling with LlamaGen's semantics, through ``lantern.ops`` only.

A token is sampled by ``lantern.ops.verify`` on a one-node tree (the root alone): that is exactly §1
(guidance, temperature, top-k, top-p) followed by the §5 exponential race keyed by (token, node 0, row,
offset = step). Speculative decoding verifies through the same op with the same stream, so on every
backend a seed reproduces an image exactly, and greedy speculative decoding at δ = 0 reproduces greedy AR.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Union

import torch

from .. import ops
from .._backend import run_backends
from ..models.gpt import check_emb_masks
from .compiled import (
    AUTO,
    CompileChoice,
    CompiledRun,
    CompileOption,
    CompileStats,
    check_compile,
    compiled_target,
    resolve_compile,
)
from .exclusive import holds_models, one_backend_per_run
from .options import check_gpt_sampling

Number = Union[int, float, torch.Tensor]


def sample_next(logits: torch.Tensor, uncond_logits: Optional[torch.Tensor], *, cfg_scale: Number = 1.0,
                temperature: Number = 1.0, top_k: Number = 0, top_p: Number = 1.0, seed: int = 0,
                offset: int = 0, rows: Optional[torch.Tensor] = None, backend: Optional[str] = None) -> torch.Tensor:
    """logits / uncond_logits [B, V] -> next tokens [B] int64 (temperature 0 = greedy argmax); rows [B]: the
    rows' Philox keys (``ops.verify``'s rows; default b); backend: ``ops.verify``'s."""
    B = logits.shape[0]
    root = torch.zeros(B, 1, dtype=torch.int64, device=logits.device)
    parents = torch.full((B, 1), -1, dtype=torch.int64, device=logits.device)
    result = ops.verify(logits[:, None], root, parents, uncond_logits=None if uncond_logits is None else
                        uncond_logits[:, None], cfg_scale=cfg_scale, temperature=temperature, top_k=top_k,
                        top_p=top_p, seed=seed, offset=offset, rows=rows, backend=backend)
    return result.next_token


def check_image_ids(image_ids: Optional[torch.Tensor], B: int, device) -> Optional[torch.Tensor]:
    """image_ids: None, or integer ids [B] in [0, 2^32) (the Philox row key of each image) -> int64 [B] on
    ``device`` (None stays None). ValueError naming image_ids otherwise. One host read."""
    if image_ids is None:
        return None
    if not isinstance(image_ids, torch.Tensor) or image_ids.dtype.is_floating_point or image_ids.dtype.is_complex \
            or image_ids.dtype == torch.bool:
        raise ValueError(f"image_ids must be an integer tensor [B], got "
                         f"{getattr(image_ids, 'dtype', type(image_ids).__name__)}")
    if image_ids.shape != (B,):
        raise ValueError(f"image_ids must have shape [{B}], got {list(image_ids.shape)}")
    image_ids = image_ids.to(device=device, dtype=torch.int64)
    if B and bool((image_ids.min() < 0) | (image_ids.max() >= 2**32)):
        raise ValueError("image_ids must be in [0, 2^32)")
    return image_ids


def condition_masks(model, cond_idx: torch.Tensor, emb_masks: Optional[torch.Tensor], guided: bool):
    """emb_masks [B, C] (t2i caption padding) checked against the batch -> the masks of the model's rows:
    [2B, C] with guidance (the uncond rows keep their caption's mask, as LlamaGen does), or None."""
    if emb_masks is None:
        return None
    if model.config.model_type != "t2i":
        raise ValueError("emb_masks (caption padding) is for t2i models; this model is c2i")
    masks = check_emb_masks(emb_masks, cond_idx.shape[0], model.config.cond_len, cond_idx.device)
    return torch.cat([masks, masks]) if guided else masks


def check_condition(model, cond_idx) -> None:
    """cond_idx must be a non-empty batch; for a c2i model, integer class ids [B] in [0, num_classes)
    (num_classes itself is the null class that guidance uses, never a class to sample)."""
    if not isinstance(cond_idx, torch.Tensor):
        raise ValueError(f"cond_idx must be a tensor, got {type(cond_idx).__name__}")
    if cond_idx.dim() == 0 or cond_idx.shape[0] == 0:
        raise ValueError(f"cond_idx must hold at least one row (an empty batch), got shape {list(cond_idx.shape)}")
    if model.config.model_type != "c2i":
        return
    n = model.config.num_classes
    check_class_ids("cond_idx", cond_idx, n, f"the model's num_classes = {n}; id {n} is the null class of guidance")


def check_class_ids(name: str, ids: torch.Tensor, n: int, where: str) -> None:
    """ids must be integer class ids [B] in [0, n); ValueError naming ``name`` otherwise (``where`` says
    what n is). One host read."""
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be integer class ids [B], got {ids.dtype} {list(ids.shape)}")
    outside = (ids < 0) | (ids >= n)
    if bool(outside.any()):
        raise ValueError(f"{name}: class ids must be in [0, {n}) ({where}), got {ids[outside].unique()[:10].tolist()}")


def nonfinite_logits(logits: torch.Tensor) -> torch.Tensor:
    """bool []: some logit is NaN or +inf (-inf is a masked token), left on the device. The decoding loops'
    value check on what the models produce, read once with the loop's other figures (the ops' own scans
    are off inside the loops: ``ops.checks.values_checked_by_caller``)."""
    return ~(logits.detach().amax() < float("inf"))


def check_length(length: Optional[int], block_size: int) -> int:
    """The number of tokens to generate: ``length``, or the whole image (block_size) when None."""
    if length is None:
        return block_size
    if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= block_size:
        raise ValueError(f"length must be an int in [1, {block_size}] (the image's tokens), got {length!r}")
    return length


@holds_models("model")
@one_backend_per_run("model")
@torch.no_grad()
def generate_ar(model, cond_idx: torch.Tensor, *, cfg_scale: Number = 1.0, temperature: Number = 1.0,
                top_k: Number = 0, top_p: Number = 1.0, cfg_interval: int = -1, seed: int = 0,
                on_token: Optional[Callable[[int], None]] = None, length: Optional[int] = None,
                emb_masks: Optional[torch.Tensor] = None, compile: Union[CompileOption, CompileChoice] = AUTO,
                stats: Optional[dict] = None, image_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sample a whole image's tokens: cond_idx c2i class ids [B] in [0, num_classes) (or t2i caption
    features [B, C, D]; B >= 1, else ValueError) -> tokens [B, L] int64, L = the model's block_size.
    emb_masks [B, C] (t2i): 1 = a real caption position; padded positions are attended by no image token
    (``Transformer.forward``).

    Guidance (cfg_scale != 1) doubles the batch as [cond; uncond] like LlamaGen; with cfg_interval >= 0,
    steps after cfg_interval use the conditional logits alone (LlamaGen's cfg_interval). The sampled
    token is fed to both halves. ``on_token(step)`` is called after each token (progress bars).
    ``length`` stops after the first ``length`` tokens (default: the whole image), the same tokens as the
    full run's prefix. ``compile``: True runs the per-token forwards through torch.compile (inductor;
    CUDA graphs on a GPU), a dict passes those torch.compile options, "auto" (the default) is True where
    torch.compile works on the device (``compile_choice.py``), a CompileChoice is a choice already resolved (the
    speculative loop's); the prefill stays eager. ``stats``, a dict, receives
    compile (what compile resolved to, and why), compile_s (the first call of each new graph, compile
    included) and compiled_graphs. ``image_ids`` [B] (default 0..B-1): each image's Philox row key, so an image's tokens
    depend on its id, not on its place in the batch (SPEC §5). One call at a time per model: a call from
    another thread on the same model waits for this one (``exclusive.py``). The ops' backends are resolved
    once, at the start (``exclusive.one_backend_per_run``)."""
    check_condition(model, cond_idx)
    B = cond_idx.shape[0]
    L, C = check_length(length, model.config.block_size), model.config.cond_len
    device = model.tok_embeddings.weight.device
    check_gpt_sampling(cfg_scale, temperature, top_k, top_p, seed, cfg_interval, B, device)
    if not isinstance(compile, CompileChoice):
        check_compile(compile)
    guided = not (isinstance(cfg_scale, (int, float)) and cfg_scale == 1.0)
    masks = condition_masks(model, cond_idx, emb_masks, guided)
    cond = model.double_for_cfg(cond_idx) if guided else cond_idx
    rows = cond.shape[0]
    keys = check_image_ids(image_ids, B, device)
    verify_backend = run_backends(device)["verify"]
    model.setup_cache(rows, C + model.config.block_size)  # whatever the length: one compiled graph per rows
    cache_len = torch.zeros(rows, dtype=torch.int64, device=device)
    logits = model(None, cond, cache_len=cache_len, emb_masks=masks)[:, -1]  # [rows, V]: predicts image token 0
    prefix = model.cond_keys[:rows].clone()  # [rows] condition keys left in each row's cache
    choice = compile if isinstance(compile, CompileChoice) else resolve_compile(compile, device, (model,))
    compiled = CompileStats() if choice.on else None
    step_model = model
    if compiled is not None:
        step_model = compiled_target(model, CompiledRun(choice.options, compiled, choice.aot))
    tokens = torch.empty(B, L, dtype=torch.int64, device=device)
    broken = torch.zeros((), dtype=torch.bool, device=device)  # NaN / +inf logits seen (read once, at the end)
    # The first token is sampled with the ops' value scans on (they check the user's settings); after it the
    # loop builds every op input itself, so the scans are off and the logits are checked by ``broken`` (no
    # host read per token; docs/dispatch.md).
    with contextlib.ExitStack() as scans_off:
        for step in range(L):
            if step == 1:
                scans_off.enter_context(ops.checks.values_checked_by_caller())
            lc, lu = (logits[:B], logits[B:]) if guided else (logits, None)
            if guided and 0 <= cfg_interval < step:
                lu = None
            broken |= nonfinite_logits(logits)
            tokens[:, step] = sample_next(lc, lu, cfg_scale=cfg_scale if lu is not None else 1.0,
                                          temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                          offset=step, rows=keys, backend=verify_backend)
            if on_token is not None:
                on_token(step)
            if step + 1 < L:
                feed = tokens[:, step : step + 1].repeat(rows // B, 1)  # [rows, 1], both CFG halves
                cache_len = prefix + step
                logits = step_model(feed, cache_len=cache_len)[:, -1]
    model.free_cache()
    if bool(broken):
        raise RuntimeError("the model produced NaN or +inf logits (broken weights or inputs); the sampled tokens "
                           "are not valid")
    if stats is not None:
        stats.update(compile=choice.reason, compile_s=compiled.compile_s if compiled else 0.0,
                     compiled_graphs=compiled.graphs if compiled else 0)
    return tokens
