"""Speculative decoding with tree verification, exact ("spec") or relaxed ("lantern"), for a batch.

Rows advance at different speeds: each verify step emits accept_len[b] + 1 tokens for row b, and every
row stops exactly at the image length L (a row's last step keeps only the tokens it still needs: a
prefix of a valid sample is a valid sample). Everything hot goes through ``lantern.ops``
(tree_attention inside the model, verify, compact_kv, build_tree), so ``lantern.enable_fused()`` swaps
the kernels without touching this loop.

Per row b: n_done[b] image tokens are committed; the last one is the root of the next tree. The target's
cache holds the condition and the committed tokens except the root (its K/V are computed by the verify
forward, as tree node 0); the drafter's cache holds every committed token.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from .. import ops
from .ar import check_length, sample_next
from .trees import DraftScorer, grow_chain, grow_dynamic, grow_static, static_shape, unguided_past_interval

STATIC_WIDTHS = (6, 4, 3, 2, 1, 1)  # 56 nodes with the root


@dataclass
class SpecConfig:
    method: str = "lantern"  # "spec" (exact, δ = 0) | "lantern" (relaxed)
    tree: str = "dynamic"  # "chain" | "static" | "dynamic"
    draft: Optional[str] = None  # "deterministic" | "sampled"; default: dynamic/chain deterministic, static sampled
    depth: int = 5  # draft levels below the root (chain length / EAGLE-2 expansions / static depth from widths)
    top_per_node: int = 10  # EAGLE-2: children per expanded node, and the beam width
    n_nodes: int = 58  # EAGLE-2: drafted nodes kept (plus the root)
    static_widths: Sequence[int] = STATIC_WIDTHS
    k: int = 1000  # neighbours merged at most
    delta: float = 0.1
    lam: Optional[float] = None  # LANTERN++ lambda mode instead of delta
    budget: str = "candidate"

    def draft_kind(self) -> str:
        if self.draft is not None:
            return self.draft
        return "sampled" if self.tree == "static" else "deterministic"


@dataclass
class SpecStats:
    target_forwards: int = 0  # batched target forwards (prefill + one per verify step)
    draft_forwards: int = 0  # batched drafter forwards
    steps: int = 0  # verify steps
    row_steps: int = 0  # sum over rows of the verify steps in which the row was still generating
    emitted: int = 0  # tokens emitted by verify steps (all rows)
    wall_s: float = 0.0
    accept_lens: list = field(default_factory=list)  # per step: accept_len [B] of the active rows

    @property
    def tau(self) -> float:
        """Mean tokens per target forward per row: accepted drafts + 1."""
        return self.emitted / max(self.row_steps, 1)


def _emit_counts(accept_len, n_done, L):
    """Tokens each row keeps from this step: accepted + 1, but never past the image end."""
    return torch.minimum(accept_len + 1, L - n_done).clamp(min=0)


@torch.no_grad()
def generate_spec(target, drafter, cond_idx: torch.Tensor, neighbours: Optional[torch.Tensor] = None, *,
                  config: SpecConfig = SpecConfig(), cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0,
                  seed: int = 0, on_step=None, length: Optional[int] = None, cfg_interval: int = -1):
    """cond_idx [B] (class ids) -> (tokens [B, L] int64, SpecStats). The first token is sampled like AR
    (offset 0); verify step s uses offset s. ``length`` (default: the whole image, block_size) stops every
    row after its first ``length`` tokens, a prefix of the image (tests and benchmarks of the first
    positions). Their law is the full run's; the tokens themselves may differ, since trees near the end
    are clipped. ``cfg_interval`` >= 0: tokens past that index are sampled without guidance, as in
    LlamaGen's AR loop (see ``unguided_past_interval``)."""
    device = target.tok_embeddings.weight.device
    L = check_length(length, target.config.block_size)
    # the loop creates its bookkeeping tensors on the default device; a torch.device context would make it
    # the model's, but it intercepts every torch call (~10 % of a CPU run), so it is entered only when needed
    same = torch.get_default_device() == device
    with contextlib.nullcontext() if same else torch.device(device):
        return _generate(target, drafter, cond_idx, neighbours, config, cfg_scale, temperature, top_k, top_p,
                         seed, on_step, L, cfg_interval)


