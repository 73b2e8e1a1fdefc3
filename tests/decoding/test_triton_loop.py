"""The decoding loop with ``lantern.enable_fused("triton")`` emits the same tokens as the reference for a
fixed seed, on the shipped tiny model cut to its first LAYERS = 2 layers (GPT-tiny-deep has 16: 4 heads, Dh 64,
1024-code VQ, 8 x 8 tokens) and its shipped EAGLE drafter.

Reduced, because the interpreter executes every Triton program in Python, and tree_attention (about 2 s a call
there) runs once per layer and forward: the 16-layer model took 13 minutes for the three settings on a loaded
2-core machine. So: 2 layers (two, so that compact_kv moves paths in more than one layer of the cache), 2 class
labels, small trees, and each run stops after the first LENGTH = 10 of the 64 tokens (``length=``). The drafter
still agrees with the cut target often enough that trees are partly accepted, so the rows' cache lengths become
ragged, verify walks real trees and compact_kv moves real paths (each speculative setting asserts that it did).
Runs only under the interpreter (CPU tensors): the loop's bookkeeping lives on the CPU; on a GPU the kernel
tests cover the ops.

The ops that run fused are counted, and must be exactly the ops lantern.kernels implements."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

import lantern
from lantern import _backend
from lantern.models.gpt import Transformer
from lantern.ops import triton_backend
from lantern.ops.reference.latent_neighbours import latent_neighbours as reference_neighbours
from lantern.pretrained import load_tiny, load_tiny_drafter

pytest.importorskip("triton")
if not triton_backend.interpreting():
    pytest.skip("the loop test runs the Triton kernels under TRITON_INTERPRET=1 on CPU tensors",
                allow_module_level=True)

pytestmark = pytest.mark.slow  # the Triton interpreter: 30-80 s per setting

LENGTH = 10  # tokens generated per row (of the tiny model's 64)
LAYERS = 2  # of the shipped target's 16
KERNEL_DIR = Path(__file__).resolve().parents[2] / "python" / "lantern" / "kernels"

SETTINGS = {
    "ar-sampled": dict(method="ar", cfg_scale=2.0, temperature=1.0, top_k=50, seed=5),
    "spec-greedy-dynamic": dict(method="spec", tree="dynamic", depth=2, top_per_node=3, n_nodes=6, temperature=0.0),
    "lantern-sampled-static": dict(method="lantern", tree="static", static_widths=(2, 2, 1), k=8, delta=0.2,
                                   cfg_scale=2.0, temperature=1.0, top_p=0.9, seed=3),
}


@pytest.fixture(scope="module")
def models():
    # float32: token-for-token equality needs the backends' logits bit for bit, and in bfloat16 the Triton
    # attention (float32 accumulators, rounded once) and the reference's round differently
    tiny = load_tiny(dtype=torch.float32)
    table = reference_neighbours(tiny.vq.quantize.embedding.weight, 8, normalize=True)  # [1024, 8]
    target = first_layers(tiny.gpt, LAYERS)
    return target, load_tiny_drafter(target), table


def first_layers(gpt, n_layer):
    """A GPT of gpt's first n_layer layers, with its embeddings, final norm and head."""
    cut = Transformer(replace(gpt.config, n_layer=n_layer))
    state = {name: value for name, value in gpt.state_dict().items()
             if not name.startswith("layers.") or int(name.split(".")[1]) < n_layer}
    cut.load_state_dict(state, strict=True)
    return cut.eval()


def run(models, setting):
    target, drafter, table = models
    labels = torch.tensor([1, 7])
    options = dict(SETTINGS[setting])
    method = options.pop("method")
    if method != "ar":  # lantern.generate refuses what a method does not use
        options["drafter"] = drafter
    if method == "lantern":
        options["neighbours"] = table
    with torch.no_grad():
        return lantern.generate(target, labels, method=method, length=LENGTH, **options)


def counting(fn, counts, name):
    def wrapper(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return fn(*args, **kwargs)
    return wrapper


@pytest.fixture(scope="module")
def fused_calls():
    return {}  # op -> number of calls to its triton kernel, over every setting


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_triton_loop_gives_the_reference_tokens(models, setting, fused_calls, monkeypatch):
    want, stats = run(models, setting)
    if SETTINGS[setting]["method"] != "ar":  # trees partly accepted, by rows that then differ in length
        accepted = [lens.tolist() for lens in stats.accept_lens]
        assert any(0 < max(lens) for lens in accepted) and any(len(set(lens)) > 1 for lens in accepted), accepted
    for op, fn in list(_backend._REGISTRY["triton"].items()):
        monkeypatch.setitem(_backend._REGISTRY["triton"], op, counting(fn, fused_calls, op))
    with lantern.fused("triton"):
        got, _ = run(models, setting)
    assert got.shape == (2, LENGTH)
    assert torch.equal(got, want), f"{setting}: triton {got.tolist()} vs reference {want.tolist()}"


def test_the_ops_that_ran_fused_are_the_ones_with_triton_kernels(fused_calls):
    """Runs after the loop tests (same module, file order). The loop calls tree_attention, compact_kv and
    verify every step; each must have run through its Triton kernel iff lantern/kernels/<op>.py exists."""
    if not fused_calls:
        pytest.skip("run together with the loop tests above")
    fused = lantern.fused_ops("triton")
    for op in triton_backend.triton_ops():
        implemented = (KERNEL_DIR / f"{op}.py").exists()
        assert fused[op] == implemented, op
        if op in ("tree_attention", "compact_kv", "verify"):
            assert (fused_calls.get(op, 0) > 0) == implemented, (op, fused_calls)
    assert fused["tree_attention"] and fused["compact_kv"]
