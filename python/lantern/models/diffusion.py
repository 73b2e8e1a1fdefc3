"""MAR's per-token diffusion head: the ``SimpleMLPAdaLN`` denoiser and the Gaussian diffusion it samples
with (cosine schedule, respacing, learned-range variance, epsilon prediction). Official key names under
``diffloss.net.``; the sampling loop takes its noise from the caller (``lantern.decoding.mar`` keys it by
token position), so a drafter and a target can share it.

Diffusion facts kept here (docs/mar.md):
- 1000 training steps, cosine schedule alpha_bar(t) = cos^2(((t + 0.008) / 1.008) pi / 2), beta clipped
  at 0.999; respaced to T steps (e.g. 100) by ``space_timesteps``; the net always sees the original step
  number (0..999) of the respaced index;
- the net predicts (eps, v) per channel; log sigma^2 = frac * log beta_t + (1 - frac) * log posterior
  variance (index 0 replaced by index 1), frac = (v + 1) / 2, v not clamped;
- x0 = sqrt(1 / abar) x_t - sqrt(1 / abar - 1) eps, not clipped (the reference) unless the sampling process
  has an ``x0_clip`` bound (the tiny configs: see ``GaussianDiffusion``); mean = coef1 x0 + coef2 x_t;
- a step adds temperature * sigma_t * eps_t for t > 0 and no noise at t = 0 (unless asked: CSpD's exact rule);
- guidance mixes eps (eps_u + s (eps_c - eps_u)) inside every step; the variance is the conditional one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn as nn

TRAIN_STEPS = 1000
TIME_FREQ_DIM = 256  # the sinusoidal timestep embedding's width


# ---------------------------------------------------------------------------------------------------
# The denoiser


def chain_dtype(dtype: torch.dtype) -> torch.dtype:
    """The reverse chain's dtype for a net computing in ``dtype``: float32 (the reference's, also under a
    bfloat16 net), or float64 for a float64 net (tests that must not depend on last-bit rounding)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class TimestepEmbedder(nn.Module):
    """t (original step numbers, float or int [N]) -> [N, W]: cos/sin features (cos first), Linear-SiLU-Linear."""

    def __init__(self, width: int, freq_dim: int = TIME_FREQ_DIM):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, width), nn.SiLU(), nn.Linear(width, width))

    @staticmethod
    def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]  # [N, half]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
        return emb

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        freq = self.timestep_embedding(t, self.freq_dim)
        return self.mlp(freq.to(self.mlp[0].weight.dtype))


class ResBlock(nn.Module):
    """x + gate * mlp(in_ln(x) * (1 + scale) + shift); (shift, scale, gate) from SiLU-Linear of y."""

    def __init__(self, width: int):
        super().__init__()
        self.in_ln = nn.LayerNorm(width, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 3 * width))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.adaLN_modulation(y).chunk(3, dim=-1)
        return x + gate * self.mlp(modulate(self.in_ln(x), shift, scale))


