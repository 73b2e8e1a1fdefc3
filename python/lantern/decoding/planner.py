"""The speculation planner of ``tree="auto"``. For a single row, each verify step it picks the draft tree (or
none: a plain AR step) that maximises the expected tokens per second (``Planner.choose``). For a batch it
picks one plan for the whole run, the fewest predicted seconds until the slowest row is done
(``Planner.plan_run``, ``steps_to_finish``): a batch steps until its last row finishes, and the mean rate
per step does not see those stragglers.

- ``Plan`` (``plans.py``): one candidate (AR, a chain of depth d, a static tree of sampled drafts, an EAGLE-2
  dynamic tree of a node budget, or, for Jacobi self-drafting (method "sjd"), a window of W drafts). The
  candidate set is small and bucketed (``candidate_plans``, ``jacobi_plans``).
- ``AcceptanceModel``: per-plan, per-depth acceptance estimated online from the run's own verify results
  (accepted-length histograms, slowly forgotten), with a conservative prior before data arrives. Plans of one
  draft family share what they learn through a chain-equivalent per-depth rate: a tree of effective width e
  accepts depth d with probability 1 - (1 - b_d)^e, b_d the chain's rate, so a chain's data also informs the
  trees and vice versa (a static tree's levels below its first: ``plans.static_level_rates``). The two
  families, sampled drafts (chains and static trees: a draft x drawn from the drafter's q is kept with
  probability min(1, p(x)/q(x)), so a level accepts with probability 1 - TV(p, q)) and deterministic drafts
  (top-1 chains and EAGLE-2 trees: a level accepts with probability p(top draft)), accept at very different
  rates on a diffuse image-token distribution and are pooled separately; so are Jacobi windows (the target's
  own earlier predictions, docs/sjd.md), a third family.
- ``Planner``: expected tokens (acceptance model) over predicted seconds (``costs.CostModel``), per plan;
  AR wins ties, so it never picks a plan its own models predict slower than AR.

The planner only chooses which drafts are proposed; verification (the acceptance rule) is the same for every
plan, so speculative decoding at δ = 0 stays exact whatever it picks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .plans import (  # noqa: F401
    AR_PLAN,
    DRAFT_KINDS,
    DYNAMIC_BUDGETS,
    DYNAMIC_SHAPES,
    FAMILIES,
    JACOBI_PREFIX,
    JACOBI_WINDOWS,
    STATIC_SHAPES,
    Plan,
    candidate_plans,
    checked_rates,
    jacobi_plan,
    jacobi_plans,
)

COST_PRIOR_STEPS = 2.0  # adapt_costs: a plan's own measured steps against this many predicted ones
AR_EVIDENCE = 0.25  # adapt_costs: probe AR when its recent steps weigh less than this many steps


class AcceptanceModel:
    """P(accept_len >= d) per plan, from the run's verify results blended with a prior.

    Per plan p and depth d: trials = rows that could accept depth d and accepted d - 1 (depth d existed in
    the image), hits = those that accepted d. h_p(d) = (hits + w ĥ_p(d)) / (trials + w), ĥ_p(d) the shared
    model's prediction; the shared chain-equivalent rate b_d pools every plan's data the same way against
    the prior (weight ``prior_weight`` rows): ``prior_rates[family][d - 1]`` where given (the chain-equivalent
    rates the calibration measured on these models, ``measured_rates``; a family of ``FAMILIES``), else
    ``prior`` for every level.

    A Jacobi window's levels accept more the longer the window (its later drafts have been refreshed by more
    forwards before they are tested, docs/sjd.md), so windows do not share their rates: where
    ``prior_rates`` has an entry under the plan's own name (its levels' rates h_p(d), measured by the
    calibration on a run of that plan alone), that entry is ĥ_p."""

    def __init__(self, prior: float = 0.5, prior_weight: float = 8.0, plan_weight: float = 8.0,
                 memory: float = 0.98, prior_rates: Optional[Dict[str, Sequence[float]]] = None):
        if not 0.0 <= prior < 1.0:
            raise ValueError(f"prior must be in [0, 1), got {prior}")
        if not 0.0 < memory <= 1.0:
            raise ValueError(f"memory must be in (0, 1], got {memory}")
        self.prior, self.prior_weight, self.plan_weight, self.memory = prior, prior_weight, plan_weight, memory
        self.prior_rates = checked_rates("prior_rates", prior_rates)
        self.counts: Dict[Plan, List[List[float]]] = {}  # plan -> [hits per depth, trials per depth]

    def observe(self, plan: Plan, hits: Sequence[float], trials: Sequence[float]) -> None:
        """hits[d-1] / trials[d-1] for d = 1..plan.depth (see the class doc)."""
        if plan.is_ar:
            return
        h, t = self.counts.setdefault(plan, [[0.0] * plan.depth, [0.0] * plan.depth])
        for d in range(plan.depth):
            h[d] += float(hits[d])
            t[d] += float(trials[d])

    def forget(self) -> None:
        """One step passes: every count is scaled by ``memory``. Acceptance drifts across an image (flat
        background, then edges), and a plan the data ruled out is tried again once the prior outweighs the
        old data (every 1 / (1 - memory) steps or so), rather than never."""
        for hits, trials in self.counts.values():
            for d in range(len(hits)):
                hits[d] *= self.memory
                trials[d] *= self.memory

    def chain_rates(self, max_depth: int, family: str = "top") -> List[float]:
        """b_d for d = 1..max_depth: the pooled chain-equivalent acceptance of each level over the plans of
        one draft family (``FAMILIES``; one pass over the data; a level no plan reached yet gets every level's
        pooled rate)."""
        return self.pooled_chain_rates(max_depth, family)[0]

    def pooled_chain_rates(self, max_depth: int, family: str = "top") -> Tuple[List[float], List[float]]:
        """(``chain_rates``, the trials behind each level's rate: its own and the prior's weight, or, for a level
        no plan reached and the prior does not give, those of the pooled rate it gets)."""
        measured = self.prior_rates.get(family, [])
        prior = sum(measured) / len(measured) if measured else self.prior
        overall_n, overall = self.prior_weight, prior * self.prior_weight
        level_n, level = [0.0] * max_depth, [0.0] * max_depth
        for plan, (hits, trials) in self.counts.items():
            if plan.family != family:
                continue
            for d in range(min(plan.depth, max_depth)):
                width = plan.pooled_width(d)
                if trials[d] <= 0 or width is None:
                    continue
                b = 1.0 - (1.0 - min(hits[d] / trials[d], 1.0 - 1e-9)) ** (1.0 / width)
                overall_n += trials[d]
                overall += trials[d] * b
                level_n[d] += trials[d]
                level[d] += trials[d] * b
        pooled = overall / overall_n
        rates = [(level[d] + self.prior_weight * (measured[d] if d < len(measured) else pooled)) /
                 (level_n[d] + self.prior_weight) for d in range(max_depth)]
        own = [n > 0 or d < len(measured) for d, n in enumerate(level_n)]
        return rates, [n + self.prior_weight if has else overall_n for n, has in zip(level_n, own)]

    def chain_rate(self, depth: int, family: str = "top") -> float:
        """b_d of level ``depth`` (1-based) for the draft family ``family``."""
        return self.chain_rates(depth, family)[depth - 1]

    def level_rates(self, plan: Plan, chain_rates: Optional[Sequence[float]] = None) -> List[float]:
        """h_p(d) for d = 1..plan.depth: P(accept depth d | accepted depth d - 1). chain_rates: the plan's
        family's b_d (computed when None)."""
        own = self.prior_rates.get(plan.name, [])
        b = chain_rates if chain_rates is not None or len(own) >= plan.depth else \
            self.chain_rates(plan.depth, plan.family)
        shared_rates = plan.shared_rates(b) if b is not None else []
        counts = self.counts.get(plan)
        rates = []
        for d in range(plan.depth):
            shared = own[d] if d < len(own) else shared_rates[d]
            hits, trials = (counts[0][d], counts[1][d]) if counts else (0.0, 0.0)
            rates.append((hits + self.plan_weight * shared) / (trials + self.plan_weight))
        return rates

    def survival(self, plan: Plan, chain_rates: Optional[Sequence[float]] = None) -> List[float]:
        """S_p(d) = P(accept_len >= d) for d = 1..plan.depth."""
        out, s = [], 1.0
        for h in self.level_rates(plan, chain_rates):
            s *= h
            out.append(s)
        return out

    def expected_tokens(self, plan: Plan, n_active: int, rows_reaching: Sequence[int],
                        chain_rates: Optional[Sequence[float]] = None) -> float:
        """Tokens the active rows emit in one step of ``plan``: each emits 1 + accepted drafts, never past
        the image end. rows_reaching[d-1] = active rows with at least d + 1 tokens still to generate."""
        total = float(n_active)
        if plan.is_ar:
            return total
        for d, s in enumerate(self.survival(plan, chain_rates)):
            if d >= len(rows_reaching):
                break
            total += rows_reaching[d] * s
        return total


