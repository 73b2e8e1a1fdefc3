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


PLAIN = [(1.0, torch.float32), (0.7, torch.float32), (1.3, torch.bfloat16), (1.0, torch.float64)]


@pytest.mark.parametrize("temperature,dtype", PLAIN, ids=[f"t{t}-{d}".replace("torch.", "") for t, d in PLAIN])
@pytest.mark.parametrize("guided", [False, True], ids=["unguided", "guided"])
def test_plain_settings_equal_the_general_path(temperature, dtype, guided):
    """Numbers that leave every token in (a temperature above 0, top-k 0, top-p 1) take a shorter path in the
    reference; its probabilities are the general path's bit for bit, which the same settings given as per-row
    tensors take."""
    from lantern.ops.reference.process_logits import _plain, process_logits

    g = torch.Generator().manual_seed(3)
    logits = (4 * torch.randn(5, 3, 257, generator=g)).to(dtype)
    logits[0, 1, :7] = -math.inf  # masked tokens stay masked
    uncond = (4 * torch.randn(5, 3, 257, generator=g)).to(dtype) if guided else None
    assert _plain(temperature, 0, 1.0) and not _plain(torch.full((5,), temperature), 0, 1.0)
    fast = process_logits(logits, uncond, 2.0, temperature, 0, 1.0)
    general = process_logits(logits, uncond, 2.0, torch.full((5,), temperature, dtype=torch.float64),
                             torch.zeros(5, dtype=torch.int64), torch.ones(5, dtype=torch.float64))
    assert fast.dtype == general.dtype
    assert torch.equal(fast, general)
    assert torch.equal(fast[0, 1, :7], torch.zeros(7, dtype=fast.dtype))
