"""AOT-compiled forwards (python/lantern/decoding/aot.py): one package per forward and mask width serves every
row count, node count and cache length with the eager forward's results; a package holds no weights (it serves
another model of the same architecture with that model's results); its name changes with everything its code
depends on and not with the weights; a later process loads it instead of compiling it; and the decoding loops
with compile=True on a CPU run the packages and give the eager loops' tokens."""
from __future__ import annotations

import pytest
import torch

import lantern
from lantern.decoding import SpecConfig, aot, generate_ar, generate_spec
from lantern.decoding.compiled import CompiledRun, CompileStats, compiled_drafter, compiled_target
from lantern.decoding.trees import depths_from_mask
from lantern.models.drafter import GPTDrafter, partial_tree_mask
from lantern.ops.reference.tree import ancestor_mask
from tiny_random_models import small_models

pytestmark = pytest.mark.skipif(aot.unavailable() is not None, reason=str(aot.unavailable()))


@pytest.fixture(scope="module", autouse=True)
def package_cache(tmp_path_factory):
    """One package folder for the module (each package compiles once, 10-30 s of CPU), the fused cpu ops."""
    mp = pytest.MonkeyPatch()
    mp.setenv("LANTERN_CACHE", str(tmp_path_factory.mktemp("lantern-cache")))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    if lantern.fused_ops("cpu").get("verify", False):
        lantern.enable_fused("cpu")
    yield
    lantern.disable_fused()
    torch.set_num_threads(threads)
    mp.undo()


def aot_run(stats: CompileStats) -> CompiledRun:
    return CompiledRun({}, stats, aot=True)