def measured_rates(counts: Dict[Plan, Tuple[Sequence[float], Sequence[float]]], max_depth: int
                   ) -> Dict[str, List[float]]:
    """The chain-equivalent acceptance per level of each draft family that ``counts`` (plan -> (hits,
    trials) per depth, e.g. from a calibration) has data for, to serve as ``prior_rates``. A level without
    data gets the family's pooled rate (a weak 0.5 prior of one row keeps every rate in (0, 1)). Each Jacobi
    window with data also gets its own levels' rates, under its name (the family's pooled rate as a prior of
    one row). Every rate is one standard error under its estimate (``_lower_bound``)."""
    model = AcceptanceModel(prior=0.5, prior_weight=1.0)
    for plan, (hits, trials) in counts.items():
        model.observe(plan, hits, trials)
    families = {p.family for p, (_, trials) in counts.items() if not p.is_ar and sum(trials) > 0}
    pooled = {family: model.pooled_chain_rates(max_depth, family) for family in sorted(families)}
    rates = {family: [_lower_bound(b, n) for b, n in zip(*pooled[family])] for family in pooled}
    for plan, (hits, trials) in counts.items():  # Jacobi windows: each its own levels' rates (class doc)
        if plan.kind == "jacobi" and sum(trials) > 0:
            rates[plan.name] = [_lower_bound((h + b) / (t + 1.0), t + 1.0) if t > 0 else _lower_bound(b, n)
                                for h, t, b, n in zip(hits, trials, *pooled["jacobi"])]
    return rates


