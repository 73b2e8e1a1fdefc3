"""The Triton kernels compile for an H100 (sm_90) — checked without a GPU, in a subprocess without
TRITON_INTERPRET (the interpreter accepts code the compiler rejects, e.g. a reassigned constexpr, and never
compiles the device helpers). Each kernel is compiled with the arguments and options its launcher passes
(recorded from ``launch``, tests/triton_compile.py: no hand-copied signatures). The generated PTX is checked
for what the interpreter cannot see: no fused multiply-add where the kernels must round as the reference's
separate float32 operations (latent_neighbours' distances, verify's guidance and node budget,
continuous_verify's densities), libdevice functions and IEEE division in continuous_verify, the barriers that
order the in-place phases, IEEE float32 dots in tree_attention and tensor cores for bfloat16."""
from __future__ import annotations

import json
import textwrap

import pytest

from triton_compile import run_compile_script

pytest.importorskip("triton")

SCRIPT = textwrap.dedent('''
    import json
    import torch
    from lantern.kernels import compact_kv, continuous_verify, latent_neighbours, tree_attention, verify
    from lantern.ops import continuous_verify_op, verify_op
    from triton_compile import launches, ptx

    report = {}
    # latent_neighbours at K = 1000 (the rank count's widest tile)
    (call,) = launches(latent_neighbours, torch.randn(1024, 8), 1000, False)
    report["latent_neighbours"] = ptx(call)
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):  # Dh = 64, group 2
        q, kv = torch.zeros(1, 4, 4, 64, dtype=dtype), torch.zeros(1, 2, 16, 64, dtype=dtype)
        mask = torch.ones(1, 4, 1, dtype=torch.int32)
        (call,) = launches(tree_attention, q, kv, kv, torch.zeros(1, dtype=torch.int64), mask)
        report["tree_attention_" + name] = ptx(call, config=-1)  # 64 x 64 rows x keys, 3 stages
    cache = torch.zeros(2, 1, 2, 16, 64, dtype=torch.bfloat16)
    (call,) = launches(compact_kv, cache, torch.zeros(1, dtype=torch.int64), torch.zeros(1, 8, dtype=torch.int64),
                       torch.zeros(1, dtype=torch.int64))
    report["compact_kv"] = ptx(call)
    # verify with every feature on: guidance (bfloat16 uncond), sampled drafts, row keys, the node budget,
    # k = 1000 neighbours (the widest merge tile), T = 64
    B, T, V = 1, 64, 2048
    parents = torch.arange(-1, T - 1).reshape(1, T)
    args = verify_op.to_schema(
        "triton", torch.zeros(B, T, V), torch.zeros(B, T, dtype=torch.int64), parents,
        torch.zeros(V, 1000, dtype=torch.int32), uncond_logits=torch.zeros(B, T, V, dtype=torch.bfloat16),
        cfg_scale=2.0, draft_probs=torch.zeros(B, T, V), k=1000, delta=0.1, budget="node", seed=1,
        rows=torch.tensor([3]))
    (call,) = launches(verify, *args)
    report["verify"] = ptx(call)
    report["verify_bits"] = call[2]["BITS"]
    for rule, ratio in (("exact", "paper"), ("paper", "code")):  # 64 tokens x 16 channels per program
        block = [torch.ones(2, 32, 16) for _ in range(5)] + [torch.zeros(2, 32), torch.zeros(2, 32)]
        bandwidth = 3.0 if rule == "paper" else 1.0
        args = continuous_verify_op.to_schema("triton", *block, rule, bandwidth, ratio, 10, 1, 0)
        (call,) = launches(continuous_verify, *args)
        report["continuous_verify_" + rule] = ptx(call)
    print(json.dumps(report))
''')


@pytest.fixture(scope="module")
def ptx():
    return json.loads(run_compile_script(SCRIPT, timeout=1500).strip().splitlines()[-1])


def test_every_kernel_compiles_for_sm90(ptx):
    kernels = {"latent_neighbours", "tree_attention_bf16", "tree_attention_fp32", "compact_kv", "verify",
               "continuous_verify_exact", "continuous_verify_paper"}
    assert kernels <= set(ptx)
    assert all(".entry" in ptx[name] for name in kernels)
    assert ".entry _verify_kernel" in ptx["verify"]
    assert ".entry _continuous_verify_kernel" in ptx["continuous_verify_exact"]


def test_verify_compiles_with_the_gpu_radix_width(ptx):
    assert ptx["verify_bits"] == 4


def test_neighbour_distances_have_no_fused_multiply_add(ptx):
    text = ptx["latent_neighbours"]
    assert "mul.rn.f32" in text and "fma.rn.f32" not in text


def test_verify_has_no_fused_multiply_add(ptx):
    """Guidance and the node budget must round as the reference's separate operations."""
    assert "fma.rn.f32" not in ptx["verify"]
    assert "mul.rn.f32" in ptx["verify"]  # the products are there, rounded on their own


def test_in_place_phases_are_ordered_by_barriers(ptx):
    for name in ("latent_neighbours", "compact_kv", "verify"):  # verify: its scratch-row passes
        assert "bar.sync" in ptx[name], name


def test_float32_attention_uses_ieee_dots_and_half_uses_tensor_cores(ptx):
    assert "tf32" not in ptx["tree_attention_fp32"]
    assert "mma" in ptx["tree_attention_bf16"]


def test_continuous_verify_float32_math_rounds_like_the_cpu_kernel(ptx):
    for rule in ("exact", "paper"):
        text = ptx["continuous_verify_" + rule]
        assert "fma.rn.f32" not in text
        assert "div.full.f32" not in text and "div.approx.f32" not in text
        assert "lg2.approx" not in text and "cos.approx" not in text
