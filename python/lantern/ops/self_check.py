"""The self-check a fused backend passes before its first use of an op on a device (docs/self_check.md).

``check(backend, op_name, device)`` runs ``backend``'s implementation of ``op_name`` and the reference on a
few tiny fixed cases built on ``device`` and returns None when they agree, else one line describing the
first mismatch. The dispatcher (``lantern._backend``) runs it once per (backend, op, device) and caches the
verdict; this module only computes verdicts.

Agreement is judged as in the tests (SPEC §5, §7): tokens, decisions, indices and moved values exactly;
attention outputs within float32 tolerance. The cases are chosen so that rounding cannot flip a decision:
inputs are small dyadic numbers drawn from a private, seeded CPU generator (exact in float32, the same on
every machine), guided logits are distinct, and the neighbour codebook has well-separated distances
(tests/ops/test_self_check.py checks these margins). Implementations are called directly, never through
``lantern.ops`` (no recursion into the dispatcher). Only an exception raised by the kernel under test
counts as a mismatch; an exception anywhere else is a bug here and propagates.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from .. import _backend
from .reference.tree import ancestor_mask

SEED = 20240611
ATTENTION_RTOL = 1e-4
ATTENTION_ATOL = 1e-5


class KernelFailed(Exception):
    """The kernel under test raised; the message is the kernel's."""


def check(backend: str, op_name: str, device: torch.device) -> Optional[str]:
    """None if ``backend``'s ``op_name`` agrees with the reference on ``device``, else the first mismatch."""
    kernel = _backend._REGISTRY[backend][op_name]
    reference = _backend._REGISTRY["reference"][op_name]
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        try:
            return CASES[op_name](_guarded(kernel), reference, device)
        except KernelFailed as e:
            return f"the kernel raised {e}"


def _guarded(kernel: Callable) -> Callable:
    def call(*args, **kwargs):
        try:
            return kernel(*args, **kwargs)
        except Exception as e:  # noqa: BLE001  (any kernel failure is a verdict, reported with its message)
            raise KernelFailed(f"{type(e).__name__}: {_one_line(str(e))}") from e

    return call


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _generator() -> torch.Generator:
    """A private CPU generator (the user's RNG state is never touched)."""
    return torch.Generator(device="cpu").manual_seed(SEED)


def _ints(g: torch.Generator, lo: int, hi: int, shape) -> torch.Tensor:
    return torch.randint(lo, hi, tuple(shape), generator=g, device="cpu", dtype=torch.int64)


def _first_difference(name: str, got, want: torch.Tensor, rtol: float = 0.0, atol: float = 0.0) -> Optional[str]:
    """None if ``got`` equals ``want`` (within rtol/atol for floating tensors; NaN equals NaN), else the first
    differing element as ``name[i, j] = got, reference want``."""
    if not isinstance(got, torch.Tensor):
        return f"{name} is a {type(got).__name__}, the reference returns a tensor"
    if got.shape != want.shape or got.dtype != want.dtype:
        return (f"{name} has shape {tuple(got.shape)} and dtype {got.dtype}, the reference "
                f"{tuple(want.shape)} and {want.dtype}")
    got, want = got.cpu(), want.cpu()
    if got.is_floating_point():
        same = torch.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
    else:
        same = got == want
    if bool(same.all()):
        return None
    index = tuple(int(i) for i in (~same).nonzero()[0])
    return f"{name}{list(index)} = {got[index].item()}, reference {want[index].item()}"


# ---- verify (SPEC §3-§5) --------------------------------------------------------------------------------

B, T, V, K = 4, 6, 16, 4
# one tree per row: branching, a chain, trailing padding, two subtrees
PARENTS = [[-1, 0, 0, 1, 1, 3], [-1, 0, 1, 2, 3, 4], [-1, 0, 0, 0, 2, -1], [-1, 0, 1, 0, 3, 3]]


def _neighbour_table(g: torch.Generator) -> torch.Tensor:
    """int32 [V, K]: K distinct codes y != x per row."""
    offsets = torch.stack([torch.randperm(V - 1, generator=g, device="cpu")[:K] + 1 for _ in range(V)])
    return ((torch.arange(V)[:, None] + offsets) % V).to(torch.int32)


