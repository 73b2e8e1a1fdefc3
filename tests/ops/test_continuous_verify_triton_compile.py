"""The Triton continuous_verify kernel compiles for an H100 (sm_90) without a GPU, in a subprocess without
TRITON_INTERPRET (under the interpreter the device helpers are plain Python and the compiler never sees
them), for both rules; the PTX calls libdevice's functions (not the approximate lg2 / cos instructions), uses
IEEE division and has no fused multiply-add, so that it rounds like the CPU kernel."""
from __future__ import annotations

import json
import textwrap

import pytest
from triton_compile import run_compile_script

pytest.importorskip("triton")

SCRIPT = textwrap.dedent('''
    import json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import lantern_kernels.continuous_verify as cv

    sig = {n: "*fp32" for n in "draft mu_p sigma_p mu_q sigma_q logsig_p logsig_q tokens".split()}
    sig.update(rows="*i64", positions="*i64", seed_ptr="*i64", offset_ptr="*i64", accepted="*i8", tries="*i32",
               M="i32", N="i32", C="i32", bandwidth="fp32", max_tries="i32")
    report = {}
    for paper in (False, True):
        meta = dict(PAPER=paper, CODE_RATIO=paper, BLOCK_M=64, BLOCK_C=16)
        full = dict(sig, **{name: "constexpr" for name in meta})
        src = ASTSource(fn=cv._continuous_verify_kernel, signature=full, constexprs=meta)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4,
                                                                                      enable_fp_fusion=False))
        report["paper" if paper else "exact"] = compiled.asm["ptx"]
    print(json.dumps(report))
''')


@pytest.fixture(scope="module")
def ptx():
    return json.loads(run_compile_script(SCRIPT, timeout=600).strip().splitlines()[-1])


def test_both_rules_compile_for_sm90(ptx):
    assert set(ptx) == {"exact", "paper"}
    assert all(".entry _continuous_verify_kernel" in text for text in ptx.values())


def test_float32_math_rounds_like_the_cpu_kernel(ptx):
    for text in ptx.values():
        assert "fma.rn.f32" not in text
        assert "div.full.f32" not in text and "div.approx.f32" not in text
        assert "lg2.approx" not in text and "cos.approx" not in text
