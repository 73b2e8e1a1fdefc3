"""compile=True (python/lantern/decoding/compiled.py): the decoding loops with their forwards compiled give
the eager loops' tokens (AR and speculative, greedy and sampled), node counts padded to buckets change no
real node's result, and a run compiles at most one graph per bucket and forward kind (none on a rerun)."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch._dynamo.utils import counters

import lantern
from lantern import ops
from lantern.decoding import SpecConfig, generate, generate_ar, generate_spec
from lantern.decoding.compiled import BUCKETS, CompiledTarget, bucket, pad_tree_mask
from lantern.models import build_gpt
from lantern.ops.reference.tree import ancestor_mask
from tiny_random_models import StubVQ, small_models

AOT = {"backend": "aot_eager"}  # the padding and wrapping, without inductor's compile time
SPEC = dict(method="lantern", k=4, delta=0.2, depth=3, n_nodes=8, top_per_node=3)


@pytest.fixture(autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    if lantern.fused_ops("cpu").get("verify", False):
        lantern.enable_fused("cpu")
    yield
    torch.set_num_threads(threads)
    lantern.disable_fused()


def neighbours():
    torch.manual_seed(1)
    return ops.latent_neighbours(torch.randn(64, 4), 4)


def unique_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_buckets():
    assert [bucket(n) for n in (1, 2, 4, 5, 9, 17, 33, 59, 64, 65, 200)] == [1, 4, 4, 8, 16, 32, 64, 64, 64, 128,
                                                                            256]


@pytest.mark.parametrize("T, T_pad", [(5, 8), (30, 64), (40, 64), (33, 33)])
def test_padded_tree_mask_is_the_mask_of_the_tree_with_padding_nodes(T, T_pad):
    """Padding nodes (parent -1, SPEC §3) see themselves only; the real nodes' bits are unchanged."""
    torch.manual_seed(T)
    parents = torch.stack([torch.cat([torch.tensor([-1]), (torch.rand(T - 1) * torch.arange(1, T)).long()])
                           for _ in range(3)])  # [3, T] topologically ordered trees
    padded_parents = torch.cat([parents, torch.full((3, T_pad - T), -1)], 1)
    assert torch.equal(pad_tree_mask(ancestor_mask(parents), T_pad), ancestor_mask(padded_parents))


@torch.no_grad()
def test_padded_tree_forward_gives_the_real_nodes_results():
    """The compiled tree forward (eager backend: dynamo only) pads 5 nodes to 8: same logits and hidden
    states as the unpadded eager forward, and the same cache for the real nodes."""
    target, _ = small_models()
    target.setup_cache(2, 40)
    target(None, torch.tensor([1, 2]), cache_len=torch.zeros(2, dtype=torch.int64))
    cache_len = torch.tensor([1, 3])
    parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 0]])
    tokens = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]])
    positions = torch.tensor([[0, 1, 1, 2, 2], [2, 3, 4, 5, 3]])
    before = target.kv_cache.clone()
    want = target(tokens, cache_len=cache_len, positions=positions, tree_mask=ancestor_mask(parents),
                  return_hidden=True)
    want_cache = target.kv_cache.clone()
    target.kv_cache.copy_(before)
    got = CompiledTarget(target, {"backend": "eager"})(tokens, cache_len=cache_len, positions=positions,
                                                       tree_mask=ancestor_mask(parents), return_hidden=True)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for row, start in enumerate(cache_len.tolist()):
        real = slice(0, start + 5)
        torch.testing.assert_close(target.kv_cache[:, :, row, :, real], want_cache[:, :, row, :, real])


def spec_run(target, drafter, tree: str, temperature: float, compile, method: str = "lantern"):
    config = SpecConfig(**dict(SPEC, method=method), tree=tree, compile=compile)
    return generate_spec(target, drafter, torch.tensor([1, 3, 4]), neighbours(), config=config, cfg_scale=2.0,
                         temperature=temperature, seed=3)


