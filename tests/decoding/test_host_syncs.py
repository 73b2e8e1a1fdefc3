"""The decoding loops read the device at most once per step (issue: at most one host synchronisation per
step). Every host read of a tensor value goes through one of the Tensor methods below (``.item()``,
``bool()``, ``int()``, ``.tolist()``, ...), so a TorchFunctionMode that counts those calls made from inside
the loop counts the loop's syncs (on a GPU each one waits for the device). The value scans of the ops are
off inside the loop (``ops.checks.values_checked_by_caller``): the loop checks the models' logits itself,
folded into its one read. The fused backend is tested: the reference ops are the readable definitions
and read values in their Python control flow (process_logits' filters, compact_kv). Negative control: with the
scans back on, the count is far above one per step."""
import contextlib
import copy
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

import lantern
from lantern import ops
from lantern.decoding import SpecConfig, generate_spec
from lantern.models import build_gpt
from lantern.models.drafter import GPTDrafter

READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "nonzero"}
LOOPS = {"_generate_fixed", "_generate_auto"}


class CountReads(TorchFunctionMode):
    """Counts host reads of tensor values made while a decoding loop runs (not its setup or wrap-up)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS or (name == "__getitem__" and _bool_index(args)):
            names = [f.name for f in traceback.extract_stack()]
            if any(n in LOOPS for n in names) and "_accept_lens" not in names and "__init__" not in names:
                self.reads += 1
        return func(*args, **(kwargs or {}))


def _bool_index(args) -> bool:
    index = args[1] if len(args) > 1 else None
    index = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    target = build_gpt("GPT-tiny", block_size=16, n_layer=1, dim=64, n_head=2).eval()
    for p in target.parameters():
        torch.nn.init.normal_(p, std=0.05)
    with torch.no_grad():
        target.output.weight.mul_(20)
    return target, GPTDrafter(copy.deepcopy(target))  # a perfect drafter: long accepted runs, ragged rows


CONFIGS = {"chain": SpecConfig(method="spec", tree="chain", depth=3),
           "dynamic": SpecConfig(method="spec", tree="dynamic", depth=3, top_per_node=3, n_nodes=8),
           "auto": SpecConfig(method="spec", tree="auto", depth=3, adapt_costs=False)}


def run_counted(models, config, backend="cpu"):
    target, drafter = models
    lantern.enable_fused(backend)
    try:
        kwargs = dict(config=config, cfg_scale=2.0, temperature=1.0, seed=3)
        generate_spec(target, drafter, torch.tensor([0, 1, 2]), **kwargs)  # calibrates tree="auto" (cached)
        with CountReads() as counter:
            out, stats = generate_spec(target, drafter, torch.tensor([0, 1, 2]), **kwargs)
    finally:
        lantern.disable_fused()
    return counter.reads, stats


@pytest.mark.parametrize("tree", sorted(CONFIGS))
def test_one_host_read_per_step(models, tree):
    reads, stats = run_counted(models, CONFIGS[tree], "cpu")
    assert stats.steps >= 3
    assert reads <= stats.steps + 1, (reads, stats.steps)  # one per step, and the read that ends the loop


def test_negative_control_the_counter_sees_the_value_scans(models, monkeypatch):
    monkeypatch.setattr(ops.checks, "values_checked_by_caller", contextlib.nullcontext)
    reads, stats = run_counted(models, CONFIGS["chain"])
    assert reads > 3 * stats.steps, (reads, stats.steps)


def test_broken_logits_stop_the_loop(models):
    """The loop's folded value check: a target that produces NaN logits mid-run raises, naming the step."""
    target, drafter = models
    broken = copy.deepcopy(target)
    calls = {"n": 0}
    forward = broken.forward

    def nan_after_prefill(*args, **kwargs):
        calls["n"] += 1
        out = forward(*args, **kwargs)
        if calls["n"] != 3:
            return out
        logits = (out[0] if isinstance(out, tuple) else out).clone()
        logits[0, 0, 5] = float("nan")
        return (logits, *out[1:]) if isinstance(out, tuple) else logits

    broken.forward = nan_after_prefill
    with pytest.raises(RuntimeError, match="NaN or \\+inf logits"):
        generate_spec(broken, GPTDrafter(copy.deepcopy(target)), torch.tensor([0, 1]),
                      config=CONFIGS["chain"], cfg_scale=2.0, seed=0)


def test_ar_reads_once_and_checks_the_logits(models):
    """generate_ar: no host read per token (the first token's settings scan aside), and NaN logits mid-run
    raise at the end instead of returning tokens sampled from them."""
    from lantern.decoding import generate_ar

    target, _ = models
    lantern.enable_fused("cpu")
    try:
        generate_ar(target, torch.tensor([0, 1]), cfg_scale=2.0, seed=1)  # first use: the backend's self-check
        reads = {}
        LOOPS.add("generate_ar")
        try:
            for length in (4, 16):
                with CountReads() as counter:
                    generate_ar(target, torch.tensor([0, 1]), cfg_scale=2.0, seed=1, length=length)
                reads[length] = counter.reads
        finally:
            LOOPS.discard("generate_ar")
        # the prefill's and the first token's scans (settings, logits, the processed logits' finiteness and
        # masked rows) and the final check: as many for 16 tokens as for 4
        assert reads[16] == reads[4] <= 16, reads
        broken = copy.deepcopy(target)
        forward, calls = broken.forward, {"n": 0}

        def nan_at_step_5(*args, **kwargs):
            calls["n"] += 1
            logits = forward(*args, **kwargs)
            if calls["n"] == 5:
                logits = logits.clone()
                logits[0, 0, 3] = float("nan")
            return logits

        broken.forward = nan_at_step_5
        with pytest.raises(RuntimeError, match="NaN or \\+inf logits"):
            generate_ar(broken, torch.tensor([0, 1]), cfg_scale=2.0, seed=1)
    finally:
        lantern.disable_fused()
