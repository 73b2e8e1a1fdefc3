"""bench/step_ops.py counts the eager ops of a decoding step and leaves out those inside compiled forwards, on
small random models (``compile={"backend": "aot_eager"}``: the graphs run by eager kernels, which the counter
would see if it did not leave them out)."""
import pytest
import torch

from bench import step_ops
from lantern import ops
from tiny_random_models import small_models

pytestmark = pytest.mark.slow  # dynamo traces the forwards: a few seconds


@pytest.fixture(scope="module")
def models():
    target, drafter = small_models()
    table = ops.latent_neighbours(torch.randn(64, 4, generator=torch.Generator().manual_seed(1)), 4)
    return target, drafter, table, dict(cfg_scale=2.0, temperature=1.0, top_k=0, top_p=1.0)


def test_counts_the_steps_eager_ops_by_site(models):
    counter = step_ops.count("exact-static", 1, models)
    assert counter.steps > 0 and sum(counter.by_site.values()) > 10 * counter.steps
    assert any(site.startswith("state.") for site in counter.by_site), counter.by_site


class CountingEverything(step_ops.StepOps):
    """StepOps that also counts the ops inside the compiled calls."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.in_step:
            self.by_site[step_ops._site()] += 1
        return func(*args, **(kwargs or {}))


def test_the_compiled_forwards_ops_are_left_out(models, monkeypatch):
    """Negative control: counted inside the compiled calls too, a step's count grows by the forwards' ops."""
    outside = step_ops.count("exact-static", 1, models)
    monkeypatch.setattr(step_ops, "StepOps", CountingEverything)
    everything = step_ops.count("exact-static", 1, models)
    per_step = lambda c: sum(c.by_site.values()) / c.steps  # noqa: E731
    assert per_step(everything) > per_step(outside) + 50, (per_step(everything), per_step(outside))