MEASURED_RATE_ERRORS = 1.0  # measured_rates: standard errors under the estimate


def _lower_bound(rate: float, trials: float) -> float:
    """A measured rate, MEASURED_RATE_ERRORS standard errors under its estimate: the planner picks the plan
    its estimates flatter most, so equal errors would favour the plans whose deep levels rest on the fewest
    trials (a calibration measures a chain's first level over hundreds of trials, its fifth over a few
    dozen); rounded, in [0, 1)."""
    below = rate - MEASURED_RATE_ERRORS * (rate * (1.0 - rate) / max(trials, 1.0)) ** 0.5
    return min(max(round(below, 4), 0.0), 0.9999)


def compaction_due(live: float, active: float) -> bool:
    """Whether the finished rows leave the models' batch now (``DecodeState.should_compact``): ``live`` rows
    (images) in the models' batch, ``active`` of them not done; due once the finished are a quarter of the
    batch or more (with the rows of the drafting plans ragged, the last rows of a batch finish many steps after
    the first; at batch 40 a fifth of the row-steps went to finished rows)."""
    return 4 * (live - active) >= live


def steps_to_finish(survival: Sequence[float], remaining: int, rows: int) -> float:
    """Expected steps until the last of ``rows`` rows, each ``remaining`` tokens from its end, is done, with
    one plan held for the whole run: a row emits 1 + the drafts it accepts each step, k drafts or more with
    probability survival[k-1] (``AcceptanceModel.survival``; AR: none, exactly ``remaining`` steps), rows
    independent. A batch steps until its slowest row finishes, so this grows with ``rows`` and with the
    spread of the accepted lengths: E[max N] = sum over n of 1 - F(n)^rows, F the law of one row's steps N."""
    return sum(running for running, _ in finish_profile(survival, remaining, rows))


def finish_profile(survival: Sequence[float], remaining: int, rows: int) -> List[Tuple[float, float]]:
    """Per step n = 1, 2, ... (``steps_to_finish``'s law): (P(the batch still steps: a row is not done),
    E[rows not done | the batch steps]) = (1 - F^rows, rows (1 - F) / (1 - F^rows)), F = P(a row is done
    after the n - 1 steps before)."""
    if remaining <= 0:
        return []
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    tail = np.array([1.0, *survival, 0.0])
    emit = tail[:-1] - tail[1:]  # [depth + 1] P(a step emits 1 + k tokens)
    K = emit.shape[0]
    # done[K + r - 1]: P(a row r tokens from its end is done after the steps so far); r <= 0 is done
    done = np.zeros(K + remaining)
    done[:K] = 1.0
    profile = []
    for _ in range(remaining):  # every step emits a token or more: `remaining` steps finish every row
        running = 1.0 - done[-1] ** rows
        profile.append((running, rows * (1.0 - done[-1]) / running if running > 0 else 0.0))
        after = np.zeros(remaining)
        for k in range(K):  # r tokens to go, 1 + k emitted: r - 1 - k to go
            after += emit[k] * done[K - 1 - k: K - 1 - k + remaining]
        done[K:] = after
    return profile


