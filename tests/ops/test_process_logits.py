"""process_logits (SPEC §1): every argument is checked, with a message that names it, on every backend (the
``backend`` fixture, tests/ops/conftest.py; the op has only the reference, so each backend inherits its
checks). Its values are checked against verify's (which computes the same distribution) in
tests/ops/test_verify.py."""
import math

import pytest
import torch

import lantern
from lantern import ops
from op_cases import to_device

BAD_PROCESS = [
    (dict(logits=torch.tensor([1.0, math.nan])), ValueError, "logits"),
    (dict(logits=torch.tensor([1.0, math.inf])), ValueError, "logits"),
    (dict(logits=torch.zeros(3, 0)), ValueError, "logits"),
    (dict(logits=[1.0, 2.0]), TypeError, "logits"),
    (dict(temperature=-0.1), ValueError, "temperature"),
    (dict(top_k=-2), ValueError, "top_k"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(cfg_scale=math.nan, uncond_logits=torch.zeros(2)), ValueError, "cfg_scale"),
    (dict(uncond_logits=torch.zeros(3)), ValueError, "uncond_logits"),
]


@pytest.mark.parametrize("override,exc,fragment", BAD_PROCESS, ids=[f"{i}-{e[2]}" for i, e in enumerate(BAD_PROCESS)])
@pytest.mark.no_kernel_check("bad input (and process_logits has only the reference)")
def test_process_logits_rejects_bad_input(backend, device, override, exc, fragment):
    kwargs = dict(logits=torch.tensor([1.0, 2.0]))
    kwargs.update(override)
    kwargs = to_device(kwargs, device)
    with lantern.fused(backend), pytest.raises(exc, match=fragment):
        ops.process_logits(**kwargs)
