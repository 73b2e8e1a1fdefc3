"""Synthetic cost models for the planner tests: a step costs a fixed dispatch time, a time per token of the
target forward (rows x tree nodes) and a time per drafter forward."""
from lantern.decoding.costs import CostModel
from lantern.decoding.planner import candidate_plans

ROWS = (2, 16, 64)


def drafter_forwards(plan) -> int:
    return 0 if plan.is_ar else max(plan.depth, 1)


def synthetic_costs(dispatch=0.01, per_token=1e-5, drafter=0.005, plans=None, rows=ROWS) -> CostModel:
    plans = plans or candidate_plans(5)
    return CostModel({p.name: {r: dispatch + per_token * r * p.nodes + drafter * drafter_forwards(p)
                               for r in rows} for p in plans})