@dataclass
class PlanRecord:
    """What one plan did in a run: steps, and expected vs achieved tokens and seconds."""
    steps: int = 0
    expected_tokens: float = 0.0
    predicted_s: float = 0.0
    tokens: int = 0
    measured_s: float = 0.0
    probes: int = 0  # AR steps taken to measure AR's time, not because AR was predicted fastest
    runner_up: Dict[str, int] = None  # the best other plan of each step -> steps
    runner_up_rate: float = 0.0  # sum over steps of that plan's predicted tokens/s
    ar_rate: float = 0.0  # sum over steps of AR's predicted tokens/s
    rate: float = 0.0  # sum over steps of this plan's predicted tokens/s

    def as_dict(self) -> dict:
        top = max(self.runner_up, key=self.runner_up.get) if self.runner_up else None
        return {"steps": self.steps, "probes": self.probes, "runner_up": top,
                "runner_up_tokens_per_s": self.runner_up_rate / self.steps if self.steps else None,
                "ar_expected_tokens_per_s": self.ar_rate / self.steps if self.steps else None,
                "mean_expected_tokens_per_s": self.rate / self.steps if self.steps else None,
                "expected_tokens_per_s": self.expected_tokens / self.predicted_s if self.predicted_s > 0 else None,
                "achieved_tokens_per_s": self.tokens / self.measured_s if self.measured_s > 0 else None,
                "expected_tokens": round(self.expected_tokens, 2), "tokens": self.tokens,
                "predicted_s": round(self.predicted_s, 6), "measured_s": round(self.measured_s, 6)}


@dataclass
class Decision:
    plan: Plan
    expected_tokens: float
    predicted_s: float
    ar_tokens_per_s: float  # what AR would give, the bar every other plan had to clear
    rows: int = 0  # rows of the forward (finished rows included)
    runner_up: Optional[Plan] = None  # the best plan other than the chosen one, and its tokens/s
    runner_up_rate: float = 0.0
    probe: bool = False  # an AR step taken to measure AR's time (adapt_costs)

    @property
    def tokens_per_s(self) -> float:
        return self.expected_tokens / self.predicted_s


