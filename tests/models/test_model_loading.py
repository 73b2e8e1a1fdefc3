"""Checkpoint loading: wrappers, stray keys, strict checks with clear messages, weights_only."""
import collections
import threading

import pytest
import torch
from safetensors.torch import save_file

from gpt_testing import SMALL, small_gpt
from lantern.cli import main
from lantern.models import build_gpt, build_vq, load_gpt, load_vq
from lantern.models.loading import check_state_dict, read_state_dict


class NotATensor:
    pass


@pytest.fixture(scope="module")
def source():
    model = small_gpt(7)
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def logits_of(model):
    tokens = torch.arange(6)[None] % 64
    with torch.no_grad():
        return model.forward_full(tokens, torch.tensor([3]))


@pytest.mark.parametrize("wrap", ["bare", "model", "module", "state_dict", "model+module", "ddp_prefix"])
def test_wrappers_and_round_trip(tmp_path, source, wrap):
    model, state = source
    if wrap == "bare":
        obj = state
    elif wrap == "model+module":
        obj = {"model": {"module": state}}
    elif wrap == "ddp_prefix":
        obj = {"model": {"module." + k: v for k, v in state.items()}}
    else:
        obj = {wrap: state, "steps": torch.tensor(1000)}
    path = tmp_path / "ckpt.pt"
    torch.save(obj, path)
    loaded = load_gpt(path, "GPT-tiny", **SMALL)
    assert not loaded.training
    torch.testing.assert_close(logits_of(loaded), logits_of(model), atol=0, rtol=0)
    loaded.setup_cache(1, 17)  # rope table and cache live on the real device
    assert loaded.freqs_cis.device.type == "cpu" and loaded.kv_cache.device.type == "cpu"


def test_safetensors_and_in_memory(tmp_path, source):
    model, state = source
    path = tmp_path / "ckpt.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    torch.testing.assert_close(logits_of(load_gpt(path, "GPT-tiny", **SMALL)), logits_of(model), atol=0, rtol=0)
    torch.testing.assert_close(logits_of(load_gpt({"model": state}, "GPT-tiny", **SMALL)), logits_of(model))


def test_dtype_conversion(source):
    _, state = source
    m = load_gpt(state, "GPT-tiny", dtype=torch.bfloat16, **SMALL)
    assert m.output.weight.dtype == torch.bfloat16 and m.freqs_cis.dtype == torch.float32
    m.setup_cache(1, 17)
    with torch.no_grad():
        out = m(torch.tensor([[1, 2]]), torch.tensor([0]), cache_len=torch.zeros(1, dtype=torch.int64))
    assert out.dtype == torch.float32 and m.kv_cache.dtype == torch.bfloat16


def test_stray_freqs_cis_and_cache_keys_dropped(source):
    model, state = source
    dirty = dict(state)
    dirty["freqs_cis"] = torch.zeros(17, 16, 2)
    dirty["layers.0.attention.kv_cache.k_cache"] = torch.zeros(2, 2, 17, 32)
    dirty["layers.0.attention.kv_cache.v_cache"] = torch.zeros(2, 2, 17, 32)
    dirty["kv_cache"] = torch.zeros(1)
    dirty["causal_mask"] = torch.zeros(1)
    torch.testing.assert_close(logits_of(load_gpt({"model": dirty}, "GPT-tiny", **SMALL)), logits_of(model))
    assert set(read_state_dict(dirty)) == set(state)


def test_missing_unexpected_misshapen(source):
    _, state = source
    broken = dict(state)
    del broken["layers.1.feed_forward.w2.weight"]
    broken["layers.9.attention.wo.weight"] = torch.zeros(64, 64)
    broken["output.weight"] = torch.zeros(65, 64)
    with pytest.raises(ValueError) as err:
        load_gpt(broken, "GPT-tiny", **SMALL)
    msg = str(err.value)
    assert "missing keys (1): ['layers.1.feed_forward.w2.weight']" in msg
    assert "unexpected keys (1): ['layers.9.attention.wo.weight']" in msg
    assert "output.weight (expected [64, 64], got [65, 64])" in msg
    with pytest.raises(ValueError, match="missing keys"):  # c2i checkpoint into a t2i model
        load_gpt(state, "GPT-tiny", model_type="t2i", **SMALL)


