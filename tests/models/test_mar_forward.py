"""MAR's forward and diffusion head against the literal re-derivation in mar_testing (raw tensors, loops,
formulas): positions, masking, the class-embedding buffer, patchify, the head's net, the respaced
schedule, the learned-range variance and guidance inside the head."""
import math

import pytest
import torch

from lantern.models import build_vae
from lantern.models.diffusion import GaussianDiffusion, space_timesteps
from mar_testing import literal_chain, literal_net, literal_schedule, literal_z, small_mar


@pytest.fixture(scope="module")
def model():
    return small_mar(0).double()


def _inputs(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    tokens = torch.randn(3, cfg.seq_len, cfg.token_embed_dim, generator=g, dtype=torch.float64)
    mask = torch.zeros(3, cfg.seq_len, dtype=torch.bool)
    for n in range(3):  # 6 unknown positions per image, different ones
        mask[n, torch.randperm(cfg.seq_len, generator=g)[:6]] = True
    return tokens, mask


def _z_against_literal(model, conditional):
    """The model's z on the test inputs, checked against the literal re-derivation -> (z, inputs, labels)."""
    tokens, mask = _inputs(model)
    labels = torch.tensor([4, 0, 2]) if conditional else None
    with torch.no_grad():
        z = model.forward_z(tokens, mask, model.class_embedding(labels, batch=3))
    expected = literal_z(model.state_dict(), model.config, tokens, mask, labels)
    torch.testing.assert_close(z, expected, atol=1e-10, rtol=1e-10)
    return z, (tokens, mask), labels


@pytest.mark.parametrize("conditional", [True, False])
def test_forward_matches_literal(model, conditional):
    _z_against_literal(model, conditional)


@pytest.mark.parametrize("conditional", [True, False])
def test_neighbour_heads_match_literal(conditional):
    """The tiny configs' neighbour heads (a fixed attention bias) against the bias written from its definition;
    SMALL has 2 encoder and 3 decoder heads, so both the biased and the plain heads are exercised."""
    model = small_mar(1, neighbour_heads=2, neighbour_slope=1.5).double()
    z, (tokens, mask), labels = _z_against_literal(model, conditional)
    # negative control: the same weights without the bias give a different z
    plain = small_mar(1).double()
    with torch.no_grad():
        z_plain = plain.forward_z(tokens, mask, plain.class_embedding(labels, batch=3))
    assert (z_plain - z).abs().max() > 1e-3


def test_neighbour_heads_validated():
    with pytest.raises(ValueError, match="neighbour_heads"):
        small_mar(0, neighbour_heads=3)  # SMALL's encoder has 2 heads
    with pytest.raises(ValueError, match="neighbour_heads"):
        small_mar(0, neighbour_heads=9, encoder_num_heads=16, decoder_num_heads=24, encoder_embed_dim=32,
                  decoder_embed_dim=48)
    with pytest.raises(ValueError, match="neighbour_slope"):
        small_mar(0, neighbour_heads=1, neighbour_slope=0.0)


def test_masked_tokens_are_invisible_known_ones_are_not(model):
    tokens, mask = _inputs(model)
    emb = model.class_embedding(torch.tensor([1, 2, 3]))
    with torch.no_grad():
        z = model.forward_z(tokens, mask, emb)
        hidden = tokens.clone()
        hidden[mask] = 100.0  # values at unknown positions never reach the encoder
        torch.testing.assert_close(model.forward_z(hidden, mask, emb), z, atol=0, rtol=0)
        shown = tokens.clone()
        shown[~mask] += 1.0  # negative control: known values do matter
        assert (model.forward_z(shown, mask, emb) - z).abs().max() > 1e-3


def test_buffer_positions_and_class(model):
    """Every buffer slot holds the class embedding with its own position embedding: swapping two buffer
    position rows changes nothing only if those slots held the same input, which they do."""
    tokens, mask = _inputs(model)
    labels = torch.tensor([1, 2, 3])
    with torch.no_grad():
        z = model.forward_z(tokens, mask, model.class_embedding(labels))
        swapped = small_mar(0).double()
        swapped.encoder_pos_embed_learned.data[0, [0, 1]] = swapped.encoder_pos_embed_learned.data[0, [1, 0]]
        swapped.decoder_pos_embed_learned.data[0, [0, 1]] = swapped.decoder_pos_embed_learned.data[0, [1, 0]]
        torch.testing.assert_close(swapped.forward_z(tokens, mask, swapped.class_embedding(labels)), z)
        # negative control: swapping a buffer slot with an image position changes z
        moved = small_mar(0).double()
        B = moved.config.buffer_size
        moved.encoder_pos_embed_learned.data[0, [0, B]] = moved.encoder_pos_embed_learned.data[0, [B, 0]]
        assert (moved.forward_z(tokens, mask, moved.class_embedding(labels)) - z).abs().max() > 1e-3
        other = model.forward_z(tokens, mask, model.class_embedding(torch.tensor([0, 2, 3])))
        assert (other[0] - z[0]).abs().max() > 1e-3 and torch.equal(other[1:], z[1:])


def test_label_dropout_uses_fake_latent(model):
    emb = model.class_embedding(torch.tensor([1, 2]), drop=torch.tensor([True, False]))
    torch.testing.assert_close(emb[0], model.fake_latent[0])
    torch.testing.assert_close(emb[1], model.class_emb.weight[2])


def test_patchify_order():
    mar = small_mar(0, patch_size=2, img_size=32)  # 4x4 tokens of 2x2 patches of 4 channels
    latents = torch.randn(2, 4, 8, 8)
    tokens = mar.patchify(latents)
    assert tokens.shape == (2, 16, 16)
    for r in range(4):
        for c in range(4):
            expected = torch.stack([latents[:, ch, 2 * r + i, 2 * c + j] for ch in range(4) for i in range(2)
                                    for j in range(2)], dim=1)
            torch.testing.assert_close(tokens[:, r * 4 + c], expected, atol=0, rtol=0)
    torch.testing.assert_close(mar.unpatchify(tokens), latents, atol=0, rtol=0)


def test_head_net_matches_literal(model):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 4, generator=g, dtype=torch.float64)
    c = torch.randn(5, 24, generator=g, dtype=torch.float64)
    t = torch.tensor([0, 1, 499, 998, 999])
    with torch.no_grad():
        got = model.diffloss.net(x, t, c)
    torch.testing.assert_close(got, literal_net(model.state_dict(), x, t.double(), c, depth=2), atol=1e-10, rtol=1e-10)


