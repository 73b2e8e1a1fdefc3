"""What the eager ops of a compiled speculative step cost right after the target's forward, against the same
ops run again at once (warm caches), and after a sweep over a buffer larger than the CPU's L2 (the forward's
pass over the weights without the forward).

    python -m bench.cold_cache [--rows 20] [--nodes 3] [--repeats 200]

The shipped tiny model in its default dtype, the cpu kernels, the target's AOT package (``compile=True``,
docs/compile.md), the thread count torch has. Three of a step's eager pieces at a batch's shapes (rows = model
rows, both guidance halves; nodes per row): the drafter's output head over the rows (``EagleDrafter.logits``),
``ops.verify`` of a chain with LANTERN's relaxation, and ``ops.compact_kv`` of its accepted path. Each round
runs, for each piece, the forward then the piece ("after forward"), the piece twice ("warm": the second
timed), and the sweep then the piece ("after sweep"); the figure is the median over rounds, in microseconds.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import lantern
from lantern import ops
from lantern.decoding import aot

from .bench_speedup import setup
from .common import header

SWEEP_BYTES = 64 << 20  # larger than the L2 of any CPU this runs on


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def pieces(gpt, drafter, table, rows: int, nodes: int) -> dict:
    """name -> a call of that piece at the shapes of ``rows`` model rows of ``nodes`` nodes."""
    B, V, dtype = rows // 2, gpt.config.vocab_size, gpt.tok_embeddings.weight.dtype
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, gpt.config.dim, generator=g).to(dtype)
    logits = torch.randn(rows, nodes, V, generator=g).to(dtype)
    tokens = torch.randint(0, V, (B, nodes), generator=g)
    parents = torch.arange(-1, nodes - 1).expand(B, nodes).contiguous()
    draft_probs = torch.softmax(torch.randn(B, nodes, V, generator=g), -1)
    cache_len = torch.full((rows,), 8)
    path = torch.arange(nodes).expand(rows, nodes).contiguous()
    keep = torch.full((rows,), min(2, nodes))
    return {
        "drafter output head": lambda: drafter.logits(hidden),
        "verify (LANTERN, chain)": lambda: ops.verify(
            logits[:B], tokens, parents, table, uncond_logits=logits[B:], cfg_scale=2.0, draft_probs=draft_probs,
            k=1000, delta=0.1, seed=0, offset=3, backend="cpu"),
        "compact_kv": lambda: ops.compact_kv(gpt.kv_cache, cache_len, path, keep, backend="cpu"),
    }


def run(rows: int = 20, nodes: int = 3, repeats: int = 200) -> dict:
    gpt, drafter, table, _ = setup()
    target = aot.AotTarget(gpt, "cpu")
    gpt.setup_cache(rows, gpt.config.cond_len + gpt.config.block_size + nodes + 8)
    tokens, cache_len = torch.zeros(rows, nodes, dtype=torch.int64), torch.full((rows,), 8)
    forward = lambda: target(tokens, cache_len=cache_len)  # noqa: E731
    sweep_buffer = torch.empty(SWEEP_BYTES // 4)
    sweep = lambda: sweep_buffer.fill_(1.0)  # noqa: E731
    calls = pieces(gpt, drafter, table, rows, nodes)
    times = {(name, when): [] for name in calls for when in ("warm", "after forward", "after sweep")}
    with lantern.fused("cpu"), ops.checks.values_checked_by_caller():
        forward(), sweep()  # the package loaded (or compiled)
        for _ in range(repeats):
            for name, call in calls.items():
                forward()
                times[(name, "after forward")].append(timed(call))
                call()
                times[(name, "warm")].append(timed(call))
                sweep()
                times[(name, "after sweep")].append(timed(call))
    gpt.free_cache()
    medians = {key: 1e6 * statistics.median(ts) for key, ts in times.items()}
    print(f"\n{rows} model rows x {nodes} nodes, {torch.get_num_threads()} threads, {gpt.tok_embeddings.weight.dtype}: "
          f"medians of {repeats} rounds, us")
    print(f"{'piece':<26} {'warm':>8} {'after forward':>14} {'after sweep':>12} {'forward / warm':>15}")
    for name in calls:
        warm, cold, swept = (medians[(name, w)] for w in ("warm", "after forward", "after sweep"))
        print(f"{name:<26} {warm:8.1f} {cold:14.1f} {swept:12.1f} {cold / warm:14.2f}x")
    return {f"{name} / {when}": v for (name, when), v in medians.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    print(header())
    run(args.rows, args.nodes, args.repeats)


if __name__ == "__main__":
    main()
