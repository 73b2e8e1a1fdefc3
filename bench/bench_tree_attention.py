"""tree_attention (the verification forward, one layer): the CPU kernel (public op with its checks, and the
bare torch.ops.lantern.tree_attention) against scaled_dot_product_attention with a dense boolean mask
(built once, outside the timing) and the reference, at L in {256, 1024}, T = 64, H = 16, Dh = 64, B = 2; and
at the shipped tiny model's decoding shapes (20 model rows: batch 10 with guidance, 4 heads, Dh 64, bfloat16,
T = 1 (an AR step) and 3 (a chain of 2) after 33 and 60 cached positions), where a work item has at most 4
query rows (the kernel's dot-product path). SDPA and the kernel are timed in alternation (the machine's load
changes during a run)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import lantern
from lantern import ops
from lantern.ops.reference.tree_attention import attention_mask

from .bench_verify import dynamic_tree_parents
from .common import Report, cuda_median_seconds, interleaved_medians, median_seconds, triton_rows_skipped


def inputs(L: int, B: int = 2, H: int = 16, T: int = 64, Dh: int = 64):
    """q [B, H, T, Dh], k, v [B, H, L + T, Dh], cache_len [B] (= L), tree_mask [B, T, 2] (a dynamic tree)."""
    g = torch.Generator().manual_seed(L)
    q = torch.randn(B, H, T, Dh, generator=g)
    k = torch.randn(B, H, L + T, Dh, generator=g)
    v = torch.randn(B, H, L + T, Dh, generator=g)
    cache_len = torch.full((B,), L, dtype=torch.int64)
    tree_mask = ops.ancestor_mask(dynamic_tree_parents(T).expand(B, T).contiguous())
    return q, k, v, cache_len, tree_mask


def run(report: Report, quick: bool = False) -> None:
    run_cpu(report, quick)
    run_cpu_decode(report, quick)
    run_triton(report, quick)


def decode_inputs(L: int, T: int, rows: int = 20, H: int = 4, Dh: int = 64, dtype=torch.bfloat16):
    """The tiny model's shapes: q [rows, H, T, Dh], a cache k, v [rows, H, L + T + 4, Dh] with L positions
    before the T nodes of a chain, cache_len [rows] (= L), the chain's mask."""
    g = torch.Generator().manual_seed(L + T)
    q = torch.randn(rows, H, T, Dh, generator=g).to(dtype)
    k = torch.randn(rows, H, L + T + 4, Dh, generator=g).to(dtype)
    v = torch.randn(rows, H, L + T + 4, Dh, generator=g).to(dtype)
    cache_len = torch.full((rows,), L, dtype=torch.int64)
    tree_mask = ops.ancestor_mask(torch.arange(-1, T - 1).expand(rows, T).contiguous())
    return q, k, v, cache_len, tree_mask


def run_cpu_decode(report: Report, quick: bool = False) -> None:
    """The decoding shapes (module doc): the bare cpu kernel against SDPA with the dense mask, alternated."""
    if not lantern.fused_ops("cpu").get("tree_attention"):
        return
    for L in ((33,) if quick else (33, 60)):
        for T in (1, 3):
            q, k, v, cache_len, tree_mask = decode_inputs(L, T)
            dense = attention_mask(cache_len, tree_mask, T, k.shape[2])[:, None]  # [rows, 1, T, Lmax] bool
            case = f"decode L={L} T={T} H=4 Dh=64 rows=20 bf16"
            sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)  # noqa: E731
            with lantern.fused("cpu"):
                kernel = lambda: torch.ops.lantern.tree_attention(q, k, v, cache_len, tree_mask)  # noqa: E731
                times = interleaved_medians({"sdpa dense mask": sdpa, "cpu kernel": kernel}, repeats=15)
                err = float((kernel().float() - sdpa().float()).abs().max())
            for name, t in times.items():
                report.add("tree_attention", case, name, t)
            report.check("tree_attention", case, "max |cpu - sdpa|", err, f"{err:.2e}")
            report.ratio("tree_attention", case, "sdpa dense mask", "cpu kernel")


