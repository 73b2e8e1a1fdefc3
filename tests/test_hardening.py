"""Regression tests of the ops' hardening (docs/hardening.md): bad or extreme inputs of compact_kv,
tree_attention, process_logits / verify on every backend. The other sections live in the test modules of what
they cover (model loading, the neighbour cache, decoding arguments, the command line, concurrency)."""
import math

import pytest
import torch

import backends


BACKENDS = backends.params(backends.NAMES)  # reference, cpu, cuda, triton (skipped, with the reason, if unusable)
# numpy's floating-point warnings from Triton's interpreter, on the deliberately non-finite inputs
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


# -- 1: compact_kv with an input in the memory it writes --------------------------------------------------

def _aliased_inputs(which):
    """The issue's reproducer: a float64 cache whose first element is read as ``which`` (cache_len, n_keep or
    path_nodes), int64 views of the cache's own memory; the copy would overwrite them mid-way."""
    cache = torch.zeros(4, 1, 1, 8, 1, dtype=torch.float64)
    cache[0, 0, 0, 1, 0] = 1e300
    alias = cache.view(-1)[:2].view(torch.int64)  # [2] int64 in the cache's first 16 bytes
    args = dict(cache_len=torch.tensor([1]), path_nodes=torch.tensor([[1, 0]]), n_keep=torch.tensor([1]))
    if which == "cache_len":
        args["cache_len"] = alias[:1]  # holds 0 (the cache's first element)
    elif which == "n_keep":
        alias[:1] = 1
        args["n_keep"] = alias[:1]
    else:
        alias[0], alias[1] = 1, 0
        args["path_nodes"] = alias.view(1, 2)
    return cache, args


