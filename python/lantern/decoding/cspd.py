"""Continuous speculative decoding (CSpD, Wang et al. 2024) for MAR models: docs/cspd.md.

The loop (``generate_cspd``), for a batch of B images that share MAR's mask schedule:
1. pre-fill: the target alone runs the first ceil(prefill * num_iter) MAR steps;
2. blocks: the drafter runs gamma MAR steps (MAR's order and schedule), each conditioned on the verified
   tokens plus its own earlier drafts of the block; its head gives per drafted token the token, the last
   step's mean / std and the log-std sum over the other steps;
3. verification: one target forward on the verified tokens only (as upstream: a block's drafts do not
   condition each other on the target's side), then the target's head on every block position with the same
   noise (x_T, eps_t, eps_0 keyed by image and position: trajectory alignment);
4. decisions: ``lantern.ops.continuous_verify`` accepts each token or resamples it from the residual, in one
   call for the block; every block position ends with a token and the next block starts from them.

rule "exact" (last_step_noise on both sides) gives each token the target's law given the verified context,
i.e. the law of the target taking the whole block in one MAR step; rule "paper" is the paper's surrogate
(bandwidth, sigma_ratio), lossy. The residual sampler is bounded (max_tries); a capped token keeps a target
sample and is counted in ``CSpDStats.residual_fallbacks``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

from .. import ops
from .._backend import run_backends
from ..ops.continuous_verify_op import check_settings
from ..ops.reference.continuous_verify import DEFAULT_MAX_TRIES, capped
from .exclusive import one_backend_per_run
from .mar import (
    cfg_scale_at,
    check_finite_tokens,
    check_flag,
    check_sampling,
    conditions,
    forward_guided,
    predict_positions,
    sample_orders,
    step_positions,
    sync_device,
    token_dtype,
)
from .options import OptionError

DEFAULT_PREFILL = 0.05
DEFAULT_GAMMA = 8


@dataclass(frozen=True)
class CSpDConfig:
    gamma: int = DEFAULT_GAMMA  # drafted MAR steps per block
    rule: str = "exact"  # "exact" | "paper"
    bandwidth: float = 1.0  # paper rule: the std scale inside the exponent (the official code: 42)
    sigma_ratio: str = "paper"  # paper rule: "paper" (prod sigma_q / sigma_p) | "code" (its reciprocal)
    prefill: float = DEFAULT_PREFILL  # fraction of the MAR steps the target runs alone first
    max_tries: int = DEFAULT_MAX_TRIES  # the residual sampler's cap
    last_step_noise: Optional[bool] = None  # None: True for "exact" (required), False for "paper" (upstream)
    align: bool = True  # False: the drafter's noise from another stream (measures trajectory alignment's effect)

    def resolved_last_step_noise(self) -> bool:
        return self.rule == "exact" if self.last_step_noise is None else bool(self.last_step_noise)

    def check(self) -> None:
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, int) or self.gamma < 1:
            raise ValueError(f"gamma must be an int >= 1 (drafted MAR steps per block), got {self.gamma!r}")
        check_settings(self.rule, self.bandwidth, self.sigma_ratio, self.max_tries)
        if isinstance(self.prefill, bool) or not (isinstance(self.prefill, (int, float)) and 0.0 <= self.prefill < 1.0):
            raise ValueError(f"prefill must be a fraction in [0, 1), got {self.prefill!r}")
        if self.last_step_noise is not None:
            check_flag("last_step_noise", self.last_step_noise)
        check_flag("align", self.align)
        if self.rule == "exact" and self.last_step_noise is False:
            raise ValueError("rule='exact' needs last_step_noise=True: it compares the two heads' last-step "
                             "Gaussians, which MAR's noiseless last step (a point mass at the mean) does not have")


@dataclass
class CSpDStats:
    """What a CSpD run did (docs/cspd.md). Token counts are summed over the batch's images."""
    num_iter: int = 0
    gamma: int = 0
    max_tries: int = 0
    steps: int = 0  # MAR steps run (pre-fill and drafted)
    prefill_steps: int = 0
    blocks: int = 0  # verifications
    target_forwards: int = 0  # transformer calls (a guided call runs 2B rows)
    drafter_forwards: int = 0
    target_head_evaluations: int = 0  # net calls of the heads (T per head run)
    drafter_head_evaluations: int = 0
    prefill_tokens: int = 0  # tokens the target sampled alone
    drafted: int = 0  # tokens verified
    accepted: int = 0
    residual_tries: int = 0  # proposals drawn by the residual sampler
    residual_tries_max: int = 0
    residual_fallbacks: int = 0  # rejected tokens whose sampler hit max_tries (kept a plain target sample)
    drafted_by_block_position: List[int] = field(default_factory=list)  # [gamma]: by the drafting step's index
    accepted_by_block_position: List[int] = field(default_factory=list)
    drafted_by_step: List[int] = field(default_factory=list)  # [num_iter]: by MAR step
    accepted_by_step: List[int] = field(default_factory=list)
    target_transformer_s: float = 0.0
    drafter_transformer_s: float = 0.0
    target_head_s: float = 0.0
    drafter_head_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0

    @property
    def acceptance(self) -> float:
        """Per-token acceptance: accepted drafts / drafted tokens (NaN when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else math.nan

    @property
    def rejected(self) -> int:
        return self.drafted - self.accepted

    @property
    def residual_tries_mean(self) -> float:
        """Proposals per rejected token (NaN when none was rejected)."""
        return self.residual_tries / self.rejected if self.rejected else math.nan

    @property
    def transformer_s(self) -> float:
        return self.target_transformer_s + self.drafter_transformer_s

    @property
    def head_s(self) -> float:
        return self.target_head_s + self.drafter_head_s

    def acceptance_by_block_position(self) -> List[float]:
        pairs = zip(self.accepted_by_block_position, self.drafted_by_block_position)
        return [a / d if d else math.nan for a, d in pairs]

    def acceptance_by_step(self) -> List[float]:
        """Per MAR step (NaN for pre-filled steps)."""
        return [a / d if d else math.nan for a, d in zip(self.accepted_by_step, self.drafted_by_step)]

    def tokens_per_target_forward(self, images: int) -> float:
        """tau: tokens per image per target forward (target-only MAR: L / num_iter)."""
        return (self.prefill_tokens + self.drafted) / max(images, 1) / max(self.target_forwards, 1)

    def merge(self, other: "CSpDStats") -> None:
        """Add another batch's counts and times (same settings)."""
        for name in ("steps", "prefill_steps", "blocks", "target_forwards", "drafter_forwards",
                     "target_head_evaluations", "drafter_head_evaluations", "prefill_tokens", "drafted", "accepted",
                     "residual_tries", "residual_fallbacks", "target_transformer_s", "drafter_transformer_s",
                     "target_head_s", "drafter_head_s", "verify_s", "wall_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.residual_tries_max = max(self.residual_tries_max, other.residual_tries_max)
        for name in ("drafted_by_block_position", "accepted_by_block_position", "drafted_by_step", "accepted_by_step"):
            mine, theirs = getattr(self, name), getattr(other, name)
            setattr(self, name, [a + b for a, b in zip(mine, theirs)] if mine else list(theirs))
        self.num_iter, self.gamma, self.max_tries = other.num_iter, other.gamma, other.max_tries


@dataclass
class CSpDSample:
    tokens: torch.Tensor  # [B, L, C] scaled latent tokens
    stats: CSpDStats


def unaligned_seed(seed: int) -> int:
    """The drafter's noise seed with align=False: another stream than the target's (and than seed + 1's)."""
    return (seed + 0x9E3779B97F4A7C15) % 2**64


def check_pair(target, drafter) -> None:
    """A drafter must sample the target's tokens: same sequence, channels, classes and diffusion steps (the
    aligned noise is keyed by position and step)."""
    t, d = target.config, drafter.config
    for what, a, b in (("seq_len", t.seq_len, d.seq_len), ("token_embed_dim", t.token_embed_dim, d.token_embed_dim),
                       ("class_num", t.class_num, d.class_num),
                       ("diffusion steps", target.diffloss.gen_diffusion.num_timesteps,
                        drafter.diffloss.gen_diffusion.num_timesteps)):
        if a != b:
            raise ValueError(f"the drafter does not match the target: {what} {b} vs {a}")
    if drafter.fake_latent.device != target.fake_latent.device:
        raise ValueError(f"the drafter is on {drafter.fake_latent.device}, the target on {target.fake_latent.device}")
    if token_dtype(drafter) != token_dtype(target):
        raise ValueError(f"the drafter's tokens are {token_dtype(drafter)}, the target's {token_dtype(target)}: "
                         f"give both models the same dtype")


class _Block:
    """The drafter's output for one block: tokens and head statistics at the drafted positions of [B, L]."""

    def __init__(self, B: int, L: int, C: int, device: torch.device, dtype: torch.dtype):
        self.tokens = torch.zeros(B, L, C, device=device, dtype=dtype)
        self.mean0 = torch.zeros(B, L, C, device=device, dtype=dtype)
        self.std0 = torch.ones(B, L, C, device=device, dtype=dtype)
        self.logstd_sum = torch.zeros(B, L, device=device, dtype=dtype)
        self.position = torch.full((B, L), -1, dtype=torch.int64, device=device)  # drafting step's index in the block
        self.step = torch.full((B, L), -1, dtype=torch.int64, device=device)  # drafting MAR step

    def write(self, b, p, out, index: int, step: int) -> None:
        self.tokens[b, p] = out.tokens
        self.mean0[b, p] = out.mean0
        self.std0[b, p] = out.std0
        self.logstd_sum[b, p] = out.logstd_sum
        self.position[b, p] = index
        self.step[b, p] = step


class CSpDRun:
    """One batch of generate_cspd: the shared state of its steps (pre-fill steps, a block's drafts, its
    verification), usable step by step (the statistical tests set ``orders`` to verify copies of one context)."""

    def __init__(self, target, drafter, labels, B, image_ids, num_iter, config: CSpDConfig, cfg, cfg_schedule,
                 temperature, seed):
        self.target, self.drafter, self.config = target, drafter, config
        self.B, self.image_ids, self.num_iter = B, image_ids, num_iter
        self.cfg, self.cfg_schedule, self.temperature, self.seed = cfg, cfg_schedule, temperature, seed
        self.last_step_noise = config.resolved_last_step_noise()
        self.device = target.fake_latent.device
        self.verify_backend = run_backends(self.device)["continuous_verify"]  # resolved once for the run
        self.L, self.C = target.config.seq_len, target.config.token_embed_dim
        self.dtype = token_dtype(target)
        guided = cfg != 1.0
        self.target_cond = conditions(target, labels, B, guided)
        self.drafter_cond = conditions(drafter, labels, B, guided)
        self.orders = sample_orders(seed, image_ids, self.L)
        self.T = target.diffloss.gen_diffusion.num_timesteps
        self.stats = CSpDStats(num_iter=num_iter, gamma=config.gamma, max_tries=config.max_tries,
                               drafted_by_block_position=[0] * config.gamma,
                               accepted_by_block_position=[0] * config.gamma,
                               drafted_by_step=[0] * num_iter, accepted_by_step=[0] * num_iter)

    def _head(self, model, z, z_uncond, to_predict, mask_len, drafting: bool = False):
        scale = cfg_scale_at(self.cfg, self.cfg_schedule, self.L, mask_len)
        seed = unaligned_seed(self.seed) if drafting and not self.config.align else self.seed
        return predict_positions(model, z, z_uncond, to_predict, self.image_ids, seed=seed, cfg=scale,
                                 temperature=self.temperature, last_step_noise=self.last_step_noise)

    def _step(self, model, cond, tokens, mask, step, drafting: bool):
        """One MAR step of ``model``: -> (mask_len, mask after the step, positions [B, L], (b, p) and the head's
        output or None when the step predicts nothing, transformer seconds, head seconds)."""
        t0 = time.perf_counter()
        z, z_uncond = forward_guided(model, tokens, mask, cond)
        sync_device(self.device)
        t1 = time.perf_counter()
        mask_len, mask_next, to_predict = step_positions(self.L, self.num_iter, step, mask, self.orders)
        rows, out = (None, None)
        if bool(to_predict[0].any()):
            rows, out = self._head(model, z, z_uncond, to_predict, mask_len, drafting=drafting)
        sync_device(self.device)
        return mask_len, mask_next, to_predict, rows, out, t1 - t0, time.perf_counter() - t1

    def prefill_step(self, tokens, mask, step):
        """The target alone takes MAR step ``step``: -> (tokens, mask after the step, tokens per image)."""
        s = self.stats
        _, mask_next, to_predict, rows, out, t_transformer, t_head = self._step(self.target, self.target_cond, tokens,
                                                                                mask, step, drafting=False)
        if out is not None:
            tokens = tokens.clone()
            tokens[rows] = out.tokens
            s.target_head_evaluations += self.T
        n_new = int(to_predict[0].sum())
        s.target_transformer_s += t_transformer
        s.target_head_s += t_head
        s.target_forwards += 1
        s.steps += 1
        s.prefill_steps += 1
        s.prefill_tokens += n_new * self.B
        return tokens, mask_next, n_new

    def draft(self, tokens, mask, first: int, end: int):
        """The drafter takes MAR steps first .. end-1: -> (_Block, the mask after them, the last step's mask_len,
        drafted positions [B, L])."""
        s = self.stats
        block = _Block(self.B, self.L, self.C, self.device, self.dtype)
        drafted = torch.zeros_like(mask)
        draft_tokens = tokens
        mask_len = 0
        for index, step in enumerate(range(first, end)):
            mask_len, mask, to_predict, rows, out, t_transformer, t_head = self._step(
                self.drafter, self.drafter_cond, draft_tokens, mask, step, drafting=True)
            if out is not None:
                draft_tokens = draft_tokens.clone()
                draft_tokens[rows] = out.tokens
                block.write(*rows, out, index, step)
                drafted |= to_predict
                s.drafter_head_evaluations += self.T
            s.drafter_transformer_s += t_transformer
            s.drafter_head_s += t_head
            s.drafter_forwards += 1
            s.steps += 1
        return block, mask, mask_len, drafted

    def verify(self, tokens, mask_before, block: _Block, mask_len: int, drafted):
        """One target forward on the verified tokens, the target's head on the drafted positions, one
        continuous_verify call: -> tokens with the block's positions filled."""
        s, B, C = self.stats, self.B, self.C
        t0 = time.perf_counter()
        z, z_uncond = forward_guided(self.target, tokens, mask_before, self.target_cond)
        sync_device(self.device)
        t1 = time.perf_counter()
        (b, p), target_out = self._head(self.target, z, z_uncond, drafted, mask_len)  # batch-major, ascending p
        sync_device(self.device)
        t2 = time.perf_counter()
        N = b.shape[0] // B  # every image drafts the same count
        blockwise = lambda t: t[b, p].reshape(B, N, *t.shape[2:])
        # the op takes float32: a float64 run rounds the drafts and both heads' statistics here
        drafted_f32 = [blockwise(t).float() for t in (block.tokens, block.mean0, block.std0, block.logstd_sum)]
        mean_p, std_p = (t.reshape(B, N, C).float() for t in (target_out.mean0, target_out.std0))
        result = ops.continuous_verify(
            drafted_f32[0], mean_p, std_p, drafted_f32[1], drafted_f32[2], target_out.logstd_sum.reshape(B, N).float(),
            drafted_f32[3], self.config.rule, self.config.bandwidth, self.config.sigma_ratio,
            self.config.max_tries, self.seed, 0, rows=self.image_ids, positions=p.reshape(B, N),
            backend=self.verify_backend)
        tokens = tokens.clone()
        tokens[b, p] = result.tokens.reshape(-1, C).to(tokens.dtype)
        sync_device(self.device)
        t3 = time.perf_counter()
        s.target_transformer_s += t1 - t0
        s.target_head_s += t2 - t1
        s.verify_s += t3 - t2
        s.target_forwards += 1
        s.target_head_evaluations += self.T
        s.blocks += 1
        self._count(result, blockwise(block.position), blockwise(block.step))
        return tokens

    def _count(self, result, position, step) -> None:
        s = self.stats
        accepted = result.accepted.flatten()
        s.drafted += accepted.numel()
        s.accepted += int(accepted.sum())
        tries = result.tries.flatten()[~accepted].to(torch.int64)  # [R]
        s.residual_tries += int(tries.clamp(max=self.config.max_tries).sum())
        s.residual_tries_max = max(s.residual_tries_max, int(tries.clamp(max=self.config.max_tries).max())
                                   if tries.numel() else 0)
        s.residual_fallbacks += int(capped(tries, self.config.max_tries).sum())
        for counts, keys in ((s.drafted_by_block_position, position), (s.drafted_by_step, step)):
            for key, n in zip(*torch.unique(keys.flatten(), return_counts=True)):
                counts[int(key)] += int(n)
        for counts, keys in ((s.accepted_by_block_position, position), (s.accepted_by_step, step)):
            for key, n in zip(*torch.unique(keys.flatten()[accepted], return_counts=True)):
                counts[int(key)] += int(n)


@one_backend_per_run("target")
@torch.no_grad()
def generate_cspd(target, drafter, labels: Optional[torch.Tensor], *, num_iter: Optional[int] = None,
                  config: Optional[CSpDConfig] = None, cfg: float = 1.0, cfg_schedule: str = "linear",
                  temperature: float = 1.0, seed: int = 0, image_ids: Optional[torch.Tensor] = None,
                  batch: Optional[int] = None, on_step: Optional[Callable[[int, int], None]] = None) -> CSpDSample:
    """Sample B images with continuous speculative decoding (module docstring).

    target, drafter: MAR models over the same tokens and diffusion steps. labels [B] (None: unconditional,
    ``batch`` images); image_ids [B] (default 0..B-1) key all the noise, so a run split into batches gives
    the same images. num_iter: MAR steps (default L, one token per step as in the paper). Guidance,
    temperature and schedule as ``sample_mar``; the target verifies a block at the guidance of the block's
    last step. ``on_step(step, n_tokens)`` after each pre-fill step and each verified block."""
    config = config or CSpDConfig()
    config.check()
    check_pair(target, drafter)
    num_iter = target.config.seq_len if num_iter is None else num_iter
    B, image_ids = check_sampling(target, labels, batch, num_iter, temperature, cfg_schedule, image_ids, cfg=cfg,
                                  seed=seed)
    L = target.config.seq_len
    if config.gamma > L:
        raise OptionError("gamma", f"must be at most the image's {L} tokens (drafted MAR steps per block; a run "
                                   f"has at most one step per token), got {config.gamma}")
    run = CSpDRun(target, drafter, labels, B, image_ids, num_iter, config, cfg, cfg_schedule, temperature, seed)
    tokens = torch.zeros(B, run.L, run.C, device=run.device, dtype=run.dtype)
    mask = torch.ones(B, run.L, dtype=torch.bool, device=run.device)
    n_prefill = min(num_iter, math.ceil(config.prefill * num_iter))
    t_start = time.perf_counter()
    for step in range(n_prefill):
        tokens, mask, n_new = run.prefill_step(tokens, mask, step)
        if on_step is not None:
            on_step(step, n_new)
    for first in range(n_prefill, num_iter, config.gamma):
        end = min(first + config.gamma, num_iter)
        block, mask_after, mask_len, drafted = run.draft(tokens, mask, first, end)
        if bool(drafted.any()):
            tokens = run.verify(tokens, mask, block, mask_len, drafted)
        mask = mask_after
        if on_step is not None:
            on_step(end - 1, int(drafted[0].sum()))
    run.stats.wall_s = time.perf_counter() - t_start
    return CSpDSample(tokens=check_finite_tokens(tokens), stats=run.stats)
