"""Case builders shared by the op tests of every backend (tests/ops) and the helpers that compare a
backend with the reference.

verify: ``random_case`` (random inputs covering every setting family), ``PINNED`` / ``PINNED_SMALL``
(fixed cases that must agree exactly; the small list for the interpreter), ``llamagen_case`` (LlamaGen's
shapes), ``agreement`` / ``rows_agree`` (the SPEC §5 agreement count), ``verify_pair``.
trees (every test's): ``random_tree`` (one parent array), ``random_parents`` (a batch of them).
tree_attention: ``attention_inputs``, ``attention_case``. compact_kv: ``compact_case``.
latent_neighbours: ``random_codebook``, ``integer_codebook``.
philox_uniform: ``PHILOX_KNOWN_ANSWERS`` (SPEC §5's table, the one copy every test reads).
"""
from __future__ import annotations

import random

import numpy as np
import torch

import lantern
from lantern import ops
from lantern.ops.reference.verify import VerifyResult

AGREEMENT = 0.999  # SPEC §5: rows that agree exactly with the reference
FLOAT64_COMPUTE = ("reference", "cpu", "cuda")  # backends that compute float64 logits in float64
FLOAT64_EXACT = ("reference", "cpu")  # ... with the reference's own float64 sums: equal on every row


# SPEC §5: seed, (c0, c1, c2, c3) -> (word 0, u, E = -log1p(-u))
PHILOX_KNOWN_ANSWERS = (
    (0, (0, 0, 0, 0), 0x6627E8D5, 0.7980929017066956, 1.5999475717544556),
    (123456789012345, (0, 3, 5, 11), 0x9DFD5F02, 0.7657051682472229, 1.4511749744415283),
    (42, (0x80000000, 1, 0, 0), 0x5E221A30, 0.7354156374931335, 1.3295950889587402),
    (42, (16383, 58, 7, 1000), 0xB60EA391, 0.5776782035827637, 0.8619877099990845),
    (2**64 - 1, (0xFFFFFFFF,) * 4, 0x408F276D, 0.5043686628341675, 0.7019228935241699),
)


