"""compile=True against eager on the CPU (python/lantern/decoding/compiled.py), batch 1 with guidance (2 rows),
random weights, fused cpu ops, one thread: the target's AR step forward (1 node), its tree forward (16 nodes),
the drafter's expansion (16 nodes), and whole decodes (AR; LANTERN with a dynamic tree). Medians of
interleaved repeats after a warm-up that compiles every graph (the one-off compile time is printed apart).

    OMP_NUM_THREADS=1 python -m bench.bench_compile [--quick] [--big]

--big adds the 16-layer dim-256 model (GPT-tiny's shape with 16 layers); the default is a 2-layer dim-64 one."""
from __future__ import annotations

import argparse

import torch

import lantern
from lantern import ops
from lantern.decoding import SpecConfig, generate_ar, generate_spec
from lantern.decoding.compiled import CompileStats, compile_options, compiled_models
from lantern.models import build_gpt
from lantern.models.drafter import EagleDrafter
from lantern.ops.reference.tree import ancestor_mask

from .common import interleaved_medians

SHAPES = {
    "small (2 layers, dim 64, V 64, 16 tokens)": dict(n_layer=2, n_head=2, dim=64, vocab_size=64, num_classes=5,
                                                      block_size=16),
    "16 layers, dim 256, V 1024, 64 tokens": dict(n_layer=16, n_head=4, dim=256, vocab_size=1024, num_classes=10,
                                                  block_size=64),
}


def models(shape: dict):
    torch.manual_seed(0)
    target = build_gpt("GPT-tiny", **shape).eval()
    drafter = EagleDrafter(target.config).bind(target).eval()
    for p in (*target.parameters(), *drafter.parameters()):
        torch.nn.init.normal_(p, std=0.05)
    return target, drafter


def forward_cases(target, drafter, compiled_target, compiled_drafter):
    """name -> (eager fn, compiled fn): the forwards of one decoding step at batch 1 with guidance."""
    rows, T = 2, 16
    C = target.config.cond_len
    target.setup_cache(rows, C + target.config.block_size + 64)
    target(None, torch.tensor([1, target.config.num_classes]), cache_len=torch.zeros(rows, dtype=torch.int64))
    drafter.reset(None, rows, target.config.block_size + 64)
    cache_len = torch.full((rows,), C + 8)
    torch.manual_seed(1)
    parents = torch.cat([torch.tensor([-1]), (torch.rand(T - 1) * torch.arange(1, T)).long()]).expand(rows, T)
    tokens = torch.randint(0, target.config.vocab_size, (rows, T))
    positions = torch.arange(T).expand(rows, T) % target.config.block_size
    mask = ancestor_mask(parents)
    one = tokens[:, :1].contiguous()
    partial = (parents[:, 1:] - 1).contiguous()  # the drafter's partial tree below the root (15 nodes)
    state = torch.randn(rows, T - 1, target.config.dim)

    def tree(model):
        return lambda: model(tokens, cache_len=cache_len, positions=positions, tree_mask=mask, return_hidden=True)

    def step(model):
        return lambda: model(one, cache_len=cache_len, return_hidden=True)

    def expand(d):
        return lambda: d.expand(tokens[:, 1:], partial, state, positions[:, 1:])

    return {"target AR step (1 node)": (step(target), step(compiled_target)),
            "target tree (16 nodes)": (tree(target), tree(compiled_target)),
            "drafter expand (15 nodes -> 16)": (expand(drafter), expand(compiled_drafter))}


def decode_cases(target, drafter, neighbours, compile):
    label = torch.tensor([1])
    kw = dict(cfg_scale=2.0, temperature=1.0, seed=0)
    config = dict(method="lantern", tree="dynamic", depth=4, n_nodes=15, top_per_node=4, k=8, delta=0.1)

    def ar(c):
        return lambda: generate_ar(target, label, compile=c, **kw)

    def spec(c):
        return lambda: generate_spec(target, drafter, label, neighbours, config=SpecConfig(**config, compile=c), **kw)

    return {"decode AR": (ar(False), ar(compile)), "decode LANTERN dynamic 16 nodes": (spec(False), spec(compile))}


def print_medians(cases, repeats: int) -> None:
    fns = {}
    for case, (eager, compiled) in cases.items():
        fns[(case, "eager")] = eager
        fns[(case, "compiled")] = compiled
    medians = interleaved_medians(fns, repeats=repeats, warmup=1)
    for case in cases:
        e, c = medians[(case, "eager")], medians[(case, "compiled")]
        print(f"  {case:<34} {1e3 * e:10.2f} {1e3 * c:12.2f} {e / c:14.2f}x")


@torch.no_grad()
def run_shape(name: str, shape: dict, repeats: int) -> None:
    target, drafter = models(shape)
    neighbours = ops.latent_neighbours(torch.randn(target.config.vocab_size, 8), 8)
    options = compile_options(True, torch.device("cpu"))
    stats = CompileStats()
    compiled_target, compiled_drafter = compiled_models(target, drafter, options, stats)
    forwards = forward_cases(target, drafter, compiled_target, compiled_drafter)
    for _, fn in forwards.values():
        fn()  # compiles
    decode_stats = {}
    generate_ar(target, torch.tensor([1]), compile=True, stats=decode_stats, cfg_scale=2.0)
    decodes = decode_cases(target, drafter, neighbours, True)
    _, spec_stats = decodes["decode LANTERN dynamic 16 nodes"][1]()
    print(f"\n{name}: one-off compile (calls that compiled a graph): forwards {stats.compile_s:.1f}s / "
          f"{stats.graphs} graphs; AR decode {decode_stats['compile_s']:.1f}s / {decode_stats['compiled_graphs']} "
          f"graphs; LANTERN decode {spec_stats.compile_s:.1f}s / {spec_stats.compiled_graphs} more graphs")
    print(f"  {'case':<34} {'eager ms':>10} {'compiled ms':>12} {'eager/compiled':>15}")
    forwards = forward_cases(target, drafter, compiled_target, compiled_drafter)  # fresh caches
    print_medians(forwards, repeats)
    target.free_cache()
    drafter.release()
    print_medians(decodes, max(3, repeats // 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--big", action="store_true", help="also the 16-layer dim-256 model")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lantern.enable_fused("cpu")
    print(f"torch {torch.__version__}, 1 thread, fused cpu ops, batch 1 with guidance (2 rows), random weights")
    for i, (name, shape) in enumerate(SHAPES.items()):
        if i == 0 or args.big:
            run_shape(name, shape, repeats=5 if args.quick else 11)


if __name__ == "__main__":
    main()