def test_respaced_schedule_values():
    kept = space_timesteps(1000, "100")
    assert kept == [math.floor(k * 999 / 99 + 0.5) for k in range(100)]
    assert kept[:7] == [0, 10, 20, 30, 40, 50, 61] and kept[-2:] == [989, 999]
    assert {b - a for a, b in zip(kept, kept[1:])} == {10, 11}
    assert space_timesteps(1000, "") == list(range(1000))
    d = GaussianDiffusion("100")
    ref = literal_schedule(100)
    assert d.timestep_map.tolist() == ref["kept"]
    for name, table in (("betas", d.betas), ("posterior_variance", d.posterior_variance)):
        expected = ref["betas"] if name == "betas" else ref["pv"]
        torch.testing.assert_close(torch.tensor(table), torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=0)
    assert abs(d.betas[0] - 4.13e-5) < 5e-8 and abs(d.betas[1] - 6.80e-4) < 5e-7 and abs(d.betas[99] - 0.99999) < 5e-6
    assert round(math.sqrt(d.betas[0]), 5) == 0.00643 and round(math.sqrt(d.posterior_variance[1]), 5) == 0.00624
    assert d.posterior_log_variance_clipped[0] == d.posterior_log_variance_clipped[1]
    base = GaussianDiffusion("")
    assert base.betas[999] == 0.999 and base.betas[:999].max() < 0.999  # only the last step is clipped