class FinalLayer(nn.Module):
    def __init__(self, width: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(width, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class SimpleMLPAdaLN(nn.Module):
    """(x_t [N, C], t [N] original step numbers, c [N, z_channels]) -> [N, 2C] = (eps, v)."""

    def __init__(self, in_channels: int, model_channels: int, out_channels: int, z_channels: int,
                 num_res_blocks: int):
        super().__init__()
        self.in_channels = in_channels
        self.time_embed = TimestepEmbedder(model_channels)
        self.cond_embed = nn.Linear(z_channels, model_channels)
        self.input_proj = nn.Linear(in_channels, model_channels)
        self.res_blocks = nn.ModuleList([ResBlock(model_channels) for _ in range(num_res_blocks)])
        self.final_layer = FinalLayer(model_channels, out_channels)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """Xavier Linears, N(0, 0.02) time MLP, zero adaLN and final projection (training from scratch)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.time_embed.mlp[0].weight, std=0.02)
        nn.init.normal_(self.time_embed.mlp[2].weight, std=0.02)
        for block in self.res_blocks:
            nn.init.zeros_(block.adaLN_modulation[-1].weight)
            nn.init.zeros_(block.adaLN_modulation[-1].bias)
        for layer in (self.final_layer.adaLN_modulation[-1], self.final_layer.linear):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor, t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        x = self.input_proj(x)
        y = self.time_embed(t) + self.cond_embed(c)
        for block in self.res_blocks:
            x = block(x, y)
        return self.final_layer(x, y)


# ---------------------------------------------------------------------------------------------------
# The schedule


def space_timesteps(num_timesteps: int, section_counts: Union[str, Sequence[int]]) -> List[int]:
    """The kept steps of a respaced process, sorted: "100" keeps 100 of 1000 steps, evenly, by the same
    float accumulation and Python ``round`` as the reference; "" keeps all of them."""
    if isinstance(section_counts, str):
        if section_counts.startswith("ddim"):
            raise ValueError("ddim respacing is not supported (MAR does not use it)")
        section_counts = [int(x) for x in section_counts.split(",")] if section_counts else [num_timesteps]
    size_per, extra = divmod(num_timesteps, len(section_counts))
    start, kept = 0, set()
    for i, count in enumerate(section_counts):
        size = size_per + (1 if i < extra else 0)
        if not 1 <= count <= size:
            raise ValueError(f"cannot take {count} steps from a section of {size} steps")
        stride = (size - 1) / (count - 1) if count > 1 else 1
        cur = 0.0
        for _ in range(count):
            kept.add(start + round(cur))
            cur += stride
        start += size
    return sorted(kept)


def cosine_betas(num_timesteps: int = TRAIN_STEPS, max_beta: float = 0.999) -> np.ndarray:
    def alpha_bar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    return np.array([min(1 - alpha_bar((i + 1) / num_timesteps) / alpha_bar(i / num_timesteps), max_beta)
                     for i in range(num_timesteps)], dtype=np.float64)


@dataclass(frozen=True)
class StepOutput:
    """One reverse step's distribution for rows [N, C]: mean, log sigma^2 (learned range, no temperature)
    and the predicted x0."""
    mean: torch.Tensor
    log_variance: torch.Tensor
    pred_x0: torch.Tensor


class GaussianDiffusion:
    """The (possibly respaced) diffusion process: float64 tables, read in the chain's dtype per step (float32
    like the reference; float64 for a float64 model). ``timestep_map[i]`` is the original step number of
    respaced index i.

    ``x0_clip`` (None: the reference, no clipping) clamps the predicted x0 to [-x0_clip, x0_clip] before the
    posterior mean. The last training step has sqrt(abar) = 4.9e-5 (beta clipped at 0.999), so the first
    reverse step multiplies the head's eps error by sqrt(1/abar - 1) = 2e4 in x0 (by about 630 in the mean
    with 50 kept steps); a briefly trained head (eps error 0.03 there) then starts the chain about 20
    standard deviations off and never recovers. The bound keeps that step's x0 in the data's range."""

    def __init__(self, respacing: Union[str, Sequence[int]] = "", num_timesteps: int = TRAIN_STEPS,
                 x0_clip: Optional[float] = None):
        if x0_clip is not None and not x0_clip > 0:
            raise ValueError(f"x0_clip must be None or > 0, got {x0_clip}")
        self.x0_clip = None if x0_clip is None else float(x0_clip)
        base_betas = cosine_betas(num_timesteps)
        base_abar = np.cumprod(1.0 - base_betas)
        kept = space_timesteps(num_timesteps, respacing)
        betas, last = [], 1.0
        for i in kept:
            betas.append(1 - base_abar[i] / last)
            last = base_abar[i]
        self.timestep_map = torch.tensor(kept, dtype=torch.int64, device="cpu")  # also when built under a meta device
        self.betas = np.array(betas, dtype=np.float64)
        self.num_timesteps = len(kept)
        abar = np.cumprod(1.0 - self.betas)
        abar_prev = np.append(1.0, abar[:-1])
        self.alphas_cumprod, self.alphas_cumprod_prev = abar, abar_prev
        self.sqrt_alphas_cumprod = np.sqrt(abar)
        self.sqrt_one_minus_alphas_cumprod = np.sqrt(1.0 - abar)
        self.sqrt_recip_alphas_cumprod = np.sqrt(1.0 / abar)
        self.sqrt_recipm1_alphas_cumprod = np.sqrt(1.0 / abar - 1)
        self.posterior_variance = self.betas * (1.0 - abar_prev) / (1.0 - abar)
        pv = self.posterior_variance
        self.posterior_log_variance_clipped = np.log(np.append(pv[1], pv[1:])) if len(pv) > 1 else np.log(pv)
        self.posterior_mean_coef1 = self.betas * np.sqrt(abar_prev) / (1.0 - abar)
        self.posterior_mean_coef2 = (1.0 - abar_prev) * np.sqrt(1.0 - self.betas) / (1.0 - abar)
        self.log_betas = np.log(self.betas)
        self._device_tables = {}

    def _at(self, table: np.ndarray, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """table[t] in like's dtype (float32, or float64 for a float64 chain) as [N, 1] on like's device
        (broadcasts over channels); the copies are made once per table, device and dtype."""
        key = (id(table), like.device, like.dtype)
        cached = self._device_tables.get(key)
        if cached is None:
            cached = self._device_tables[key] = torch.from_numpy(table).to(like.dtype).to(like.device)
        return cached[t.to(like.device)][:, None]

    def original_steps(self, t: torch.Tensor) -> torch.Tensor:
        """Respaced indices [N] -> the step numbers the net is called with."""
        return self.timestep_map.to(t.device)[t]

    def step_distribution(self, net_out: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> StepOutput:
        """net_out [N, 2C] (eps, v), x_t [N, C], respaced t [N] -> the reverse step's mean and log variance."""
        C = x_t.shape[1]
        eps, v = net_out[:, :C].to(x_t.dtype), net_out[:, C:].to(x_t.dtype)
        min_log = self._at(self.posterior_log_variance_clipped, t, x_t)
        max_log = self._at(self.log_betas, t, x_t)
        frac = (v + 1) / 2
        log_variance = frac * max_log + (1 - frac) * min_log
        pred_x0 = self._at(self.sqrt_recip_alphas_cumprod, t, x_t) * x_t - \
            self._at(self.sqrt_recipm1_alphas_cumprod, t, x_t) * eps
        if self.x0_clip is not None:
            pred_x0 = pred_x0.clamp(-self.x0_clip, self.x0_clip)
        mean = self._at(self.posterior_mean_coef1, t, x_t) * pred_x0 + self._at(self.posterior_mean_coef2, t, x_t) * x_t
        return StepOutput(mean, log_variance, pred_x0)

    # ---- training (the tiny models) --------------------------------------------------------------

    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return (self._at(self.sqrt_alphas_cumprod, t, x0) * x0
                + self._at(self.sqrt_one_minus_alphas_cumprod, t, x0) * noise)

    def q_posterior(self, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor):
        mean = self._at(self.posterior_mean_coef1, t, x_t) * x0 + self._at(self.posterior_mean_coef2, t, x_t) * x_t
        return mean, self._at(self.posterior_log_variance_clipped, t, x_t)

    def training_losses(self, net: Callable, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor,
                        c: torch.Tensor) -> torch.Tensor:
        """Per-row loss [N] = mse(eps) + vb, the vb term with the mean branch detached (learned-range
        variance trained by the variational bound only), in bits; at t = 0 the discretised-Gaussian NLL."""
        x_t = self.q_sample(x0, t, noise)
        out = net(x_t, self.original_steps(t), c).float()
        C = x0.shape[1]
        mse = ((noise - out[:, :C]) ** 2).mean(dim=1)
        frozen = torch.cat([out[:, :C].detach(), out[:, C:]], dim=1)
        step = self.step_distribution(frozen, x_t, t)
        true_mean, true_log_var = self.q_posterior(x0, x_t, t)
        kl = normal_kl(true_mean, true_log_var, step.mean, step.log_variance).mean(dim=1) / math.log(2.0)
        nll = -discretized_gaussian_log_likelihood(x0, step.mean, 0.5 * step.log_variance).mean(dim=1) / math.log(2.0)
        return mse + torch.where(t == 0, nll, kl)


