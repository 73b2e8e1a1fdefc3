"""compile on wrapped transformers models (lantern/hf/generate.py, decoding/compiled.py's CompiledTarget over
HFTarget): the compiled forwards (node counts padded to buckets, the attention over the whole row cache under the
4D mask) give the eager greedy tokens; the choice and its reason are in the stats; a model whose forward does not
trace in one graph runs eagerly under "auto" (the reason in the stats) and makes compile=True raise, naming the
reason. The fast tests compile with dynamo alone (backend "eager": what traces, and the padding); inductor
itself is the slow test (minutes of C++ compiling on a loaded CPU). wrap(attention="lantern") (the tree forwards'
attention through ops.tree_attention) compiles too, with the reference op and with the fused CPU kernel."""
import pytest
import torch

import lantern
import lantern.hf
from hf_models import emu3_prompt, janus_prompt, left_padded, model, wrap
from lantern.decoding import compile_choice
from lantern.hf.random_models import random_model

DYNAMO = {"backend": "eager"}  # dynamo's trace in one graph (fullgraph), without a compiler's time
CFG_SCALE = 2.0


def run(kind, method, compile, attention="model", **options):
    m = model(kind)
    if kind == "janus":
        ids, mask = janus_prompt([[5, 6, 7], [9]])
    elif kind == "emu3":
        ids, mask = emu3_prompt(m, [[5, 6], [11, 12, 13]])
    else:  # chameleon: a 32 x 32 image; its first 10 codes
        ids, mask = left_padded([[3, 5, 6, 7], [3, 9]])
        options = dict(length=10, **options)
    return lantern.generate(wrap(m, attention=attention), ids, attention_mask=mask, method=method,
                            cfg_scale=CFG_SCALE, temperature=0, compile=compile, **options)


@pytest.mark.parametrize("kind,method,options", [("janus", "sjd", dict(tree="chain", window=4)),
                                                 ("emu3", "ar", {})])
def test_compiled_forwards_give_the_eager_greedy_tokens(kind, method, options):
    """Janus: Jacobi chains of 5 nodes padded to 8 (the tree forward); Emu3: AR steps (the chain forward) with
    its forced row ends."""
    stats = {} if method == "ar" else None
    eager, _ = run(kind, method, False, **options)
    compiled, spec_stats = run(kind, method, DYNAMO, **options, **({"stats": stats} if stats is not None else {}))
    assert compiled.tolist() == eager.tolist()
    got = stats if stats is not None else vars(spec_stats)
    assert got["compile"] == "on (compile options given)" and got["compiled_graphs"] >= 1


@pytest.mark.slow
@pytest.mark.parametrize("kind,method,options", [("janus", "sjd", dict(tree="chain", window=3)),
                                                 ("emu3", "ar", {})])
def test_inductor_gives_the_eager_greedy_tokens(kind, method, options):
    """compile=True itself: inductor's C++ code on the CPU."""
    eager, _ = run(kind, method, False, **options)
    compiled, _ = run(kind, method, True, **options)
    assert compiled.tolist() == eager.tolist()


def run_with_lantern_attention(kind, method, compile, backend, options):
    """run(attention="lantern") under lantern.fused(backend) -> (tokens, stats as a dict)."""
    stats = {} if method == "ar" else None
    with lantern.fused(backend):
        tokens, spec_stats = run(kind, method, compile, attention="lantern", **options,
                                 **({"stats": stats} if stats is not None else {}))
    return tokens, (stats if stats is not None else vars(spec_stats))


LANTERN_ATTENTION = [("janus", "sjd", "reference", dict(tree="chain", window=4)),
                     ("chameleon", "sjd", "reference", dict(tree="chain", window=3)),
                     ("emu3", "ar", "cpu", {})]


def assert_compiled_lantern_attention_gives_eager_tokens(kind, method, backend, options, compile):
    eager, _ = run_with_lantern_attention(kind, method, False, backend, options)
    compiled, stats = run_with_lantern_attention(kind, method, compile, backend, options)
    assert compiled.tolist() == eager.tolist()
    assert stats["compile"].startswith("on (") and stats["compiled_graphs"] >= 1
    assert model(kind).config.get_text_config()._attn_implementation == "sdpa"  # restored after the forwards


@pytest.mark.slow
def test_lantern_attention_traces_and_gives_the_eager_greedy_tokens():
    """wrap(attention="lantern"), dynamo's trace (Emu3's AR steps; each family under inductor in the slow test):
    the attention function switched in and out inside the graph, the fused CPU kernel an operator of every
    decoding graph (a backend that records the graphs dynamo hands it)."""
    graphs = []

    def recording(graph_module, example_inputs):
        graphs.append({str(node.target) for node in graph_module.graph.nodes if node.op == "call_function"})
        return graph_module.forward

    assert_compiled_lantern_attention_gives_eager_tokens(*LANTERN_ATTENTION[-1], {"backend": recording})
    assert graphs and all("lantern.tree_attention" in ops_called for ops_called in graphs)


