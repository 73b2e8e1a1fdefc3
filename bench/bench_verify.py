"""verify at LlamaGen shapes (V = 16384, T = 59 dynamic tree, k = 1000, δ = 0.1, CFG 3, top-k 2000) for
B in {1, 8, 64}: the fused CPU kernel (the public op with its argument checks, and the bare
torch.ops.lantern.verify), the vectorised reference, an upstream-style loop (bench/upstream_verify.py: one
candidate at a time, host-side control flow) and a streaming pass over the bytes verify reads
(logits.sum() + uncond.sum(): the memory bound of any method that reads every node). The stream and the
kernel are timed in alternation (the machine's load changes during a run)."""
from __future__ import annotations

import torch

import lantern
from lantern import ops

from .common import Report, cuda_median_seconds, interleaved_medians, median_seconds, triton_rows_skipped
from .upstream_verify import upstream_verify


def dynamic_tree_parents(T: int) -> torch.Tensor:
    """A fixed EAGLE-2-like shape: depth-first chains under a few root children."""
    parents = [-1]
    for i in range(1, T):
        parents.append(0 if i % 6 == 1 else i - 1)
    return torch.tensor(parents)


def inputs(B: int, T: int = 59, V: int = 16384, K: int = 1000):
    """Random logits; a node's i-th child drafts the parent's i-th most likely guided token (distinct
    siblings, as EAGLE-2's top-k expansion gives), so walks go a few levels deep."""
    g = torch.Generator().manual_seed(B)
    logits = torch.randn(B, T, V, generator=g) * 2
    uncond = torch.randn(B, T, V, generator=g) * 2
    parents = dynamic_tree_parents(T).expand(B, T).contiguous()
    ranked = (uncond + 3.0 * (logits - uncond)).topk(10, dim=-1).indices  # [B, T, 10]
    tokens = torch.zeros(B, T, dtype=torch.int64)
    tokens[:, 0] = torch.randint(V, (B,), generator=g)
    seen = {}
    for c in range(1, T):
        par = int(parents[0, c])
        rank = seen.get(par, 0)
        seen[par] = rank + 1
        tokens[:, c] = ranked[:, par, rank % 10]
    neighbours = torch.randint(V, (V, K), generator=g, dtype=torch.int64).to(torch.int32)
    return logits, uncond, tokens, parents, neighbours


SETTINGS = dict(cfg_scale=3.0, top_k=2000, k=1000, delta=0.1, seed=1)


def run(report: Report, quick: bool = False) -> None:
    run_cpu(report, quick)
    run_triton(report, quick)


def run_triton(report: Report, quick: bool = False) -> None:
    """The Triton kernel on a CUDA device against the reference on the same GPU and a streaming pass over
    logits + uncond (the memory bound); CUDA events, the first calls autotune."""
    if triton_rows_skipped("verify"):
        return
    from lantern.ops import verify_op

    triton_verify = verify_op.OP.caller("triton")

    for B in ((1,) if quick else (1, 8, 64)):
        logits, uncond, tokens, parents, neighbours = (t.cuda() for t in inputs(B))
        case = f"B={B} T=59 V=16384 k=1000 cuda"
        args = (logits, tokens, parents, neighbours)
        kernel = lambda: triton_verify(*args, uncond_logits=uncond, **SETTINGS)

        def public():
            return ops.verify(*args, uncond_logits=uncond, **SETTINGS)

        with lantern.fused("reference"):
            want = public()
            report.add("verify", case, "reference (cuda)", cuda_median_seconds(public, repeats=5, warmup=1))
        with lantern.fused("triton"):
            got = public()
            report.add("verify", case, "triton (public op)", cuda_median_seconds(public, repeats=20))
        report.add("verify", case, "triton kernel", cuda_median_seconds(kernel, repeats=20))
        report.add("verify", case, "stream logits+uncond (cuda)",
                   cuda_median_seconds(lambda: (logits.sum(), uncond.sum()), repeats=20))
        agree = all(bool(torch.equal(a, b)) for a, b in zip(want, got))
        report.rows.append(dict(bench="verify", case=case, check="triton == reference", value=agree,
                                mean_accept_len=float(got.accept_len.float().mean())))
        print(f"{'verify':>18} {case:<34} triton == reference: {agree}; mean accept_len "
              f"{float(got.accept_len.float().mean()):.2f}", flush=True)
        for slow in ("reference (cuda)", "triton (public op)", "stream logits+uncond (cuda)"):
            report.ratio("verify", case, slow, "triton kernel")


def run_cpu(report: Report, quick: bool = False) -> None:
    for B in ((1,) if quick else (1, 8, 64)):
        logits, uncond, tokens, parents, neighbours = inputs(B)
        case = f"B={B} T=59 V=16384 k=1000"
        few = 1 if B == 64 else 3

        def public():
            return ops.verify(logits, tokens, parents, neighbours, uncond_logits=uncond, **SETTINGS)

        with lantern.fused("reference"):
            want = public()
            report.add("verify", case, "reference", median_seconds(public, repeats=few, warmup=0 if B == 64 else 1))
        up_rows = min(B, 8)  # the loop's time is linear in B: time 8 rows at most and scale
        up = median_seconds(lambda: upstream_verify(logits[:up_rows], tokens[:up_rows], parents[:up_rows], neighbours,
                                                    uncond_logits=uncond[:up_rows], **SETTINGS), repeats=few, warmup=0)
        report.add("verify", case, "upstream loop", up * B / up_rows, measured_rows=up_rows)
        stream = lambda: (logits.sum(), uncond.sum())
        if not lantern.fused_ops("cpu").get("verify"):
            report.add("verify", case, "stream logits+uncond", median_seconds(stream, repeats=9))
            continue
        from lantern.ops import verify_op

        with lantern.fused("cpu"):
            got = public()
            kernel = lambda: verify_op.OP.caller("cpu")(logits, tokens, parents, neighbours, uncond_logits=uncond,
                                                        **SETTINGS)
            times = interleaved_medians({"stream logits+uncond": stream, "cpu (public op)": public,
                                         "cpu kernel": kernel}, repeats=9)
        for name, t in times.items():
            report.add("verify", case, name, t)
        agree = sum(bool(torch.equal(a, b)) for a, b in zip(want, got)) == 4
        up_len, up_next = upstream_verify(logits[:up_rows], tokens[:up_rows], parents[:up_rows], neighbours,
                                          uncond_logits=uncond[:up_rows], **SETTINGS)
        up_agree = up_len == got.accept_len[:up_rows].tolist() and up_next == got.next_token[:up_rows].tolist()
        report.rows.append(dict(bench="verify", case=case, check="cpu == reference", value=agree,
                                upstream_matches_on_rows=up_rows if up_agree else 0,
                                mean_accept_len=float(got.accept_len.float().mean())))
        print(f"{'verify':>18} {case:<34} cpu == reference: {agree}; upstream loop == cpu on {up_rows} rows: "
              f"{up_agree}; mean accept_len {float(got.accept_len.float().mean()):.2f}", flush=True)
        for slow in ("upstream loop", "reference", "stream logits+uncond", "cpu (public op)"):
            report.ratio("verify", case, slow, "cpu kernel")
