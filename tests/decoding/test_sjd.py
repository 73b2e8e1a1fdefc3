"""Jacobi self-drafting (method "sjd", no drafter): greedy SJD reproduces greedy AR token for token (fixed
windows, coupled and independent draws, both fresh-slot rules, the planner's windows, ragged rows); the
window's rules (coupled draws repeat a position's token, Jacobi slots come from the forward's rows); sampled
SJD at δ = 0 reproduces AR's joint law of the first three tokens (the calibrated G-test of
tests/stats/gtest.py, false-failure rate <= 1e-6 per assertion; negative control: a wrong residual);
the options' errors."""
import numpy as np
import pytest
import torch

from lantern import ops
from lantern.decoding import SpecConfig, generate, generate_ar, generate_spec
from lantern.decoding.calibration import calibrate
from lantern.decoding.config import Sampling
from lantern.decoding.costs import CostModel
from lantern.decoding.jacobi import JacobiWindow
from lantern.decoding.planner import AcceptanceModel, jacobi_plans
from lantern.models import build_gpt
from lantern.ops.reference import verify as reference_verify
from planner_models import synthetic_costs
from stats.gtest import assert_fails_widely, assert_fits, g_test
from test_spec import sharpen
from test_spec_statistics import CFG, V, random_model

LABELS = torch.tensor([0, 3, 7, 9, 3])


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return sharpen(build_gpt("GPT-tiny", block_size=16, n_layer=2))


@pytest.fixture(scope="module")
def context_free():
    """Token embeddings zero: each position's prediction depends on the class and the position only, so a
    Jacobi draft from the last forward is the target's own choice and greedy windows get accepted."""
    torch.manual_seed(0)
    model = sharpen(build_gpt("GPT-tiny", block_size=16, n_layer=2))
    with torch.no_grad():
        model.tok_embeddings.weight.zero_()
    return model


def sjd(model, labels=LABELS, temperature=0.0, **options):
    config = SpecConfig(method="sjd", **{"tree": "chain", **options})
    return generate_spec(model, None, labels, config=config, cfg_scale=3.0, temperature=temperature)


@pytest.mark.parametrize("window", [1, 3, 8, 20])
@pytest.mark.parametrize("coupling,init", [(False, "repeat"), (True, "repeat"), (False, "sample"), (True, "sample")])
def test_greedy_sjd_reproduces_greedy_ar(target, window, coupling, init):
    want = generate_ar(target, LABELS, cfg_scale=3.0, temperature=0.0)
    got, stats = sjd(target, window=window, coupling=coupling, init=init)
    assert torch.equal(got, want)
    L = target.config.block_size
    assert stats.emitted == LABELS.shape[0] * (L - 1)
    assert stats.target_forwards == stats.steps + 1 and stats.draft_forwards == 0


@pytest.mark.parametrize("coupling", [False, True])
def test_greedy_windows_are_accepted_and_rows_are_ragged(context_free, coupling):
    want = generate_ar(context_free, LABELS, cfg_scale=3.0, temperature=0.0)
    got, stats = sjd(context_free, window=4, coupling=coupling)
    assert torch.equal(got, want)
    L = context_free.config.block_size
    assert stats.steps < (L - 1) // 2  # AR would take L - 1 steps
    lens = [a for a in stats.accept_lens if a.numel() == LABELS.shape[0]]
    assert any(int(a.max()) == 4 for a in lens)  # whole windows accepted
    assert any(int(a.min()) != int(a.max()) for a in lens)  # rows advance at their own speed


def test_greedy_auto_picks_windows_and_reproduces_ar(context_free):
    want = generate_ar(context_free, LABELS, cfg_scale=3.0, temperature=0.0)
    plans = jacobi_plans(8)
    costs = synthetic_costs(dispatch=0.01, per_token=2e-5, drafter=0.0, plans=plans)  # forward-bound: windows pay
    got, stats = generate(context_free, LABELS, method="sjd", window=8, cost_model=costs, cfg_scale=3.0,
                          temperature=0.0)
    assert torch.equal(got, want)
    assert set(stats.plan_counts) <= {p.name for p in plans}
    assert sum(n for name, n in stats.plan_counts.items() if name != "ar") > 0


