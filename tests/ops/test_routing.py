"""Backend selection: which implementation each public op runs under each backend (lantern._backend)."""
from __future__ import annotations

import pytest
import torch

import backends
import lantern
from lantern import _backend
from lantern.ops.reference.latent_neighbours import latent_neighbours as reference_neighbours
from lantern.ops.reference.tree_attention import tree_attention as reference_attention
from op_cases import random_codebook

OPS = ("verify", "latent_neighbours", "tree_attention", "compact_kv", "philox_uniform", "continuous_verify")
TRITON_OPS = ("verify", "latent_neighbours", "tree_attention", "compact_kv", "continuous_verify")


def implementation(backend: str, op: str):
    """The function the backend is expected to run for ``op``."""
    if backend in ("cpu", "cuda"):
        from lantern.ops import fused_cpu
        return getattr(fused_cpu, op)
    import importlib
    return getattr(importlib.import_module(f"lantern_kernels.{op}"), op)


@pytest.mark.parametrize("backend", backends.params(["cpu", "cuda"]), indirect=True)
def test_extension_backends_route_every_op(backend, device):
    """Under the backend and under auto, on the backend's device, every op runs lantern._C's kernel."""
    for name in OPS:
        assert _backend.resolve(name, device) is implementation(backend, name), name
        with lantern.fused("auto"):
            assert _backend.resolve(name, device) is implementation(backend, name), name
    assert all(lantern.fused_ops(backend)[name] for name in OPS)


@pytest.mark.parametrize("backend", backends.params(["triton"]), indirect=True)
def test_triton_routes_its_kernels(backend, device):
    for name in TRITON_OPS:
        assert _backend.resolve(name, device) is implementation("triton", name), name
    fused = lantern.fused_ops("triton")
    assert all(fused[name] for name in TRITON_OPS)


@pytest.mark.parametrize("backend", backends.params(["triton"]), indirect=True)
def test_enable_fused_switches_the_public_ops(backend, device):
    codebook = random_codebook(30, 3, seed=12, device=device)
    lantern.enable_fused(backend)
    try:
        assert _backend.active_backend() == backend
        assert lantern.fused_ops()["latent_neighbours"] and lantern.fused_ops()["tree_attention"]
        got = lantern.ops.latent_neighbours(codebook, 4)
    finally:
        lantern.disable_fused()
    assert _backend.active_backend() == "reference" and not any(lantern.fused_ops().values())
    assert torch.equal(got, reference_neighbours(codebook, 4, False))


def test_auto_prefers_cuda_then_triton_on_cuda_tensors(monkeypatch):
    """Resolution only (no CUDA tensor is made): a usable cuda kernel wins; without one, triton's runs."""
    pytest.importorskip("triton")
    _backend._load_backends()  # so the real availability checks are in place before they are replaced
    cuda = torch.device("cuda")
    fake_cuda_kernel = object()
    monkeypatch.setenv("LANTERN_SELF_CHECK", "0")  # on a GPU machine the self-check would reject the stand-in
    monkeypatch.setitem(_backend._REGISTRY["cuda"], "tree_attention", fake_cuda_kernel)
    monkeypatch.setitem(_backend._AVAILABILITY, "cuda", lambda: None)
    monkeypatch.setitem(_backend._AVAILABILITY, "triton", lambda: None)
    with lantern.fused("auto"):
        assert _backend.resolve("tree_attention", cuda) is fake_cuda_kernel
        monkeypatch.setitem(_backend._AVAILABILITY, "cuda", lambda: "not built")
        assert _backend.resolve("tree_attention", cuda) is implementation("triton", "tree_attention")
        monkeypatch.setitem(_backend._AVAILABILITY, "triton", lambda: "no triton")
        assert _backend.resolve("tree_attention", cuda) is reference_attention
        on_cpu = _backend.resolve("latent_neighbours", torch.device("cpu"))  # auto never picks triton for CPU
        assert on_cpu in (_backend._REGISTRY["cpu"].get("latent_neighbours"), reference_neighbours)
