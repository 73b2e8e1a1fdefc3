"""The Triton verify's own pieces (lantern/kernels/verify.py), which only this backend has: its Philox
against SPEC §5's known answers and the reference, and the GPU's radix digit width. Agreement with the
reference on every backend is tests/ops/test_verify.py.

Without a GPU the kernels run under Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import backends
import lantern
from lantern import ops
from lantern.ops import verify_op
from lantern.ops.reference import philox as ref_philox
from op_cases import PHILOX_KNOWN_ANSWERS, random_case, to_device

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

kv = pytest.importorskip("lantern.kernels.verify")

DEVICE = backends.device_for("triton")
KNOWN = [(seed, counters, u) for seed, counters, _, u, _ in PHILOX_KNOWN_ANSWERS]  # SPEC §5: seed, counters -> u


# ---- Philox (SPEC §5) ------------------------------------------------------------------------------------

@triton.jit
def _uniform_kernel(seed_ptr, c0_ptr, c1_ptr, c2_ptr, c3_ptr, out_ptr, tl_out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    seed = tl.load(seed_ptr)
    c0 = tl.load(c0_ptr + offs, mask=mask, other=0).to(tl.uint32)
    c1 = tl.load(c1_ptr + offs, mask=mask, other=0).to(tl.uint32)
    c2 = tl.load(c2_ptr + offs, mask=mask, other=0).to(tl.uint32)
    c3 = tl.load(c3_ptr + offs, mask=mask, other=0).to(tl.uint32)
    tl.store(out_ptr + offs, kv._uniform(seed, c0, c1, c2, c3), mask=mask)
    word, _, _, _ = tl.philox(seed, c0, c1, c2, c3)  # Triton's own Philox, for the layout check
    tl.store(tl_out_ptr + offs, tl.random.uint_to_uniform_float(word), mask=mask)


def kernel_uniforms(seed: int, counters: np.ndarray):
    """(the kernel's uniforms, tl.philox's uniforms) for counters [4, N] (values in [0, 2^32))."""
    N = counters.shape[1]
    cs = [torch.as_tensor(c.astype(np.int64), device=DEVICE) for c in counters]
    seed_t = torch.tensor([seed - 2**64 if seed >= 2**63 else seed], dtype=torch.int64, device=DEVICE)
    out, tl_out = (torch.empty(N, dtype=torch.float32, device=DEVICE) for _ in range(2))
    _uniform_kernel[(1,)](seed_t, *cs, out, tl_out, N, BLOCK=triton.next_power_of_2(N))
    return out.cpu(), tl_out.cpu()


@pytest.mark.parametrize("seed,counters,u", KNOWN)
def test_philox_known_answers(seed, counters, u):
    got, from_tl = kernel_uniforms(seed, np.array(counters).reshape(4, 1))
    want = torch.tensor([u], dtype=torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(from_tl.view(torch.int32), want.view(torch.int32))


def test_philox_matches_reference_bit_for_bit():
    """The kernel's uniforms (and tl.philox's: same key/counter layout) equal the reference's."""
    rng = np.random.default_rng(0)
    counters = rng.integers(0, 2**32, (4, 256), dtype=np.uint64).astype(np.int64)
    for seed in (0, 7, 2**40 + 3, 2**64 - 5):
        got, from_tl = kernel_uniforms(seed, counters)
        want = ref_philox.philox_uniform(seed, *(torch.as_tensor(c) for c in counters))
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        assert torch.equal(from_tl.view(torch.int32), want.view(torch.int32))


def test_triton_is_routed():
    with lantern.fused("triton"):
        assert lantern._backend.resolve("verify", DEVICE) is backends.kernel("triton", "verify")


@pytest.mark.parametrize("backend", backends.params(["triton"]), indirect=True)
@pytest.mark.parametrize("seed", [0, 13])
@pytest.mark.no_kernel_check("calls the kernel's launcher itself (kv.run, to set the digit width): nothing could "
                             "reroute it, and only the op's caller counts calls")
def test_gpu_radix_width_agrees(backend, seed):
    """The GPU's digit width (4 bits, 8 passes) selects the same top-k / top-p sets as the interpreter's 8."""
    args, kwargs = random_case(seed, V=512, T=9, B=4)
    kwargs.update(top_k=torch.tensor([0, 1, 7, 100]).clamp(max=args[0].shape[-1]), top_p=torch.tensor(
        [0.5, 1.0, 0.9, 0.2], dtype=torch.float64), temperature=1.0)
    args, kwargs = to_device(args, DEVICE), to_device(kwargs, DEVICE)
    with lantern.fused("reference"):
        want = ops.verify(*args, **kwargs)
    got = kv.run(*verify_op.to_schema("triton", *args, **kwargs), radix_bits=4)
    for a, b in zip(want, got):
        assert torch.equal(a.cpu(), b.cpu())