def run_triton(report: Report, quick: bool = False) -> None:
    """On a CUDA device, bfloat16 and float32: the Triton kernel (through the public op, and bare) against
    SDPA with the dense mask and the reference on the same GPU; max |triton - sdpa|."""
    if triton_rows_skipped("tree_attention"):
        return
    from lantern.ops import tree_attention_op

    triton_kernel = tree_attention_op.OP.caller("triton")

    B, H, T, Dh = 2, 16, 64, 64
    for L in ((256,) if quick else (256, 1024)):
        for dtype in (torch.bfloat16, torch.float32):
            q, k, v, cache_len, tree_mask = (t.cuda() for t in inputs(L, B, H, T, Dh))
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            dense = attention_mask(cache_len, tree_mask, T, L + T)[:, None]  # [B, 1, T, Lmax] bool
            case = f"L={L} T={T} H={H} Dh={Dh} B={B} cuda {str(dtype).replace('torch.', '')}"
            sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)  # noqa: E731
            with lantern.fused("reference"):
                report.add("tree_attention", case, "reference (cuda)",
                           cuda_median_seconds(lambda: ops.tree_attention(q, k, v, cache_len, tree_mask)))
            report.add("tree_attention", case, "sdpa dense mask (cuda)", cuda_median_seconds(sdpa))
            with lantern.fused("triton"):
                got = ops.tree_attention(q, k, v, cache_len, tree_mask)
                report.add("tree_attention", case, "triton (public op)",
                           cuda_median_seconds(lambda: ops.tree_attention(q, k, v, cache_len, tree_mask)))
            report.add("tree_attention", case, "triton kernel",
                       cuda_median_seconds(lambda: triton_kernel(q, k, v, cache_len, tree_mask)))
            err = float((got.float() - sdpa().float()).abs().max())
            report.check("tree_attention", case, "max |triton - sdpa|", err, f"{err:.2e}")
            for slow in ("sdpa dense mask (cuda)", "reference (cuda)", "triton (public op)"):
                report.ratio("tree_attention", case, slow, "triton kernel")


def run_cpu(report: Report, quick: bool = False) -> None:
    B, H, T, Dh = 2, 16, 64, 64
    for L in ((256,) if quick else (256, 1024)):
        Lmax = L + T
        q, k, v, cache_len, tree_mask = inputs(L, B, H, T, Dh)
        dense = attention_mask(cache_len, tree_mask, T, Lmax)[:, None]  # [B, 1, T, Lmax] bool
        case = f"L={L} T={T} H={H} Dh={Dh} B={B}"
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        with lantern.fused("reference"):
            report.add("tree_attention", case, "reference",
                       median_seconds(lambda: ops.tree_attention(q, k, v, cache_len, tree_mask), repeats=5))
        if not lantern.fused_ops("cpu").get("tree_attention"):
            report.add("tree_attention", case, "sdpa dense mask", median_seconds(sdpa, repeats=9))
            continue
        with lantern.fused("cpu"):
            got = ops.tree_attention(q, k, v, cache_len, tree_mask)
            public = lambda: ops.tree_attention(q, k, v, cache_len, tree_mask)
            kernel = lambda: torch.ops.lantern.tree_attention(q, k, v, cache_len, tree_mask)
            times = interleaved_medians({"sdpa dense mask": sdpa, "cpu (public op)": public, "cpu kernel": kernel},
                                        repeats=15)
            threads = torch.get_num_threads()  # one thread too: less exposed to a loaded machine's scheduling
            torch.set_num_threads(1)
            try:
                single = interleaved_medians({"sdpa dense mask (1 thread)": sdpa, "cpu kernel (1 thread)": kernel},
                                             repeats=15)
            finally:
                torch.set_num_threads(threads)
        for name, t in {**times, **single}.items():
            report.add("tree_attention", case, name, t)
        err = float((got - sdpa()).abs().max())
        report.check("tree_attention", case, "max |cpu - sdpa|", err, f"{err:.2e}")
        for slow in ("sdpa dense mask", "reference", "cpu (public op)"):
            report.ratio("tree_attention", case, slow, "cpu kernel")
        report.ratio("tree_attention", case, "sdpa dense mask (1 thread)", "cpu kernel (1 thread)")
