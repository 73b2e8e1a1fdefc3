"""The Triton verify kernel compiles for an H100 (sm_90) without a GPU, in a subprocess without
TRITON_INTERPRET (under the interpreter the device helpers are plain Python and the compiler never sees
them), with the options the launch uses; the PTX has the barriers that order the scratch-row passes and no
fused multiply-add (guidance and the node budget must round as the reference's separate operations)."""
from __future__ import annotations

import textwrap

import pytest
from triton_compile import run_compile_script

pytest.importorskip("triton")

SCRIPT = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import lantern_kernels.verify as kv

    sig = dict(logits="*fp32", uncond="*bf16", draft="*fp32", tokens="*i64", parents="*i64", nbrs="*i32",
               cfg_scale="*fp32", temperature="*fp32", top_k="*i64", top_p="*fp64", seed_ptr="*i64",
               offset_ptr="*i64", row_keys="*i64", p_scratch="*fp32", q_scratch="*fp32", depth_scratch="*i32",
               accept_len="*i64", path="*i64", next_token="*i64", status="*i8", T="i32", V="i32", K="i32", k="i32",
               delta="fp32", lam_m1="fp32")
    meta = dict(HAS_UNCOND=True, SAMPLED=True, LAMBDA=False, HAS_ROWS=True, NODE_BUDGET=True, BLOCK_V=1024,
                BLOCK_K=1024, BLOCK_T=64, BITS=kv.RADIX_BITS)
    sig.update({name: "constexpr" for name in meta})
    src = ASTSource(fn=kv._verify_kernel, signature=sig, constexprs=meta)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, enable_fp_fusion=False))
    print("RADIX_BITS", kv.RADIX_BITS)
    print(compiled.asm["ptx"])
''')


@pytest.fixture(scope="module")
def ptx():
    return run_compile_script(SCRIPT, timeout=900)


def test_verify_compiles_for_sm90_with_the_gpu_radix_width(ptx):
    assert "RADIX_BITS 4" in ptx and ".entry _verify_kernel" in ptx


def test_scratch_passes_are_ordered_by_barriers(ptx):
    assert "bar.sync" in ptx


def test_no_fused_multiply_add(ptx):
    assert "fma.rn.f32" not in ptx
    assert "mul.rn.f32" in ptx  # the products are there, rounded on their own