def test_coupled_draws_repeat_a_positions_token():
    """Same rows, same positions, another step: coupled draws repeat every token, independent ones do not."""
    B, S, Vocab = 3, 16, 1000
    rows = torch.full((B, Vocab), 1.0 / Vocab)
    root = torch.zeros(B, dtype=torch.int64)
    n_done = torch.full((B,), 5)
    draws = {}
    for coupled in (False, True):
        window = JacobiWindow(root, rows, S, "sample", coupled, seed=3)
        fresh = torch.ones(B, S, dtype=torch.bool)
        window._fill(fresh, rows[:, None].expand(B, S, Vocab), root, n_done, step=1)
        first = window.tokens.clone()
        window._fill(fresh, rows[:, None].expand(B, S, Vocab), root, n_done, step=2)
        draws[coupled] = (first, window.tokens)
    assert torch.equal(*draws[True])
    assert not torch.equal(*draws[False])  # 48 uniform draws of 1000 tokens all repeating: p = 1e-144


def test_advance_takes_jacobi_slots_from_the_forward_and_keeps_only_jacobi_drafts():
    """Window of 4, W = 2 fed, one draft accepted: new slot 0 is old slot 2 (drawn from node 2's row, a
    one-hot here), new slot 1 would be old slot 3 (past the forward): kept only if slot 3 was a Jacobi draw
    (it was fresh, so it is refilled: "repeat" copies the token to its left)."""
    B, S, Vocab = 1, 4, 10
    root = torch.tensor([7])
    window = JacobiWindow(root, torch.full((B, Vocab), 0.1), S, "repeat", False, seed=0)
    assert torch.equal(window.tokens, torch.full((B, S), 7)) and not window.jacobi.any()
    probs = torch.nn.functional.one_hot(torch.tensor([[1, 2, 3]]), Vocab).float()  # [B, W + 1, V]
    window.advance(torch.tensor([1]), torch.tensor([5]), 2, probs, torch.tensor([4]), step=1)
    assert window.tokens[0, 0] == 3 and torch.equal(window.q[0, 0], probs[0, 2])
    assert window.jacobi.tolist() == [[True, False, False, False]]
    assert window.tokens[0, 1:].tolist() == [3, 3, 3]  # fresh: copies of the token to their left


def test_advance_keeps_a_jacobi_draft_past_the_forward():
    """Window of 4: a step of W = 3 (nothing accepted) makes slots 0-2 Jacobi draws; a step of W = 1
    (nothing accepted) then draws slot 0 from node 1 and keeps old slot 2's Jacobi draft as slot 1; old slot 3
    was fresh, so slots 2 and 3 are fresh again."""
    B, S, Vocab = 1, 4, 10
    window = JacobiWindow(torch.tensor([7]), torch.full((B, Vocab), 0.1), S, "repeat", False, seed=0)
    one_hot = torch.nn.functional.one_hot
    window.advance(torch.tensor([0]), torch.tensor([5]), 3, one_hot(torch.tensor([[1, 2, 3, 4]]), Vocab).float(),
                   torch.tensor([2]), step=1)
    assert window.tokens.tolist() == [[2, 3, 4, 4]] and window.jacobi.tolist() == [[True, True, True, False]]
    window.advance(torch.tensor([0]), torch.tensor([6]), 1, one_hot(torch.tensor([[8, 9]]), Vocab).float(),
                   torch.tensor([3]), step=2)
    assert window.tokens.tolist() == [[9, 4, 4, 4]] and window.jacobi.tolist() == [[True, True, False, False]]
    assert torch.equal(window.q[0, 1], one_hot(torch.tensor(4), Vocab).float())  # the kept draft's own row


# -- the law at δ = 0 -----------------------------------------------------------------------------------------

ROWS = 6000


@pytest.fixture(scope="module")
def small_target():
    return random_model(0, 2)


@torch.no_grad()
def exact_first_three(target, label: int) -> np.ndarray:
    """P(x0, x1, x2) [V^3] under the target with guidance, temperature 1, no filtering."""
    lab, null = torch.tensor([label]), torch.tensor([target.config.num_classes])

    def next_law(prefix):  # prefix [N, n] -> [N, V]
        n = prefix.shape[0]
        cond = target.forward_full(prefix, lab.expand(n))[:, -1]
        uncond = target.forward_full(prefix, null.expand(n))[:, -1]
        return ops.process_logits(cond, uncond, cfg_scale=CFG).double()

    p0 = next_law(torch.zeros(1, 0, dtype=torch.int64))[0]  # [V]
    x0 = torch.arange(V)[:, None]
    p1 = next_law(x0)  # [V, V]
    x01 = torch.stack(torch.meshgrid(torch.arange(V), torch.arange(V), indexing="ij"), -1).reshape(-1, 2)
    p2 = next_law(x01).reshape(V, V, V)
    return (p0[:, None, None] * p1[:, :, None] * p2).reshape(-1).numpy()


