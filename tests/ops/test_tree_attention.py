"""tree_attention (SPEC §6) on every backend: against per-query float64 attention over an explicitly walked
key set, against causal attention / plain decoding for chains and single nodes, and (fused backends)
against the reference at the kernels' tile boundaries (several key / query / tree tiles, Dh with and
without a fixed-size path, GQA / MQA, strided caches, every dtype). Under Triton's interpreter the largest
case is smaller; GPT-XL's shapes run on a GPU.

Tolerances against the float32 reference: float32 / float64 inputs rtol = atol = 2e-5 (float32 dots,
online softmax: ~1e-6 observed; the cpu kernel's float64 path 1e-5); float16 2e-3 and bfloat16 2e-2 (about
one ulp of the output plus P rounded to the input dtype before P @ V)."""
import math
import random

import pytest
import torch
import torch.nn.functional as F

import backends
import lantern
from lantern.ops.reference.tree_attention import tree_attention as reference_attention
from op_cases import attention_case, attention_inputs, random_parents


def make_inputs(B, H, Hkv, T, Dh, cache_len, Lmax, seed, dtype=torch.float32, garbage=float("nan"), device="cpu"):
    """q [B, H, T, Dh], caches [B, Hkv, Lmax, Dh] with `garbage` past each row's cache_len + T."""
    inputs = attention_inputs(B, H, Hkv, T, Dh, cache_len, Lmax, seed, dtype, garbage=garbage)
    return tuple(t.to(device) for t in inputs)


