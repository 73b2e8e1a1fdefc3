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
    return backends.kernel(backend, op)


@pytest.mark.parametrize("backend", backends.params(["cpu", "cuda"]), indirect=True)
@pytest.mark.no_kernel_check("checks the routing only (resolve), runs no op")
def test_extension_backends_route_every_op(backend, device):
    """Under the backend and under auto, on the backend's device, every op runs lantern._C's kernel."""
    for name in OPS:
        assert _backend.resolve(name, device) is implementation(backend, name), name
        with lantern.fused("auto"):
            assert _backend.resolve(name, device) is implementation(backend, name), name
    assert all(lantern.fused_ops(backend)[name] for name in OPS)


@pytest.mark.parametrize("backend", backends.params(["triton"]), indirect=True)
@pytest.mark.no_kernel_check("checks the routing only (resolve), runs no op")
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


def test_resolved_backends_names_cuda_where_cpu_and_cuda_share_the_caller(monkeypatch):
    """cpu and cuda run one caller (the dispatcher picks the kernel by device): on CUDA tensors the run's
    backends must say "cuda", not "cpu", or the run passes backend="cpu" with CUDA tensors and is refused."""
    _backend._load_backends()
    shared = [op for op in OPS if _backend._REGISTRY["cuda"].get(op) is not None
              and _backend._REGISTRY["cuda"].get(op) is _backend._REGISTRY["cpu"].get(op)]
    if not shared:
        pytest.skip("lantern._C is not built, or built without CUDA kernels: no op has a caller cpu and cuda share")
    monkeypatch.setenv("LANTERN_SELF_CHECK", "0")  # resolution only: no kernel runs
    monkeypatch.setitem(_backend._AVAILABILITY, "cuda", lambda: None)
    cuda = torch.device("cuda")
    for backend in ("auto", "cuda"):
        chosen = _backend.resolved_backends(cuda, backend=backend)
        assert {op: chosen[op] for op in shared} == {op: "cuda" for op in shared}, backend
    assert all(_backend.resolved_backends(torch.device("cpu"), backend="cpu")[op] == "cpu" for op in shared)


def test_a_kernel_module_that_fails_to_import_disables_only_the_triton_backend(monkeypatch):
    """E.g. a torch whose triton_op cannot take a launcher's declaration: one warning names the module and the
    error, the triton backend is unavailable with that reason (self_check_report lists it for every device),
    and the other backends load and run."""
    pytest.importorskip("triton")
    import importlib

    from lantern.ops import library, triton_backend

    def import_module(name):
        if name == "lantern.kernels.verify":
            raise ValueError("infer_schema(func): Parameter logits must have a type annotation")
        return importlib.import_module(name)

    _backend._load_backends()
    monkeypatch.setattr(library, "importlib", type("Stub", (), {"import_module": staticmethod(import_module)}))
    for op in library.ops():
        monkeypatch.setattr(op, "_triton_caller", None)
    monkeypatch.setattr(triton_backend, "_found", None)
    monkeypatch.setattr(triton_backend, "_failures", {})
    monkeypatch.setattr(_backend, "_loaded", False)
    for name in ("cpu", "cuda", "triton"):
        monkeypatch.setitem(_backend._REGISTRY, name, {})
    with pytest.warns(RuntimeWarning, match=r"triton backend is disabled: lantern.kernels.verify failed to import "
                                            r"\(ValueError: infer_schema"):
        lantern.enable_fused("auto")
    why = _backend._why_unavailable("triton")
    assert why.startswith("lantern.kernels.verify failed to import (ValueError: infer_schema(func): Parameter logits")
    with pytest.raises(RuntimeError, match="backend 'triton' is unavailable: lantern.kernels.verify failed"):
        lantern.enable_fused("triton")
    assert lantern.self_check_report()[("triton", "verify", "*")] == why
    assert _backend._why_unavailable("cpu") == backends.why_unavailable("cpu")  # as before: not affected
    lantern.disable_fused()
    codebook = random_codebook(30, 3, seed=12)
    with lantern.fused("auto"):
        assert torch.equal(lantern.ops.latent_neighbours(codebook, 4), reference_neighbours(codebook, 4, False))


def test_unknown_backend_is_named(monkeypatch):
    with pytest.raises(ValueError, match="'tpu'"):
        lantern.enable_fused("tpu")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="triton.*TRITON_INTERPRET"):
            lantern.enable_fused("triton")
    assert lantern.active_backend() == "reference"