def to_device(value, device):
    """A tensor, or a tuple / dict of values, moved to ``device`` (anything else unchanged)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


# ---- verify ------------------------------------------------------------------------------------------

def random_neighbours(rng, V, K):
    """int32 [V, K]: K distinct ids y != x per row, cheap for large V (row x takes a rotated window of one
    random permutation of the offsets 1..V-1)."""
    K = min(K, V - 1)
    base = rng.permutation(np.arange(1, V))  # [V - 1] distinct nonzero offsets
    shifts = rng.integers(0, V - 1, V)
    offsets = base[(shifts[:, None] + np.arange(K)[None, :]) % (V - 1)]  # [V, K], distinct per row
    return torch.as_tensor((np.arange(V)[:, None] + offsets) % V, dtype=torch.int32)


def random_tree(rng: np.random.Generator, T: int, pad_rate: float = 0.2, chain_rate: float = 0.0) -> np.ndarray:
    """int64 [T], a valid parent array (the one tree generator of the tests): parents[0] = -1; node i is
    padding (-1) with probability pad_rate, else the child of the last real node with probability chain_rate
    (deep paths), else of a uniformly chosen earlier real node."""
    parents = np.full(T, -1, dtype=np.int64)
    real = [0]
    for i in range(1, T):
        if rng.random() < pad_rate:
            continue
        chain = chain_rate > 0 and not rng.random() < 1 - chain_rate
        parents[i] = real[-1] if chain else real[int(rng.integers(len(real)))]
        real.append(i)
    return parents


def random_case(seed: int, V=None, T=None, B=None, dtype=torch.float32):
    """(args, kwargs) of one random verify call."""
    rng = np.random.default_rng(seed)
    V = V or int(rng.choice([2, 8, 33, 256, 1000, 4096]))
    T = T or int(rng.choice([1, 2, 5, 9, 17, 33]))
    B = B or int(rng.integers(1, 33))
    scale = float(rng.choice([0.5, 2.0, 4.0]))
    logits = rng.normal(0, scale, (B, T, V))
    if rng.random() < 0.3:  # masked tokens
        logits[rng.random((B, T, V)) < 0.2] = -np.inf
        logits[..., 0] = np.maximum(logits[..., 0], 0.0)  # at least one finite logit per node
    if rng.random() < 0.3:  # ties (quantised logits)
        logits = np.round(logits * 2) / 2
    guidance = rng.random() < 0.5
    uncond = rng.normal(0, scale, (B, T, V)) if guidance else None
    parents = np.stack([random_tree(rng, T, float(rng.choice([0.0, 0.2])), chain_rate=0.5) for _ in range(B)])
    sampled = rng.random() < 0.35
    draft = None
    if sampled:
        w = np.exp(0.7 * np.nan_to_num(logits, neginf=-30) + rng.normal(0, 0.8, (B, T, V)))
        if rng.random() < 0.3:
            w[rng.random((B, T, V)) < 0.3] = 0.0
            w[..., 0] += 1e-3
        draft = w / w.sum(-1, keepdims=True)
    tokens = np.full((B, T), -1, dtype=np.int64)
    tokens[:, 0] = rng.integers(V, size=B)
    guided = logits if uncond is None else uncond + 2.0 * (logits - uncond)
    for b in range(B):
        for i in range(1, T):
            par = parents[b, i]
            if par < 0:
                continue
            if sampled:
                tokens[b, i] = rng.choice(V, p=draft[b, par])
            elif rng.random() < 0.6:  # a likely token (deep walks)
                top = np.argsort(-np.nan_to_num(guided[b, par], neginf=-1e30))[:3]
                tokens[b, i] = top[int(rng.integers(len(top)))]
            else:
                tokens[b, i] = rng.integers(V)
    K = int(rng.choice([0, 1, 4, 16]))
    K = min(K, V - 1)
    k = int(rng.integers(0, K + 1)) if K else 0
    nbrs = random_neighbours(rng, V, K) if K > 0 else None

    def per_row(values, scalar):
        return values if rng.random() < 0.5 else scalar

    temp = np.where(rng.random(B) < 0.25, 0.0, rng.choice([0.5, 1.0, 1.5], B))
    top_k = np.where(rng.random(B) < 0.5, 0, rng.integers(1, V + 1, B))
    top_p = np.where(rng.random(B) < 0.5, 1.0, rng.choice([0.2, 0.5, 0.9, 0.99], B))
    kwargs = dict(
        uncond_logits=None if uncond is None else torch.as_tensor(uncond).to(dtype),
        cfg_scale=per_row(torch.full((B,), 2.0), 2.0),
        temperature=per_row(torch.as_tensor(temp),
                            float(temp[0]) if np.all(temp == temp[0]) else torch.as_tensor(temp)),
        top_k=per_row(torch.as_tensor(top_k), int(top_k[0]) if np.all(top_k == top_k[0]) else torch.as_tensor(top_k)),
        top_p=per_row(torch.as_tensor(top_p),
                      float(top_p[0]) if np.all(top_p == top_p[0]) else torch.as_tensor(top_p)),
        draft_probs=None if draft is None else torch.as_tensor(draft).to(dtype),
        k=k, seed=int(rng.integers(0, 2**63)), offset=int(rng.integers(0, 2**32)),
    )
    mode = rng.choice(["delta", "lambda", "node"])
    if mode == "lambda":
        kwargs["lam"] = float(rng.choice([1.0, 1.5, 3.0]))
    else:
        kwargs["delta"] = float(rng.choice([0.0, 0.05, 0.2, 0.5]))
        kwargs["budget"] = "node" if mode == "node" else "candidate"
    args = (torch.as_tensor(logits).to(dtype), torch.as_tensor(tokens), torch.as_tensor(parents), nbrs)
    return args, kwargs


def narrowed(value):
    """float64 logits-like tensors ([B, T, V]) rounded to float32 (a float32 backend's inputs)."""
    if isinstance(value, torch.Tensor) and value.dtype == torch.float64 and value.dim() == 3:
        return value.float()
    return value


def verify_pair(backend: str, args, kwargs, device, reference_args=None, reference_kwargs=None):
    """(reference, backend) results of one verify call, both on the CPU; both run on ``device``. The
    reference runs on ``reference_args`` / ``reference_kwargs`` when given (e.g. float32-rounded inputs)."""
    args, kwargs = to_device(args, device), to_device(kwargs, device)
    with lantern.fused("reference"):
        want = ops.verify(*to_device(reference_args or args, device),
                          **to_device(reference_kwargs or kwargs, device))
    with lantern.fused(backend):
        got = ops.verify(*args, **kwargs)
    return VerifyResult(*(t.cpu() for t in want)), VerifyResult(*(t.cpu() for t in got))


def rows_agree(want, got) -> np.ndarray:
    """[B] bool: every output of the row is equal."""
    same = np.ones(want.accept_len.shape[0], dtype=bool)
    for a, b in zip(want, got):
        eq = (a == b)
        same &= eq.reshape(eq.shape[0], -1).all(1).numpy() if eq.dim() > 1 else eq.numpy()
    return same


def agreement(run, cases):
    """run(args, kwargs) -> (reference, fused) results; cases: {seed: (args, kwargs)} ->
    (rows that agree exactly, rows, seeds of the cases with a mismatch)."""
    rows = agree = 0
    bad = []
    for seed, (args, kwargs) in cases.items():
        same = rows_agree(*run(args, kwargs))
        rows += len(same)
        agree += int(same.sum())
        if not same.all():
            bad.append(seed)
    return agree, rows, bad


def random_cases(interpreted: bool) -> dict:
    """{seed: (args, kwargs)}: 150 random cases, or 36 with B <= 6 rows for the interpreter."""
    if interpreted:
        return {seed: random_case(seed, B=int(np.random.default_rng(seed + 10_000).integers(1, 7)))
                for seed in range(36)}
    return {seed: random_case(seed) for seed in range(150)}


# Pinned cases: fixed inputs that must agree exactly (every setting family at least once).
PINNED = [
    dict(seed=3, V=1000, T=17, B=24),
    dict(seed=11, V=4096, T=9, B=8),
    dict(seed=21, V=256, T=33, B=32),
    dict(seed=42, V=33, T=5, B=32),
    dict(seed=77, V=8, T=9, B=32),
]
PINNED_SMALL = [  # the interpreter's: fewer rows, no V = 4096
    dict(seed=3, V=1000, T=17, B=6),
    dict(seed=21, V=256, T=33, B=6),
    dict(seed=42, V=33, T=5, B=12),
    dict(seed=77, V=8, T=9, B=12),
]


def pinned_id(case: dict) -> str:
    return f"seed{case['seed']}-V{case['V']}-B{case['B']}"


# LlamaGen's verify (LanternLlamaGen: top-k 2000, CFG 3.0; LANTERN++ adds top-p): deterministic drafts
# (the drafter's argmax) and sampled drafts given with their draft_probs.
LLAMAGEN_SETTINGS = {
    "delta": dict(temperature=1.0, top_k=2000, k=1000, delta=0.1),                    # LANTERN sampling
    "lambda-top-p": dict(temperature=1.0, top_k=2000, top_p=0.95, k=100, lam=2.0),     # LANTERN++ (lambda)
    "node-budget": dict(temperature=1.0, top_k=0, k=1000, delta=0.1, budget="node"),  # node budget, no top-k
    "greedy": dict(temperature=0.0, k=1000, delta=0.1),
    "delta-draft-probs": dict(temperature=1.0, top_k=2000, k=1000, delta=0.1, drafts="sampled"),
    "lambda-draft-probs": dict(temperature=1.0, top_k=2000, top_p=0.95, k=100, lam=2.0, drafts="sampled"),
}
LLAMAGEN_V, LLAMAGEN_T, LLAMAGEN_K = 16384, 59, 1000


def llamagen_case(B: int, settings: dict):
    """(args, kwargs) of a verify call at LlamaGen's shapes: V = 16384, T = 59 (an EAGLE-2-like dynamic tree),
    CFG 3.0, K = 1000 neighbours. Deterministic drafts (default): each node's token is the parent's argmax,
    except every sixth node (a random token). ``drafts="sampled"``: each node's token is drawn from its
    parent's drafter row, and the rows are passed as draft_probs."""
    settings = dict(settings)
    sampled = settings.pop("drafts", "argmax") == "sampled"
    g = torch.Generator().manual_seed(5)
    T, V, K = LLAMAGEN_T, LLAMAGEN_V, LLAMAGEN_K
    logits = torch.randn(B, T, V, generator=g) * 3
    uncond = torch.randn(B, T, V, generator=g) * 3
    parents = torch.tensor([-1] + [0 if i % 6 == 1 else i - 1 for i in range(1, T)]).expand(B, T).contiguous()
    guided = uncond + 3.0 * (logits - uncond)
    at_parent = lambda x: x.gather(1, parents.clamp(min=0)[:, :, None].expand(B, T, V))  # noqa: E731
    draft = None
    if sampled:  # a drafter correlated with the target, as a trained one is
        draft = torch.softmax(0.7 * guided + torch.randn(B, T, V, generator=g), dim=-1)
        tokens = torch.multinomial(at_parent(draft).reshape(B * T, V), 1, generator=g).reshape(B, T)
    else:
        tokens = at_parent(guided).argmax(-1)  # parent's argmax
        tokens[:, 1::6] = torch.randint(V, (B, len(range(1, T, 6))), generator=g)
    nbrs = random_neighbours(np.random.default_rng(5), V, K)
    return (logits, tokens, parents, nbrs), dict(uncond_logits=uncond, cfg_scale=3.0, draft_probs=draft, seed=9,
                                                 offset=4, **settings)


# ---- trees, tree_attention ---------------------------------------------------------------------------

def random_parents(rng, B: int, T: int, pad_prob: float) -> torch.Tensor:
    """int64 [B, T]: B trees of ``random_tree`` (rng: a numpy Generator, or a random.Random that seeds one)."""
    if isinstance(rng, random.Random):
        rng = np.random.default_rng(rng.getrandbits(64))
    if B == 0:  # as torch.tensor([]) of no rows: shape [0] (the fuzzer's malformed empty batch)
        return torch.zeros(0, dtype=torch.int64)
    return torch.as_tensor(np.stack([random_tree(rng, T, pad_prob) for _ in range(B)]))


def random_expansion(rng: random.Random, B: int, M: int, V: int = 1000):
    """Candidates with parents earlier in the list and cumulative scores that never increase along a path
    (quantised so ties are common)."""
    tokens = torch.tensor([[rng.randrange(V) for _ in range(M)] for _ in range(B)], dtype=torch.int64)
    tokens = tokens.reshape(B, M)
    parents = torch.full((B, M), -1, dtype=torch.int64)
    scores = torch.zeros(B, M, dtype=torch.float32)
    for b in range(B):
        for m in range(M):
            p = rng.choice([-1] + list(range(m))) if m else -1
            parents[b, m] = p
            base = 0.0 if p < 0 else float(scores[b, p])
            scores[b, m] = base - rng.choice([0.0, 0.5, 1.0, 2.5])
    root = torch.tensor([rng.randrange(V) for _ in range(B)])
    return tokens, parents, scores, root


def attention_inputs(B, H, Hkv, T, Dh, cache_len, Lmax, seed, dtype=torch.float32, layout="contiguous",
                     garbage=float("nan")):
    """q [B, H, T, Dh]; caches [B, Hkv, Lmax, Dh] ('strided': a [B, Lmax, Hkv, Dh] buffer viewed as such)
    holding ``garbage`` past each row's cache_len + T (never to be read); cache_len int64 [B]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dh, generator=g)
    if layout == "contiguous":
        k, v = torch.randn(B, Hkv, Lmax, Dh, generator=g), torch.randn(B, Hkv, Lmax, Dh, generator=g)
    else:
        k = torch.randn(B, Lmax, Hkv, Dh, generator=g).transpose(1, 2)
        v = torch.randn(B, Lmax, Hkv, Dh, generator=g).transpose(1, 2)
    cache_len = torch.tensor(cache_len, dtype=torch.int64)
    for b in range(B):
        k[b, :, int(cache_len[b]) + T:] = garbage
        v[b, :, int(cache_len[b]) + T:] = garbage
    return q.to(dtype), k.to(dtype), v.to(dtype), cache_len


def attention_case(B, H, Hkv, T, Dh, cache_len, Lmax, dtype, seed, layout="contiguous", pad_prob=0.2,
                   device="cpu"):
    """``attention_inputs`` plus a random tree per row (with padding) as its ancestor mask, on ``device``:
    (q, k_cache, v_cache, cache_len, tree_mask)."""
    q, k, v, cache_len = attention_inputs(B, H, Hkv, T, Dh, cache_len, Lmax, seed, dtype, layout)
    mask = ops.ancestor_mask(random_parents(random.Random(seed), B, T, pad_prob))
    return tuple(t.to(device) for t in (q, k, v, cache_len, mask))


# ---- compact_kv --------------------------------------------------------------------------------------

def compact_case(rng: random.Random, lead, B, Hkv, Lmax, Dh, P, dtype=torch.float32, any_order=False,
                 device="cpu"):
    """A random cache [*lead, B, Hkv, Lmax, Dh]; per row a cache_len, a tree of T nodes that fits, and a kept
    list of n_keep <= P nodes: root first then increasing ids (a tree walk), or with ``any_order`` arbitrary,
    repeated nodes; -1 after. Returns (cache, cache_len, path_nodes [B, P], n_keep) on ``device``."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    cache = torch.randn(*lead, B, Hkv, Lmax, Dh, generator=g).to(dtype)
    cache_len, path_nodes, n_keep = [], [], []
    for _ in range(B):
        T = rng.randint(1, Lmax)
        keep = rng.randint(0, min(P, T))
        if any_order:
            nodes = [rng.randrange(T) for _ in range(keep)]
        else:
            nodes = [0] + sorted(rng.sample(range(1, T), keep - 1)) if keep else []
        cache_len.append(rng.randint(0, Lmax - T))
        n_keep.append(keep)
        path_nodes.append(nodes + [-1] * (P - keep))
    as_long = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    case = cache, as_long(cache_len), as_long(path_nodes).reshape(B, P), as_long(n_keep)
    return tuple(t.to(device) for t in case)


# ---- latent_neighbours -------------------------------------------------------------------------------

def random_codebook(V, d, seed, dtype=torch.float32, device="cpu"):
    return torch.randn(V, d, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def integer_codebook(V, d, seed, spread=2, device="cpu"):
    """Small integer coordinates: every distance is exact in float32 and ties are everywhere."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-spread, spread + 1, (V, d), generator=g).to(torch.float32).to(device)


# ---- continuous_verify ---------------------------------------------------------------------------------

def continuous_block(seed: int, B: int, N: int, C: int, gap: float = 0.3, spread: float = 0.5) -> dict:
    """A random continuous_verify block (CPU, float32): target N(mu_p, sigma_p), drafter mean within ``gap``
    (in units of the target std) and std within a factor exp(+-spread), the draft a sample of the drafter,
    log-std sums of either sign."""
    g = torch.Generator().manual_seed(seed)
    shape = (B, N, C)
    mu_p = torch.randn(shape, generator=g)
    sigma_p = torch.exp(torch.randn(shape, generator=g) * 0.5)
    mu_q = mu_p + gap * sigma_p * torch.randn(shape, generator=g)
    sigma_q = sigma_p * torch.exp((torch.rand(shape, generator=g) * 2 - 1) * spread)
    draft = mu_q + sigma_q * torch.randn(shape, generator=g)
    logsig_p, logsig_q = torch.randn(B, N, generator=g) * 2, torch.randn(B, N, generator=g) * 2
    return dict(draft=draft, mu_p=mu_p, sigma_p=sigma_p, mu_q=mu_q, sigma_q=sigma_q, logsig_p=logsig_p,
                logsig_q=logsig_q)


def assert_continuous_agree(got, want, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """Decisions and tries equal, tokens within float32 rounding of the math functions (docs/cspd.md)."""
    assert torch.equal(got.accepted.cpu(), want.accepted.cpu())
    assert torch.equal(got.tries.cpu(), want.tries.cpu())
    assert got.tokens.dtype == torch.float32 and got.tries.dtype == torch.int32 and got.accepted.dtype == torch.bool
    torch.testing.assert_close(got.tokens.cpu(), want.tokens.cpu(), rtol=rtol, atol=atol)