def normal_kl(mean1, logvar1, mean2, logvar2):
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def _approx_standard_normal_cdf(x):
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def discretized_gaussian_log_likelihood(x, means, log_scales):
    """log-likelihood of data in [-1, 1] discretised to 255 bins (the reference's decoder term)."""
    centered = x - means
    inv_stdv = torch.exp(-log_scales)
    cdf_plus = _approx_standard_normal_cdf(inv_stdv * (centered + 1.0 / 255.0))
    cdf_min = _approx_standard_normal_cdf(inv_stdv * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    cdf_delta = cdf_plus - cdf_min
    return torch.where(x < -0.999, log_cdf_plus,
                       torch.where(x > 0.999, log_one_minus_cdf_min, torch.log(cdf_delta.clamp(min=1e-12))))


# ---------------------------------------------------------------------------------------------------
# The head


@dataclass
class HeadSample:
    """A head run for N tokens: the tokens [N, C] and, per token, the last step's mean [N, C] and std
    [N, C] (learned-range std times temperature), and S [N] = sum over steps t >= 1 and channels of
    log sigma_t (without temperature, which would add the same (T - 1) C log(temperature) to every S)."""
    tokens: torch.Tensor
    mean0: torch.Tensor
    std0: torch.Tensor
    logstd_sum: torch.Tensor


NoiseFn = Callable[[int], torch.Tensor]  # respaced step t -> eps_t [N, C]


class DiffLoss(nn.Module):
    """Holds ``net`` (state-dict prefix ``diffloss.net.``) and the two processes: 1000 steps for training,
    ``num_sampling_steps`` for sampling (with ``x0_clip``, None for the reference's unclipped x0)."""

    def __init__(self, target_channels: int, z_channels: int, depth: int, width: int,
                 num_sampling_steps: str = "100", x0_clip: Optional[float] = None):
        super().__init__()
        self.in_channels = target_channels
        self.net = SimpleMLPAdaLN(target_channels, width, target_channels * 2, z_channels, depth)
        self.train_diffusion = GaussianDiffusion("")
        self.gen_diffusion = GaussianDiffusion(str(num_sampling_steps), x0_clip=x0_clip)

    def loss(self, target: torch.Tensor, z: torch.Tensor, t: Optional[torch.Tensor] = None,
             noise: Optional[torch.Tensor] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """target [N, C], z [N, Dd] -> per-row loss [N] at uniformly drawn training steps."""
        N = target.shape[0]
        if t is None:
            t = torch.randint(0, self.train_diffusion.num_timesteps, (N,), generator=generator).to(target.device)
        if noise is None:
            noise = torch.randn(target.shape, generator=generator).to(target.device)
        return self.train_diffusion.training_losses(self.net, target.float(), t, noise, z)

    @torch.no_grad()
    def sample(self, z: torch.Tensor, x_T: torch.Tensor, noise: NoiseFn, *, temperature: float = 1.0,
               cfg: float = 1.0, z_uncond: Optional[torch.Tensor] = None,
               last_step_noise: Optional[torch.Tensor] = None, on_step=None) -> HeadSample:
        """Run the reverse process for N tokens from x_T [N, C].

        z [N, Dd] conditions the net; with ``z_uncond`` [N, Dd] (and any cfg) every step runs the net on
        [x; x] with [z; z_uncond] and uses eps_u + cfg (eps_c - eps_u) with the conditional variance.
        ``noise(t)`` gives eps_t [N, C] for t = T-1 .. 1. ``last_step_noise`` [N, C] (optional) adds
        std0 * eps_0 at t = 0 (MAR adds none). The chain runs in ``chain_dtype(z.dtype)``."""
        diffusion = self.gen_diffusion
        N, C = x_T.shape
        x = x_T.to(chain_dtype(z.dtype))
        logstd_sum = torch.zeros(N, dtype=x.dtype, device=x.device)
        step = None
        for t_index in reversed(range(diffusion.num_timesteps)):
            t = torch.full((N,), t_index, dtype=torch.int64, device=x.device)
            step = self.step(x, t, z, cfg, z_uncond)
            std = torch.exp(0.5 * step.log_variance)  # [N, C]
            if t_index > 0:
                logstd_sum += 0.5 * step.log_variance.sum(dim=1)
                x = step.mean + std * temperature * noise(t_index).to(x)
            else:
                x = step.mean if last_step_noise is None else step.mean + std * temperature * last_step_noise.to(x)
            if on_step is not None:
                on_step(t_index)
        return HeadSample(tokens=x, mean0=step.mean, std0=torch.exp(0.5 * step.log_variance) * temperature,
                          logstd_sum=logstd_sum)

    def step(self, x: torch.Tensor, t: torch.Tensor, z: torch.Tensor, cfg: float,
             z_uncond: Optional[torch.Tensor]) -> StepOutput:
        """One reverse step's distribution for rows x [N, C] at respaced t [N] (guided when z_uncond is given)."""
        diffusion = self.gen_diffusion
        steps = diffusion.original_steps(t)
        if z_uncond is None:
            out = self.net(x.to(z.dtype), steps, z).to(x.dtype)
        else:
            both = self.net(torch.cat([x, x]).to(z.dtype), torch.cat([steps, steps]),
                            torch.cat([z, z_uncond])).to(x.dtype)  # [2N, 2C]
            C = x.shape[1]
            cond, uncond = both[: len(x)], both[len(x):]
            eps = uncond[:, :C] + cfg * (cond[:, :C] - uncond[:, :C])
            out = torch.cat([eps, cond[:, C:]], dim=1)
        return diffusion.step_distribution(out, x, t)
