"""MAR and KL-16 checkpoints: the official layouts (every name and shape, written out in mar_testing from the
published formulas) load strictly with zero mismatches; model_ema is the entry used; head sizes are
inferred from the weights or given; wrong / missing / misshapen keys are listed; pickles other than
tensors are refused, with the re-save recipe."""
import argparse
import os

import pytest
import torch
from safetensors.torch import save_file

from lantern.models import build_mar, build_vae, load_mar, load_vae
from lantern.models.mar_loading import infer_head_sizes
from mar_testing import OFFICIAL_MAR, SMALL, kl16_official_shapes, mar_official_shapes, meta_state, small_mar


@pytest.mark.parametrize("name", sorted(OFFICIAL_MAR))
def test_official_mar_layout_loads_strictly(name):
    sizes, n_tensors, millions = OFFICIAL_MAR[name]
    shapes = mar_official_shapes(**sizes)
    assert len(shapes) == n_tensors
    total = sum(torch.Size(s).numel() for s in shapes.values())
    assert round(total / 1e6, 2) == millions
    model = load_mar({"model": meta_state(shapes), "model_ema": meta_state(shapes)}, name, device="meta")
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == shapes
    assert (model.config.diffloss_d, model.config.diffloss_w) == (sizes["d"], sizes["W"])
    assert not model.training


def test_head_sizes_inferred_or_given():
    # the README's training command uses a 3 x 1024 head with MAR-B's transformer
    shapes = mar_official_shapes(De=768, Dd=768, enc_depth=12, dec_depth=12, W=1024, d=3)
    assert infer_head_sizes(meta_state(shapes)) == {"diffloss_w": 1024, "diffloss_d": 3}
    model = load_mar(meta_state(shapes), "MAR-B", device="meta")
    assert (model.config.diffloss_d, model.config.diffloss_w) == (3, 1024)
    with pytest.raises(ValueError, match="diffloss_d=6") as err:  # given explicitly: the file must match
        load_mar(meta_state(shapes), "MAR-B", device="meta", diffloss_d=6)
    assert "missing keys (24)" in str(err.value)  # res_blocks 3..5, 8 tensors each


def test_official_kl16_layout_loads_strictly():
    shapes = kl16_official_shapes()
    assert len(shapes) == 312
    assert round(sum(torch.Size(s).numel() for s in shapes.values()) / 1e6, 2) == 66.46
    vae = load_vae({"model": meta_state(shapes)}, "KL-16", device="meta")
    assert {k: tuple(v.shape) for k, v in vae.state_dict().items()} == shapes
    assert vae.scale == 0.2325