def brute_force(q, k_cache, v_cache, cache_len, parents):
    """Per (row, head, query): keys = the prefix + the query's tree ancestors found by walking parents;
    softmax attention in float64."""
    q, k_cache, v_cache, cache_len, parents = (t.cpu() for t in (q, k_cache, v_cache, cache_len, parents))
    B, H, T, Dh = q.shape
    group = H // k_cache.shape[1]
    out = torch.zeros(B, H, T, Dh, dtype=torch.float64)
    for b in range(B):
        L = int(cache_len[b])
        for i in range(T):
            nodes, j = [i], int(parents[b, i])
            while j >= 0:
                nodes.append(j)
                j = int(parents[b, j])
            positions = list(range(L)) + [L + n for n in nodes]
            for h in range(H):
                keys = k_cache[b, h // group, positions].double()  # [n, Dh]
                vals = v_cache[b, h // group, positions].double()
                w = torch.softmax(keys @ q[b, h, i].double() / math.sqrt(Dh), dim=0)
                out[b, h, i] = w @ vals
    return out


def run(q, k_cache, v_cache, cache_len, parents):
    """The active backend's output, on the CPU."""
    mask = lantern.ops.ancestor_mask(parents.to(q.device))
    return lantern.ops.tree_attention(q, k_cache, v_cache, cache_len, mask).cpu()


@pytest.mark.parametrize("B,H,Hkv,T,Dh,cache_len,Lmax,pad", [
    (1, 2, 2, 5, 8, [3], 10, 0.0),
    (2, 4, 2, 12, 16, [0, 7], 24, 0.2),  # empty prefix in row 0
    (3, 4, 1, 40, 8, [5, 0, 11], 60, 0.3),  # two mask words, multi-query (Hkv = 1)
    (2, 6, 3, 33, 4, [1, 2], 35, 0.0),  # cache exactly full in row 1
])
def test_random_trees_match_brute_force(backend, device, B, H, Hkv, T, Dh, cache_len, Lmax, pad):
    q, k_cache, v_cache, cache_len = make_inputs(B, H, Hkv, T, Dh, cache_len, Lmax, seed=T, device=device)
    parents = random_parents(random.Random(T), B, T, pad)
    got = run(q, k_cache, v_cache, cache_len, parents)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), brute_force(q, k_cache, v_cache, cache_len, parents),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("Hkv", [1, 2, 4])
def test_chain_equals_causal_attention(backend, device, Hkv):
    B, H, T, Dh, L = 2, 4, 9, 16, 6
    q, k_cache, v_cache, cache_len = make_inputs(B, H, Hkv, T, Dh, [L, L], L + T + 3, seed=Hkv, garbage=0.0)
    chain = torch.arange(-1, T - 1).expand(B, T)
    got = run(*(t.to(device) for t in (q, k_cache, v_cache, cache_len, chain)))
    keys = k_cache[:, :, :L + T].repeat_interleave(H // Hkv, dim=1)
    vals = v_cache[:, :, :L + T].repeat_interleave(H // Hkv, dim=1)
    causal = torch.arange(L + T)[None, :] <= L + torch.arange(T)[:, None]  # [T, L + T]
    expected = F.scaled_dot_product_attention(q, keys, vals, attn_mask=causal)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_single_node_equals_plain_decoding(backend, device):
    B, H, Hkv, Dh = 3, 8, 2, 32
    q, k_cache, v_cache, cache_len = make_inputs(B, H, Hkv, 1, Dh, [4, 9, 0], 16, seed=1)
    got = run(*(t.to(device) for t in (q, k_cache, v_cache, cache_len, torch.full((B, 1), -1))))
    for b in range(B):
        n = int(cache_len[b]) + 1  # the prefix and the node itself
        keys = k_cache[b:b + 1, :, :n].repeat_interleave(H // Hkv, dim=1)
        vals = v_cache[b:b + 1, :, :n].repeat_interleave(H // Hkv, dim=1)
        expected = F.scaled_dot_product_attention(q[b:b + 1], keys, vals)
        torch.testing.assert_close(got[b:b + 1], expected, rtol=1e-5, atol=1e-5)


def test_padding_nodes_attend_to_prefix_and_themselves(backend, device):
    q, k_cache, v_cache, cache_len = make_inputs(1, 2, 2, 4, 8, [3], 8, seed=2, device=device)
    parents = torch.tensor([[-1, 0, -1, 1]])
    got = run(q, k_cache, v_cache, cache_len, parents)
    torch.testing.assert_close(got.double(), brute_force(q, k_cache, v_cache, cache_len, parents),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_give_output_in_their_dtype(backend, device, dtype):
    q, k_cache, v_cache, cache_len = make_inputs(2, 4, 2, 10, 16, [5, 2], 20, seed=3, dtype=dtype, device=device)
    parents = random_parents(random.Random(3), 2, 10, 0.1)
    got = run(q, k_cache, v_cache, cache_len, parents)
    assert got.dtype == dtype
    expected = brute_force(q, k_cache, v_cache, cache_len, parents)
    torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=2e-2)


# --- bad input -----------------------------------------------------------------------------------

def _good_args(T=3):
    q, k_cache, v_cache, cache_len = make_inputs(2, 4, 2, T, 8, [2, 3], 8, seed=0)
    parents = torch.arange(-1, T - 1).expand(2, T)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_len=cache_len,
                tree_mask=lantern.ops.ancestor_mask(parents))


def _bad_cases():
    good = _good_args()
    no_self = good["tree_mask"].clone()
    no_self[0, 1, 0] = 0b01  # node 1 without its own bit
    past_tree = good["tree_mask"].clone()
    past_tree[1, 2, 0] |= 0b1000  # bit for node 3 of a 3-node tree
    strided_q = torch.randn(2, 4, 3, 16)[..., ::2]
    return [
        (dict(q=good["q"].numpy()), TypeError, "q"),
        (dict(q=good["q"][0]), ValueError, "q"),
        (dict(q=good["q"].long()), TypeError, "q"),
        (dict(q=good["q"][:, :, :0]), ValueError, "q"),
        (dict(q=strided_q), ValueError, "q"),
        (dict(k_cache=good["k_cache"].double()), TypeError, "k_cache"),
        (dict(k_cache=good["k_cache"][:1]), ValueError, "k_cache"),
        (dict(k_cache=good["k_cache"][..., :4]), ValueError, "k_cache"),
        (dict(k_cache=torch.randn(2, 3, 8, 8), v_cache=torch.randn(2, 3, 8, 8)), ValueError, "k_cache"),
        (dict(v_cache=good["v_cache"][:, :, :7]), ValueError, "v_cache"),
        (dict(v_cache=good["v_cache"].half()), TypeError, "v_cache"),
        (dict(cache_len=good["cache_len"].int()), TypeError, "cache_len"),
        (dict(cache_len=torch.tensor([2])), ValueError, "cache_len"),
        (dict(cache_len=torch.tensor([2, 6])), ValueError, "cache_len"),  # 6 + 3 > Lmax = 8
        (dict(cache_len=torch.tensor([-1, 0])), ValueError, "cache_len"),
        (dict(tree_mask=good["tree_mask"].long()), TypeError, "tree_mask"),
        (dict(tree_mask=good["tree_mask"][:, :2]), ValueError, "tree_mask"),
        (dict(tree_mask=torch.zeros(2, 3, 2, dtype=torch.int32)), ValueError, "tree_mask"),
        (dict(tree_mask=no_self), ValueError, "tree_mask"),
        (dict(tree_mask=past_tree), ValueError, "tree_mask"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
@pytest.mark.no_kernel_check("bad input: rejected before any kernel runs")
def test_bad_input(backend, device, case):
    change, exc, name = _bad_cases()[case]
    args = {key: value.to(device) if isinstance(value, torch.Tensor) else value
            for key, value in {**_good_args(), **change}.items()}
    with pytest.raises(exc, match=name):
        lantern.ops.tree_attention(**args)


# --- fused backends against the reference, at the kernels' tile boundaries -------------------------

CASES = [
    # B, H, Hkv, T, Dh, cache_len, Lmax
    (2, 16, 16, 64, 64, [1024, 300], 1100),  # the benchmark shape, ragged prefixes
    (1, 8, 2, 70, 128, [65], 200),            # 3 tree words (bit 31 set: negative int32), 2 tree tiles, GQA 4
    (3, 6, 3, 5, 80, [0, 7, 130], 140),       # Dh = 80 (generic path / padded lanes), an empty prefix
    (2, 4, 1, 33, 16, [64, 63], 100),         # MQA: 4 heads x 33 nodes = 132 packed rows (3 row blocks)
    (2, 2, 2, 1, 64, [9, 200], 201),          # T = 1 (decoding)
]
CASES_SMALL = [  # the interpreter's: a smaller first case, Dh below a dot tile in the last
    (2, 4, 4, 64, 64, [300, 20], 400),   # ragged prefixes, several prefix tiles, a partial last tile
    *CASES[1:4],
    (2, 2, 2, 1, 8, [9, 200], 201),      # T = 1 (decoding), Dh below a dot tile
]
case_id = lambda c: f"B{c[0]}H{c[1]}kv{c[2]}T{c[3]}Dh{c[4]}"  # noqa: E731


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("backend,case", backends.case_params(
    backends.FUSED, CASES, CASES_SMALL, ids=[case_id(c) for c in CASES], small_ids=[case_id(c) for c in CASES_SMALL]),
    indirect=["backend"])
def test_fused_matches_reference(backend, device, case, layout):
    q, k, v, cache_len, mask = attention_case(*case, dtype=torch.float32, seed=sum(case[:5]), layout=layout,
                                              device=device)
    got = lantern.ops.tree_attention(q, k, v, cache_len, mask)
    assert got.dtype == q.dtype and got.shape == q.shape and got.is_contiguous()
    torch.testing.assert_close(got, reference_attention(q, k, v, cache_len, mask), rtol=2e-5, atol=2e-5)


# the cpu kernel's work items hold (H / Hkv) x T query rows; items of at most 4 rows (AR steps, short chains)
# compute their scores as dot products, wider ones 16 rows at a time: both sides of that boundary, each Dh path
NARROW_CASES = [
    # B, H, Hkv, T, Dh, cache_len, Lmax: rows per item
    (2, 2, 2, 1, 16, [100, 3], 110),   # 1
    (1, 4, 2, 1, 32, [130], 140),      # 2 (GQA)
    (2, 2, 2, 3, 128, [70, 0], 80),    # 3, a tree of 3 nodes, an empty prefix
    (1, 4, 1, 1, 24, [65], 70),        # 4 (MQA), Dh without a fixed-size path
    (1, 4, 2, 2, 64, [64], 70),        # 4, a tree of 2 nodes
    (1, 5, 1, 1, 64, [90], 100),       # 5: the 16-row path
]


@pytest.mark.parametrize("backend", backends.params(["cpu"]), indirect=True)
@pytest.mark.parametrize("case", NARROW_CASES, ids=[case_id(c) for c in NARROW_CASES])
def test_cpu_few_query_rows_match_reference(backend, case):
    q, k, v, cache_len, mask = attention_case(*case, dtype=torch.float32, seed=sum(case[:5]))
    got = lantern.ops.tree_attention(q, k, v, cache_len, mask)
    torch.testing.assert_close(got, reference_attention(q, k, v, cache_len, mask), rtol=2e-5, atol=2e-5)


DTYPE_CASES = [(2, 4, 2, 9, 32, [20, 3], 40), CASES[1], CASES[2]]


@pytest.mark.parametrize("backend", backends.params(backends.FUSED), indirect=True)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("case", DTYPE_CASES, ids=[case_id(c) for c in DTYPE_CASES])
def test_fused_dtypes(backend, device, case, dtype, tol):
    if backend == "cpu" and dtype == torch.float64:
        tol = 1e-5
    q, k, v, cache_len, mask = attention_case(*case, dtype=dtype, seed=5, device=device)
    got = lantern.ops.tree_attention(q, k, v, cache_len, mask)
    assert got.dtype == dtype
    want = reference_attention(q, k, v, cache_len, mask)
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)


def test_chain_over_an_empty_prefix_is_causal_attention(backend, device):
    """A chain tree over an empty prefix is causal self-attention over the T new positions."""
    B, H, T, Dh = 2, 4, 40, 32
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, H, T, Dh, generator=g).to(device) for _ in range(3))
    chain = torch.arange(-1, T - 1).expand(B, T).to(device)
    got = lantern.ops.tree_attention(q, k, v, torch.zeros(B, dtype=torch.int64, device=device),
                                     lantern.ops.ancestor_mask(chain))
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=2e-5, atol=2e-5)


@pytest.mark.no_kernel_check("bad input: rejected before any kernel runs")
def test_bad_input_messages(backend, device):
    """The messages name the argument first."""
    q, k, v, cache_len, mask = attention_case(1, 2, 2, 4, 8, [10], 14, dtype=torch.float32, seed=6, device=device)
    attend = lantern.ops.tree_attention
    with pytest.raises(ValueError, match="^cache_len must"):
        attend(q, k, v, cache_len + 1, mask)
    with pytest.raises(ValueError, match="multiple"):
        attend(q[:, :1].expand(1, 3, 4, 8).contiguous(), k, v, cache_len, mask)
    with pytest.raises(TypeError, match="^k_cache must"):
        attend(q, k.double(), v, cache_len, mask)
    with pytest.raises(ValueError, match="^tree_mask must set bit i"):
        attend(q, k, v, cache_len, torch.zeros_like(mask))  # a node that does not see itself
    with pytest.raises(ValueError, match="^q must have a contiguous last"):
        attend(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, cache_len, mask)


# --- GPT-XL's shapes (GPU) -----------------------------------------------------------------------

@pytest.mark.parametrize("backend", backends.params(["cuda", "triton"]), indirect=True)
@pytest.mark.gpu
@pytest.mark.parametrize("L", [257, 1024])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3), (torch.float32, 2e-5)])
def test_gpu_gpt_xl_shapes(backend, device, L, dtype, tol):
    """GPT-XL's verification forward: B = 4 (2 images with CFG), H = 20, Dh = 64, a 64-node tree, ragged
    prefixes of up to L tokens (256 image tokens + the class token)."""
    q, k, v, cache_len, mask = attention_case(4, 20, 20, 64, 64, [L, L // 2 + 3, L, 1], L + 64, dtype=dtype,
                                              seed=L, device=device)
    got = lantern.ops.tree_attention(q, k, v, cache_len, mask)
    torch.testing.assert_close(got.double(), reference_attention(q, k, v, cache_len, mask).double(),
                               rtol=tol, atol=tol)


ALL_BACKENDS = backends.params(backends.NAMES)  # reference, cpu, cuda, triton (skipped, with the reason, if unusable)


# ---- non-finite keys, values or queries -------------------------------------------------------------------

def _non_finite_case():
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
@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter on non-finite inputs
def test_non_finite_inputs_give_nan_rows(backend, corruption):
    """A NaN key is not skipped as if it were absent (a finite output): every backend gives NaN in every
    element of exactly the queries that read a non-finite score or value, and the other queries are as without
    the corruption (a value no query attends to cannot leak through 0 x NaN)."""
    import lantern
    from lantern import ops

    q, k, v, cache_len, mask = _non_finite_case()
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
@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter on non-finite inputs
def test_non_finite_inputs_of_other_dtypes_give_nan_rows(backend, dtype):
    """float64 values beyond float32's range become inf in the float32 math: the queries reading them are
    NaN; float16 / bfloat16 infinities likewise (every backend the same)."""
    import lantern
    from lantern import ops

    q, k, v, cache_len, mask = (t.to(dtype) if t.is_floating_point() else t for t in _non_finite_case())
    v[0, 1, 8, 0] = 1e300 if dtype == torch.float64 else math.inf  # row 0's side branch, kv head 1
    with lantern.fused(backend):
        got = ops.tree_attention(q, k, v, cache_len, mask)
    nan_rows = got.isnan().all(-1).nonzero().tolist()
    assert nan_rows == [[0, 2, 3], [0, 3, 3]] and int(got.isnan().sum()) == 2 * 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter on non-finite inputs
def test_half_precision_nan_value_poisons_the_row(backend, dtype):
    """A NaN value in a bfloat16 / float16 cache makes its query's whole row NaN on every backend, not only its
    own column (under the interpreter, bfloat16 NaN compares equal to itself)."""
    import lantern
    from lantern import ops

    q, k = torch.ones(1, 1, 1, 3, dtype=dtype), torch.ones(1, 1, 1, 3, dtype=dtype)
    v = torch.tensor([[[[math.nan, 0.84, -0.72]]]], dtype=dtype)
    with lantern.fused(backend):
        out = ops.tree_attention(q, k, v, torch.tensor([0]), ops.ancestor_mask(torch.tensor([[-1]])))
    assert bool(out.isnan().all())