@pytest.mark.slow
@pytest.mark.parametrize("kind,method,backend,options", LANTERN_ATTENTION, ids=[c[0] for c in LANTERN_ATTENTION])
def test_lantern_attention_under_inductor_gives_the_eager_greedy_tokens(kind, method, backend, options):
    """wrap(attention="lantern") with compile=True: inductor's C++ code around ops.tree_attention (the reference
    op, and the fused CPU kernel for Emu3; Janus: a window of 5 nodes padded to 8)."""
    assert_compiled_lantern_attention_gives_eager_tokens(kind, method, backend, options, True)


def test_auto_keeps_the_speculative_forwards_eager_on_a_cpu_and_says_why(monkeypatch):
    monkeypatch.delenv("LANTERN_COMPILE", raising=False)
    if not compile_choice.resolve_compile("auto", torch.device("cpu")).on:
        pytest.skip("torch.compile cannot work here (no C++ compiler)")
    _, stats = run("janus", "sjd", "auto", tree="chain", window=3)
    assert stats.compile.startswith("on, AR's loop only (auto: on a CPU") and stats.compiled_graphs == 0


@pytest.mark.slow  # inductor compiles the AR graph: ~10-20 s of CPU
def test_auto_compiles_ars_loop_on_a_cpu_and_says_so(monkeypatch):
    monkeypatch.delenv("LANTERN_COMPILE", raising=False)
    if not compile_choice.resolve_compile("auto", torch.device("cpu")).on:
        pytest.skip("torch.compile cannot work here (no C++ compiler)")
    ar_stats = {}
    got, _ = run("emu3", "ar", "auto", stats=ar_stats)
    assert ar_stats["compile"].startswith("on, AR's loop only (auto: on a CPU") and ar_stats["compiled_graphs"] >= 1
    assert got.tolist() == run("emu3", "ar", False)[0].tolist()  # greedy: the eager tokens


def untraceable_janus(monkeypatch):
    """A tiny Janus (its own model: the verdict is kept per model) whose decoder breaks dynamo's graph."""
    m = random_model("janus", dtype=torch.float64, seed=1)
    target = wrap(m)
    decode = target.rules.decode

    def decode_with_a_graph_break(*args):
        torch._dynamo.graph_break()
        return decode(*args)

    monkeypatch.setattr(target.rules, "decode", decode_with_a_graph_break)
    return target


def test_auto_runs_a_model_that_does_not_trace_eagerly_and_says_why(monkeypatch):
    monkeypatch.setenv("LANTERN_COMPILE", "1")  # "auto" compiles on this CPU
    target = untraceable_janus(monkeypatch)
    ids, mask = janus_prompt([[5, 6, 7], [9]])
    kw = dict(attention_mask=mask, method="sjd", tree="chain", window=3, cfg_scale=CFG_SCALE, temperature=1.0,
              seed=3)
    got, stats = lantern.generate(target, ids, compile="auto", **kw)
    assert stats.compile.startswith("off (auto: the wrapped janus model does not trace: Unsupported")
    assert "graph_break" in stats.compile and stats.compiled_graphs == 0
    want, eager = lantern.generate(target, ids, compile=False, **kw)
    assert got.tolist() == want.tolist() and eager.compile == "off (compile=False)"
    ar_stats = {}
    lantern.generate(target, ids, attention_mask=mask, method="ar", cfg_scale=CFG_SCALE, compile="auto",
                     stats=ar_stats)  # known now: eager from the start
    assert ar_stats["compile"] == stats.compile


def test_compile_true_on_a_model_that_does_not_trace_raises_naming_the_reason(monkeypatch):
    target = untraceable_janus(monkeypatch)
    ids = torch.tensor([[1, 5, 6, 62]])
    for _ in range(2):  # traced and failed; then known, refused before any work
        with pytest.raises(lantern.hf.NotTraceable, match="compile=True: the wrapped janus model's forward does "
                                                          "not trace .*graph_break"):
            lantern.generate(target, ids, method="ar", compile=True)
    # negative control: a Janus without the graph break traces (the first test's run: its graph, if made, reused)
    _, stats = run("janus", "sjd", DYNAMO, tree="chain", window=4)
    assert stats.compile == "on (compile options given)"


def test_compile_and_stats_are_checked():
    target = wrap(model("janus"))
    ids = torch.tensor([[1, 5, 62]])
    with pytest.raises(ValueError, match="compile"):
        lantern.generate(target, ids, method="ar", compile="yes")
    with pytest.raises(ValueError, match="stats"):
        lantern.generate(target, ids, method="sjd", stats={})