def _child_tokens(parents: torch.Tensor, ranked: torch.Tensor, roots: torch.Tensor) -> torch.Tensor:
    """tokens [B, T]: the i-th child of a node gets the node's i-th ranked token (deep walks, some rejections).
    ranked [B, T, V] token ids, best first."""
    tokens = torch.full((B, T), -1, dtype=torch.int64)
    tokens[:, 0] = roots
    for b in range(B):
        children_seen = [0] * T
        for i in range(1, T):
            p = int(parents[b, i])
            if p >= 0:
                tokens[b, i] = ranked[b, p, children_seen[p]]
                children_seen[p] += 1
    return tokens


def verify_cases(device: torch.device):
    """Two (kwargs, label) verify calls: deterministic drafts with guidance, per-row settings (a greedy row,
    top-k, top-p) and the node budget; sampled drafts in lambda mode with row keys (``rows``)."""
    g = _generator()
    parents = torch.tensor(PARENTS, dtype=torch.int64)
    # guided logits: distinct multiples of 1/2 in [-4, 4) per node; with cfg_scale 2 and
    # cond = (guided + uncond) / 2, uncond + 2 (cond - uncond) equals them exactly in float32
    guided = torch.stack([torch.randperm(V, generator=g, device="cpu") for _ in range(B * T)]).reshape(B, T, V)
    guided = (guided.to(torch.float32) - V / 2) / 2
    uncond = _ints(g, -8, 9, (B, T, V)).to(torch.float32) / 4
    cond = (guided + uncond) / 2
    roots = _ints(g, 0, V, (B,))
    tokens = _child_tokens(parents, guided.argsort(-1, descending=True), roots)
    neighbours = _neighbour_table(g)
    deterministic = dict(
        logits=cond, tokens=tokens, parents=parents, neighbours=neighbours, uncond_logits=uncond, cfg_scale=2.0,
        temperature=torch.tensor([0.0, 1.0, 0.8, 1.25], dtype=torch.float32),
        top_k=torch.tensor([0, 0, 6, 0], dtype=torch.int64),
        top_p=torch.tensor([1.0, 1.0, 1.0, 0.7], dtype=torch.float64),
        k=2, delta=0.15, budget="node", seed=1234, offset=7)

    weights = _ints(g, 1, 9, (B, T, V)).to(torch.float32)
    draft = weights / weights.sum(-1, keepdim=True)  # [B, T, V]
    logits = (torch.stack([torch.randperm(V, generator=g, device="cpu") for _ in range(B * T)])
              .reshape(B, T, V).to(torch.float32) - V / 2) / 4
    # siblings are distinct tokens, the drafter's best first (drawn without replacement)
    draft_ranked = (weights + torch.arange(V) / (2 * V)).argsort(-1, descending=True)
    sampled_tokens = _child_tokens(parents, draft_ranked, roots)
    sampled = dict(
        logits=logits, tokens=sampled_tokens, parents=parents, neighbours=neighbours, draft_probs=draft,
        temperature=torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.float32), k=3, lam=1.5, seed=99, offset=3,
        rows=torch.tensor([5, 0, 2**32 - 1, 70000], dtype=torch.int64))  # Philox row keys other than b
    return [(_to(deterministic, device), "deterministic drafts"), (_to(sampled, device), "sampled drafts")]


def _to(kwargs: Dict, device: torch.device) -> Dict:
    return {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in kwargs.items()}


def _check_verify(kernel: Callable, reference: Callable, device: torch.device) -> Optional[str]:
    for kwargs, label in verify_cases(device):
        args = [kwargs.pop(n) for n in ("logits", "tokens", "parents", "neighbours")]
        want = reference(*args, **kwargs)
        got = kernel(*args, **kwargs)
        for field in want._fields:
            if not hasattr(got, field):
                return f"verify ({label}) returned {type(got).__name__} without a {field} field"
            diff = _first_difference(field, getattr(got, field), getattr(want, field))
            if diff is not None:
                return f"verify ({label}): {diff}"
    return None


