"""How many eager aten ops a decoding step dispatches around its compiled forwards, by where they come from.
On a GPU each is a kernel launch of several microseconds of host time, which CUDA graphs of the forwards do
not remove, so this count is what a step costs there beyond its forwards (docs/performance.md).

    python -m bench.step_ops [--methods lantern lantern-chain sjd] [--images 1]

The shipped tiny model, batch 1, the cpu kernels, ``compile={"backend": "aot_eager"}``: the same graphs as
inductor's, run by eager kernels, so the ops inside a compiled forward can be told apart and left out. Each op
is charged to the innermost function of ``lantern.decoding``, ``lantern.ops`` or ``lantern.models`` on its
Python stack.
Counts, not times: they do not depend on the machine or its load.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import sys
from typing import Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lantern
from lantern.decoding import compiled, state

from .bench_speedup import setup

CASES = {
    "lantern": dict(method="lantern", tree="dynamic"),
    "lantern-chain": dict(method="lantern", tree="chain", depth=5),
    "exact-static": dict(method="spec", tree="static", static_widths=(2, 2, 1, 1)),
    "sjd": dict(method="sjd", tree="chain"),  # a fixed window: the planner's choices depend on timing
}
AOT_EAGER = {"backend": "aot_eager"}


class StepOps(TorchDispatchMode):
    """Counts the aten ops dispatched inside ``DecodeState.step`` and outside the compiled forwards, by the
    innermost lantern function on the stack."""

    def __init__(self):
        super().__init__()
        self.in_step = self.in_graph = 0
        self.by_site: Dict[str, int] = collections.Counter()
        self.steps = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.in_step and not self.in_graph:
            self.by_site[_site()] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def counting(self):
        step, call = state.DecodeState.step, compiled._Compiled.__call__
        mode = self

        def counted_step(self, *args, **kwargs):
            mode.steps += 1
            mode.in_step += 1
            try:
                return step(self, *args, **kwargs)
            finally:
                mode.in_step -= 1

        def uncounted_call(self, *args, **kwargs):
            mode.in_graph += 1
            try:
                return call(self, *args, **kwargs)
            finally:
                mode.in_graph -= 1

        state.DecodeState.step, compiled._Compiled.__call__ = counted_step, uncounted_call
        try:
            with self:
                yield self
        finally:
            state.DecodeState.step, compiled._Compiled.__call__ = step, call


def _site() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith(("lantern.decoding", "lantern.ops", "lantern.models")):
            return f"{module.rsplit('.', 1)[-1]}.{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def count(case: str, images: int, models) -> StepOps:
    gpt, drafter, table, sampling = models
    options = dict(CASES[case])
    if options["method"] != "sjd":
        options["drafter"] = drafter
    if options["method"] == "lantern":
        options["neighbours"] = table
    counter = StepOps()

    def generate_all():
        for image in range(images):
            lantern.generate(gpt, torch.tensor([image % gpt.config.num_classes]), compile=AOT_EAGER, **options,
                             **dict(sampling, seed=image))

    with torch.no_grad(), lantern.fused("cpu"):
        generate_all()  # the first calls compile; their steps' eager ops are the same
        with counter.counting():
            generate_all()
    return counter


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--images", type=int, default=1)
    parser.add_argument("--top", type=int, default=12, help="sites listed per case")
    args = parser.parse_args(argv)
    if args.images < 1:
        parser.error("--images must be at least 1")
    models = setup()
    for case in args.methods:
        counter = count(case, args.images, models)
        total = sum(counter.by_site.values())
        print(f"{case}: {total / counter.steps:.0f} eager ops a step ({counter.steps} steps, {total} ops)")
        for site, n in counter.by_site.most_common(args.top):
            print(f"  {n / counter.steps:7.1f}  {site}")


if __name__ == "__main__":
    main()