def test_learned_range_variance_unclamped():
    d = GaussianDiffusion("10")
    ref = literal_schedule(10)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, generator=g)
    out = torch.randn(4, 6, generator=g) * 3  # v far outside [-1, 1]
    for j in (0, 1, 5, 9):
        step = d.step_distribution(out, x, torch.full((4,), j))
        frac = (out[:, 3:].double() + 1) / 2
        logvar = frac * math.log(ref["betas"][j]) + (1 - frac) * ref["log_pv_clipped"][j]
        a = ref["abar"][j]
        x0 = math.sqrt(1 / a) * x.double() - math.sqrt(1 / a - 1) * out[:, :3].double()
        mean = ref["coef1"][j] * x0 + ref["coef2"][j] * x.double()
        torch.testing.assert_close(step.log_variance.double(), logvar, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(step.pred_x0.double(), x0, rtol=1e-5, atol=1e-4)  # no clipping to [-1, 1]
        torch.testing.assert_close(step.mean.double(), mean, rtol=1e-5, atol=1e-4)
    assert step.pred_x0.abs().max() > 1.0


@pytest.mark.parametrize("cfg,temperature", [(1.0, 1.0), (3.0, 0.7)])
def test_head_sampling_chain_matches_literal(cfg, temperature):
    model = small_mar(1)  # float32, as sampling runs
    sd = model.state_dict()
    g = torch.Generator().manual_seed(5)
    zc, zu = torch.randn(6, 24, generator=g), torch.randn(6, 24, generator=g)
    x_T = torch.randn(6, 4, generator=g)
    noise = torch.randn(10, 6, 4, generator=g)
    guided = cfg != 1.0
    out = model.diffloss.sample(zc, x_T, lambda t: noise[t], temperature=temperature, cfg=cfg,
                                z_uncond=zu if guided else None)
    sched = literal_schedule(10)
    tokens, mean0, std0, S = literal_chain(sd, 2, sched, zc, zu if guided else None, x_T, noise, cfg, temperature)
    torch.testing.assert_close(out.tokens.double(), tokens, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.mean0.double(), mean0, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.std0.double(), std0, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out.logstd_sum.double(), S, rtol=1e-4, atol=1e-3)
    assert torch.equal(out.tokens, out.mean0)  # no noise at the last step
    if guided:  # negative control: the unconditional branch's variance gives another chain
        other = literal_chain(sd, 2, sched, zc, zu, x_T, noise, cfg, temperature, variance_from="uncond")
        assert (other[3] - S).abs().max() > 1e-2


def test_last_step_noise_adds_std0_eps0():
    model = small_mar(2)
    g = torch.Generator().manual_seed(1)
    z, x_T = torch.randn(3, 24, generator=g), torch.randn(3, 4, generator=g)
    noise, eps0 = torch.randn(10, 3, 4, generator=g), torch.randn(3, 4, generator=g)
    plain = model.diffloss.sample(z, x_T, lambda t: noise[t], temperature=0.8)
    noisy = model.diffloss.sample(z, x_T, lambda t: noise[t], temperature=0.8, last_step_noise=eps0)
    torch.testing.assert_close(noisy.mean0, plain.mean0)
    torch.testing.assert_close(noisy.tokens, plain.mean0 + plain.std0 * eps0)


def test_training_loss_finite_and_head_trainable():
    model = small_mar(0)
    model.train()
    latents = torch.randn(4, 4, 4, 4)
    loss = model.training_loss(latents, torch.tensor([0, 1, 2, 3]), generator=torch.Generator().manual_seed(0))
    loss.backward()
    assert torch.isfinite(loss) and model.diffloss.net.final_layer.linear.weight.grad.abs().sum() > 0
    assert model.z_proj.weight.grad.abs().sum() > 0


def test_vae_posterior_and_scale():
    torch.manual_seed(0)
    vae = build_vae("KL-tiny", scale=0.5).eval()
    x = torch.rand(2, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        post = vae.encode(x)
        assert post.mean.shape == (2, 16, 8, 8) and float(post.logvar.max()) <= 20 and float(post.logvar.min()) >= -30
        a, b = post.sample(torch.Generator().manual_seed(0)), post.sample(torch.Generator().manual_seed(0))
        assert torch.equal(a, b) and not torch.equal(a, post.mode())
        torch.testing.assert_close(vae.decode_tokens(post.mode() * 0.5), vae.decode(post.mode()))