# ---- latent_neighbours (SPEC §2) ------------------------------------------------------------------------

NEIGHBOUR_V, NEIGHBOUR_D, NEIGHBOUR_K = 24, 4, 5
MIN_RELATIVE_GAP = 1e-3


def neighbour_codebook(device: torch.device) -> torch.Tensor:
    """float32 [V, d] codes (multiples of 1/16) whose K + 1 nearest others, raw and L2-normalised, are at
    distances at least 0.1 % apart (no near-ties: the table is unique whatever the rounding)."""
    g = _generator()
    for _ in range(100):
        codebook = _ints(g, -32, 33, (NEIGHBOUR_V, NEIGHBOUR_D)).to(torch.float32) / 16
        if min_relative_gap(codebook, False) > MIN_RELATIVE_GAP and min_relative_gap(codebook, True) > MIN_RELATIVE_GAP:
            return codebook.to(device)
    raise RuntimeError("self-check: no tie-free neighbour codebook in 100 draws")  # a bug here, not a kernel's


def min_relative_gap(codebook: torch.Tensor, normalize: bool) -> float:
    """The smallest (d_{i+1} - d_i) / d_{i+1} over each row's K + 1 nearest other codes (float64)."""
    rows = codebook.to(torch.float64)
    if normalize:
        rows = rows / rows.norm(dim=1, keepdim=True)
    dist = ((rows[:, None, :] - rows[None, :, :]) ** 2).sum(-1)  # [V, V]
    dist.fill_diagonal_(float("inf"))
    nearest = dist.sort(dim=1).values[:, : NEIGHBOUR_K + 2]  # [V, K + 2]
    gaps = (nearest[:, 1:] - nearest[:, :-1]) / nearest[:, 1:]
    return float(gaps.min()) if bool((nearest[:, 0] > 0).all()) else 0.0


def _check_latent_neighbours(kernel: Callable, reference: Callable, device: torch.device) -> Optional[str]:
    codebook = neighbour_codebook(device)
    for normalize in (False, True):
        want = reference(codebook, NEIGHBOUR_K, normalize)
        diff = _first_difference("table", kernel(codebook, NEIGHBOUR_K, normalize), want)
        if diff is not None:
            return f"latent_neighbours (normalize={normalize}): {diff}"
    return None


# ---- tree_attention and compact_kv (SPEC §6) ------------------------------------------------------------

ATT_B, ATT_H, ATT_HKV, ATT_T, ATT_DH, ATT_LMAX = 2, 4, 2, 5, 16, 16
ATT_PARENTS = [[-1, 0, 0, 1, 2], [-1, 0, 1, -1, 1]]
ATT_CACHE_LEN = [3, 8]


def attention_case(device: torch.device):
    """q [B, H, T, Dh], k/v [B, Hkv, Lmax, Dh] (NaN past each row's tree: never read), cache_len, tree_mask."""
    g = _generator()
    q = _ints(g, -16, 17, (ATT_B, ATT_H, ATT_T, ATT_DH)).to(torch.float32) / 8
    k = _ints(g, -16, 17, (ATT_B, ATT_HKV, ATT_LMAX, ATT_DH)).to(torch.float32) / 8
    v = _ints(g, -16, 17, (ATT_B, ATT_HKV, ATT_LMAX, ATT_DH)).to(torch.float32) / 8
    for b, length in enumerate(ATT_CACHE_LEN):
        k[b, :, length + ATT_T:] = float("nan")
        v[b, :, length + ATT_T:] = float("nan")
    cache_len = torch.tensor(ATT_CACHE_LEN, dtype=torch.int64)
    tree_mask = ancestor_mask(torch.tensor(ATT_PARENTS, dtype=torch.int64))  # [B, T, 1]
    return tuple(t.to(device) for t in (q, k, v, cache_len, tree_mask))


def _check_tree_attention(kernel: Callable, reference: Callable, device: torch.device) -> Optional[str]:
    args = attention_case(device)
    want = reference(*args)
    diff = _first_difference("output", kernel(*args), want, ATTENTION_RTOL, ATTENTION_ATOL)
    return None if diff is None else f"tree_attention: {diff}"


