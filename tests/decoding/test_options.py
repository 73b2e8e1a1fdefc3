"""lantern.generate's options (decoding/options.py): an option that does not apply to the model, method or tree
is refused naming it, before any work; the sampling settings are bounded before the first forward; an option
at its default is accepted. Small random models (tests/models/gpt_testing.py, tests/mar_testing.py)."""
import math

import pytest
import torch

import lantern
import lantern.decoding as decoding
from lantern import ops
from lantern.decoding import CSpDConfig, SpecConfig, generate_ar, generate_cspd, generate_spec, sample_mar
from lantern.models.drafter import GPTDrafter
from mar_testing import small_mar
from models.gpt_testing import small_gpt

LABELS = torch.tensor([0, 3])


@pytest.fixture(scope="module")
def gpt():
    return small_gpt(0)  # V 64, 4x4 tokens, 5 classes


@pytest.fixture(scope="module")
def drafter():
    return GPTDrafter(small_gpt(1, n_layer=1))


@pytest.fixture(scope="module")
def table(gpt):
    return ops.latent_neighbours(torch.randn(gpt.config.vocab_size, 4, generator=torch.Generator().manual_seed(0)), 4)


@pytest.fixture(scope="module")
def mar():
    return small_mar(0, num_sampling_steps="4")  # L = 16


@pytest.fixture
def no_work(monkeypatch, gpt, mar):
    """Any forward of the models fails the test: a refusal must come before the work."""
    for model in (gpt, mar):
        monkeypatch.setattr(model, "forward", lambda *a, **k: pytest.fail("a model ran"))
    monkeypatch.setattr(mar, "forward_z", lambda *a, **k: pytest.fail("a model ran"))


# -- MAR --------------------------------------------------------------------------------------------------------

MAR_REFUSED = [
    (dict(tree="chain"), "tree"), (dict(k=5), "k"), (dict(delta=0.2), "delta"), (dict(lam=2.0), "lam"),
    (dict(budget="node"), "budget"), (dict(top_k=5), "top_k"), (dict(top_p=0.9), "top_p"),
    (dict(cfg_interval=3), "cfg_interval"), (dict(length=4), "length"), (dict(compile=True), "compile"),
    (dict(window=3), "window"), (dict(depth=2), "depth"), (dict(n_nodes=4), "n_nodes"),
    (dict(method="bogus"), "method"), (dict(method="lantern"), "method"), (dict(method="spec"), "method"),
    (dict(gamma=2), "gamma applies to method='cspd'"), (dict(align=False), "align applies to method='cspd'"),
]


@pytest.mark.parametrize("options,name", MAR_REFUSED, ids=lambda x: str(x) if isinstance(x, dict) else "")
def test_mar_refuses_options_it_would_ignore(mar, no_work, options, name):
    with pytest.raises(ValueError, match=name):
        lantern.generate(mar, LABELS, **options)


def test_mar_refuses_the_neighbour_table(mar, table, no_work):
    with pytest.raises(ValueError, match="neighbours does not apply to MAR models"):
        lantern.generate(mar, LABELS, neighbours=table)


def test_mar_options_at_their_defaults_run(mar):
    tokens, stats = lantern.generate(mar, LABELS, tree="auto", k=1000, delta=0.1, top_k=0, top_p=1.0,
                                     cfg_interval=-1, compile=False, window=8, gamma=8, num_iter=2)
    assert tokens.shape == (2, 16, mar.config.token_embed_dim) and stats.steps == 2
    again, _ = lantern.generate(mar, LABELS, method="ar", num_iter=2)
    assert torch.equal(tokens, again)