class Planner:
    """Chooses a plan per step from a cost model (seconds per step at a given row count) and an
    acceptance model. ``plans`` must contain AR; plans the cost model does not know are never chosen.

    With ``adapt_costs`` the calibrated seconds are corrected by the run's own step times (sums over recent
    steps, forgotten like the acceptance data): AR's by measured / predicted of its steps; a drafting plan
    p's by (measured_p + c r) / (predicted_p + c), r the same ratio over every drafting plan (the device
    got busier, or the calibration misjudged drafting), c COST_PRIOR_STEPS predicted steps of p. AR's time is measured
    first (``choose`` probes it), so a calibration taken while the device was loaded differently is
    corrected within a few steps. A plan's first step in the run is not counted: it pays its shapes' first
    calls (one such step of a tree measured 1.5 times its prediction and turned a run to AR). Without
    adapt_costs the choice depends on the models alone (reproducible).

    ``margin``: a drafting plan is chosen only when its predicted tokens/s beat AR's by more than this
    fraction. Near break-even (a compute-bound device, a wide batch) the prediction's errors decide, and
    they lean one way: a drafting step's time and tokens vary more than an AR step's, so a plan predicted a
    few percent faster is often slower."""

    def __init__(self, cost_model, plans: Sequence[Plan], acceptance: Optional[AcceptanceModel] = None,
                 adapt_costs: bool = False, margin: float = 0.0, compacts: bool = False):
        """compacts: the run's finished rows leave the models' batch (``DecodeState.compactable``), so a
        whole run's later steps cost fewer rows (``run_steps``)."""
        if not 0.0 <= margin < 10.0:
            raise ValueError(f"margin must be in [0, 10), got {margin}")
        self.margin, self.compacts = margin, compacts
        if AR_PLAN not in plans:
            raise ValueError("the planner's candidates must include AR (the plan of last resort)")
        self.cost_model = cost_model
        self.plans = [p for p in plans if cost_model.knows(p.name)]
        if AR_PLAN not in self.plans:
            raise ValueError("the cost model has no entry for 'ar'")
        self._max_depth = max(p.depth for p in self.plans)
        self.acceptance = acceptance or AcceptanceModel()
        self.records: Dict[str, PlanRecord] = {}
        self.adapt_costs = adapt_costs
        self.recent: Dict[str, List[float]] = {}  # plan name -> [measured s, predicted s], forgotten per step

    @property
    def max_depth(self) -> int:
        return self._max_depth

    def step_seconds(self, plan: Plan, rows: int, ratios: Optional[Tuple[float, float]] = None) -> float:
        """The cost model's seconds for one step, corrected by the run's measurements (adapt_costs)."""
        seconds = self.cost_model.step_seconds(plan.name, rows)
        if not self.adapt_costs:
            return seconds
        ar_ratio, spec_ratio = ratios or self._ratios()
        if plan.is_ar:
            return seconds * ar_ratio
        m, p = self.recent.get(plan.name, (0.0, 0.0))
        c = COST_PRIOR_STEPS * seconds
        return seconds * (m + c * spec_ratio) / (p + c)

    def _ratios(self) -> Tuple[float, float]:
        """measured / predicted over AR's recent steps, and over every drafting plan's."""
        ar_measured, ar_predicted = self.recent.get(AR_PLAN.name, (0.0, 0.0))
        ar_ratio = ar_measured / ar_predicted if ar_predicted > 0 else 1.0
        measured = predicted = 0.0
        for name, (m, p) in self.recent.items():
            if name != AR_PLAN.name:
                measured += m
                predicted += p
        return ar_ratio, measured / predicted if predicted > 0 else ar_ratio

    def forget(self) -> None:
        """One step passes: the acceptance data and the recent step times lose weight."""
        self.acceptance.forget()
        for pair in self.recent.values():
            pair[0] *= self.acceptance.memory
            pair[1] *= self.acceptance.memory

    def rates(self, rows: int, n_active: int, rows_reaching: Sequence[int]) -> List[Tuple[float, float, Plan]]:
        """(expected tokens, predicted seconds, plan) for every candidate, AR first."""
        b = {family: self.acceptance.chain_rates(self.max_depth, family)
             for family in {p.family for p in self.plans if not p.is_ar}}
        ratios = self._ratios() if self.adapt_costs else None
        out = []
        for plan in self.plans:
            seconds = self.step_seconds(plan, rows, ratios)
            out.append((self.acceptance.expected_tokens(plan, n_active, rows_reaching, b.get(plan.family)),
                        seconds, plan))
        return out

    def run_seconds(self, plan: Plan, rows: int, n_active: int, remaining: int) -> float:
        """Predicted seconds for ``n_active`` rows, each ``remaining`` tokens from its end, to finish with
        ``plan`` at every step and ``rows`` model rows in each forward: ``steps_to_finish`` x the step's
        seconds. The stragglers a per-step rate does not see are in it: at batch 10 a chain of 2 that
        emits 2.4 tokens a row per step on average needs ~29 steps, not 63 / 2.4 = 26."""
        steps, step_s = self.run_steps(plan, rows, n_active, remaining)
        return steps * step_s

    def run_steps(self, plan: Plan, rows: int, n_active: int, remaining: int) -> Tuple[float, float]:
        """(expected steps until the last of ``n_active`` rows is done, the mean seconds of those steps):
        ``run_seconds``' factors. Where finished rows leave the models' batch (``compacts``), a drafting
        plan's later steps cost the rows still in it: the rows not done (``finish_profile``), taken out when
        ``compaction_due`` (the loop's rule). At batch 10 a chain of 2's
        forwards average 0.89 of the batch's rows."""
        profile = finish_profile(self.acceptance.survival(plan), remaining, n_active)
        steps = sum(running for running, _ in profile)
        if not self.compacts or plan.is_ar or steps <= 0:
            return steps, self.step_seconds(plan, rows)
        halves, live, seconds = rows / n_active, float(n_active), 0.0
        for running, active in profile:
            if compaction_due(live, active):
                live = active
            seconds += running * self.step_seconds(plan, live * halves)
        return steps, seconds / steps

    def plan_run(self, rows: int, n_active: int, remaining: int, ar_step_s: Optional[float] = None) -> Decision:
        """The plan to hold for a whole run: the fewest predicted seconds (``run_seconds``); AR (``ar_step_s``
        a step, default the planner's AR step) unless a drafting plan is faster by more than ``margin``. The
        decision's figures are per step (expected tokens: the run's tokens over its expected steps);
        ar_tokens_per_s and runner_up_rate are whole-run rates."""
        ar_step_s = self.step_seconds(AR_PLAN, rows) if ar_step_s is None else ar_step_s
        if remaining <= 0:  # nothing to generate: no step at all
            return Decision(AR_PLAN, 0.0, ar_step_s, 0.0, rows)
        total = n_active * remaining
        ar_run = remaining * ar_step_s
        runs = []  # (run seconds, plan, steps, step seconds)
        for p in self.plans:
            if not p.is_ar:
                steps, step_s = self.run_steps(p, rows, n_active, remaining)
                runs.append((steps * step_s, p, steps, step_s))
        runs.sort(key=lambda r: r[0])
        runs.append((ar_run, AR_PLAN, remaining, ar_step_s))
        if runs[0][1].is_ar or runs[0][0] * (1.0 + self.margin) >= ar_run:
            runs.sort(key=lambda r: not r[1].is_ar)  # AR, then the fastest drafting plan
        (_, plan, steps, step_s), second = runs[0], (runs[1] if len(runs) > 1 else None)
        return Decision(plan, total / steps, step_s, total / ar_run, rows, second and second[1],
                        total / second[0] if second else 0.0)

    def choose(self, rows: int, n_active: int, rows_reaching: Sequence[int]) -> Decision:
        """The plan with the most expected tokens per second; AR unless another is faster by more than
        ``margin``. With adapt_costs, an AR step whose time no recent step measured is taken instead (a
        probe: the cheapest step there is), so AR's prediction is corrected like the others'."""
        rates = self.rates(rows, n_active, rows_reaching)
        ar_tokens, ar_s, _ = next(r for r in rates if r[2].is_ar)
        ar_rate = ar_tokens / ar_s
        ranked = sorted(rates, key=lambda r: (-r[0] / r[1], not r[2].is_ar))  # AR first among equals
        if not ranked[0][2].is_ar and ranked[0][0] / ranked[0][1] <= ar_rate * (1.0 + self.margin):
            ranked.sort(key=lambda r: not r[2].is_ar)  # not enough to clear the margin: AR, then the best
        tokens, seconds, plan = ranked[0]
        second = ranked[1] if len(ranked) > 1 else None
        decision = Decision(plan, tokens, seconds, ar_rate, rows, second and second[2],
                            second[0] / second[1] if second else 0.0)
        if self.adapt_costs and not plan.is_ar:
            evidence = self.recent.get(AR_PLAN.name, (0.0, 0.0))[1]
            if evidence < AR_EVIDENCE * self.cost_model.step_seconds(AR_PLAN.name, rows):
                return Decision(AR_PLAN, ar_tokens, ar_s, ar_rate, rows, plan, tokens / seconds, probe=True)
        return decision

    def record(self, decision: Decision, tokens: int, measured_s: float) -> None:
        rec = self.records.setdefault(decision.plan.name, PlanRecord(runner_up={}))
        rec.steps += 1
        rec.probes += decision.probe
        rec.ar_rate += decision.ar_tokens_per_s
        rec.rate += decision.tokens_per_s
        if decision.runner_up is not None:
            rec.runner_up[decision.runner_up.name] = rec.runner_up.get(decision.runner_up.name, 0) + 1
            rec.runner_up_rate += decision.runner_up_rate
        rec.expected_tokens += decision.expected_tokens
        rec.predicted_s += decision.predicted_s
        rec.tokens += tokens
        rec.measured_s += measured_s
        if self.adapt_costs and rec.steps > 1:  # a plan's first step pays its shapes' first calls
            pair = self.recent.setdefault(decision.plan.name, [0.0, 0.0])
            pair[0] += measured_s
            pair[1] += self.cost_model.step_seconds(decision.plan.name, decision.rows)

    def summary(self) -> dict:
        families = {p.family for p in self.plans if not p.is_ar}
        rates = {family: [round(b, 4) for b in self.acceptance.chain_rates(self.max_depth, family)]
                 for family in sorted(families)}
        return {"plans": {name: rec.as_dict() for name, rec in sorted(self.records.items(),
                                                                         key=lambda kv: -kv[1].steps)},
                "chain_rate_per_depth": rates}