def sjd_counts(model, **options) -> np.ndarray:
    config = SpecConfig(method="sjd", tree="chain", **options)
    out, _ = generate_spec(model, None, torch.full((ROWS,), 1), config=config, cfg_scale=CFG, seed=5)
    return np.bincount((out[:, 0] * V * V + out[:, 1] * V + out[:, 2]).numpy(), minlength=V ** 3).astype(float)


@pytest.mark.slow
@pytest.mark.parametrize("coupling,init", [(False, "repeat"), (True, "sample")])
def test_delta0_sjd_reproduces_the_ar_law(small_target, coupling, init):
    """x2 is often verified as a Jacobi draft (drawn from the row of a forward that fed a rejected x1)."""
    exact = exact_first_three(small_target, 1)
    assert_fits(g_test(sjd_counts(small_target, window=2, coupling=coupling, init=init), exact),
                f"(x0, x1, x2) under sjd coupling={coupling} init={init}")


@pytest.mark.slow
def test_negative_control_wrong_residual_fails(small_target, monkeypatch):
    def broken(*args, backend=None, **kwargs):  # ops.verify's signature; the faulty reference runs whatever backend
        return reference_verify.verify(*args, **kwargs, faults=("wrong_residual",))

    monkeypatch.setattr(ops, "verify", broken)
    exact = exact_first_three(small_target, 1)
    assert_fails_widely(g_test(sjd_counts(small_target, window=2), exact), "sjd with a wrong residual")


# -- calibration and options ----------------------------------------------------------------------------------

def test_calibration_measures_each_windows_acceptance(context_free):
    """Each window's levels get their own rates (kept under the plan's name), which the planner's prior uses."""
    plans = jacobi_plans(4)
    config = SpecConfig(method="sjd", window=4)
    sampling = Sampling(3.0, 0.0, 0, 1.0, 0, -1)
    with torch.no_grad():
        measured = calibrate(context_free, None, LABELS[:2], None, config, sampling, 16, plans, rows_grid=(4,),
                             reps=1)
    rates = measured["acceptance"]
    assert {"jacobi", "sjd1", "sjd2", "sjd4"} <= set(rates)
    assert len(rates["sjd4"]) == 4 and rates["sjd4"][3] > 0.5  # greedy windows of this model are accepted
    model = AcceptanceModel(prior_rates=CostModel(measured["points"], acceptance=rates).acceptance)
    assert model.level_rates(plans[-1]) == pytest.approx(rates["sjd4"], abs=1e-6)


@pytest.mark.parametrize("options,match", [
    ({"tree": "static"}, "tree"),
    ({"window": 0}, "window"),
    ({"init": "zeros"}, "init"),
    ({"coupling": 1}, "coupling"),
    ({"draft": "sampled"}, "draft"),
])
def test_bad_sjd_options_are_named(target, options, match):
    with pytest.raises(ValueError, match=match):
        sjd(target, **options)


def test_sjd_takes_no_drafter_and_other_methods_need_one(target):
    with pytest.raises(ValueError, match="drafter"):
        generate_spec(target, object(), LABELS, config=SpecConfig(method="sjd", tree="chain"))
    with pytest.raises(ValueError, match="drafter"):
        generate_spec(target, None, LABELS, config=SpecConfig(method="spec", tree="chain"))
    with pytest.raises(ValueError, match="coupling"):
        generate_spec(target, object(), LABELS, config=SpecConfig(method="spec", tree="chain", coupling=True))


def test_acceptance_keys_are_families_or_window_names():
    AcceptanceModel(prior_rates={"jacobi": [0.5], "sjd8": [0.5, 0.6]})
    for bad in ({"sjd0": [0.5]}, {"sjdx": [0.5]}, {"greedy": [0.5]}, {"sjd4": [1.0]}):
        with pytest.raises(ValueError, match="prior_rates"):
            AcceptanceModel(prior_rates=bad)
