"""Speculative decoding loop: faithfulness (greedy δ = 0 reproduces greedy AR exactly, for every drafter
and tree kind, rows finishing at different steps) and bookkeeping invariants."""
import copy

import pytest
import torch

import lantern
from lantern import _backend, ops
from lantern.decoding import SpecConfig, generate, generate_ar, generate_spec
from lantern.models import build_gpt
from lantern.models.drafter import EagleDrafter, GPTDrafter
from rounding import shape_dependent_rounding


def sharpen(model):
    """Random weights, scaled so the class and the logits matter."""
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    with torch.no_grad():
        model.cls_embedding.embedding_table.weight.mul_(40)
        model.output.weight.mul_(20)
    return model.eval()


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return sharpen(build_gpt("GPT-tiny", block_size=16, n_layer=2))


def drafters(target):
    torch.manual_seed(1)
    return {
        "self": GPTDrafter(copy.deepcopy(target)),  # a perfect drafter: long accepted runs, ragged rows
        "small": GPTDrafter(sharpen(build_gpt("GPT-tiny", block_size=16, n_layer=1))),
        "eagle": EagleDrafter(target.config).bind(target).eval(),
    }


TREES = [SpecConfig(method="spec", tree="chain", depth=4),
         SpecConfig(method="spec", tree="static", static_widths=(3, 2, 1)),
         SpecConfig(method="spec", tree="dynamic", depth=3, top_per_node=4, n_nodes=12)]


@pytest.mark.parametrize("drafter_name", ["self", "small", "eagle"])
@pytest.mark.parametrize("config", TREES, ids=lambda c: c.tree)
def test_greedy_spec_reproduces_greedy_ar(target, drafter_name, config):
    labels = torch.tensor([0, 3, 7, 9, 3])
    want = generate_ar(target, labels, cfg_scale=3.0, temperature=0.0)
    got, stats = generate_spec(target, drafters(target)[drafter_name], labels, config=config, cfg_scale=3.0,
                               temperature=0.0)
    assert torch.equal(got, want)
    assert stats.emitted == labels.shape[0] * (target.config.block_size - 1)
    assert stats.target_forwards == stats.steps + 1


def test_greedy_lantern_with_zero_delta_equals_spec(target):
    labels = torch.tensor([1, 2])
    table = ops.latent_neighbours(torch.randn(target.config.vocab_size, 8), 8)
    exact, _ = generate_spec(target, drafters(target)["self"], labels, config=TREES[2], temperature=0.0)
    relaxed_cfg = SpecConfig(method="lantern", tree="dynamic", depth=3, top_per_node=4, n_nodes=12, k=8, delta=0.0)
    relaxed, _ = generate_spec(target, drafters(target)["self"], labels, table, config=relaxed_cfg, temperature=0.0)
    assert torch.equal(exact, relaxed)


def test_perfect_drafter_accepts_whole_chains_and_rows_stop_at_L(target):
    """A copy of the target drafts exactly what greedy verification wants: every step accepts the whole
    chain, except where a row reaches the image end (its last step is cut to what it still needs)."""
    labels = torch.tensor([4, 5, 6])
    L = target.config.block_size
    out, stats = generate_spec(target, drafters(target)["self"], labels, config=SpecConfig(method="spec", tree="chain",
                               depth=4), temperature=0.0)
    assert out.shape == (3, L)
    assert all(bool((a == 4).all()) for a in stats.accept_lens[:-1])
    assert stats.tau > 4.0