def compact_case(device: torch.device):
    """cache [layers, 2, B, Hkv, Lmax, Dh], cache_len [B], path_nodes [B, P] (-1 past n_keep), n_keep [B]."""
    g = _generator()
    cache = _ints(g, -100, 101, (2, 2, 2, 2, 12, 8)).to(torch.float32) / 4
    cache_len = torch.tensor([3, 5], dtype=torch.int64)
    path_nodes = torch.tensor([[0, 2, 4, -1], [0, 1, 3, 6]], dtype=torch.int64)
    n_keep = torch.tensor([3, 4], dtype=torch.int64)
    return tuple(t.to(device) for t in (cache, cache_len, path_nodes, n_keep))


def _check_compact_kv(kernel: Callable, reference: Callable, device: torch.device) -> Optional[str]:
    cache, cache_len, path_nodes, n_keep = compact_case(device)
    want_cache, got_cache = cache.clone(), cache.clone()  # compact_kv moves K/V in place
    want_len = reference(want_cache, cache_len, path_nodes, n_keep)
    got_len = kernel(got_cache, cache_len, path_nodes, n_keep)
    diff = (_first_difference("new cache_len", got_len, want_len)
            or _first_difference("cache", got_cache, want_cache))
    return None if diff is None else f"compact_kv: {diff}"


# ---- philox_uniform (SPEC §5) ---------------------------------------------------------------------------

def philox_cases(device: torch.device):
    """(seed, c0, c1, c2, c3) calls: broadcast counters, extreme words, 64-bit seeds, scalar counters."""
    i64 = dict(dtype=torch.int64, device=device)
    c0 = torch.tensor([0, 1, 16383, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF], **i64)[:, None]  # [6, 1]
    c1 = torch.tensor([0, 3, 58], **i64)  # [3]
    return [(0, c0, c1, 5, 11), (2**64 - 1, c0, c1, 0xFFFFFFFF, 0xFFFFFFFF), (123456789012345, c1, 3, 5, c0)]


def _check_philox_uniform(kernel: Callable, reference: Callable, device: torch.device) -> Optional[str]:
    for args in philox_cases(device):
        diff = _first_difference("u", kernel(*args), reference(*args))
        if diff is not None:
            return f"philox_uniform (seed {args[0]}): {diff}"
    return None


# ---- continuous_verify (docs/cspd.md) --------------------------------------------------------------------

CV_B, CV_N, CV_C = 3, 4, 3
CONTINUOUS_RTOL = 1e-5
CONTINUOUS_ATOL = 1e-5


def continuous_cases(device: torch.device):
    """(kwargs, label) continuous_verify calls on one block of multiples of 1/8: drafts near and far from the
    target (accepts, residual tries), keys that are not (b, n), an offset that wraps; the exact rule, the
    paper rule with the code's ratio and bandwidth, and a cap of 2 tries that some tokens hit."""
    g = _generator()
    shape = (CV_B, CV_N, CV_C)
    mu_p = _ints(g, -16, 17, shape).to(torch.float32) / 8
    mu_q = mu_p + _ints(g, -4, 5, shape).to(torch.float32) / 8
    sigma_p = _ints(g, 2, 9, shape).to(torch.float32) / 8
    sigma_q = _ints(g, 2, 9, shape).to(torch.float32) / 8
    draft = mu_q + sigma_q * _ints(g, -12, 13, shape).to(torch.float32) / 8
    logsig_p = _ints(g, -16, 17, shape[:2]).to(torch.float32) / 8
    logsig_q = _ints(g, -16, 17, shape[:2]).to(torch.float32) / 8
    block = dict(draft=draft, mu_p=mu_p, sigma_p=sigma_p, mu_q=mu_q, sigma_q=sigma_q, logsig_p=logsig_p,
                 logsig_q=logsig_q, rows=torch.tensor([7, 0, 2**32 - 1]),
                 positions=_ints(g, 0, 4096, shape[:2]), seed=2**64 - 3, offset=2**32 - 3)
    # row 1 of the capped case: q a little wider than p, the draft in q's tail: rejected, and the residual
    # max(0, p - q) / p is small near p's mode, so most tokens use up their 2 tries
    near = dict(block, mu_q=mu_p.clone(), sigma_q=sigma_q.clone(), draft=draft.clone())
    near["sigma_q"][1] = sigma_p[1] * 9 / 8
    near["draft"][1] = mu_p[1] + 4 * near["sigma_q"][1]
    cases = [(dict(block, rule="exact"), "exact"),
             (dict(block, rule="paper", bandwidth=3.0, sigma_ratio="code"), "paper, code ratio"),
             (dict(near, rule="exact", max_tries=2, offset=5), "exact, 2 tries")]
    return [(_to(kwargs, device), label) for kwargs, label in cases]


