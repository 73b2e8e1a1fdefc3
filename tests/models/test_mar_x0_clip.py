"""The tiny MAR configs sample with a bounded x0 (MARConfig.x0_clip).

The first reverse step runs at the last training step, where sqrt(abar) = 4.9e-5, so it multiplies the
head's eps error by about 630 in the mean (50 kept steps). The trained MAR-tiny head has an eps error of
about 0.03 rms there; unclipped, that sent every token some 20 standard deviations off and the samples
were noise (classifier accuracy at chance). The stub head below is the ideal denoiser of N(0, 1) data plus
that error."""
import math

import pytest
import torch
import torch.nn as nn

from lantern.models import build_mar
from lantern.models.diffusion import GaussianDiffusion
from lantern.models.mar import MAR_CONFIGS

EPS_ERROR = 0.03  # the trained MAR-tiny head's eps error (rms) at the last training steps


class NearIdealHead(nn.Module):
    """(x_t, original step, c) -> (eps, v = 0): E[eps | x_t] = sqrt(1 - abar) x_t for x0 ~ N(0, 1), plus a
    fixed error of EPS_ERROR per channel."""

    def __init__(self, channels: int):
        super().__init__()
        abar = torch.from_numpy(GaussianDiffusion("").alphas_cumprod).float()
        self.register_buffer("sqrt_1m_abar", (1 - abar).sqrt())
        sign = torch.where(torch.arange(channels) % 2 == 0, 1.0, -1.0)
        self.register_buffer("error", EPS_ERROR * sign)

    def forward(self, x, t, c):
        eps = self.sqrt_1m_abar[t][:, None] * x + self.error
        return torch.cat([eps, torch.zeros_like(x)], dim=1)


def _tiny(name: str, **overrides):
    model = build_mar(name, **overrides).eval()
    model.diffloss.net = NearIdealHead(model.config.token_embed_dim)
    return model


def _first_step(model, n: int = 4096) -> torch.Tensor:
    """x_{T-1} from x_T ~ N(0, 1): the reverse step at the last training step (sqrt(abar) = 4.9e-5)."""
    C, diffusion = model.config.token_embed_dim, model.diffloss.gen_diffusion
    gen = torch.Generator().manual_seed(0)
    x_T, noise = torch.randn(n, C, generator=gen), torch.randn(n, C, generator=gen)
    t = torch.full((n,), diffusion.num_timesteps - 1)
    step = model.diffloss.step(x_T, t, torch.zeros(n, model.config.decoder_embed_dim), 1.0, None)
    return step.mean + torch.exp(0.5 * step.log_variance) * noise


@pytest.mark.parametrize("name", ["MAR-tiny", "MAR-tiny-drafter"])
def test_tiny_configs_first_reverse_step_stays_on_the_data_scale(name):
    """For unit-variance data, x at the second-to-last kept step is N(0, 1) up to sqrt(abar) = 0.03."""
    x = _first_step(_tiny(name))
    assert 0.9 < float(x.std()) < 1.1, float(x.std())
    assert float(x.mean(dim=0).abs().max()) < 0.35


def test_unclipped_first_step_is_thrown_off_by_the_same_head():
    """Negative control: without the bound (the released models' law) the same eps error puts x about 20
    standard deviations off, which the trained tiny head never recovers from."""
    x = _first_step(_tiny("MAR-tiny", x0_clip=None))
    assert float(x.mean(dim=0).abs().min()) > 10.0


@pytest.mark.parametrize("name", ["MAR-tiny", "MAR-tiny-drafter"])
def test_tiny_configs_sample_unit_scale_tokens_with_a_near_ideal_head(name):
    """The whole chain with the bound: the head's law (N(0, 1) data) comes out."""
    model, n = _tiny(name), 4096
    C, T = model.config.token_embed_dim, model.diffloss.gen_diffusion.num_timesteps
    gen = torch.Generator().manual_seed(1)
    x_T, steps = torch.randn(n, C, generator=gen), torch.randn(T, n, C, generator=gen)
    tokens = model.diffloss.sample(torch.zeros(n, model.config.decoder_embed_dim), x_T, lambda t: steps[t]).tokens
    assert 0.85 < float(tokens.std()) < 1.15, float(tokens.std())
    assert float(tokens.mean(dim=0).abs().max()) < 0.15


def test_x0_clip_bounds_pred_x0_and_is_off_for_the_released_configs():
    diffusion = GaussianDiffusion("50", x0_clip=2.0)
    x = torch.randn(8, 4)
    t = torch.full((8,), 49)
    out = diffusion.step_distribution(torch.cat([x + 0.5, torch.zeros_like(x)], dim=1), x, t)
    assert float(out.pred_x0.abs().max()) == 2.0
    unclipped = GaussianDiffusion("50").step_distribution(torch.cat([x + 0.5, torch.zeros_like(x)], dim=1), x, t)
    assert float(unclipped.pred_x0.abs().max()) > 1000.0
    for name in ("MAR-B", "MAR-L", "MAR-H"):
        assert MAR_CONFIGS[name].x0_clip is None
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="x0_clip"):
            GaussianDiffusion("50", x0_clip=bad)
