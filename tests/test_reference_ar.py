"""bench/reference_ar.py, the compiled AR loop every speed figure is held against: it must run the model lantern
runs. Greedy (temperature 0) it gives lantern's AR tokens, token for token; sampled, its draws follow the same
law but another random stream."""
import pytest
import torch

import lantern
from bench.reference_ar import ReferenceAR, ReferenceGPT
from lantern.models.gpt import build_gpt


def _gpt(layers=2):
    torch.manual_seed(0)
    gpt = build_gpt("GPT-tiny", n_layer=layers, block_size=16).eval()
    for p in gpt.parameters():  # LlamaGen's init leaves the head at zero: every logit would tie
        torch.nn.init.normal_(p, std=0.3)
    return gpt


@pytest.mark.parametrize("cfg_scale", [1.0, 2.5])
def test_greedy_reference_equals_lanterns_ar(cfg_scale):
    gpt = _gpt()
    labels = torch.tensor([0, 3, 7])
    reference = ReferenceAR(ReferenceGPT.from_lantern(gpt), compile=False).generate(labels, cfg_scale, temperature=0)
    with lantern.fused("cpu"):
        ours = lantern.generate(gpt, labels, method="ar", cfg_scale=cfg_scale, temperature=0)[0]
    assert torch.equal(reference, ours)


def test_the_copy_is_the_model():
    """Negative control: another model's weights give other greedy tokens."""
    gpt, other = _gpt(), _gpt(layers=3)
    labels = torch.tensor([0, 3, 7])
    reference = ReferenceAR(ReferenceGPT.from_lantern(other), compile=False).generate(labels, 2.0, temperature=0)
    ours = lantern.generate(gpt, labels, method="ar", cfg_scale=2.0, temperature=0)[0]
    assert not torch.equal(reference, ours)


def test_sampled_tokens_follow_top_k():
    gpt = _gpt()
    labels = torch.arange(8)
    tokens = ReferenceAR(ReferenceGPT.from_lantern(gpt), compile=False).generate(labels, 1.0, temperature=1.0,
                                                                                  top_k=1)
    assert torch.equal(tokens, lantern.generate(gpt, labels, method="ar", temperature=0)[0])  # top-1 is greedy


@pytest.mark.slow
def test_compiled_reference_equals_eager():
    gpt = _gpt()
    labels = torch.tensor([1, 2])
    model = ReferenceGPT.from_lantern(gpt)
    eager = ReferenceAR(model, compile=False).generate(labels, 2.0, temperature=0)
    assert torch.equal(ReferenceAR(model, compile=True).generate(labels, 2.0, temperature=0), eager)
