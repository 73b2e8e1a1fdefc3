"""The Triton verify (lantern_kernels/verify.py) against the reference (SPEC §5, §7).

Without a GPU the kernel runs under Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1), so shapes and batch sizes here are small; the same random-case generator as the CPU
backend's tests covers guidance on/off, top-k, top-p, greedy rows, both draft kinds, delta / lambda modes,
both budgets, padding nodes, ragged trees and per-row settings. Tokens and decisions must agree on
>= 99.9 % of rows (float32 on both sides; they may differ only where a sum or an exp rounds differently),
exactly on the pinned cases. float64 logits are computed in float32 by this backend (docs/semantics.md),
so they are compared with the reference run on the same logits rounded to float32.
Tests at LlamaGen shapes run on a CUDA device only (marked gpu)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import lantern
from lantern import ops
from lantern.ops.reference import philox as ref_philox
from lantern.ops.reference.verify import VerifyResult

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from test_verify_bad_input import BAD_VERIFY, call_verify  # noqa: E402  (tests/ops is on sys.path under pytest)
from test_verify_fused import (LLAMAGEN_IDS, LLAMAGEN_SETTINGS, agreement, llamagen_case,  # noqa: E402
                               random_case, rows_agree)

kv = pytest.importorskip("lantern_kernels.verify")

AGREEMENT = 0.999
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KNOWN = [  # SPEC §5: seed, (c0, c1, c2, c3) -> u
    (0, (0, 0, 0, 0), 0.7980929017066956),
    (123456789012345, (0, 3, 5, 11), 0.7657051682472229),
    (42, (0x80000000, 1, 0, 0), 0.7354156374931335),
    (42, (16383, 58, 7, 1000), 0.5776782035827637),
    (2**64 - 1, (0xFFFFFFFF,) * 4, 0.5043686628341675),
]


def to_device(args, kwargs):
    move = lambda v: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
    return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}


def run_both(args, kwargs, **triton_kwargs):
    args, kwargs = to_device(args, kwargs)
    with lantern.fused("reference"):
        want = ops.verify(*args, **kwargs)
    if triton_kwargs:
        got = kv.verify(*args, **kwargs, **triton_kwargs)
    else:
        with lantern.fused("triton"):
            got = ops.verify(*args, **kwargs)
    return VerifyResult(*(t.cpu() for t in want)), VerifyResult(*(t.cpu() for t in got))


def test_triton_is_routed():
    with lantern.fused("triton"):
        assert lantern._backend.resolve("verify", torch.device(DEVICE)) is kv.verify


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


# ---- agreement with the reference ----------------------------------------------------------------------

def test_agreement_on_random_cases():
    """>= 99.9 % of rows agree exactly (accept_len, path, next_token, node_status) over random cases (B <= 6
    rows each, to keep the interpreter's time down)."""
    cases = {seed: random_case(seed, B=int(np.random.default_rng(seed + 10_000).integers(1, 7))) for seed in range(36)}
    agree, rows, bad = agreement(run_both, cases)
    rate = agree / rows
    print(f"verify triton vs reference: {agree}/{rows} rows agree ({100 * rate:.3f} %), cases with a mismatch: {bad}")
    assert rows > 100
    assert rate >= AGREEMENT, (rate, bad)


PINNED = [  # every setting family at least once (see random_case)
    dict(seed=3, V=1000, T=17, B=6),
    dict(seed=21, V=256, T=33, B=6),
    dict(seed=42, V=33, T=5, B=12),
    dict(seed=77, V=8, T=9, B=12),
]


@pytest.mark.parametrize("case", PINNED, ids=[f"seed{c['seed']}-V{c['V']}" for c in PINNED])
def test_pinned_cases_agree_exactly(case):
    want, got = run_both(*random_case(**case))
    for a, b in zip(want, got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seed", [0, 13])
def test_gpu_radix_width_agrees(seed):
    """The GPU's digit width (4 bits, 8 passes) selects the same top-k / top-p sets as the interpreter's 8."""
    args, kwargs = random_case(seed, V=512, T=9, B=4)
    kwargs.update(top_k=torch.tensor([0, 1, 7, 100]).clamp(max=args[0].shape[-1]), top_p=torch.tensor(
        [0.5, 1.0, 0.9, 0.2], dtype=torch.float64), temperature=1.0)
    want, got = run_both(args, kwargs, radix_bits=4)
    for a, b in zip(want, got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs(dtype):
    """bfloat16 / float16 logits and drafter rows are widened to float32 on load, as the reference does."""
    args, kwargs = random_case(7, V=256, T=9, B=8, dtype=dtype)
    want, got = run_both(args, kwargs)
    assert rows_agree(want, got).mean() >= 0.99


@pytest.mark.parametrize("seed", [1000, 1002])
def test_float64_logits_compute_in_float32(seed):
    """float64 inputs are narrowed to float32 on load: the result is the reference's on the float32 logits."""
    args, kwargs = random_case(seed, B=6, dtype=torch.float64)
    with lantern.fused("triton"):
        got = ops.verify(*to_device(args, kwargs)[0], **to_device(args, kwargs)[1])
    narrow = lambda v: v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.float64 and v.dim() == 3 else v
    want, _ = run_both(tuple(narrow(a) for a in args), {k: narrow(v) for k, v in kwargs.items()})
    assert rows_agree(want, VerifyResult(*(t.cpu() for t in got))).mean() >= AGREEMENT


def test_seed_and_offset_tensors_read_in_kernel():
    """seed / offset given as tensors (no host sync) give the same draws as the same ints."""
    args, kwargs = random_case(4, V=64, T=9, B=4)
    as_ints = run_both(args, kwargs)[1]
    tensors = dict(kwargs, seed=torch.tensor(kwargs["seed"]), offset=torch.tensor(kwargs["offset"]))
    as_tensors = run_both(args, tensors)[1]
    for a, b in zip(as_ints, as_tensors):
        assert torch.equal(a, b)
    other = run_both(args, dict(kwargs, offset=(kwargs["offset"] + 1) % 2**32))[1]
    assert not all(torch.equal(a, b) for a, b in zip(as_ints, other))


@pytest.mark.parametrize("override, exc, match", BAD_VERIFY, ids=[f"{i}-{m}" for i, (_, _, m) in
                                                                    enumerate(BAD_VERIFY)])
def test_bad_input_raises(override, exc, match):
    """SPEC §9 through lantern.fused("triton"): the same errors as every backend."""
    with pytest.raises(exc, match=match):
        call_verify("triton", **override)


# ---- LlamaGen shapes (GPU only) ------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("settings", LLAMAGEN_SETTINGS, ids=LLAMAGEN_IDS)
def test_llamagen_shapes_on_gpu(settings):
    """B = 8 at LlamaGen's shapes (see test_verify_fused.llamagen_case)."""
    want, got = run_both(*llamagen_case(8, settings))
    assert rows_agree(want, got).mean() >= 7 / 8  # float32 on both sides; rounding may flip a rare row