def _generate(target, drafter, cond_idx, neighbours, config, cfg_scale, temperature, top_k, top_p, seed, on_step,
              L, cfg_interval):
    if config.method not in ("spec", "lantern"):
        raise ValueError(f"method must be 'spec' or 'lantern', got {config.method!r}")
    if config.tree not in ("chain", "static", "dynamic"):
        raise ValueError(f"tree must be 'chain', 'static' or 'dynamic', got {config.tree!r}")
    relaxed = config.method == "lantern"
    if relaxed and config.k > 0 and neighbours is None:
        raise ValueError("method='lantern' needs the neighbour table (lantern.ops.latent_neighbours)")
    t0 = time.perf_counter()
    stats = SpecStats()
    B = cond_idx.shape[0]
    C = target.config.cond_len
    guided = not (isinstance(cfg_scale, (int, float)) and cfg_scale == 1.0)
    cond = target.double_for_cfg(cond_idx) if guided else cond_idx
    rows = cond.shape[0]
    halves = rows // B
    sampled = config.draft_kind() == "sampled"
    shape = static_shape(config.static_widths) if config.tree == "static" else None
    T_max = {"chain": config.depth + 1, "dynamic": config.n_nodes + 1, "static": len(shape or [])}[config.tree]

    # prefill: the condition, then the first token exactly as AR does
    target.setup_cache(rows, C + L + T_max)
    logits, hidden = target(None, cond, cache_len=torch.zeros(rows, dtype=torch.int64), return_hidden=True)
    stats.target_forwards += 1
    lc, lu = (logits[:B, -1], logits[B:, -1]) if guided else (logits[:, -1], None)
    first = sample_next(lc, lu, cfg_scale=cfg_scale, temperature=temperature, top_k=top_k, top_p=top_p,
                        seed=seed, offset=0)
    out = torch.zeros(B, L, dtype=torch.int64)
    out[:, 0] = first
    n_done = torch.ones(B, dtype=torch.int64)
    target_len = torch.full((rows,), C, dtype=torch.int64)
    beams = config.depth * config.top_per_node if config.tree == "dynamic" else 0  # EAGLE-2 partial trees
    drafter.reset(cond, rows, L + max(T_max, beams))
    pending = first[:, None].repeat(halves, 1)  # [rows, P] newly committed tokens, fed to the drafter
    pending_feat = hidden[:, -1:]  # [rows, P, dim] the target hidden state before each of them
    n_pending = torch.ones(rows, dtype=torch.int64)

    def process(draft_logits):  # the drafter's sampling distribution for sampled drafts
        return ops.process_logits(draft_logits, None, 1.0, temperature, top_k, top_p)

    step = 0
    while bool((n_done < L).any()):
        step += 1
        active = n_done < L
        # 1. the drafter caches the committed tokens and scores the root
        pos = (n_done.repeat(halves) - n_pending)[:, None] + torch.arange(pending.shape[1])
        root_logits, root_state = drafter.commit(pending, pending_feat, n_pending, pos.clamp(max=L - 1))
        scorer = DraftScorer(drafter, B, guided, cfg_scale, n_done - 1, L - 1, cfg_interval)
        scorer.forwards = 1
        root_tok = out.gather(1, (n_done - 1)[:, None]).squeeze(1)
        root_logits = scorer.guide(root_logits, n_done)
        # 2. grow the draft tree
        if config.tree == "chain":
            tree = grow_chain(scorer, root_tok, root_logits, root_state, config.depth, sampled, process, seed, step)
        elif config.tree == "static":
            tree = grow_static(scorer, root_tok, root_logits, root_state, shape, process, seed, step)
        else:
            tree = grow_dynamic(scorer, root_tok, root_logits, root_state, config.depth, config.top_per_node,
                                config.n_nodes)
        stats.draft_forwards += tree.draft_forwards
        # 3. one target forward over every row's tree
        T = tree.tokens.shape[1]
        positions = ((n_done - 1)[:, None] + tree.depth).clamp(max=L - 1)
        mask = ops.ancestor_mask(tree.parents)
        rep = lambda x: x.repeat(halves, *([1] * (x.dim() - 1)))  # noqa: E731
        logits, hidden = target(rep(tree.tokens), cache_len=target_len, positions=rep(positions),
                                tree_mask=rep(mask), return_hidden=True)
        stats.target_forwards += 1
        # 4. verify
        uncond = (unguided_past_interval(logits[:B], logits[B:], n_done[:, None] + tree.depth, cfg_interval)
                  if guided else None)
        result = ops.verify(logits[:B], tree.tokens, tree.parents, neighbours if relaxed else None,
                            uncond_logits=uncond, cfg_scale=cfg_scale,
                            temperature=temperature, top_k=top_k, top_p=top_p, draft_probs=tree.draft_probs,
                            k=config.k if relaxed else 0, delta=config.delta if relaxed else 0.0,
                            lam=config.lam if relaxed else None, budget=config.budget if relaxed else "candidate",
                            seed=seed, offset=step)
        # 5. commit: accepted path tokens, then next_token; never past L
        n_emit = torch.where(active, _emit_counts(result.accept_len, n_done, L), 0)  # [B]
        kept_nodes = torch.cat([torch.zeros(B, 1, dtype=torch.int64), result.path.clamp(min=0)], 1)  # [B, T]
        emitted = torch.cat([tree.tokens.gather(1, kept_nodes[:, 1:]), result.next_token[:, None]], 1)
        j = torch.arange(T)
        emitted = torch.where(j[None] < result.accept_len[:, None], emitted, result.next_token[:, None])
        write = j[None] < n_emit[:, None]  # [B, T]; never past L
        row_ids = torch.arange(B)[:, None].expand(B, T)
        out[row_ids[write], (n_done[:, None] + j[None])[write]] = emitted[write]
        # 6. keep the root and accepted nodes' K/V (the root plus n_emit - 1 path nodes)
        target_len = ops.compact_kv(target.kv_cache, target_len, rep(kept_nodes), rep(n_emit))
        # 7. the drafter's next input: the emitted tokens with the target hidden state before each
        width = max(int(n_emit.max()), 1)  # feed the drafter only as many positions as the longest row needs
        pending = rep(emitted[:, :width])
        n_pending = rep(n_emit)
        feat_nodes = rep(kept_nodes[:, :width])[..., None].expand(-1, -1, hidden.shape[-1])
        pending_feat = hidden.gather(1, feat_nodes)
        stats.steps += 1
        stats.row_steps += int(active.sum())
        stats.emitted += int(n_emit.sum())
        stats.accept_lens.append(result.accept_len[active].cpu())
        n_done = n_done + n_emit
        if on_step is not None:
            on_step(n_emit)
    drafter.release()
    target.free_cache()
    stats.wall_s = time.perf_counter() - t0
    return out, stats