def test_sampled_runs_are_reproducible_and_seed_dependent(target):
    labels = torch.tensor([0, 1])
    table = ops.latent_neighbours(torch.randn(target.config.vocab_size, 8), 8)
    cfg = SpecConfig(method="lantern", tree="static", static_widths=(3, 2, 1), k=8, delta=0.2)
    a, _ = generate_spec(target, drafters(target)["small"], labels, table, config=cfg, cfg_scale=2.0, seed=3)
    b, _ = generate_spec(target, drafters(target)["small"], labels, table, config=cfg, cfg_scale=2.0, seed=3)
    c, _ = generate_spec(target, drafters(target)["small"], labels, table, config=cfg, cfg_scale=2.0, seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_bad_configuration_is_named(target):
    with pytest.raises(ValueError, match="tree"):
        generate_spec(target, drafters(target)["small"], torch.tensor([0]), config=SpecConfig(tree="bush"))
    with pytest.raises(ValueError, match="neighbour"):
        generate_spec(target, drafters(target)["small"], torch.tensor([0]), config=SpecConfig(method="lantern"))


def test_length_stops_every_row_at_the_prefix(target):
    labels = torch.tensor([0, 3, 7])
    full = generate_ar(target, labels, cfg_scale=3.0, temperature=0.0)
    for length in (1, 2, 5):
        got, stats = generate_spec(target, drafters(target)["self"], labels, config=TREES[0], cfg_scale=3.0,
                                   temperature=0.0, length=length)
        assert torch.equal(got, full[:, :length])  # greedy: the prefix of the whole image
        assert stats.emitted == labels.shape[0] * (length - 1)
    with pytest.raises(ValueError, match="length"):
        generate_spec(target, drafters(target)["self"], labels, config=TREES[0], length=0)


@pytest.mark.slow
@pytest.mark.parametrize("cfg_interval", [0, 4, 9])
def test_greedy_spec_with_cfg_interval_reproduces_greedy_ar(target, cfg_interval):
    """Trees straddle the interval's end: nodes predicting tokens past it are verified unguided."""
    labels = torch.tensor([0, 3, 7])
    want = generate_ar(target, labels, cfg_scale=3.0, temperature=0.0, cfg_interval=cfg_interval)
    assert not torch.equal(want, generate_ar(target, labels, cfg_scale=3.0, temperature=0.0))  # it matters
    for drafter_name in ("self", "small"):
        got, _ = generate_spec(target, drafters(target)[drafter_name], labels, config=TREES[2], cfg_scale=3.0,
                               temperature=0.0, cfg_interval=cfg_interval)
        assert torch.equal(got, want)
    unguided, _ = generate_spec(target, drafters(target)["small"], labels, config=TREES[2], temperature=0.0,
                                cfg_interval=cfg_interval)  # no guidance at all: the interval changes nothing
    assert torch.equal(unguided, generate_ar(target, labels, temperature=0.0))


@pytest.mark.slow
@pytest.mark.skipif(not lantern.fused_ops("cpu").get("verify", False), reason="lantern._C is not built")
@torch.no_grad()
def test_fused_loop_is_thread_invariant():
    """LANTERN decoding with the fused cpu ops, one image (B = 1) over a 12293-token vocabulary, at 1 and at 2
    threads: at 2, verify splits each node's vocabulary passes over the threads and tree attention and the
    neighbour table spread their work; the tokens must be the same. The models run in float64 under one-ulp
    rounding by thread count in every product (tests/rounding.py), so the test does not rely on torch's
    matrix products being thread-invariant: a decision could change only if a float32 uniform or a competing
    race key fell within ~1e-16 relative of its threshold (< 1e-8 per decision, < 1e-6 over the run)."""
    V = 3 * 4096 + 5
    torch.manual_seed(3)
    target = sharpen(build_gpt("GPT-tiny", block_size=16, n_layer=1, dim=64, n_head=2, vocab_size=V)).double()
    drafter = EagleDrafter(target.config).bind(target).eval().double()
    codebook = torch.randn(V, 8, generator=torch.Generator().manual_seed(4))
    options = dict(method="lantern", drafter=drafter, tree="dynamic", depth=3, n_nodes=10, top_per_node=3, k=8,
                   delta=0.2, cfg_scale=2.0, temperature=1.0, top_k=200, seed=6)
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with lantern.fused("cpu"), shape_dependent_rounding(threads=True):
                table = ops.latent_neighbours(codebook, 8)
                tokens, stats = generate(target, torch.tensor([3]), neighbours=table, **options)
            runs.append((table, tokens, stats.row_steps))
    finally:
        torch.set_num_threads(before)
    (table1, tokens1, steps1), (table2, tokens2, steps2) = runs
    assert torch.equal(table1, table2) and torch.equal(tokens1, tokens2) and steps1 == steps2
    assert steps1 < target.config.block_size  # drafts were accepted: the tree path ran


def _cpu_kernel_calls_of(run):
    """run() -> (its result, {op: calls of lantern's cpu kernel for op during run}, only ops that ran)."""
    before = _backend.kernel_calls()["ran"]
    out = run()
    after = _backend.kernel_calls()["ran"]
    return out, {op: n - before.get((name, op), 0) for (name, op), n in after.items()
                 if name == "cpu" and n > before.get((name, op), 0)}


@pytest.mark.skipif(not lantern.fused_ops("cpu").get("verify", False), reason="lantern._C is not built")
@pytest.mark.parametrize("start,switch_to", [("reference", "cpu"), ("cpu", "reference")])
def test_a_run_keeps_the_backends_it_started_with(target, start, switch_to):
    """A run resolves its ops' backends once, at its start: a progress callback that switches the default
    (lantern.enable_fused) after the first step changes neither the kernels the rest of the run calls (the cpu
    kernels' call counts: tree_attention inside the model, verify and compact_kv in the loop) nor the tokens.
    Started under cpu, the run calls those kernels (the counts are not vacuous); under the reference, none."""
    labels = torch.tensor([0, 3, 7])
    drafter = drafters(target)["small"]
    config = SpecConfig(method="spec", tree="chain", depth=3)

    def run(on_step=None):
        with lantern.fused(start):  # restores the default on exit, whatever on_step set
            return generate_spec(target, drafter, labels, config=config, cfg_scale=2.0, seed=2, on_step=on_step)[0]

    want, want_calls = _cpu_kernel_calls_of(run)
    switched = []
    got, got_calls = _cpu_kernel_calls_of(lambda: run(lambda _: switched.append(lantern.enable_fused(switch_to))))
    assert len(switched) > 1  # the default changed while the run had steps left
    assert torch.equal(got, want) and got_calls == want_calls
    if start == "cpu":
        assert {"tree_attention", "verify", "compact_kv"} <= set(want_calls)
    else:
        assert want_calls == {}
