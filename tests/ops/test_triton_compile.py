"""The Triton kernels compile for an H100 (sm_90) — checked without a GPU, in a subprocess without
TRITON_INTERPRET (the interpreter accepts code the compiler rejects, e.g. a reassigned constexpr).
Also checks, in the generated PTX, what the interpreter cannot see: latent_neighbours has no fused
multiply-add (its exactness needs the reference's separate float32 roundings), and the barriers that
order the in-place phases are there."""
from __future__ import annotations

import json
import textwrap

import pytest
from triton_compile import run_compile_script

triton = pytest.importorskip("triton")

SCRIPT = textwrap.dedent('''
    import json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import lantern_kernels.compact_kv as ck
    import lantern_kernels.latent_neighbours as ln
    import lantern_kernels.tree_attention as ta

    def ptx(kernel, signature, constexprs, **options):
        fn = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

    report = {}
    sig = dict(codes="*fp32", codes_t="*fp32", out="*i32", V="i32", K="i32")
    meta = dict(D=8, KP=1024, ORDER_ROWS=1, CHUNK=16, BLOCK_R=16, BLOCK_C=32, RADIX=ln.RADIX_BITS,
                PASSES=ln.N_PASSES)
    sig.update({name: "constexpr" for name in meta})
    report["latent_neighbours"] = ptx(ln._neighbours_kernel, sig, meta, num_warps=4, enable_fp_fusion=False)
    for dt in ("bf16", "fp32"):
        sig = dict(q="*" + dt, k="*" + dt, v="*" + dt, o="*" + dt, cache_len="*i64", tree_mask="*i32")
        sig.update({n: "i32" for n in "sq_b sq_h sq_t sk_b sk_h sk_l sv_b sv_h sv_l sm_b sm_t Hkv T GROUP Dh".split()})
        sig["qk_scale"] = "fp32"
        meta = dict(BLOCK_D=64, IEEE=dt == "fp32", UPCAST=False, BF16_AS_F32=False, BLOCK_M=64, BLOCK_N=64)
        sig.update({name: "constexpr" for name in meta})
        report["tree_attention_" + dt] = ptx(ta._tree_attention_kernel, sig, meta, num_warps=4, num_stages=3)
    sig = dict(cache="*bf16", cache_len="*i64", path_nodes="*i64", n_keep="*i64", new_len="*i64")
    sig.update({n: "i32" for n in "B Hkv Lmax Dh s_path_b s_path_p".split()})
    meta = dict(BLOCK_P=8, BLOCK_D=64)
    sig.update({name: "constexpr" for name in meta})
    report["compact_kv"] = ptx(ck._compact_kv_kernel, sig, meta, num_warps=4)
    print(json.dumps(report))
''')


@pytest.fixture(scope="module")
def ptx():
    return json.loads(run_compile_script(SCRIPT, timeout=600).strip().splitlines()[-1])


def test_every_kernel_compiles_for_sm90(ptx):
    assert set(ptx) == {"latent_neighbours", "tree_attention_bf16", "tree_attention_fp32", "compact_kv"}
    assert all(".entry" in text for text in ptx.values())


def test_neighbour_distances_have_no_fused_multiply_add(ptx):
    text = ptx["latent_neighbours"]
    assert "mul.rn.f32" in text and "fma.rn.f32" not in text


def test_in_place_phases_are_ordered_by_barriers(ptx):
    assert "bar.sync" in ptx["latent_neighbours"] and "bar.sync" in ptx["compact_kv"]


def test_float32_attention_uses_ieee_dots_and_half_uses_tensor_cores(ptx):
    assert "tf32" not in ptx["tree_attention_fp32"]
    assert "mma" in ptx["tree_attention_bf16"]