@pytest.mark.parametrize("which", ["cache_len", "n_keep", "path_nodes"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.no_kernel_check("bad input: rejected before any kernel runs")
def test_1_compact_kv_rejects_inputs_in_the_cache(backend, which):
    import lantern
    from lantern import ops

    cache, args = _aliased_inputs(which)
    before = cache.clone()
    with lantern.fused(backend), pytest.raises(ValueError, match=f"{which} overlaps the memory of cache"):
        ops.compact_kv(cache, **args)
    assert torch.equal(cache, before)  # untouched


@pytest.mark.parametrize("which", ["cache_len", "n_keep", "path_nodes"])
@pytest.mark.parametrize("kernel", ["lantern", "lantern_triton"])
def test_1_compact_kv_kernels_called_directly_reject_aliasing(kernel, which):
    """The kernels behind the checks (torch.ops.lantern.compact_kv: cpu, cuda; lantern_triton: triton) refuse
    the overlap themselves: before, the cpu kernel re-read cache_len after overwriting it and crashed."""
    name = {"lantern": "cpu", "lantern_triton": "triton"}[kernel]
    if backends.why_unavailable(name) is not None:
        pytest.skip(f"backend {name!r} is unavailable: {backends.why_unavailable(name)}")
    import lantern

    lantern.enable_fused("reference")  # loads the fused ops without using them
    cache, args = _aliased_inputs(which)
    before = cache.clone()
    with pytest.raises(ValueError, match=f"{which} overlaps the memory of cache"):
        getattr(torch.ops, kernel).compact_kv(cache, args["cache_len"], args["path_nodes"], args["n_keep"])
    assert torch.equal(cache, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_1_compact_kv_separate_memory_and_grad(backend):
    """Neighbouring (not overlapping) memory is accepted and moves what it should; a cache that requires grad
    is refused on every backend (it is modified in place)."""
    import lantern
    from lantern import ops

    buffer = torch.arange(10, dtype=torch.float64)
    cache = buffer[:8].view(1, 1, 8, 1)  # B = 1, Hkv = 1, Lmax = 8, Dh = 1
    lengths = buffer[8:].view(torch.int64)[:1]  # int64 view of the next 8 bytes: outside the cache's span
    lengths.fill_(2)
    with lantern.fused(backend):
        new_len = ops.compact_kv(cache, lengths, torch.tensor([[0, 3]]), torch.tensor([2]))
        assert new_len.tolist() == [4] and cache.flatten()[:6].tolist() == [0, 1, 2, 5, 4, 5]
        leaf = torch.zeros(1, 1, 8, 1, requires_grad=True)
        with pytest.raises(ValueError, match="cache must not require grad"):
            ops.compact_kv(leaf, torch.tensor([0]), torch.tensor([[0]]), torch.tensor([1]))


# -- 3: tree_attention with non-finite keys, values or queries -----------------------------------------

def _attention_case():
    """B = 2 rows, H = 4 query heads over Hkv = 2, a chain of T = 3 nodes plus a side branch (node 3, child
    of the root), Dh = 8, cache_len (5, 2), Lmax = 12; NaN in every unused position."""
    from lantern import ops

    g = torch.Generator().manual_seed(4)
    B, H, Hkv, T, Dh, Lmax = 2, 4, 2, 4, 8, 12
    q = torch.randn(B, H, T, Dh, generator=g)
    k, v = torch.randn(B, Hkv, Lmax, Dh, generator=g), torch.randn(B, Hkv, Lmax, Dh, generator=g)
    cache_len = torch.tensor([5, 2])
    for b in range(B):
        k[b, :, int(cache_len[b]) + T:] = math.nan
        v[b, :, int(cache_len[b]) + T:] = math.nan
    mask = ops.ancestor_mask(torch.tensor([[-1, 0, 1, 0]] * B))
    return q, k, v, cache_len, mask


CORRUPTIONS = {  # name -> (where to write, what, the (b, h, t) queries that must come out NaN)
    "nan-prefix-key": (("k", 0, 1, 2, 3), math.nan, [(0, h, t) for h in (2, 3) for t in range(4)]),
    "inf-prefix-key": (("k", 1, 0, 0, 0), math.inf, [(1, h, t) for h in (0, 1) for t in range(4)]),
    "neg-inf-prefix-key": (("k", 1, 0, 1, 5), -math.inf, [(1, h, t) for h in (0, 1) for t in range(4)]),
    "nan-prefix-value": (("v", 0, 0, 4, 7), math.nan, [(0, h, t) for h in (0, 1) for t in range(4)]),
    # node 3 (the side branch) of row 0 sits at position 5 + 3: only node 3 attends to it
    "inf-branch-value": (("v", 0, 1, 8, 0), math.inf, [(0, 2, 3), (0, 3, 3)]),
    "nan-branch-key": (("k", 0, 0, 8, 0), math.nan, [(0, 0, 3), (0, 1, 3)]),
    # node 1 of row 1 (position 2 + 1): read by nodes 1 and 2
    "nan-chain-value": (("v", 1, 0, 3, 2), math.nan, [(1, h, t) for h in (0, 1) for t in (1, 2)]),
    "inf-query": (("q", 1, 2, 0, 4), math.inf, [(1, 2, 0)]),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_3_non_finite_attention_inputs_give_nan_rows(backend, corruption):
    """Before, the cpu kernel skipped a NaN key as if it were absent (a finite output) while reference and
    triton gave NaN. Now every backend gives NaN in every element of exactly the queries that read a
    non-finite score or value, and the other queries are as without the corruption (a value no query
    attends to cannot leak through 0 x NaN)."""
    import lantern
    from lantern import ops

    q, k, v, cache_len, mask = _attention_case()
    with lantern.fused("reference"):
        clean = ops.tree_attention(q, k, v, cache_len, mask)
    (name, *index), value, poisoned = CORRUPTIONS[corruption]
    tensors = {"q": q, "k": k, "v": v}
    tensors[name][tuple(index)] = value
    with lantern.fused(backend):
        got = ops.tree_attention(tensors["q"], tensors["k"], tensors["v"], cache_len, mask)
    want_nan = torch.zeros(got.shape[:3], dtype=torch.bool)
    for b, h, t in poisoned:
        want_nan[b, h, t] = True
    assert torch.equal(got.isnan().all(-1), want_nan) and torch.equal(got.isnan().any(-1), want_nan)
    assert torch.allclose(got[~want_nan], clean[~want_nan], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_3_non_finite_attention_other_dtypes(backend, dtype):
    """float64 values beyond float32's range become inf in the float32 math: the queries reading them are
    NaN; float16 / bfloat16 infinities likewise (every backend the same)."""
    import lantern
    from lantern import ops

    q, k, v, cache_len, mask = (t.to(dtype) if t.is_floating_point() else t for t in _attention_case())
    v[0, 1, 8, 0] = 1e300 if dtype == torch.float64 else math.inf  # row 0's side branch, kv head 1
    with lantern.fused(backend):
        got = ops.tree_attention(q, k, v, cache_len, mask)
    nan_rows = got.isnan().all(-1).nonzero().tolist()
    assert nan_rows == [[0, 2, 3], [0, 3, 3]] and int(got.isnan().sum()) == 2 * 8


# -- 6 / 8 / 10: processed logits that are no distribution, settings the kernels cannot represent --------

def _one_node(logits, **kwargs):
    """verify with one node per row (the root): every row's P_0 is computed and sampled from."""
    from lantern import ops

    B = logits.shape[0]
    return ops.verify(logits, torch.zeros(B, 1, dtype=torch.int64), torch.full((B, 1), -1), **kwargs)


def _rows_of(logits):
    return logits.reshape(-1, logits.shape[-1])


def _overflowing_cases():
    """(logits [B, 1, V], verify / process_logits settings) whose processed logits overflow float32 (#6)."""
    torch.manual_seed(0)
    x = torch.randn(2, 1, 8)
    near_max = torch.full((1, 1, 4), 3e38)
    near_max[0, 0, 3] = 3.3e38
    return {
        "tiny-temperature": (10 * x, dict(temperature=1e-38)),
        "guidance-difference": (near_max, dict(uncond_logits=-near_max, cfg_scale=0.0)),  # 0 * inf
        "guidance-scale": (10 * x, dict(uncond_logits=-10 * x, cfg_scale=1e38)),
        "per-row-temperature": (10 * x, dict(temperature=torch.tensor([1.0, 1e-38]))),
        "float64-logits": (10 * x.double(), dict(temperature=1e-38)),  # fine in float64, not in float32
    }


@pytest.mark.parametrize("case", list(_overflowing_cases()))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.no_kernel_check("bad input: rejected before any kernel runs")
def test_6_overflowing_guidance_or_temperature_raises(backend, case):
    import lantern
    from lantern import ops

    logits, settings = _overflowing_cases()[case]
    with lantern.fused(backend):
        with pytest.raises(ValueError, match="guidance and temperature overflow float32"):
            _one_node(logits, **settings)
        with pytest.raises(ValueError, match="guidance and temperature overflow float32"):
            ops.process_logits(_rows_of(logits), **{k: _rows_of(v) if k == "uncond_logits" else v
                                                    for k, v in settings.items()})


@pytest.mark.parametrize("backend", BACKENDS)
def test_6_large_but_finite_processed_logits_agree(backend):
    """Just inside the bound: logits / 1e-30 and a guidance scale of 1e30 stay finite in float32, run, and
    give the reference's tokens (the largest guided logit wins every row)."""
    import lantern

    torch.manual_seed(1)
    logits, uncond = torch.randn(6, 1, 32), torch.randn(6, 1, 32)
    cases = [dict(temperature=1e-30), dict(uncond_logits=uncond, cfg_scale=1e30),
             dict(uncond_logits=uncond, cfg_scale=-1e30, temperature=0.0)]
    for settings in cases:
        with lantern.fused("reference"):
            want = _one_node(logits, **settings)
        with lantern.fused(backend):
            got = _one_node(logits, **settings)
        guided = logits if "uncond_logits" not in settings else uncond + settings["cfg_scale"] * (logits - uncond)
        assert torch.equal(got.next_token, want.next_token)
        assert torch.equal(want.next_token, guided[:, 0].argmax(-1))


def _masked_cases():
    """(logits [2, 2, 8], extra settings): a node whose tokens are all masked (#8)."""
    torch.manual_seed(2)
    logits = torch.randn(2, 2, 8)
    all_masked = logits.clone()
    all_masked[1, 1] = -math.inf  # row 1's node 1: a padding node, never visited by the walk
    lc, lu = logits.clone(), logits.clone()
    lc[0, 0, :4] = -math.inf
    lu[0, 0, 4:] = -math.inf  # every token masked in one of the two: nothing left after guidance
    return {"all--inf": (all_masked, {}), "all--inf-top-p": (all_masked, dict(top_p=0.5)),
            "masked-by-guidance": (lc, dict(uncond_logits=lu, cfg_scale=2.0))}


@pytest.mark.parametrize("case", list(_masked_cases()))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.no_kernel_check("bad input: rejected before any kernel runs")
def test_8_every_token_masked_raises(backend, case):
    """Before, process_logits and the reference verify failed with an IndexError under top_p < 1 and cpu /
    triton returned tokens; now every backend raises the same ValueError, even for a node the walk skips."""
    import lantern
    from lantern import ops

    logits, settings = _masked_cases()[case]
    tokens = torch.tensor([[3, 1], [2, -1]])
    parents = torch.tensor([[-1, 0], [-1, -1]])  # row 1's node 1 is padding
    with lantern.fused(backend):
        with pytest.raises(ValueError, match="has every token masked"):
            ops.verify(logits, tokens, parents, **settings)
        with pytest.raises(ValueError, match="has every token masked"):
            ops.process_logits(logits, **settings)


UNREPRESENTABLE = [
    (dict(temperature=1e300), "temperature must be finite in float32"),
    (dict(temperature=torch.tensor([1.0, 1e300], dtype=torch.float64)), "temperature must be finite in float32"),
    (dict(temperature=1e-300), "rounds to 0"),
    (dict(cfg_scale=1e300), "cfg_scale must be finite in float32"),
    (dict(cfg_scale=10**400), "cfg_scale must be finite"),
    (dict(top_k=2**63), r"top_k must be in \[0, 2\^63\)"),
    (dict(top_k=torch.tensor([2**64 - 1, 1], dtype=torch.uint64)), r"top_k must be in \[0, 2\^63\)"),
    (dict(delta=1e300), "delta must be a number >= 0, finite in float32"),
    (dict(lam=1e300), "lam must be a number >= 1"),
    (dict(temperature=1.0, logits_scale=1e300), "beyond float32's range"),  # float64 logits
]


@pytest.mark.parametrize("settings,message", UNREPRESENTABLE, ids=lambda v: str(v)[:40] if isinstance(v, dict) else "")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.no_kernel_check("bad input: rejected before any kernel runs")
def test_10_settings_beyond_float32_raise_on_every_backend(backend, settings, message):
    """Settings that passed the checks but overflowed a kernel's type (a RuntimeError on cpu, inf on the
    reference) now fail the checks: the same ValueError everywhere."""
    import lantern

    settings = dict(settings)
    logits = torch.randn(2, 1, 8, dtype=torch.float64) * settings.pop("logits_scale", 1.0)
    extra = dict(uncond_logits=torch.randn(2, 1, 8, dtype=torch.float64)) if "cfg_scale" in settings else {}
    with lantern.fused(backend), pytest.raises(ValueError, match=message):
        _one_node(logits, **settings, **extra)


@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_scalar_settings_mean_their_python_numbers(backend):
    """numpy scalars (np.float32(0.9), np.int64(3)) are read as the Python numbers they hold, on every op."""
    import numpy as np

    import lantern
    from lantern import ops

    torch.manual_seed(3)
    logits, uncond = torch.randn(4, 3, 16), torch.randn(4, 3, 16)
    tokens, parents = torch.randint(16, (4, 3)), torch.tensor([[-1, 0, 1]] * 4)
    plain = dict(uncond_logits=uncond, cfg_scale=1.5, temperature=0.75, top_k=5, top_p=0.875, seed=7, offset=3,
                 k=2, delta=0.25, neighbours=torch.randint(16, (16, 4), dtype=torch.int32))
    numpy = dict(plain, cfg_scale=np.float64(1.5), temperature=np.float32(0.75), top_k=np.int64(5),
                 top_p=np.float32(0.875), seed=np.uint64(7), offset=np.int32(3), k=np.int64(2),
                 delta=np.float32(0.25))
    with lantern.fused(backend):
        want, got = ops.verify(logits, tokens, parents, **plain), ops.verify(logits, tokens, parents, **numpy)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        assert torch.equal(ops.philox_uniform(np.uint64(5), np.int64(1), 2, 3, np.uint32(4)),
                           ops.philox_uniform(5, 1, 2, 3, 4))
        codebook = torch.randn(8, 3)
        assert torch.equal(ops.latent_neighbours(codebook, np.int64(2)), ops.latent_neighbours(codebook, 2))
        with pytest.raises(TypeError, match="temperature must be a number"):
            ops.process_logits(logits, temperature=np.bool_(True))


# -- found by the differential fuzzer (tests/test_fuzz.py) ---------------------------------------------------

@pytest.mark.parametrize("backend", backends.params(["reference", "cpu", "cuda"]))  # triton has no philox op
def test_fuzz_philox_counters_that_do_not_broadcast_raise(backend):
    """Counters of shapes [3] and [0] passed the checks and failed inside torch.broadcast_tensors with a
    RuntimeError (every backend); now the checks refuse them with a ValueError naming the counters."""
    import lantern
    from lantern import ops

    with lantern.fused(backend):
        with pytest.raises(ValueError, match="c0, c1, c2, c3 must broadcast together"):
            ops.philox_uniform(1, torch.tensor([1, 2, 3]), torch.zeros(0, dtype=torch.int64), 0, 0)
        assert ops.philox_uniform(1, torch.tensor([1, 2, 3]), torch.zeros(2, 1, dtype=torch.int64), 0, 0).shape == (2, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fuzz_neighbour_table_does_not_depend_on_the_codebook_layout(backend):
    """The reference normalised a non-contiguous codebook with another rounding than a contiguous one, so
    near-tied neighbours (here: both at squared distance ~1 from the zero row) swapped with the layout, and
    the reference disagreed with cpu. Every backend now gives one table for both layouts."""
    import lantern
    from lantern import ops

    codebook = torch.tensor([[0.0, 0.0, 0.0], [0.5684312582, -1.0845223665, -1.3985954523],
                             [0.4033468366, 0.8380263448, -0.7192575932]])
    transposed = codebook.t().contiguous().t()
    with lantern.fused("reference"):
        want = ops.latent_neighbours(codebook, 1, normalize=True)
    with lantern.fused(backend):
        assert torch.equal(ops.latent_neighbours(codebook, 1, normalize=True), want)
        assert torch.equal(ops.latent_neighbours(transposed, 1, normalize=True), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fuzz_neighbour_row_whose_norm_overflows_raises(backend):
    """A row whose float32 L2 norm overflows (3.3e38 in one coordinate) was 'normalised' to the zero row by
    every backend (x / inf), silently; with normalize=True it is now refused. Without normalisation it is
    an ordinary (far away) code."""
    import lantern
    from lantern import ops

    codebook = torch.tensor([[3.3e38, -0.2, -0.3], [0.5, -1.0, -1.4], [0.4, 0.8, -0.7]])
    with lantern.fused(backend):
        with pytest.raises(ValueError, match="codebook row 0: its L2 norm overflows float32"):
            ops.latent_neighbours(codebook, 1, normalize=True)
        assert ops.latent_neighbours(codebook, 1, normalize=False).flatten().tolist() == [1, 2, 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fuzz_half_precision_nan_value_poisons_the_row(backend, dtype):
    """A NaN value in a bfloat16 cache reached the triton kernel's output only in its own column (under the
    interpreter, bfloat16 NaN compared equal to itself), not as a NaN row; every backend now gives the row."""
    import lantern
    from lantern import ops

    q, k = torch.ones(1, 1, 1, 3, dtype=dtype), torch.ones(1, 1, 1, 3, dtype=dtype)
    v = torch.tensor([[[[math.nan, 0.84, -0.72]]]], dtype=dtype)
    with lantern.fused(backend):
        out = ops.tree_attention(q, k, v, torch.tensor([0]), ops.ancestor_mask(torch.tensor([[-1]])))
    assert bool(out.isnan().all())


# -- 9: verify on an empty batch ------------------------------------------------------------------------

@pytest.mark.parametrize("T", [1, 3])
def test_9_reference_verify_of_no_rows_matches_cpu(T):
    import lantern
    from lantern import ops

    V = 8
    logits, tokens = torch.randn(0, T, V), torch.zeros(0, T, dtype=torch.int64)
    parents = torch.arange(-1, T - 1).expand(0, T)
    with lantern.fused("reference"):
        got = ops.verify(logits, tokens, parents, temperature=1.0)
        greedy = ops.verify(logits, tokens, parents, temperature=0.0)
    with lantern.fused("cpu"):
        want = ops.verify(logits, tokens, parents, temperature=1.0)
    assert isinstance(got, ops.VerifyResult) and isinstance(greedy, ops.VerifyResult)
    for result in (got, greedy):
        for name, a, b in zip(want._fields, result, want):
            assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device, name
    assert [tuple(a.shape) for a in want] == [(0,), (0, T - 1), (0,), (0, T)]
