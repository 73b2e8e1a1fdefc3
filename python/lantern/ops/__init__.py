"""Public ops. Each validates its arguments (so every backend raises the same errors), then runs the
active backend's implementation (see ``lantern.enable_fused``), a torch.library op (``library``,
docs/dispatch.md). Semantics: docs/SPEC.md."""
from __future__ import annotations

from typing import Optional, Union

import torch

from .. import _backend
from . import checks, library
from . import reference  # noqa: F401  (registers the reference implementations)
from .reference.continuous_verify import DEFAULT_MAX_TRIES, ContinuousVerifyResult
from .reference.verify import VerifyResult

library.reference_ops()  # declares lantern_reference::<op> now, not while torch.compile traces

__all__ = [
    "VerifyResult",
    "process_logits",
    "latent_neighbours",
    "verify",
    "philox_uniform",
    "ancestor_mask",
    "build_tree",
    "tree_attention",
    "compact_kv",
    "ContinuousVerifyResult",
    "continuous_verify",
]

ScalarOrTensor = Union[int, float, torch.Tensor]


def process_logits(logits, uncond_logits=None, cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0):
    """§1: guidance, temperature, top-k, top-p -> float32 probabilities ``[..., V]``."""
    cfg_scale, temperature, top_k, top_p = map(checks.plain, (cfg_scale, temperature, top_k, top_p))
    checks.check_process_logits(logits, uncond_logits, cfg_scale, temperature, top_k, top_p)
    impl = _backend.dispatch("process_logits", logits.device)
    return impl(logits, uncond_logits, cfg_scale, temperature, top_k, top_p)


def latent_neighbours(codebook: torch.Tensor, K: int, normalize: bool = False) -> torch.Tensor:
    """§2: int32 ``[V, K]``, the K nearest other codes of each code, nearest first."""
    K = checks.plain(K)
    checks.check_latent_neighbours(codebook, K, normalize)
    impl = _backend.dispatch("latent_neighbours", codebook.device)
    return impl(codebook, K, normalize)


def verify(
    logits,
    tokens,
    parents,
    neighbours=None,
    *,
    uncond_logits=None,
    cfg_scale=1.0,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    draft_probs=None,
    k: int = 0,
    delta: float = 0.0,
    lam: Optional[float] = None,
    budget: str = "candidate",
    seed: ScalarOrTensor = 0,
    offset: ScalarOrTensor = 0,
    rows: Optional[torch.Tensor] = None,
) -> VerifyResult:
    """§3-5: verify a batch of draft trees in one call (see ``reference.verify`` for the definition).
    rows [B] (integer, values in [0, 2^32)): the Philox counter's row word of each row (default b), e.g. the
    image ids, so that a row's draws do not depend on its place in the batch."""
    cfg_scale, temperature, top_k, top_p, k, delta, lam, seed, offset = map(
        checks.plain, (cfg_scale, temperature, top_k, top_p, k, delta, lam, seed, offset))
    checks.check_verify(
        logits, tokens, parents, neighbours, uncond_logits, cfg_scale, temperature, top_k, top_p,
        draft_probs, k, delta, lam, budget, seed, offset, rows,
    )
    impl = _backend.dispatch("verify", logits.device)
    return impl(
        logits, tokens, parents, neighbours, uncond_logits=uncond_logits, cfg_scale=cfg_scale,
        temperature=temperature, top_k=top_k, top_p=top_p, draft_probs=draft_probs, k=k, delta=delta,
        lam=lam, budget=budget, seed=seed, offset=offset, rows=rows,
    )


def philox_uniform(seed, c0, c1, c2, c3) -> torch.Tensor:
    """§5: float32 uniforms in [0, 1) from Philox4x32-10 word 0; counters broadcast."""
    seed, c0, c1, c2, c3 = map(checks.plain, (seed, c0, c1, c2, c3))
    device = checks.check_philox(seed, c0, c1, c2, c3)
    impl = _backend.dispatch("philox_uniform", device)
    return impl(seed, c0, c1, c2, c3)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """§6: int32 ``[B, T, ceil(T/32)]``; bit j of node i is set iff j is i or an ancestor of i."""
    checks.check_parents(parents, "parents")
    impl = _backend.dispatch("ancestor_mask", parents.device)
    return impl(parents)


def build_tree(cand_tokens, cand_parents, cand_scores, root_token, n_nodes: int):
    """EAGLE-2 tree selection: the ``n_nodes`` best candidates (by cumulative draft log-probability)
    plus the root, as ``(tokens [B, n_nodes+1], parents [B, n_nodes+1])`` in topological order."""
    n_nodes = checks.plain(n_nodes)
    checks.check_build_tree(cand_tokens, cand_parents, cand_scores, root_token, n_nodes)
    impl = _backend.dispatch("build_tree", cand_tokens.device)
    return impl(cand_tokens, cand_parents, cand_scores, root_token, n_nodes)


def tree_attention(q, k_cache, v_cache, cache_len, tree_mask) -> torch.Tensor:
    """§6: attention of T tree queries over each row's cached prefix plus its ancestors in the tree."""
    checks.check_tree_attention(q, k_cache, v_cache, cache_len, tree_mask)
    impl = _backend.dispatch("tree_attention", q.device)
    return impl(q, k_cache, v_cache, cache_len, tree_mask)


def compact_kv(cache, cache_len, path_nodes, n_keep) -> torch.Tensor:
    """§6: in place, move the kept tree nodes' K/V (all layers) to consecutive positions from
    ``cache_len``; returns the new lengths ``cache_len + n_keep``."""
    checks.check_compact_kv(cache, cache_len, path_nodes, n_keep)
    impl = _backend.dispatch("compact_kv", cache.device)
    return impl(cache, cache_len, path_nodes, n_keep)


def continuous_verify(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rule: str = "exact",
                      bandwidth: float = 1.0, sigma_ratio: str = "paper", max_tries: int = DEFAULT_MAX_TRIES,
                      seed: ScalarOrTensor = 0, offset: ScalarOrTensor = 0, *, rows=None,
                      positions=None) -> ContinuousVerifyResult:
    """docs/cspd.md: accept or resample a block of B x N drafted continuous tokens in one call ->
    (tokens [B, N, C], accepted [B, N] bool, tries [B, N] int32; tries > max_tries: the residual sampler hit
    its cap and kept a target sample). draft and both heads' last-step means / stds [B, N, C] float32, the
    log-std sums over the non-final steps [B, N]; rule "exact" | "paper" (bandwidth, sigma_ratio "paper" |
    "code"); Philox keys rows [B] and positions [B, N] (default b and n). See
    ``reference.continuous_verify`` for the definition."""
    bandwidth, max_tries, seed, offset = map(checks.plain, (bandwidth, max_tries, seed, offset))
    checks.check_continuous_verify(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rule, bandwidth,
                                   sigma_ratio, max_tries, seed, offset, rows, positions)
    impl = _backend.dispatch("continuous_verify", draft.device)
    return impl(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rule, bandwidth, sigma_ratio, max_tries,
                seed, offset, rows=rows, positions=positions)
