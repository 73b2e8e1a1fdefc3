"""One decoding call at a time per model (decoding/exclusive.py): calls from several threads on one GPT (and
one drafter) each return the tokens they return alone; a callback that starts a call on the model it is
decoding with gets a RuntimeError naming the model. Real threads, small random models."""
import threading
import time

import pytest
import torch

import lantern
from lantern.decoding import generate_ar
from lantern.models.drafter import GPTDrafter
from models.gpt_testing import small_gpt
from threads import run_in_threads


@pytest.fixture(scope="module")
def gpt():
    return small_gpt(0)  # 4x4 tokens, 5 classes


@pytest.fixture(scope="module")
def drafter():
    return GPTDrafter(small_gpt(1, n_layer=1))


@pytest.fixture
def one_thread_per_op():
    """Every run, alone or concurrent, computes with one intra-op thread, so that the matrix products round
    the same way in each (they need not be thread-count invariant)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _slow(step):  # gives the other thread the interpreter between tokens: the calls interleave
    time.sleep(0.002)


def _calls(gpt, drafter):
    """Calls of different batch sizes and methods on one GPT (a shared cache would be resized under each)."""
    return [
        lambda: generate_ar(gpt, torch.tensor([1, 2, 3, 4]), cfg_scale=2.0, seed=1, on_token=_slow),
        lambda: generate_ar(gpt, torch.tensor([0, 4]), seed=2, on_token=_slow),
        lambda: lantern.generate(gpt, torch.tensor([3]), method="spec", drafter=drafter, tree="chain", depth=2,
                                 seed=3)[0],
        lambda: lantern.generate(gpt, torch.tensor([2, 1, 0]), method="sjd", tree="chain", window=3, seed=4)[0],
    ]




@pytest.mark.slow
def test_concurrent_calls_on_one_model_each_get_their_own_tokens(gpt, drafter, one_thread_per_op):
    calls = _calls(gpt, drafter)
    alone = run_in_threads(calls, together=False)
    for _ in range(2):
        together = run_in_threads(calls, together=True)
        for want, got in zip(alone, together):
            assert torch.equal(got, want)


def test_a_callback_starting_a_call_on_its_own_model_raises(gpt):
    def again(step):
        if step == 2:
            generate_ar(gpt, torch.tensor([1]))

    with pytest.raises(RuntimeError, match=r"Transformer.* is already decoding in this thread"):
        generate_ar(gpt, torch.tensor([0]), on_token=again)
    assert generate_ar(gpt, torch.tensor([0]), length=3).shape == (1, 3)  # the model is free again


def test_a_waiting_call_starts_when_the_model_is_free(gpt):
    """Each call notes its tokens while it holds the model (its on_token callback): every token of the first
    call comes before any of the second's, which started while the first was sleeping in its first token. (The
    note is taken inside the calls: after a call returns, the other thread may run before it appends anything.)"""
    order = []
    first_running = threading.Event()

    def first():
        def note(step):
            if step == 0:
                first_running.set()
                time.sleep(0.2)  # hold the model a while
            order.append("first")
        generate_ar(gpt, torch.tensor([0]), on_token=note)

    def second():
        first_running.wait()
        generate_ar(gpt, torch.tensor([1]), length=2, on_token=lambda step: order.append("second"))

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert order == ["first"] * gpt.config.block_size + ["second"] * 2