def random_trees(rows: int, T: int, seed: int) -> torch.Tensor:
    """parents [rows, T]: random topologically ordered trees, node 0 the root."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.cat([torch.tensor([-1]), (torch.rand(T - 1, generator=g) * torch.arange(1, T)).long()])
                        for _ in range(rows)])


def tree_inputs(model, rows: int, T: int, seed: int):
    """A cache of random values with the rows at different lengths, and a random tree per row -> (tokens,
    cache_len, positions, tree_mask)."""
    g = torch.Generator().manual_seed(seed)
    L = model.config.block_size
    model.setup_cache(rows, 1 + L + T)
    model.kv_cache.normal_(generator=g)
    cache_len = torch.randint(1, L, (rows,), generator=g)
    mask = ancestor_mask(random_trees(rows, T, seed))
    positions = ((cache_len - 1)[:, None] + depths_from_mask(mask, T)).clamp(max=L - 1)
    return torch.randint(0, model.config.vocab_size, (rows, T), generator=g), cache_len, positions, mask


def eager_and_wrapped(model, wrapper, rows: int, T: int, seed: int):
    """The same forward through the model and through the wrapper, from the same cache -> (wrapper's
    (logits, hidden), model's (logits, hidden), wrapper's cache after, model's cache after)."""
    tokens, cache_len, positions, mask = tree_inputs(model, rows, T, seed)
    before = model.kv_cache.clone()
    want = model(tokens, cache_len=cache_len, positions=positions, tree_mask=mask, return_hidden=True)
    want_cache, model.kv_cache = model.kv_cache, before
    got = wrapper(tokens, cache_len=cache_len, positions=positions, tree_mask=mask, return_hidden=True)
    return got, want, model.kv_cache, want_cache


def assert_close_all(got, want):
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # two packages compiled: ~40 s of CPU
@torch.no_grad()
def test_one_package_serves_every_row_count_node_count_and_cache_length():
    """T = 1 (an AR step), one row, 32 nodes (the first mask word's last), 33 and 50 nodes (the second word's
    package): the eager forward's logits, hidden states and cache writes; two packages in all."""
    target, _ = small_models()
    stats = CompileStats()
    wrapper = compiled_target(target, aot_run(stats))
    for rows, T in [(2, 1), (1, 1), (1, 7), (4, 5), (3, 32), (2, 33), (5, 50)]:
        got, want, cache, want_cache = eager_and_wrapped(target, wrapper, rows, T, seed=rows * 100 + T)
        assert_close_all(got, want)
        torch.testing.assert_close(cache, want_cache, rtol=1e-5, atol=1e-5)
    assert sorted(key for _, key in stats.seen) == [("words", 1), ("words", 2)]
    assert sorted(key for _, key in stats.loaded) == [("words", 1), ("words", 2)]
    # compiled while the model held a cache: the package binds weights only, the cache is an input
    for runner in wrapper.forward.runners.values():
        assert not [name for name in runner.get_constant_fqns() if "cache" in name or "cond_keys" in name]


@pytest.mark.slow  # one package (compiled by the test above when both run)
@torch.no_grad()
def test_a_package_holds_no_weights():
    """A package made for one model serves another of the same architecture with the other's weights, loaded
    from disk rather than compiled; and a model whose tensors were replaced (as ``model.to`` replaces them) is
    bound anew: the package never computes with tensors the model no longer has."""
    first, _ = small_models(seed=0)
    second, _ = small_models(seed=5)
    eager_and_wrapped(first, compiled_target(first, aot_run(CompileStats())), 2, 3, seed=0)  # the package exists
    stats = CompileStats()
    wrapper = compiled_target(second, aot_run(stats))
    got, want, _, _ = eager_and_wrapped(second, wrapper, 3, 6, seed=1)
    assert_close_all(got, want)
    assert stats.seen == {} and list(stats.loaded) == [("target forward (aot)", ("words", 1))]
    assert not torch.allclose(got[0], eager_and_wrapped(first, compiled_target(first, aot_run(CompileStats())),
                                                        3, 6, seed=1)[0][0])  # the weights matter
    for name, p in list(second.named_parameters()):
        owner, _, attr = name.rpartition(".")
        setattr(second.get_submodule(owner), attr, torch.nn.Parameter(p.detach() * 0.5))
    stale, want, _, _ = eager_and_wrapped(second, wrapper, 3, 6, seed=1)  # within a run nothing is rebound
    assert not torch.allclose(stale[0], want[0])
    got, want, _, _ = eager_and_wrapped(second, compiled_target(second, aot_run(CompileStats())), 3, 6, seed=1)
    assert_close_all(got, want)  # a run's start binds the model's tensors again


def test_package_names_change_with_the_architecture_dtype_backend_and_width_not_the_weights():
    target, drafter = small_models(seed=0)
    other, _ = small_models(seed=3)
    key = aot.package_key(aot.TreeForward(target), 1, "cpu")
    assert aot.package_key(aot.TreeForward(other), 1, "cpu") == key  # other weights, the same code
    assert aot.package_key(aot.TreeForward(target), 2, "cpu") != key
    assert aot.package_key(aot.TreeForward(target), 1, "reference") != key
    assert aot.package_key(aot.TreeForward(small_models(dtype=torch.bfloat16)[0]), 1, "cpu") != key
    from lantern.models import build_gpt

    deeper = build_gpt("GPT-tiny", n_layer=3, n_head=2, dim=64, vocab_size=64, num_classes=5, block_size=16)
    assert aot.package_key(aot.TreeForward(deeper), 1, "cpu") != key
    assert aot.package_key(aot.EaglePredict(drafter), 1, "cpu") not in (key, aot.package_key(
        aot.EaglePredict(drafter), 2, "cpu"))


def test_a_failed_compile_leaves_no_package(monkeypatch, tmp_path):
    """Packages are written under a unique name and renamed into place: a compile that fails leaves nothing a
    later process would load."""
    import torch._inductor

    def fail(exported, package_path, inductor_configs):
        with open(package_path, "wb") as f:
            f.write(b"half a package")
        raise RuntimeError("the C++ compiler failed")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fail)
    target, _ = small_models()
    path = tmp_path / "aot" / "TreeForward-x.pt2"
    with pytest.raises(RuntimeError, match="compiler failed"):
        aot.compile_package(aot.TreeForward(target), 1, path)
    assert list((tmp_path / "aot").iterdir()) == []