def _outputs(model):
    tokens = torch.randn(2, model.config.seq_len, model.config.token_embed_dim,
                         generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(2, model.config.seq_len, dtype=torch.bool)
    mask[:, 5:] = True
    with torch.no_grad():
        return model.forward_z(tokens, mask, model.class_embedding(torch.tensor([1, 3])))


def test_checkpoint_file_uses_model_ema(tmp_path):
    ema, raw = small_mar(1), small_mar(2)
    path = tmp_path / "checkpoint-last.pth"
    torch.save({"model": raw.state_dict(), "model_ema": ema.state_dict(), "epoch": 399}, path)
    loaded = load_mar(path, "MAR-tiny", **{k: v for k, v in SMALL.items() if not k.startswith("diffloss")})
    torch.testing.assert_close(_outputs(loaded), _outputs(ema), atol=0, rtol=0)
    assert not torch.equal(_outputs(loaded), _outputs(raw))  # the two entries differ: the choice is visible


def test_safetensors_and_dtype(tmp_path):
    model = small_mar(3)
    path = tmp_path / "mar.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    loaded = load_mar(str(path), "MAR-tiny", **SMALL)
    torch.testing.assert_close(_outputs(loaded), _outputs(model), atol=0, rtol=0)
    half = load_mar(model.state_dict(), "MAR-tiny", dtype=torch.bfloat16, **SMALL)
    assert half.z_proj.weight.dtype == torch.bfloat16


def test_listing_error_names_every_bad_key():
    state = dict(small_mar(0).state_dict())
    state.pop("diffusion_pos_embed_learned")
    state.pop("diffloss.net.final_layer.linear.bias")
    state["decoder_blocks.0.ls1.gamma"] = torch.zeros(24)
    state["mask_token"] = torch.zeros(1, 1, 16)
    with pytest.raises(ValueError) as err:
        load_mar(state, "MAR-tiny", **SMALL)
    msg = str(err.value)
    assert "missing keys (2)" in msg and "diffusion_pos_embed_learned" in msg and "final_layer.linear.bias" in msg
    assert "unexpected keys (1)" in msg and "decoder_blocks.0.ls1.gamma" in msg
    assert "misshapen keys (1)" in msg and "mask_token (expected [1, 1, 24], got [1, 1, 16])" in msg


def test_vae_listing_error_and_round_trip(tmp_path):
    torch.manual_seed(0)
    vae = build_vae("KL-tiny").eval()
    path = tmp_path / "kl.ckpt"
    torch.save({"model": vae.state_dict()}, path)
    loaded = load_vae(path, "KL-tiny")
    x = torch.rand(1, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        torch.testing.assert_close(loaded.decode(loaded.encode(x).mode()), vae.decode(vae.encode(x).mode()))
    bad = dict(vae.state_dict())
    bad["decoder.up.0.attn.0.q.weight"] = torch.zeros(32, 32, 1, 1)  # KL-16's decoder levels have no attention
    with pytest.raises(ValueError, match=r"unexpected keys \(1\).*decoder\.up\.0\.attn\.0\.q\.weight"):
        load_vae(bad, "KL-tiny")


class Hostile:
    def __reduce__(self):
        return (os.system, ("touch HOSTILE_MARKER",))


@pytest.mark.parametrize("payload", ["hostile", "argparse"])
def test_pickles_refused_with_resave_hint(tmp_path, monkeypatch, payload):
    monkeypatch.chdir(tmp_path)
    state = small_mar(0).state_dict()
    extra = Hostile() if payload == "hostile" else argparse.Namespace(model="mar_base", diffloss_d=6)
    path = tmp_path / "checkpoint-last.pth"
    torch.save({"model_ema": state, "args": extra}, path)
    with pytest.raises(ValueError) as err:
        load_mar(path, "MAR-tiny", **SMALL)
    assert "weights_only=True" in str(err.value) and "torch.save({'model_ema'" in str(err.value)
    assert not (tmp_path / "HOSTILE_MARKER").exists()
    torch.save({"model_ema": state}, path)  # re-saved as the hint says: loads
    load_mar(path, "MAR-tiny", **SMALL)


def test_unknown_config_and_bad_buffer():
    with pytest.raises(ValueError, match="unknown MAR config"):
        build_mar("MAR-XL")
    with pytest.raises(ValueError, match="buffer_size"):
        build_mar("MAR-tiny", buffer_size=0)
    with pytest.raises(ValueError, match="unknown MARConfig fields"):
        build_mar("MAR-tiny", buffer=3)


def _forbid_building(monkeypatch):
    """Building a MAR fails the test: a refusal must come before the model is built."""
    import lantern.models.mar_loading as mar_loading

    monkeypatch.setattr(mar_loading, "build_mar", lambda *a, **k: pytest.fail("a model was built"))


@pytest.mark.parametrize("extra", ["diffloss.net.res_blocks.1000000.x", "diffloss.net.res_blocks.7.x"])
def test_a_stray_head_block_is_refused_before_anything_is_built(monkeypatch, extra):
    state = dict(small_mar(0).state_dict())  # res_blocks 0 and 1
    state[extra] = torch.zeros(1)
    _forbid_building(monkeypatch)
    with pytest.raises(ValueError, match=rf"unexpected key '{extra}'.*numbered 0 \.\. d-1"):
        load_mar(state, "MAR-tiny", **{k: v for k, v in SMALL.items() if not k.startswith("diffloss")})


def test_head_sizes_read_from_a_file_are_bounded(monkeypatch):
    from lantern.models.mar_loading import MAX_DIFFLOSS_D, MAX_DIFFLOSS_W

    _forbid_building(monkeypatch)
    deep = {f"diffloss.net.res_blocks.{i}.x": torch.empty(1, device="meta") for i in range(MAX_DIFFLOSS_D + 1)}
    with pytest.raises(ValueError, match=f"the head has {MAX_DIFFLOSS_D + 1} res_blocks"):
        load_mar(deep, "MAR-tiny")
    wide = {"diffloss.net.input_proj.weight": torch.empty(MAX_DIFFLOSS_W + 1, 16, device="meta")}
    with pytest.raises(ValueError, match=r"head width must be in \[1, 8192\]"):
        load_mar(wide, "MAR-tiny")
    for name, value in (("diffloss_d", 0), ("diffloss_d", 10**6), ("diffloss_w", 10**9), ("diffloss_d", 2.0)):
        with pytest.raises(ValueError, match=name):
            load_mar({}, "MAR-tiny", **{name: value})


def test_a_tensor_repeating_its_bytes_is_refused(tmp_path):
    state = dict(small_mar(0).state_dict())
    # 1 stored float declared as the whole embedding: converting it would allocate the declared shape
    state["mask_token"] = torch.zeros(1).expand(*state["mask_token"].shape)
    path = tmp_path / "checkpoint-last.pth"
    torch.save({"model_ema": state}, path)
    with pytest.raises(ValueError, match=r"tensor 'mask_token' .* 4 bytes of data for 24 torch.float32 elements"):
        load_mar(path, "MAR-tiny", **SMALL)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, value):
    state = dict(small_mar(0).state_dict())
    state["diffloss.net.res_blocks.1.mlp.0.weight"] = state["diffloss.net.res_blocks.1.mlp.0.weight"].clone()
    state["diffloss.net.res_blocks.1.mlp.0.weight"][3, 2] = value
    kind = "NaN" if value != value else "inf"
    with pytest.raises(ValueError, match=rf"'diffloss.net.res_blocks.1.mlp.0.weight' holds {kind} values"):
        load_mar(state, "MAR-tiny", **SMALL)
    vae = dict(build_vae("KL-tiny").state_dict())
    vae["decoder.conv_in.bias"] = vae["decoder.conv_in.bias"].clone()
    vae["decoder.conv_in.bias"][0] = value
    torch.save({"model": vae}, tmp_path / "kl.ckpt")
    with pytest.raises(ValueError, match=rf"'decoder.conv_in.bias' holds {kind} values"):
        load_vae(tmp_path / "kl.ckpt", "KL-tiny")


def test_weights_that_overflow_the_asked_dtype_are_refused():
    state = dict(small_mar(0).state_dict())
    state["z_proj.bias"] = state["z_proj.bias"].clone()
    state["z_proj.bias"][0] = 1e5  # finite in float32, inf in float16
    assert load_mar(state, "MAR-tiny", **SMALL).z_proj.bias[0] == 1e5
    with pytest.raises(ValueError, match=r"'z_proj.bias' holds inf values \(as torch.float16\)"):
        load_mar(state, "MAR-tiny", dtype=torch.float16, **SMALL)


def test_sampling_steps_must_be_a_step_count():
    for steps in ("abc", "0", "-3", "5000", "", "1.5", True):
        with pytest.raises(ValueError, match=r"num_sampling_steps must be an int in \[1, 1000\]"):
            build_mar("MAR-tiny", **{**SMALL, "num_sampling_steps": steps})
    assert build_mar("MAR-tiny", **{**SMALL, "num_sampling_steps": 7}).diffloss.gen_diffusion.num_timesteps == 7