def test_weights_only_refuses_pickled_objects(tmp_path, source):
    _, state = source
    path = tmp_path / "evil.pt"
    torch.save({"model": state, "args": NotATensor()}, path)
    with pytest.raises(ValueError, match="weights_only"):
        load_gpt(path, "GPT-tiny", **SMALL)
    torch.save({"model": collections.OrderedDict(state), "steps": 3, "note": "ok"}, tmp_path / "ok.pt")
    load_gpt(tmp_path / "ok.pt", "GPT-tiny", **SMALL)  # plain containers and numbers are fine


def test_non_tensor_entries_rejected():
    with pytest.raises(ValueError, match="not tensors"):
        read_state_dict({"tok_embeddings.weight": [1, 2, 3]})


def test_official_size_shapes_check():
    """GPT-B c2i: a synthetic official-layout state dict (meta tensors) passes the strict check."""
    with torch.device("meta"):
        model = build_gpt("GPT-B")
        state = {k: torch.empty(v.shape) for k, v in model.state_dict().items()}
    state["freqs_cis"] = torch.empty(257, 32, 2, device="meta")
    check_state_dict(model, read_state_dict({"model": state}))
    state["cls_embedding.embedding_table.weight"] = torch.empty(1000, 768, device="meta")  # no null row
    with pytest.raises(ValueError, match=r"embedding_table.weight \(expected \[1001, 768\], got \[1000, 768\]\)"):
        check_state_dict(model, read_state_dict(state))


def test_vq_full_and_decoder_only(tmp_path):
    torch.manual_seed(0)
    vq = build_vq("VQ-tiny").eval()
    state = vq.state_dict()
    path = tmp_path / "vq.pt"
    torch.save({"model": state}, path)
    codes = torch.randint(0, 1024, (1, 64))
    with torch.no_grad():
        ref = vq.decode_codes(codes, 8, 8)
        full = load_vq(path, "VQ-tiny")
        dec = load_vq(path, "VQ-tiny", decoder_only=True)
        torch.testing.assert_close(full.decode_codes(codes, 8, 8), ref, atol=0, rtol=0)
        torch.testing.assert_close(dec.decode_codes(codes, 8, 8), ref, atol=0, rtol=0)
    assert not any(k.startswith(("encoder.", "quant_conv.")) for k in dec.state_dict())
    broken = {k: v for k, v in state.items() if k != "decoder.conv_out.bias"}
    with pytest.raises(ValueError, match="decoder.conv_out.bias"):
        load_vq(broken, "VQ-tiny", decoder_only=True)
    with pytest.raises(ValueError, match="missing keys"):
        load_vq({k: v for k, v in state.items() if not k.startswith("encoder.")}, "VQ-tiny")  # full needs encoder


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_gpt_and_vq_weights_are_refused_naming_the_tensor(tmp_path, source, value):
    _, state = source
    bad = dict(state, **{"layers.1.attention.wqkv.weight": state["layers.1.attention.wqkv.weight"].clone()})
    bad["layers.1.attention.wqkv.weight"][5, 7] = value
    kind = "NaN" if value != value else "inf"
    save_file({k: v.contiguous() for k, v in bad.items()}, str(tmp_path / "gpt.safetensors"))
    with pytest.raises(ValueError, match=rf"'layers.1.attention.wqkv.weight' holds {kind} values"):
        load_gpt(str(tmp_path / "gpt.safetensors"), "GPT-tiny", **SMALL)
    torch.manual_seed(0)
    vq = dict(build_vq("VQ-tiny").state_dict())
    vq["quantize.embedding.weight"] = vq["quantize.embedding.weight"].clone()
    vq["quantize.embedding.weight"][9, 0] = value
    for decoder_only in (False, True):
        with pytest.raises(ValueError, match=rf"'quantize.embedding.weight' holds {kind} values"):
            load_vq(vq, "VQ-tiny", decoder_only=decoder_only)