def test_one_process_compiles_a_package_the_others_wait_for_it(monkeypatch, tmp_path):
    """Processes that start together (torchrun ranks) compile a package once: the others wait on its lock file,
    then load what the first wrote. Four threads here, each with its own lock object (as processes have)."""
    import threading
    import time

    calls = []

    def slow_compile(module, words, path):
        calls.append(path)
        time.sleep(0.3)
        path.write_bytes(b"package")

    monkeypatch.setattr(aot, "compile_package", slow_compile)
    target, _ = small_models()
    path = tmp_path / "aot" / "TreeForward-x.pt2"
    compiled = []
    threads = [threading.Thread(target=lambda: compiled.append(aot.ensure_package(aot.TreeForward(target), 1, path)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and sorted(compiled) == [False, False, False, True] and path.read_bytes() == b"package"
    assert not aot.ensure_package(aot.TreeForward(target), 1, path)  # there already: nothing to do


def test_inputs_of_the_wrong_dtype_are_refused():
    target, _ = small_models()
    forward = aot.AotForward(aot.TreeForward(target), "target forward", "cpu")
    target.setup_cache(2, 20)
    tokens = torch.zeros(2, 3, dtype=torch.int32)  # int64 expected
    with pytest.raises(ValueError, match="input 1 must be a torch.int64 CPU tensor"):
        forward(target.kv_cache, tokens, torch.ones(2, dtype=torch.int64), tokens.long(),
                torch.ones(2, 3, 1, dtype=torch.int32))
    assert forward.runners == {}  # refused before any package was loaded or compiled
    big = torch.zeros(2, 2, aot.MAX_ROWS + 1, 2, 1, 32)  # more rows than the packages are made for
    with pytest.raises(ValueError, match="at most 16384 model rows"):
        forward(big, tokens.long(), torch.ones(2, dtype=torch.int64), tokens.long(),
                torch.ones(2, 3, 1, dtype=torch.int32))
    assert forward.runners == {}


@pytest.mark.slow  # one package compiled: ~20 s of CPU
@torch.no_grad()
def test_the_eagle_drafter_package_gives_the_eager_commit_and_expand():
    """Catch-up (a causal chain of ragged rows) and expansions of a partial tree, with another target's
    embedding bound (the drafter reads its target's token embedding)."""
    for seed in (0, 7):  # the second pair loads the first pair's package
        target, drafter = small_models(seed=seed)
        wrapper = compiled_drafter(drafter, torch.device("cpu"), aot_run(CompileStats()))
        tokens = torch.randint(0, 64, (3, 4))
        features = torch.randn(3, 4, 64)
        n_new = torch.tensor([4, 1, 2])
        positions = torch.arange(4).expand(3, 4)
        parents = torch.tensor([[-1, -1, 0, 1], [-1, 0, 1, 2], [-1, -1, -1, 2]])
        outs = []
        for model in (drafter, wrapper):
            drafter.reset(None, 3, 32)
            commit = model.commit(tokens, features, n_new, positions)
            expand = model.expand(tokens.flip(1), parents, features.flip(1), positions + 4,
                                  partial_tree_mask(parents))
            outs.append((*commit, *expand, drafter.kv_cache.clone()))
        assert_close_all(outs[1], outs[0])


@pytest.mark.slow  # the drafter's package (compiled by the test above when both run)
@torch.no_grad()
def test_a_drafter_bound_to_another_target_reads_that_targets_embedding_and_head():
    """The EAGLE drafter reads its target's token embedding and output head, which are not its own
    parameters: bound to another target between runs, the package computes with the new target's."""
    first, drafter = small_models(seed=0)
    second, _ = small_models(seed=9)
    flipped, _ = small_models(seed=0)  # the first target with another output head
    flipped.output.weight.neg_()
    tokens, features = torch.randint(0, 64, (2, 3)), torch.randn(2, 3, 64)
    positions, n_new = torch.arange(3).expand(2, 3), torch.tensor([3, 2])

    def commit(model):
        drafter.reset(None, 2, 16)
        return model.commit(tokens, features, n_new, positions)  # (root logits, root state)

    commit(compiled_drafter(drafter, torch.device("cpu"), aot_run(CompileStats())))  # bound to the first
    for other in (second, flipped):
        drafter.bind(other)
        got = commit(compiled_drafter(drafter, torch.device("cpu"), aot_run(CompileStats())))  # a new run
        assert_close_all(got, commit(drafter))
    drafter.bind(first)
    eager = commit(drafter)
    assert not torch.allclose(got[0], eager[0])  # the head matters
    assert torch.allclose(got[1], eager[1], rtol=1e-5, atol=1e-5)  # the flipped target's embedding is the first's
    drafter.bind(second)
    assert not torch.allclose(commit(drafter)[1], eager[1])  # the embedding matters


@torch.no_grad()
def loop_tokens(target, drafter, tree: str, temperature: float, compile, method="spec", labels=(1, 3, 4), **kw):
    config = SpecConfig(method=method, tree=tree, depth=3, n_nodes=8, top_per_node=3, compile=compile, **kw)
    return generate_spec(target, drafter, torch.tensor(labels), None, config=config, cfg_scale=2.0,
                         temperature=temperature, seed=3)


@pytest.mark.slow  # the packages of test_one_package... and of the drafter: compiled once for the module
@pytest.mark.parametrize("tree", ["chain", "static", "dynamic"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_speculative_loop_on_packages_gives_the_eager_tokens(tree, temperature):
    target, drafter = small_models()
    want, _ = loop_tokens(target, drafter, tree, temperature, False)
    got, stats = loop_tokens(target, drafter, tree, temperature, True)
    assert torch.equal(got, want)
    assert stats.compile.startswith("on (compile=True: ahead-of-time")


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@torch.no_grad()
def test_ar_on_the_package_gives_the_eager_tokens(temperature):
    target, _ = small_models()
    kw = dict(cfg_scale=2.0, temperature=temperature, seed=2)
    stats = {}
    assert torch.equal(generate_ar(target, torch.tensor([0, 4, 2]), compile=True, stats=stats, **kw),
                       generate_ar(target, torch.tensor([0, 4, 2]), **kw))
    assert "ahead-of-time" in stats["compile"]


@pytest.mark.slow
def test_rows_leave_the_batch_when_they_finish(monkeypatch):
    """With packages (any row count) finished rows leave the models' batch, as in the eager loop: the same
    tokens, and forwards over fewer rows than the batch's."""
    target, drafter = small_models()
    rows, run = [], aot.AotForward.__call__

    def counting(self, *args):
        if self.kind == "target forward":
            rows.append(args[1].shape[0])
        return run(self, *args)

    monkeypatch.setattr(aot.AotForward, "__call__", counting)
    labels = tuple(range(5)) * 2
    want, _ = loop_tokens(target, drafter, "chain", 1.0, False, labels=labels)
    got, _ = loop_tokens(target, drafter, "chain", 1.0, True, labels=labels)
    assert torch.equal(got, want)
    assert rows and min(rows) < max(rows) == 2 * len(labels)


@pytest.mark.slow
@torch.no_grad()
def test_a_gpt_drafter_runs_its_models_package():
    from lantern.models import build_gpt

    target, _ = small_models()
    torch.manual_seed(4)
    small = build_gpt("GPT-tiny", n_layer=1, n_head=2, dim=32, vocab_size=64, num_classes=5, block_size=16).eval()
    for p in small.parameters():
        torch.nn.init.normal_(p, std=0.1)
    want, _ = loop_tokens(target, GPTDrafter(small), "dynamic", 1.0, False)
    got, _ = loop_tokens(target, GPTDrafter(small), "dynamic", 1.0, True)
    assert torch.equal(got, want)


@pytest.mark.slow  # the module's packages (compiled above when run together)
def test_lantern_generate_reports_the_packages(tmp_path, monkeypatch, capsys):
    """lantern generate --compile on small random models (the loaders replaced): the printout and the JSON say
    how many packages the process compiled and loaded, and how long that took, apart from the run's time."""
    import argparse
    import json

    from lantern import ops, sources
    from lantern.cli import generate as generate_cli
    from tiny_random_models import StubVQ

    target, drafter = small_models()
    monkeypatch.setattr(sources, "load_discrete", lambda args: (target, StubVQ(), {"sampling": {"cfg_scale": 2.0}}))
    table = ops.latent_neighbours(torch.randn(64, 4, generator=torch.Generator().manual_seed(1)), 4)
    monkeypatch.setattr(sources, "drafter_and_table", lambda args, gpt, vq: (drafter, table))
    before = aot.process_summary()
    parser = argparse.ArgumentParser()
    generate_cli.add_generate_parser(parser.add_subparsers(dest="command"))
    js = tmp_path / "run.json"
    args = parser.parse_args(["generate", "--model", "checkpoint", "--method", "lantern", "--tree", "chain", "--depth",
                              "3", "--k", "4", "--classes", "1", "2", "--per-class", "1", "--compile", "--no-progress",
                              "--out", str(tmp_path / "g.png"), "--json", str(js)])
    assert generate_cli.run_generate(args) == 0
    packages = json.loads(js.read_text())["aot_packages"]
    after = aot.process_summary()
    assert packages == after and after["loaded"] >= before["loaded"] + 2  # the target's and the drafter's
    assert "compiled forwards: " in capsys.readouterr().out


def test_packages_serve_cpu_models_only():
    """A run with packages wraps lantern's CPU models in them, and leaves a model elsewhere (here on the meta
    device) to torch.compile."""
    from lantern.decoding.compiled import CompiledTarget
    from lantern.models import build_gpt

    assert isinstance(compiled_target(small_models()[0], aot_run(CompileStats())), aot.AotTarget)
    with torch.device("meta"):
        elsewhere = build_gpt("GPT-tiny", n_layer=1, n_head=2, dim=32, vocab_size=64, num_classes=5, block_size=16)
    assert isinstance(compiled_target(elsewhere, aot_run(CompileStats())), CompiledTarget)
