"""2D RoPE: angles r*f_k / c*f_k on interleaved pairs, and LlamaGen's zeroed condition positions."""
import math

import torch

import lantern
from gpt_testing import small_gpt
from lantern.models import gpt as gpt_module
from lantern.models.gpt import apply_rope, precompute_freqs_cis_2d


def rotate_reference(x, r, c, base=10000.0):
    """x [Dh] float64 -> rotated [Dh], LlamaGen's 2D RoPE written out pair by pair: the first half of the
    pairs rotates by the row r, the second half by the column c."""
    Dh = x.shape[0]
    quarter = Dh // 4
    out = x.clone()
    for j in range(Dh // 2):
        k = j if j < quarter else j - quarter
        angle = (r if j < quarter else c) * base ** (-k / quarter)
        a, b = x[2 * j].item(), x[2 * j + 1].item()
        out[2 * j] = a * math.cos(angle) - b * math.sin(angle)
        out[2 * j + 1] = b * math.cos(angle) + a * math.sin(angle)
    return out


def test_table_layout():
    for Dh, grid, cond in ((64, 16, 1), (100, 4, 120), (32, 4, 1)):
        table = precompute_freqs_cis_2d(grid, Dh, 10000.0, cond)
        assert table.shape == (cond + grid * grid, Dh // 2, 2) and table.dtype == torch.float32
        assert (table[:cond] == 0).all()
        quarter = Dh // 4
        f = torch.tensor([10000.0 ** (-k / quarter) for k in range(quarter)], dtype=torch.float64)
        for t in (0, 1, grid - 1, grid, grid * grid - 1, 5 % (grid * grid)):
            r, c = t // grid, t % grid
            angles = torch.cat([r * f, c * f])
            torch.testing.assert_close(table[cond + t, :, 0].double(), torch.cos(angles), atol=2e-6, rtol=0)
            torch.testing.assert_close(table[cond + t, :, 1].double(), torch.sin(angles), atol=2e-6, rtol=0)


def test_apply_rope_matches_pairwise_rotation():
    torch.manual_seed(0)
    Dh, grid = 32, 4
    table = precompute_freqs_cis_2d(grid, Dh, 10000.0, 1)
    x = torch.randn(1, 1, 2, Dh)
    for t in range(grid * grid):
        out = apply_rope(x, table[1 + t][None, None])
        for h in range(2):
            ref = rotate_reference(x[0, 0, h].double(), t // grid, t % grid)
            torch.testing.assert_close(out[0, 0, h].double(), ref, atol=1e-5, rtol=0)


def test_model_keys_are_rotated_by_raster_position():
    """Layer 0's cached key of an image token equals the pairwise rotation of its raw key."""
    model = small_gpt(1)
    B, L = 1, 10
    tokens = torch.randint(0, 64, (B, L))
    model.setup_cache(B, 1 + 16)
    with torch.no_grad():
        model(tokens, torch.tensor([2]), cache_len=torch.zeros(B, dtype=torch.int64))
        layer = model.layers[0].attention
        raw = layer.wqkv(model.layers[0].attention_norm(model.tok_embeddings(tokens)))  # [B, L, 3*dim]
    H, Dh = layer.n_head, layer.head_dim
    raw_k = raw[0, :, H * Dh: 2 * H * Dh].view(L, H, Dh)
    for t in range(L):
        for h in range(H):
            cached = model.kv_cache[0, 0, 0, h, 1 + t]
            ref = rotate_reference(raw_k[t, h].double(), t // 4, t % 4)
            torch.testing.assert_close(cached.double(), ref, atol=1e-5, rtol=0)


def test_condition_q_and_k_are_zero_in_every_layer(monkeypatch):
    for model_type, extra in (("c2i", {}), ("t2i", dict(caption_len=6, caption_dim=12))):
        model = small_gpt(2, model_type=model_type, **extra)
        C = model.cond_len
        cond = torch.tensor([1, 3]) if model_type == "c2i" else torch.randn(2, C, 12)
        seen_q = []
        real = lantern.ops.tree_attention

        def spy(q, *args):
            seen_q.append(q.clone())
            return real(q, *args)

        monkeypatch.setattr(gpt_module.ops, "tree_attention", spy)
        model.setup_cache(2, C + 16)
        with torch.no_grad():
            model(torch.randint(0, 64, (2, 3)), cond, cache_len=torch.zeros(2, dtype=torch.int64))
        monkeypatch.undo()
        assert len(seen_q) == model.config.n_layer
        for q in seen_q:  # [B, H, C + 3, Dh]
            assert (q[:, :, :C] == 0).all() and (q[:, :, C:] != 0).any()
        k_cache, v_cache = model.kv_cache[:, 0], model.kv_cache[:, 1]  # [n_layer, B, H, Lmax, Dh]
        assert (k_cache[:, :, :, :C] == 0).all()
        assert (v_cache[:, :, :, :C] != 0).any(dim=-1).all()  # values still flow
        assert (k_cache[:, :, :, C:C + 3] != 0).any(dim=-1).all()
