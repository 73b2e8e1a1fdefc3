"""The public ops' argument checks (each op module's ``check``, run before every backend) against the
kernels they guard, at LlamaGen shapes: check_verify with the neighbour table already validated (what
decoding sees: the same table every call) and with it scanned again (first call / after an edit), and
check_tree_attention. Also unpack_bits (used by check_tree_attention) as now (index_select) against the
advanced indexing it replaced, timed in alternation."""
from __future__ import annotations

import torch

import lantern
from lantern.ops.verify_op import _NEIGHBOUR_TABLES

from .bench_tree_attention import inputs as attention_inputs
from .bench_verify import SETTINGS
from .bench_verify import inputs as verify_inputs
from .common import Report, interleaved_medians


def check_verify_args(logits, tokens, parents, neighbours, uncond):
    s = SETTINGS
    return (logits, tokens, parents, neighbours, uncond, s["cfg_scale"], 1.0, s["top_k"], 1.0, None, s["k"],
            s["delta"], None, "candidate", s["seed"], 0)


def unpack_bits_advanced_indexing(words: torch.Tensor, T: int) -> torch.Tensor:
    """unpack_bits as it was before (words[..., j // 32]), kept here as the 'before' of the comparison."""
    j = torch.arange(T, device=words.device)
    return ((words[..., j // 32] >> (j % 32)) & 1).bool()


def run(report: Report, quick: bool = False) -> None:
    if not lantern.fused_ops("cpu").get("verify"):
        print("checks: the cpu backend is unavailable; skipped", flush=True)
        return
    from lantern.ops import tree_attention_op, verify_op
    from lantern.ops.reference.tree import unpack_bits

    logits, uncond, tokens, parents, neighbours = verify_inputs(1)
    args = check_verify_args(logits, tokens, parents, neighbours, uncond)

    def scanned():
        _NEIGHBOUR_TABLES.entries.clear()
        verify_op.check(*args)

    case = "verify B=1 T=59 V=16384 k=1000"
    times = interleaved_medians({
        "check_verify (table cached)": lambda: verify_op.check(*args),
        "check_verify (table scanned)": scanned,
        "cpu kernel": lambda: verify_op.OP.caller("cpu")(logits, tokens, parents, neighbours, uncond_logits=uncond,
                                               **SETTINGS),
    }, repeats=5 if quick else 15)
    for name, t in times.items():
        report.add("checks", case, name, t)
    report.ratio("checks", case, "check_verify (table scanned)", "check_verify (table cached)")
    report.ratio("checks", case, "check_verify (table cached)", "cpu kernel")

    for L in (256,) if quick else (256, 1024):
        q, k_cache, v_cache, cache_len, mask = attention_inputs(L)
        case = f"tree_attention L={L} T=64"
        T = q.shape[2]
        times = interleaved_medians({
            "unpack_bits [..., j // 32]": lambda: unpack_bits_advanced_indexing(mask, 32 * mask.shape[-1]),
            "unpack_bits index_select": lambda: unpack_bits(mask, 32 * mask.shape[-1]),
            "check_tree_attention": lambda: tree_attention_op.check(q, k_cache, v_cache, cache_len, mask),
            "cpu kernel": lambda: tree_attention_op.OP.caller("cpu")(q, k_cache, v_cache, cache_len, mask),
        }, repeats=5 if quick else 15)
        assert torch.equal(unpack_bits(mask, T), unpack_bits_advanced_indexing(mask, T))
        for name, t in times.items():
            report.add("checks", case, name, t)
        report.ratio("checks", case, "unpack_bits [..., j // 32]", "unpack_bits index_select")
        report.ratio("checks", case, "check_tree_attention", "cpu kernel")