@pytest.mark.slow  # torch.compile: ~10 s of CPU per case
@pytest.mark.parametrize("tree", ["chain", "dynamic", "static"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@torch.no_grad()
def test_compiled_speculative_loop_gives_the_eager_tokens(tree, temperature):
    target, drafter = small_models()
    want, _ = spec_run(target, drafter, tree, temperature, False)
    before = unique_graphs()
    got, stats = spec_run(target, drafter, tree, temperature, AOT)
    assert torch.equal(got, want)
    # one graph per (forward kind, bucket): the drafter's catch-up and expansions, the target's tree forward
    # (none where an earlier test compiled the same shapes: the graphs are per shape, not per model)
    assert stats.compiled_graphs == unique_graphs() - before <= 3 * len(BUCKETS)
    assert (stats.compile_s > 0) == (stats.compiled_graphs > 0)
    again, rerun = spec_run(target, drafter, tree, temperature, AOT)  # the graphs are reused
    assert torch.equal(again, want) and rerun.compiled_graphs == 0 and unique_graphs() == before + stats.compiled_graphs


@pytest.mark.slow  # torch.compile: ~10 s of CPU per case
@torch.no_grad()
def test_compiled_auto_tree_loop_gives_the_eager_tokens_and_compiles_a_graph_per_bucket():
    """tree="auto" with a fixed cost model (reproducible plans): AR steps and several tree sizes in one run
    (a single row: a batch holds one plan for its run)."""
    from lantern.decoding import CostModel, Plan

    target, drafter = small_models()
    plans = [Plan("ar", "ar"), Plan("chain2", "chain", depth=2), Plan("tree6", "dynamic", depth=2, n_nodes=5,
                                                                       top_per_node=3)]
    points = {"ar": {2: 1.0, 16: 1.0}, "chain2": {2: 1.1, 16: 1.1}, "tree6": {2: 1.2, 16: 1.2}}
    cost = CostModel(points, {"source": "test"})
    kw = dict(method="spec", tree="auto", cost_model=cost, plans=plans, adapt_costs=False, depth=2)
    runs = []
    for compile in (False, AOT):
        before = unique_graphs()
        tokens, stats = generate_spec(target, drafter, torch.tensor([2]), config=SpecConfig(**kw, compile=compile),
                                      cfg_scale=1.5, temperature=1.0, seed=5)
        runs.append((tokens, stats, unique_graphs() - before))
    (want, eager_stats, _), (got, stats, graphs) = runs
    assert torch.equal(got, want) and stats.plan_counts == eager_stats.plan_counts
    assert len(stats.plan_counts) >= 2, stats.plan_counts
    assert stats.compiled_graphs == graphs <= 4 * len(BUCKETS)


@pytest.mark.slow  # torch.compile: ~10 s of CPU per case
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@torch.no_grad()
def test_compiled_ar_gives_the_eager_tokens(temperature):
    target, _ = small_models()
    kw = dict(cfg_scale=2.0, temperature=temperature, seed=2)
    want = generate_ar(target, torch.tensor([0, 4]), **kw)
    before, stats = unique_graphs(), {}
    got = generate_ar(target, torch.tensor([0, 4]), compile=AOT, stats=stats, **kw)
    assert torch.equal(got, want)
    assert stats["compiled_graphs"] == unique_graphs() - before <= 1  # one token per step: one shape
    assert torch.equal(generate(target, torch.tensor([0, 4]), method="ar", compile=AOT, **kw)[0], want)


@pytest.mark.parametrize("compile, error", [("yes", ValueError), (1.5, TypeError), ([True], TypeError)])
def test_compile_option_is_checked(compile, error):
    target, drafter = small_models()
    with pytest.raises(error, match="compile must be"):
        generate_ar(target, torch.tensor([0]), compile=compile, length=2)
    with pytest.raises(error, match="compile must be"):
        generate(target, torch.tensor([0]), method="lantern", drafter=drafter, neighbours=neighbours(), k=4,
                 compile=compile, length=2)


@pytest.mark.slow
@torch.no_grad()
def test_inductor_loops_give_the_eager_tokens():
    """compile=True itself (inductor on the CPU): AR and speculative decoding, greedy and sampled."""
    target, drafter = small_models()
    for temperature in (0.0, 1.0):
        kw = dict(cfg_scale=2.0, temperature=temperature, seed=2)
        assert torch.equal(generate_ar(target, torch.tensor([0, 4]), compile=True, **kw),
                           generate_ar(target, torch.tensor([0, 4]), **kw))
        for method, tree in (("lantern", "dynamic"), ("spec", "chain")):
            want, _ = spec_run(target, drafter, tree, temperature, False, method)
            got, stats = spec_run(target, drafter, tree, temperature, True, method)
            assert torch.equal(got, want), (method, tree, temperature)


@pytest.mark.slow  # torch.compile: ~10 s of CPU per case
@pytest.mark.parametrize("method", ["ar", "lantern"])
def test_cli_compile_reports_the_compile_time(tmp_path, monkeypatch, capsys, method):
    """lantern generate --compile on small random models (the loaders replaced), aot_eager instead of inductor
    for speed: the JSON and the printout carry the one-off compile time and the graph count."""
    import argparse
    import json

    from lantern import sources
    from lantern.cli import generate as generate_cli
    from lantern.decoding import ar, spec

    target, drafter = small_models()
    monkeypatch.setattr(sources, "load_discrete", lambda args: (target, StubVQ(), {"sampling": {"cfg_scale": 2.0}}))
    monkeypatch.setattr(sources, "drafter_and_table", lambda args, gpt, vq: (drafter, neighbours()))
    from lantern.decoding import compiled
    from lantern.decoding.compiled import CompileChoice

    monkeypatch.setattr(compiled, "baseline_compile", lambda device: True)  # the AR baseline compiled
    for module in (ar, spec):
        monkeypatch.setattr(module, "resolve_compile", lambda compile, device, models=(): CompileChoice(
            dict(AOT) if compile else None, "on (test)" if compile else "off (compile=False)"))
    parser = argparse.ArgumentParser()
    generate_cli.add_generate_parser(parser.add_subparsers(dest="command"))
    js = tmp_path / "run.json"
    speculative = [] if method == "ar" else ["--tree", "chain", "--depth", "3", "--k", "4"]  # ar refuses them
    args = parser.parse_args(["generate", "--model", "checkpoint", "--method", method, *speculative, "--classes", "1",
                              "2", "--per-class", "1", "--compile", "--no-progress", "--out", str(tmp_path / "g.png"),
                              "--json", str(js)])
    assert generate_cli.run_generate(args) == 0
    figures = json.loads(js.read_text())
    assert figures["compile"] == "on (test)" and figures["compiled_graphs"] >= 0 and figures["compile_s"] >= 0
    out = capsys.readouterr().out
    assert "compile on (test)" in out
    if method != "ar":  # the compiled AR baseline, and the eager one beside it
        assert figures["ar_compile"] == "on (test)" and "ar_compile_s" in figures and "ar_eager_s" in figures
        assert "speed-up vs AR (compiled" in out and "speed-up vs eager AR" in out


@pytest.mark.slow  # torch.compile: ~10 s of CPU per case
@pytest.mark.parametrize("tree", ["chain", "dynamic"])
@torch.no_grad()
def test_compiled_loop_with_a_gpt_drafter_gives_the_eager_tokens(tree):
    """A GPTDrafter's forwards run as the target's do (padded tree forwards; the catch-up as a causal tree)."""
    from lantern.models.drafter import GPTDrafter

    target, _ = small_models()
    torch.manual_seed(4)
    small = build_gpt("GPT-tiny", n_layer=1, n_head=2, dim=32, vocab_size=64, num_classes=5, block_size=16).eval()
    for p in small.parameters():
        torch.nn.init.normal_(p, std=0.1)
    drafter = GPTDrafter(small)
    want, _ = spec_run(target, drafter, tree, 1.0, False, "spec")
    got, stats = spec_run(target, drafter, tree, 1.0, AOT, "spec")
    assert torch.equal(got, want)


@pytest.mark.parametrize("isolates", [True, False])
def test_known_keys_skip_guards_only_where_torch_isolates_the_wrappers(monkeypatch, isolates):
    """torch < 2.14 (the GPU machine's 2.11) has no torch.compile(isolate_recompiles=...): the wrapper compiles
    without it and runs every call with all its guards; with it, a call at a known key skips the guards that
    do not tell its own graphs apart. isolates=True is the negative control of the second half."""
    from lantern.decoding import compiled

    def compile_like_torch(fn, *, fullgraph, dynamic, **options):
        if not isolates:
            assert "isolate_recompiles" not in options  # torch 2.11 raises TypeError on it
        return fn

    stances = []

    def record_stance(*args, **kwargs):
        stances.append(kwargs)
        return contextlib.nullcontext()

    monkeypatch.setattr(compiled, "ISOLATES_RECOMPILES", isolates)
    monkeypatch.setattr(torch, "compile", compile_like_torch)
    monkeypatch.setattr(torch.compiler, "set_stance", record_stance)
    wrapper = compiled._Compiled(lambda x: (x + 1,), {}, "test", torch.device("cpu"))
    x = torch.zeros(2)
    for _ in range(3):
        assert torch.equal(wrapper(("key",), x)[0], x + 1)
    assert stances == ([dict(skip_guard_eval_unsafe=True)] * 2 if isolates else [])


def test_isolates_recompiles_is_what_this_torch_accepts():
    import inspect

    from lantern.decoding import compiled

    assert compiled.ISOLATES_RECOMPILES == ("isolate_recompiles" in inspect.signature(torch.compile).parameters)