BAD_MAR_SETTINGS = [
    (dict(cfg=math.nan), "cfg_scale"), (dict(cfg=math.inf), "cfg_scale"), (dict(cfg=-math.inf), "cfg_scale"),
    (dict(cfg=1e4), "cfg_scale"), (dict(cfg=True), "cfg_scale"), (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"), (dict(temperature=0.0), "temperature"),
    (dict(temperature=-1.0), "temperature"), (dict(temperature=1e4), "temperature"), (dict(seed=-1), "seed"),
    (dict(seed=2**64), "seed"), (dict(seed=1.5), "seed"), (dict(num_iter=0), "num_iter"),
    (dict(num_iter=-5), "num_iter"), (dict(num_iter=17), r"num_iter must be an int in \[1, 16\]"),
    (dict(num_iter=2.5), "num_iter"), (dict(num_iter=True), "num_iter"),
    (dict(last_step_noise="no"), "last_step_noise must be a bool"), (dict(head_stats=1), "head_stats"),
]


@pytest.mark.parametrize("settings,name", BAD_MAR_SETTINGS, ids=lambda x: str(x) if isinstance(x, dict) else "")
def test_mar_settings_are_bounded_before_sampling(mar, no_work, settings, name):
    with pytest.raises(ValueError, match=name):
        sample_mar(mar, LABELS, **{"num_iter": 2, **settings})
    if "cfg" in settings:  # lantern.generate's name for it
        settings = dict(cfg_scale=settings.pop("cfg"))
    with pytest.raises(ValueError, match=name):
        lantern.generate(mar, LABELS, **{"num_iter": 2, **settings})


def test_mar_edge_settings_run(mar):
    out = sample_mar(mar, LABELS, num_iter=16, cfg=1000.0, temperature=1000.0, seed=2**64 - 1)
    assert out.stats.steps == 16 and bool(torch.isfinite(out.tokens).all())
    assert sample_mar(mar, LABELS).stats.steps == 16  # the default: 64 steps, at most one per token


@pytest.mark.parametrize("config,name", [
    (dict(last_step_noise="no"), "last_step_noise must be a bool"), (dict(align="no"), "align must be a bool"),
    (dict(align=0), "align must be a bool"), (dict(last_step_noise=1), "last_step_noise must be a bool"),
    (dict(prefill=True), "prefill"), (dict(gamma=17), r"gamma must be at most the image's 16 tokens"),
])
def test_cspd_settings_are_checked(mar, no_work, config, name):
    with pytest.raises(ValueError, match=name):
        generate_cspd(mar, mar, LABELS, num_iter=4, config=CSpDConfig(**config))
    with pytest.raises(ValueError, match=name):
        lantern.generate(mar, LABELS, method="cspd", drafter=mar, num_iter=4, **config)


def test_cspd_refuses_bad_guidance(mar, no_work):
    for settings, name in ((dict(cfg=math.nan), "cfg_scale"), (dict(temperature=math.inf), "temperature")):
        with pytest.raises(ValueError, match=name):
            generate_cspd(mar, mar, LABELS, num_iter=4, **settings)


def test_mar_nan_tokens_raise(mar):
    broken = small_mar(0, num_sampling_steps="4")
    with torch.no_grad():
        broken.diffloss.net.final_layer.linear.bias.fill_(math.nan)
    with pytest.raises(RuntimeError, match="NaN or inf tokens"):
        sample_mar(broken, LABELS, num_iter=2)
    with pytest.raises(ValueError, match="draft contains NaN"):  # continuous_verify's check of the block
        generate_cspd(broken, broken, LABELS, num_iter=2)
    with pytest.raises(RuntimeError, match="NaN or inf tokens"):  # a run of pre-fill steps only
        generate_cspd(broken, broken, LABELS, num_iter=2, config=CSpDConfig(prefill=0.9))
    assert bool(torch.isfinite(sample_mar(mar, LABELS, num_iter=2).tokens).all())  # the intact model


# -- GPT ---------------------------------------------------------------------------------------------------------

def _gpt_refusals(drafter, table):
    return [
        (dict(method="ar", tree="chain"), "tree does not apply to method='ar'"),
        (dict(method="ar", drafter=drafter), "drafter does not apply to method='ar'"),
        (dict(method="ar", neighbours=table), "neighbours does not apply to method='ar'"),
        (dict(method="ar", depth=3), "depth does not apply to method='ar'"),
        (dict(method="bogus"), "method must be one of"),
        (dict(method="cspd"), "is for MAR models"),
        (dict(method="spec", drafter=drafter, window=3), "window applies to method='sjd' only"),
        (dict(method="lantern", drafter=drafter, neighbours=table, k=4, init="sample"), "init applies to method='sjd'"),
        (dict(method="spec", drafter=drafter, k=4), "k applies to relaxed acceptance"),
        (dict(method="spec", drafter=drafter, delta=0.3), "delta applies to relaxed acceptance"),
        (dict(method="spec", drafter=drafter, lam=2.0), "lam applies to relaxed acceptance"),
        (dict(method="spec", drafter=drafter, neighbours=table), "neighbours applies to relaxed acceptance"),
        (dict(method="sjd", lam=3.0), "lam applies to relaxed acceptance; method='sjd' relaxes only with a neighbour"),
        (dict(method="sjd", delta=0.3), "delta applies to relaxed acceptance; method='sjd'"),
        (dict(method="sjd", k=4), "k applies to relaxed acceptance"),
        (dict(method="sjd", depth=3), "depth does not apply to method='sjd'"),
        (dict(method="sjd", n_nodes=3), "n_nodes does not apply to method='sjd'"),
        (dict(method="spec", drafter=drafter, tree="chain", n_nodes=4), "n_nodes applies to tree='dynamic'"),
        (dict(method="spec", drafter=drafter, tree="chain", top_per_node=4), "top_per_node applies to tree='dynamic'"),
        (dict(method="spec", drafter=drafter, tree="chain", static_widths=(2,)),
         "static_widths applies to tree='static'"),
        (dict(method="spec", drafter=drafter, tree="static", depth=2), "depth does not apply to tree='static'"),
        (dict(method="spec", drafter=drafter, tree="chain", margin=0.2), "margin applies to tree='auto'"),
        (dict(method="spec", drafter=drafter, num_iter=4), "num_iter applies to MAR models only"),
        (dict(method="spec", drafter=drafter, gamma=4), "gamma applies to MAR models only"),
        (dict(method="lantern", drafter=drafter, neighbours=table, k=4, lam=2.0, budget="node"), "budget"),
    ]


def test_gpt_refuses_options_of_other_methods_and_trees(gpt, drafter, table, no_work):
    for options, message in _gpt_refusals(drafter, table):
        with pytest.raises(ValueError, match=message):
            lantern.generate(gpt, LABELS, **options)


@pytest.mark.parametrize("options,name", [
    (dict(depth=1023 + 1), r"depth must be an int in \[1, 1023\]"), (dict(tree="dynamic", n_nodes=5000), "n_nodes"),
    (dict(tree="static", static_widths=(40, 40)), "static_widths make a tree of 1641 nodes"),
    (dict(delta=1.5), r"delta must be a total-variation budget in \[0, 1\]"), (dict(delta=math.nan), "delta"),
    (dict(lam=0.5), "lam must be a number >= 1"), (dict(lam=math.inf), "lam"),
    (dict(k=5), r"k must be an int in \[0, 4\]"),
])
def test_speculative_sizes_are_bounded(gpt, drafter, table, no_work, options, name):
    options = dict(dict(method="lantern", drafter=drafter, neighbours=table, k=4, tree="chain"), **options)
    with pytest.raises(ValueError, match=name):
        lantern.generate(gpt, LABELS, **options)


def test_sjd_window_is_bounded(gpt, no_work):
    with pytest.raises(ValueError, match="window"):
        lantern.generate(gpt, LABELS, method="sjd", tree="chain", window=5000)


@pytest.mark.parametrize("settings,name", [
    (dict(temperature=math.nan), "temperature"), (dict(temperature=-1.0), "temperature"),
    (dict(cfg_scale=math.inf), "cfg_scale"), (dict(top_p=2.0), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(seed=-1), "seed"), (dict(seed=2**64), "seed"), (dict(cfg_interval=-2), "cfg_interval"),
    (dict(cfg_interval=2**63), "cfg_interval"), (dict(cfg_interval=1.5), "cfg_interval"),
])
def test_gpt_settings_are_checked_before_the_first_forward(gpt, drafter, no_work, settings, name):
    with pytest.raises(ValueError, match=name):
        generate_ar(gpt, LABELS, **settings)
    with pytest.raises(ValueError, match=name):
        generate_spec(gpt, drafter, LABELS, config=SpecConfig(method="spec", tree="chain", depth=2), **settings)


def test_gpt_options_at_their_defaults_and_relaxed_sjd_run(gpt, drafter, table):
    want, _ = lantern.generate(gpt, LABELS, method="spec", drafter=drafter, tree="chain", depth=2, temperature=0.0)
    got, _ = lantern.generate(gpt, LABELS, method="spec", drafter=drafter, tree="chain", depth=2, temperature=0.0,
                              k=1000, delta=0.1, budget="candidate", n_nodes=58, window=8)
    assert torch.equal(got, want)
    assert torch.equal(lantern.generate(gpt, LABELS, method="ar", tree="auto", temperature=0.0)[0],
                       generate_ar(gpt, LABELS, temperature=0.0))
    tokens, stats = lantern.generate(gpt, LABELS, method="sjd", tree="chain", window=2, neighbours=table, k=4,
                                     lam=2.0)
    assert tokens.shape == (2, 16) and stats.steps > 0
    tokens, _ = lantern.generate(gpt, LABELS, method="sjd", tree="chain", window=2, delta=0.0)  # 0: exact
    assert tokens.shape == (2, 16)


def test_spec_config_refuses_what_its_method_ignores(gpt, drafter):
    for config, message in ((SpecConfig(method="spec", tree="chain", window=3), "window applies to method='sjd'"),
                            (SpecConfig(method="sjd", tree="chain", lam=2.0), "relaxes only with a neighbour table"),
                            (SpecConfig(method="sjd", tree="chain", delta=0.3), "relaxes only with a neighbour table"),
                            (SpecConfig(method="spec", tree="chain", depth=5000), "depth")):
        with pytest.raises(ValueError, match=message):
            generate_spec(gpt, None if config.method == "sjd" else drafter, LABELS, config=config)


def test_the_dispatch_default_method_follows_the_family(gpt, mar, drafter, table, monkeypatch):
    calls = []
    monkeypatch.setattr(decoding, "generate_spec", lambda *a, config, **k: calls.append(config.method) or (None, None))
    monkeypatch.setattr(decoding, "generate_mar", lambda *a, **k: calls.append("mar") or (None, None))
    lantern.generate(gpt, LABELS, drafter=drafter, neighbours=table, k=4)
    lantern.generate(mar, LABELS)
    assert calls == ["lantern", "mar"]


# -- decoding arguments: class ids, speculative options, empty batches ---------------------------------------------

@pytest.fixture(scope="module")
def small_pair():
    from lantern.models.drafter import GPTDrafter
    from models.gpt_testing import small_gpt

    return small_gpt(0), GPTDrafter(small_gpt(1, n_layer=1))  # num_classes 5, V 64, 4x4 tokens


@pytest.mark.parametrize("labels", [[5], [0, 7], [-1]])
def test_class_ids_outside_the_model_raise(small_pair, labels):
    import lantern
    from lantern.decoding import SpecConfig, generate_ar, generate_spec

    gpt, drafter = small_pair
    cond = torch.tensor(labels)
    for run in (lambda: lantern.generate(gpt, cond, method="ar"),
                lambda: generate_ar(gpt, cond, cfg_scale=2.0),
                lambda: generate_spec(gpt, drafter, cond, config=SpecConfig(method="spec", tree="chain", depth=2)),
                lambda: lantern.generate(gpt, cond, method="spec", drafter=drafter, tree="chain", depth=2)):
        with pytest.raises(ValueError, match=r"cond_idx: class ids must be in \[0, 5\)"):
            run()


def test_class_ids_must_be_integers_in_a_batch(small_pair):
    from lantern.decoding import generate_ar

    gpt, _ = small_pair
    for bad in (torch.tensor([1.0]), torch.tensor([[1]]), torch.tensor([True])):
        with pytest.raises(ValueError, match="cond_idx must be integer class ids"):
            generate_ar(gpt, bad)
    assert generate_ar(gpt, torch.tensor([4]), length=2).shape == (1, 2)  # the last real class still runs


def test_mar_labels_outside_the_model_raise():
    from lantern.decoding import sample_mar
    from lantern.models import build_mar

    torch.manual_seed(0)
    mar = build_mar("MAR-tiny-drafter").eval()
    n = mar.config.class_num
    with pytest.raises(ValueError, match=rf"labels: class ids must be in \[0, {n}\)"):
        sample_mar(mar, torch.tensor([n]), num_iter=1)


SPEC_ERRORS = [
    (dict(tree="chain", depth=-3), "depth must be an int >= 1"),
    (dict(tree="dynamic", depth=0), "depth must be an int >= 1"),
    (dict(tree="auto", depth=0), "depth must be an int >= 1"),
    (dict(tree="dynamic", top_per_node=0), r"top_per_node must be an int in \[1, 64\]"),
    (dict(tree="dynamic", top_per_node=65), r"top_per_node must be an int in \[1, 64\]"),
    (dict(tree="static", static_widths=(0,)), "static_widths must be a non-empty sequence"),
    (dict(tree="static", static_widths=()), "static_widths must be a non-empty sequence"),
    (dict(tree="chain", draft="bogus"), "draft must be one of"),
    (dict(tree="dynamic", draft="sampled"), "draft='sampled' does not apply to tree='dynamic'"),
    (dict(tree="dynamic", n_nodes=0), "n_nodes must be an int >= 1"),
]


@pytest.mark.parametrize("options,message", SPEC_ERRORS, ids=lambda x: str(x) if isinstance(x, dict) else "")
def test_bad_speculative_options_raise_naming_the_option(small_pair, options, message):
    from lantern.decoding import SpecConfig, generate_spec, resolve_cost_model

    gpt, drafter = small_pair
    config = SpecConfig(method="spec", **options)
    with pytest.raises(ValueError, match=message):
        generate_spec(gpt, drafter, torch.tensor([0, 1]), config=config, temperature=0.0)
    with pytest.raises(ValueError, match=message):
        resolve_cost_model(gpt, drafter, torch.tensor([0, 1]), config=config)


def test_empty_batch_raises(small_pair):
    from lantern.decoding import SpecConfig, generate_ar, generate_spec

    gpt, drafter = small_pair
    empty = torch.zeros(0, dtype=torch.int64)
    with pytest.raises(ValueError, match="cond_idx must hold at least one row"):
        generate_spec(gpt, drafter, empty, config=SpecConfig(method="spec", tree="chain", depth=2))
    with pytest.raises(ValueError, match="cond_idx must hold at least one row"):
        generate_ar(gpt, empty)


def test_valid_edge_speculative_options_still_run(small_pair):
    from lantern.decoding import SpecConfig, generate_ar, generate_spec

    gpt, drafter = small_pair
    labels = torch.tensor([0, 4])
    want = generate_ar(gpt, labels, temperature=0.0)
    for config in (SpecConfig(method="spec", tree="chain", depth=1),
                   SpecConfig(method="spec", tree="dynamic", depth=1, top_per_node=64, n_nodes=1),
                   SpecConfig(method="spec", tree="static", static_widths=(1,)),
                   SpecConfig(method="spec", tree="chain", depth=2, draft="sampled")):
        got, _ = generate_spec(gpt, drafter, labels, config=config, temperature=0.0)
        assert torch.equal(got, want)