def test_a_gpt_tensor_repeating_its_bytes_is_refused(tmp_path, source):
    _, state = source
    bad = dict(state, **{"tok_embeddings.weight": torch.zeros(1).expand(*state["tok_embeddings.weight"].shape)})
    torch.save({"model": bad}, tmp_path / "gpt.pt")
    with pytest.raises(ValueError, match="tensor 'tok_embeddings.weight' .* bytes of data for"):
        load_gpt(tmp_path / "gpt.pt", "GPT-tiny", **SMALL)
    load_gpt(state, "GPT-tiny", **SMALL)  # the saved weights themselves load


def _drafter_dir(tmp_path, gpt, n_layer="1", poison=None):
    from lantern.models.drafter import EagleDrafter

    torch.manual_seed(0)
    state = {k: v.clone().contiguous() for k, v in EagleDrafter(gpt.config, n_layer=1).state_dict().items()}
    if poison is not None:
        state[poison].view(-1)[0] = float("nan")
    save_file(state, str(tmp_path / "drafter.safetensors"), metadata={"n_layer": n_layer})
    return tmp_path


def test_drafter_files_are_checked_before_the_drafter_is_built(tmp_path, source):
    from lantern.pretrained import load_tiny_drafter

    gpt = small_gpt(7)
    assert load_tiny_drafter(gpt, _drafter_dir(tmp_path, gpt)) is not None
    for n_layer in ("1000000", "0", "x", "-1"):
        with pytest.raises(ValueError, match=r"n_layer must be an int in \[1, 16\]"):
            load_tiny_drafter(gpt, _drafter_dir(tmp_path, gpt, n_layer=n_layer))
    with pytest.raises(ValueError, match=r"'fc.weight' holds NaN values"):
        load_tiny_drafter(gpt, _drafter_dir(tmp_path, gpt, poison="fc.weight"))


# -- a checkpoint whose wrapper contains itself --------------------------------------------------------------------

def within(seconds, fn, *args, **kwargs):
    """fn's return value, or its exception re-raised; fails (instead of hanging the run) if it is still
    running after ``seconds``."""
    box = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"{getattr(fn, '__name__', fn)} still running after {seconds}s (a hang)"
    if "error" in box:
        raise box["error"]
    return box.get("value")



@pytest.fixture
def cyclic_checkpoint(tmp_path):
    path = tmp_path / "cycle.pt"
    d = {}
    d["model"] = d
    torch.save(d, path)
    return path


def test_self_containing_checkpoint_wrapper_raises(cyclic_checkpoint):
    with pytest.raises(ValueError, match="contains itself"):
        within(30, read_state_dict, cyclic_checkpoint)
    with pytest.raises(ValueError, match="contains itself"):
        within(30, load_gpt, cyclic_checkpoint, "GPT-B")
    with pytest.raises(ValueError, match="contains itself"):
        within(30, load_vq, cyclic_checkpoint, "VQ-16", decoder_only=True)


def test_neighbours_cli_on_a_self_containing_vq_checkpoint_raises(cyclic_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="contains itself"):
        within(30, main, ["neighbours", "--vq", str(cyclic_checkpoint), "--K", "4"])


def test_two_level_wrapper_cycles_and_deep_chains_raise():
    a, b = {}, {}
    a["state_dict"], b["module"] = b, a
    with pytest.raises(ValueError, match="contains itself"):
        within(30, read_state_dict, a)
    deep = {"w": torch.zeros(1)}
    for _ in range(40):
        deep = {"model": deep}
    with pytest.raises(ValueError, match="nest more than"):
        read_state_dict(deep)
    shallow = {"w": torch.zeros(1)}
    for _ in range(3):
        shallow = {"model": shallow}
    assert list(read_state_dict(shallow)) == ["w"]  # ordinary nesting still unwraps
