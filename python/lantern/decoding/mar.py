"""MAR's sampling loop with explicit, counter-based noise.

Every random number comes from the project's Philox stream (SPEC §5, ``lantern.ops.philox_uniform``), keyed
by what it is for, never by where it sits in a batch: (seed; purpose, Box-Muller half, channel; image id;
token position; diffusion step), the layout of ``lantern.ops.reference.noise``. So an image gets the same
noise at any batch size or composition (and the same image wherever the matrix products compute a row alike
whatever the batch: docs/sampling.md "Numerics"), and two models sampling the same position of the same image
(a drafter and a target) see the same x_T and the same eps_t.

The loop (``sample_mar``) is the reference's: a random order per image (argsort of one uniform per
position), consumed from its end; the cosine mask schedule, shared by the batch; every remaining token on the
last step; linear (1 + (cfg - 1) (L - still masked) / L) or constant guidance, applied on eps inside every
diffusion step; temperature on the per-step noise std only.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Union

import torch

from .. import ops
from ..ops.reference.noise import (  # noqa: F401
    MAX_CHANNELS,
    PURPOSE_ACCEPT,
    PURPOSE_EPS,
    PURPOSE_EPS_0,
    PURPOSE_ORDER,
    PURPOSE_RESIDUAL,
    PURPOSE_X_T,
    box_muller,
    noise_counters,
)
from .ar import check_class_ids, check_image_ids
from .exclusive import one_backend_per_run
from .options import OptionError, check_int, check_mar_settings

IntOrTensor = Union[int, torch.Tensor]


def gaussian(seed: int, purpose: int, image: torch.Tensor, position: torch.Tensor, step: IntOrTensor,
             channels: int) -> torch.Tensor:
    """Standard normals float32 for rows (image [N], position [N]): [N, channels] at an int ``step``, or
    [S, N, channels] for a 1-D tensor of S steps."""
    if not 0 < channels <= MAX_CHANNELS:
        raise ValueError(f"channels must be in 1..{MAX_CHANNELS}, got {channels}")
    channel = torch.arange(channels, dtype=torch.int64, device=image.device)[None, :]  # [1, C]
    img, pos = image.to(torch.int64)[:, None], position.to(torch.int64)[:, None]  # [N, 1]
    if isinstance(step, torch.Tensor):
        step = step.to(device=image.device, dtype=torch.int64)[:, None, None]  # [S, 1, 1]
    u0 = ops.philox_uniform(seed, *noise_counters(purpose, 0, channel, img, pos, step))
    u1 = ops.philox_uniform(seed, *noise_counters(purpose, 1, channel, img, pos, step))
    return box_muller(*torch.broadcast_tensors(u0, u1))


def step_noise(seed: int, image: torch.Tensor, position: torch.Tensor, num_steps: int, channels: int,
               max_elements: int = 1 << 21) -> torch.Tensor:
    """eps_t [num_steps, N, C] for t = 0 .. num_steps-1 (row t = 0 unused by MAR's loop), drawn in chunks of
    steps of at most ``max_elements`` numbers (one Philox call pair per chunk, not per step)."""
    N = image.shape[0]
    per_chunk = max(1, max_elements // max(1, N * channels))
    steps = torch.arange(num_steps, dtype=torch.int64, device=image.device)
    return torch.cat([gaussian(seed, PURPOSE_EPS, image, position, chunk, channels)
                      for chunk in steps.split(per_chunk)])


def sample_orders(seed: int, image_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One random permutation of range(seq_len) per image [B, L] int64: positions sorted by their uniform
    (ties, which need two equal 31-bit draws, go to the lower position)."""
    positions = torch.arange(seq_len, dtype=torch.int64, device=image_ids.device)[None, :]
    u = ops.philox_uniform(seed, *noise_counters(PURPOSE_ORDER, 0, 0, image_ids.to(torch.int64)[:, None], positions, 0))
    return torch.argsort(u, dim=1, stable=True)


def next_mask_len(seq_len: int, num_iter: int, step: int, n_masked: int) -> int:
    """How many positions stay masked after MAR step ``step``: floor(L cos(pi/2 (step+1)/num_iter)), at
    least 1 and at most n_masked - 1 (n_masked: masked now)."""
    ratio = math.cos(math.pi / 2.0 * (step + 1) / num_iter)
    return max(1, min(n_masked - 1, math.floor(seq_len * ratio)))


def mask_by_order(mask_len: int, orders: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: the first ``mask_len`` positions of each image's order masked."""
    mask = torch.zeros(orders.shape, dtype=torch.bool, device=orders.device)
    return mask.scatter_(1, orders[:, :mask_len], True)


def cfg_scale_at(cfg: float, schedule: str, seq_len: int, mask_len: int) -> float:
    """The guidance of a step whose post-step masked count is mask_len."""
    if schedule == "linear":
        return 1.0 + (cfg - 1.0) * (seq_len - mask_len) / seq_len
    if schedule == "constant":
        return float(cfg)
    raise ValueError(f"cfg_schedule must be 'linear' or 'constant', got {schedule!r}")


def tokens_per_step(seq_len: int, num_iter: int) -> List[int]:
    """How many tokens each MAR step predicts (the schedule alone, no model)."""
    counts, n_masked = [], seq_len
    for step in range(num_iter):
        mask_len = next_mask_len(seq_len, num_iter, step, n_masked)
        new = n_masked if step >= num_iter - 1 else n_masked - mask_len
        counts.append(max(new, 0))
        n_masked = mask_len
    return counts


# ---------------------------------------------------------------------------------------------------


@dataclass
class MARStats:
    steps: int = 0
    tokens_per_step: List[int] = field(default_factory=list)
    transformer_forwards: int = 0  # forward calls (a guided call runs 2B rows)
    head_evaluations: int = 0  # net calls of the head (one per diffusion step per MAR step)
    transformer_s: float = 0.0
    head_s: float = 0.0
    wall_s: float = 0.0


@dataclass
class MARSample:
    """tokens [B, L, C] (scaled latent tokens; ``model.unpatchify`` -> [B, c, h, w]) and, with
    ``head_stats=True``, per position the head's last-step mean [B, L, C], std [B, L, C] (times the
    temperature) and S [B, L] = sum over steps t >= 1 and channels of log sigma_t."""
    tokens: torch.Tensor
    stats: MARStats
    mean0: Optional[torch.Tensor] = None
    std0: Optional[torch.Tensor] = None
    logstd_sum: Optional[torch.Tensor] = None


def token_dtype(model) -> torch.dtype:
    """The dtype of a MAR loop's tokens: the head's chain dtype (float32; float64 for a float64 model)."""
    from ..models.diffusion import chain_dtype

    return chain_dtype(model.fake_latent.dtype)


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def predict_positions(model, z: torch.Tensor, z_uncond: Optional[torch.Tensor], to_predict: torch.Tensor,
                      image_ids: torch.Tensor, *, seed: int, cfg: float, temperature: float,
                      last_step_noise: bool = False):
    """Run the head for the positions ``to_predict`` [B, L] bool (the same count in every row) with the
    noise of (seed, image, position): -> (rows (b, p), HeadSample of those rows in batch-major, ascending
    position order). z, z_uncond [B, L, Dd] (z_uncond None: no guidance)."""
    b, p = to_predict.nonzero(as_tuple=True)
    img = image_ids[b]
    C = model.config.token_embed_dim
    x_T = gaussian(seed, PURPOSE_X_T, img, p, 0, C)
    eps_all = step_noise(seed, img, p, model.diffloss.gen_diffusion.num_timesteps, C)  # [T, M, C]
    eps = lambda t: eps_all[t]
    eps0 = gaussian(seed, PURPOSE_EPS_0, img, p, 0, C) if last_step_noise else None
    out = model.diffloss.sample(z[b, p], x_T.to(z.device), eps, temperature=temperature, cfg=cfg,
                                z_uncond=None if z_uncond is None else z_uncond[b, p], last_step_noise=eps0)
    return (b, p), out


def check_sampling(model, labels: Optional[torch.Tensor], batch: Optional[int], num_iter: int, temperature: float,
                   cfg_schedule: str, image_ids: Optional[torch.Tensor], *, cfg: float = 1.0, seed: int = 0):
    """The arguments every MAR loop shares (``options.check_mar_settings``: bounded guidance and temperature,
    1 <= num_iter <= L) -> (B, image_ids [B] int64 on the model's device)."""
    device = model.fake_latent.device
    if labels is not None:
        if batch is not None:
            raise ValueError("batch is for unconditional sampling (labels None); with labels B is their count")
        check_class_ids("labels", labels, model.config.class_num, "the model's class_num")
        B = labels.shape[0]
        if B < 1:
            raise ValueError("labels must hold at least one class id (an empty batch)")
    else:
        if batch is None:
            raise ValueError("MAR sampling needs labels [B] or batch >= 1")
        check_int("batch", batch, 1, None, " (images to sample unconditionally)")
        B = batch
    check_mar_settings(cfg, temperature, seed, num_iter, model.config.seq_len)
    cfg_scale_at(1.0, cfg_schedule, 1, 0)  # validates the schedule name
    image_ids = check_image_ids(image_ids, B, device)
    return B, torch.arange(B, device=device) if image_ids is None else image_ids


def check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise OptionError(name, f"must be a bool (True or False), got {value!r}")


def check_finite_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """tokens, or RuntimeError when some is NaN or inf (broken weights, or settings the head's arithmetic
    cannot carry): one host read after the loop."""
    if not bool(torch.isfinite(tokens).all()):
        raise RuntimeError("the MAR model produced NaN or inf tokens (broken weights or inputs); the sampled tokens "
                           "are not valid")
    return tokens


def conditions(model, labels: Optional[torch.Tensor], B: int, guided: bool) -> torch.Tensor:
    """The class embeddings [B, De], followed by B unconditional rows when guided ([2B, De])."""
    cond = model.class_embedding(labels.to(model.fake_latent.device) if labels is not None else None, batch=B)
    return torch.cat([cond, model.class_embedding(None, batch=B)]) if guided else cond


def forward_guided(model, tokens: torch.Tensor, mask: torch.Tensor, cond: torch.Tensor):
    """(z [B, L, Dd], z_uncond [B, L, Dd] or None): one transformer forward, on the doubled batch when
    cond has 2B rows (the unconditional half sees the same tokens and mask)."""
    B = tokens.shape[0]
    if cond.shape[0] == 2 * B:
        z_all = model.forward_z(torch.cat([tokens, tokens]), torch.cat([mask, mask]), cond)
        return z_all[:B], z_all[B:]
    return model.forward_z(tokens, mask, cond), None


def step_positions(seq_len: int, num_iter: int, step: int, mask: torch.Tensor, orders: torch.Tensor):
    """MAR step ``step`` from ``mask`` [B, L] (True = unknown): -> (mask_len, the mask after the step,
    the positions it predicts [B, L]; the last step predicts everything left)."""
    mask_len = next_mask_len(seq_len, num_iter, step, int(mask[0].sum()))
    mask_next = mask_by_order(mask_len, orders)
    to_predict = mask if step >= num_iter - 1 else mask & ~mask_next
    return mask_len, mask_next, to_predict


DEFAULT_NUM_ITER = 64  # the released models' demo setting


@one_backend_per_run("model")
@torch.no_grad()
def sample_mar(model, labels: Optional[torch.Tensor], *, num_iter: Optional[int] = None, cfg: float = 1.0,
               cfg_schedule: str = "linear", temperature: float = 1.0, seed: int = 0,
               image_ids: Optional[torch.Tensor] = None, batch: Optional[int] = None, last_step_noise: bool = False,
               head_stats: bool = False, on_step: Optional[Callable[[int, int], None]] = None) -> MARSample:
    """Sample B images' tokens with MAR's loop.

    labels [B] int64 class ids (None: unconditional, ``batch`` images). image_ids [B] (default 0..B-1): the
    images' indices in the whole run, which key all their noise; pass them when a run is split into
    batches. cfg != 1 doubles the transformer batch (the unconditional half sees the same tokens) and
    guides eps in each diffusion step; cfg_schedule "linear" | "constant". ``on_step(step, n_tokens)`` after
    each MAR step (progress bars). num_iter: MAR steps, in [1, L] (default 64, or L for a shorter image).
    RuntimeError if the tokens come out NaN or inf."""
    if num_iter is None:
        num_iter = min(DEFAULT_NUM_ITER, model.config.seq_len)
    B, image_ids = check_sampling(model, labels, batch, num_iter, temperature, cfg_schedule, image_ids, cfg=cfg,
                                  seed=seed)
    check_flag("last_step_noise", last_step_noise)
    check_flag("head_stats", head_stats)
    device = model.fake_latent.device
    L, C = model.config.seq_len, model.config.token_embed_dim
    cond = conditions(model, labels, B, cfg != 1.0)
    dtype = token_dtype(model)
    tokens = torch.zeros(B, L, C, device=device, dtype=dtype)
    mask = torch.ones(B, L, dtype=torch.bool, device=device)
    orders = sample_orders(seed, image_ids, L)
    stats = MARStats()
    keep = dict(mean0=torch.zeros(B, L, C, device=device, dtype=dtype),
                std0=torch.zeros(B, L, C, device=device, dtype=dtype),
                logstd_sum=torch.zeros(B, L, device=device, dtype=dtype)) if head_stats else None
    t_start = time.perf_counter()
    for step in range(num_iter):
        t0 = time.perf_counter()
        z, z_uncond = forward_guided(model, tokens, mask, cond)
        sync_device(device)
        t1 = time.perf_counter()
        mask_len, mask_next, to_predict = step_positions(L, num_iter, step, mask, orders)
        n_new = int(to_predict[0].sum())
        if n_new > 0:
            scale = cfg_scale_at(cfg, cfg_schedule, L, mask_len)
            (b, p), out = predict_positions(model, z, z_uncond, to_predict, image_ids, seed=seed, cfg=scale,
                                            temperature=temperature, last_step_noise=last_step_noise)
            tokens = tokens.clone()
            tokens[b, p] = out.tokens.to(tokens.dtype)
            if keep is not None:
                keep["mean0"][b, p] = out.mean0
                keep["std0"][b, p] = out.std0
                keep["logstd_sum"][b, p] = out.logstd_sum
            stats.head_evaluations += model.diffloss.gen_diffusion.num_timesteps
        sync_device(device)
        t2 = time.perf_counter()
        mask = mask_next
        stats.steps += 1
        stats.transformer_forwards += 1
        stats.tokens_per_step.append(n_new)
        stats.transformer_s += t1 - t0
        stats.head_s += t2 - t1
        if on_step is not None:
            on_step(step, n_new)
    stats.wall_s = time.perf_counter() - t_start
    return MARSample(tokens=check_finite_tokens(tokens), stats=stats, **(keep or {}))


def generate_mar(model, labels: Optional[torch.Tensor], *, drafter=None, cfg_scale: float = 1.0,
                 temperature: float = 1.0, seed: int = 0, **options):
    """``lantern.generate`` for MAR models: -> (tokens [B, L, C], MARStats). options go to ``sample_mar``
    (num_iter, cfg_schedule, image_ids, last_step_noise, on_step)."""
    if drafter is not None:
        raise ValueError("a drafter is used by continuous speculative decoding: call lantern.generate with "
                         "method='cspd' (or without a drafter for plain MAR sampling)")
    out = sample_mar(model, labels, cfg=cfg_scale, temperature=temperature, seed=seed, **options)
    return out.tokens, out.stats
