"""verify's ``rows``: the Philox counter's row word of each batch row (SPEC §5), so a row's draws follow its key
(e.g. an image id), not its place in the batch. Every backend agrees with the reference on non-default keys; a
permuted batch with permuted keys gives the permuted results; the default keys are b; bad keys are refused."""
from __future__ import annotations

import pytest
import torch

import backends
import lantern
from lantern import ops
from op_cases import random_case, rows_agree, to_device, verify_pair

# sampled temperatures, so that every row draws (greedy rows draw nothing); B small for the interpreter
CASE_SEEDS = [11, 12, 13, 14, 15, 16]


def keyed_case(seed: int, B: int):
    """(args, kwargs) of a random verify call with every row sampling and arbitrary 32-bit row keys."""
    args, kwargs = random_case(seed, B=B, V=33)
    kwargs = dict(kwargs, temperature=1.0)
    g = torch.Generator().manual_seed(seed)
    kwargs["rows"] = torch.randint(0, 2**32, (B,), generator=g, dtype=torch.int64)
    return args, kwargs


def _small(backend) -> int:
    return 3 if backends.interpreted(backend) else 12


@pytest.mark.parametrize("seed", CASE_SEEDS)
def test_every_backend_agrees_with_the_reference_on_row_keys(backend, device, seed):
    if backends.interpreted(backend) and seed not in CASE_SEEDS[:2]:
        pytest.skip("the interpreter runs two cases (time)")
    args, kwargs = keyed_case(seed, _small(backend))
    want, got = verify_pair(backend, args, kwargs, device)
    agree = rows_agree(want, got)
    assert agree.mean() >= (1.0 if len(agree) < 10 else 0.9), (seed, agree)  # float32 rounding may split a rare row


def _permuted(args, kwargs, perm):
    """The same call with its batch rows reordered by perm (row keys moved with their rows)."""
    def take(t):
        return t[perm] if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == len(perm) else t

    return [take(a) for a in args], {n: take(v) for n, v in kwargs.items()}


@pytest.mark.parametrize("seed", CASE_SEEDS[:3])
def test_a_permuted_batch_with_permuted_keys_gives_permuted_results(backend, device, seed):
    """Row b's result depends on its key, not on its index: the reordered batch gives the reordered results.
    Negative control: the same reordering without keys changes the sampled tokens."""
    B = _small(backend)
    args, kwargs = keyed_case(seed, B)
    perm = torch.roll(torch.arange(B), 1)  # every row moves
    once = ops.verify(*to_device(args, device), **to_device(kwargs, device))
    p_args, p_kwargs = _permuted(args, kwargs, perm)
    again = ops.verify(*to_device(p_args, device), **to_device(p_kwargs, device))
    for a, b in zip(once, again):
        assert torch.equal(a.cpu()[perm], b.cpu())

    del kwargs["rows"], p_kwargs["rows"]
    plain = ops.verify(*to_device(args, device), **to_device(kwargs, device)).next_token.cpu()
    moved = ops.verify(*to_device(p_args, device), **to_device(p_kwargs, device)).next_token.cpu()
    assert not torch.equal(plain[perm], moved)  # keyed by place (fixed cases: deterministic)


def test_default_keys_are_the_row_indices(backend, device):
    args, kwargs = keyed_case(21, _small(backend))
    kwargs["rows"] = torch.arange(_small(backend))
    keyed = ops.verify(*to_device(args, device), **to_device(kwargs, device))
    del kwargs["rows"]
    plain = ops.verify(*to_device(args, device), **to_device(kwargs, device))
    for a, b in zip(keyed, plain):
        assert torch.equal(a, b)


def test_int32_keys_equal_int64_keys(backend, device):
    args, kwargs = keyed_case(22, _small(backend))
    kwargs["rows"] = kwargs["rows"] % 2**31
    wide = ops.verify(*to_device(args, device), **to_device(kwargs, device))
    kwargs["rows"] = kwargs["rows"].to(torch.int32)
    narrow = ops.verify(*to_device(args, device), **to_device(kwargs, device))
    for a, b in zip(wide, narrow):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rows,exc,fragment", [
    (torch.tensor([0, 1]), ValueError, "rows"),  # B = 3: wrong shape
    (torch.zeros(3, 1, dtype=torch.int64), ValueError, "rows"),
    (torch.tensor([0.0, 1.0, 2.0]), (TypeError, ValueError), "rows"),
    (torch.tensor([0, -1, 2]), ValueError, "rows"),
    (torch.tensor([0, 2**32, 2]), ValueError, "rows"),
])
def test_bad_row_keys_are_refused(rows, exc, fragment):
    args, kwargs = keyed_case(23, 3)
    kwargs["rows"] = rows
    with pytest.raises(exc, match=fragment):
        ops.verify(*args, **kwargs)


def test_row_keys_on_another_device_are_refused():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device for the mismatch")
    args, kwargs = keyed_case(24, 3)
    kwargs["rows"] = kwargs["rows"].cuda()
    with pytest.raises(ValueError, match="rows"):
        ops.verify(*args, **kwargs)


def test_the_extension_op_checks_its_rows_argument():
    """torch.ops.lantern.verify called directly (no Python checks): rows of the wrong shape or dtype raise."""
    if backends.why_unavailable("cpu") is not None:
        pytest.skip("lantern._C is not built")
    from lantern.ops import verify_op

    args, kwargs = keyed_case(25, 3)
    kwargs = {**kwargs, "temperature": 1.0, "seed": 5, "offset": 0}
    kwargs.pop("rows", None)
    base = verify_op.to_schema("triton", *args, **kwargs)
    for bad in (torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int32)):
        with pytest.raises((ValueError, TypeError), match="rows"):
            torch.ops.lantern.verify(*base[:-1], bad)
    with lantern.fused("reference"):
        assert base[-1] is None