def _check_continuous_verify(kernel: Callable, reference: Callable, device: torch.device) -> Optional[str]:
    for kwargs, label in continuous_cases(device):
        want = reference(**kwargs)
        got = kernel(**kwargs)
        for field in want._fields:
            if not hasattr(got, field):
                return f"continuous_verify ({label}) returned {type(got).__name__} without a {field} field"
            tol = (CONTINUOUS_RTOL, CONTINUOUS_ATOL) if field == "tokens" else (0.0, 0.0)
            diff = _first_difference(field, getattr(got, field), getattr(want, field), *tol)
            if diff is not None:
                return f"continuous_verify ({label}): {diff}"
    return None


# ---- draft_sample (SPEC §5, "Sampled drafts") -------------------------------------------------------------

DRAFT_PROBS_RTOL = 1e-5


def draft_cases(device: torch.device):
    """(kwargs, label) draft_sample calls on distinct multiples of 1/8: plain settings, guidance with a greedy
    row, top-k and top-p per row, several draws (more than a top-k set holds: +inf keys in token order), row
    keys and node ids that are not (b, n), an offset that wraps."""
    g = _generator()
    B, N, V = 3, 2, 16
    logits = (torch.randperm(B * N * V, generator=g).reshape(B, N, V).to(torch.float32) - 48) / 8
    uncond = (torch.randperm(B * N * V, generator=g).reshape(B, N, V).to(torch.float32) - 48) / 8
    i64 = dict(dtype=torch.int64)
    common = dict(node_ids=torch.tensor([[0, 1], [5, 2**32 - 1], [3, 4]], **i64), seed=2**64 - 5, offset=2**32 - 2)
    cases = [(dict(common, logits=logits, draws=1), "plain"),
             (dict(common, logits=logits, uncond_logits=uncond, cfg_scale=torch.tensor([1.5, 2.0, 0.5]),
                   temperature=torch.tensor([1.0, 0.0, 0.75]), draws=2, rows=torch.tensor([7, 0, 2**32 - 1])),
              "guided, a greedy row"),
             (dict(common, logits=logits, top_k=torch.tensor([3, 0, 2]), top_p=torch.tensor([1.0, 0.5, 0.9]),
                   draws=4), "top-k, top-p, more draws than kept tokens")]
    return [(_to(kwargs, device), label) for kwargs, label in cases]


def _check_draft_sample(kernel: Callable, reference: Callable, device: torch.device) -> Optional[str]:
    for kwargs, label in draft_cases(device):
        want, got = reference(**kwargs), kernel(**kwargs)
        if not isinstance(got, tuple) or len(got) != 2:
            return f"draft_sample ({label}) returned {type(got).__name__}, not (probs, tokens)"
        diff = (_first_difference("tokens", got[1], want.tokens)
                or _first_difference("probs", got[0], want.probs, DRAFT_PROBS_RTOL, 0.0))
        if diff is not None:
            return f"draft_sample ({label}): {diff}"
    return None


# op name -> check(kernel, reference, device) -> None or the first mismatch
CASES: Dict[str, Callable[[Callable, Callable, torch.device], Optional[str]]] = {
    "verify": _check_verify,
    "latent_neighbours": _check_latent_neighbours,
    "tree_attention": _check_tree_attention,
    "compact_kv": _check_compact_kv,
    "philox_uniform": _check_philox_uniform,
    "continuous_verify": _check_continuous_verify,
    "draft_sample": _check_draft_sample,
}
