"""The decode loop's Triton kernels compile for the H200 (sm_90a) on a machine without a GPU.

CI has no GPU, and the Triton interpreter runs a kernel's Python semantics, not its compilation: a kernel that the
interpreter accepts can still fail in the compiler (a type the lowering refuses, a layout it cannot convert). Each
kernel here is compiled ahead of time to a cubin (Triton's own ptxas) at the shapes the engine launches it with,
including the hybrid 27B shape, so such a failure shows in CI rather than on the first GPU runner. A kernel must
also fit the shared memory of a Hopper block; the skinny GEMM is compiled with the alignment Triton assumes at the
engine's launches, since that decides whether its loads are staged in shared memory.
"""
from __future__ import annotations

import inspect

import pytest

triton = pytest.importorskip("triton")
compiler = pytest.importorskip("triton.compiler")
backend = pytest.importorskip("triton.backends.compiler")

from kernels import (all_reduce, argmax, fused, gated_delta, int8_linear, skinny_linear, tree_attention,  # noqa: E402
                     tree_ops, verify_rows)

H200 = backend.GPUTarget("cuda", 90, 32)
HOPPER_SHARED = 227 * 1024  # shared memory a block may take on an H100 or H200


def ptr(dtype: str) -> str:
    return "*" + dtype


BF16, F32, I64, I32, U8 = ptr("bf16"), ptr("fp32"), ptr("i64"), ptr("i32"), ptr("u8")

ATTENTION = dict(q_ptr=BF16, k_ptr=BF16, v_ptr=BF16, start_ptr=I64, nm_ptr=U8, rows_ptr=I32, out_ptr=BF16,
                 pacc_ptr=F32, pm_ptr=F32, pl_ptr=F32, count_ptr=I32, qk_scale="fp32")
BUILD = dict(logp_ptr=F32, ids_ptr=I64, tokens_ptr=I64, parents_ptr=I64, depths_ptr=I64, visible_ptr=U8,
             count_ptr=I64)
SKINNY = dict(x_ptr=BF16, res_ptr=BF16, norm_ptr=BF16, w_ptr=BF16, b_ptr=BF16, y_ptr=BF16, h_ptr=BF16, eps="fp32")
# What Triton assumes at a launch with 16-byte aligned tensors and widths that are multiples of 16 (SmolLM2's, the
# 8B's): the loads may then be pipelined through shared memory, whose size is what can fail on the GPU.
ALIGNED_SKINNY = ("x_ptr", "res_ptr", "norm_ptr", "w_ptr", "b_ptr", "y_ptr", "h_ptr", "N", "K", "s_xm", "s_rm",
                  "s_wn", "s_ym", "s_hm")


def skinny_constexprs(N: int, K: int) -> dict:
    block_n, block_k, _, stages = skinny_linear.skinny_config(N, K)
    chunks = -(-K // block_k)
    return dict(BLOCK_M=skinny_linear.BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, SOFT_RNE=False,
                SOFT_RNE_OUT=False, K_CHUNKS=chunks, UNROLL=2 if chunks > 4 else 1, PDL=True, PREFETCH=True)


QK_STORE = dict(qkv_ptr=BF16, qn_ptr=BF16, kn_ptr=BF16, cos_ptr=BF16, sin_ptr=BF16, slots_ptr=I64, q_ptr=BF16,
                kc_ptr=BF16, vc_ptr=BF16, h_ptr=BF16, eps="fp32", norm_eps="fp32")
INT8 = dict(x_ptr=BF16, xs_ptr=F32, q_ptr=ptr("i8"), s_ptr=F32, b_ptr=BF16, y_ptr=BF16)
ALIGNED_INT8 = ("x_ptr", "xs_ptr", "q_ptr", "s_ptr", "y_ptr", "N", "K", "s_xm", "s_qn", "s_ym")


def int8_case(what: str, M: int, N: int, K: int, out=BF16, a8: bool = False) -> tuple:
    """The int8 draft GEMM with the tiles int8_config picks for M rows (int8 rows where a8) against an [N, K]
    weight."""
    block_m, block_n, block_k, warps, stages = int8_linear.int8_config(M, N, K, a8)
    return (f"int8 linear{', int8 rows' if a8 else ''}, {what}", int8_linear._int8_linear_kernel,
            dict(INT8, y_ptr=out, x_ptr=ptr("i8") if a8 else BF16),
            dict(A8=a8, HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages,
                 F32_DOT=False, ROUND=out != F32, SOFT_RNE=False, PDL=True),
            dict(num_warps=warps, divisible=ALIGNED_INT8))


# (name, kernel, pointer and float argument types (others: i32), constexprs, compile options; the options key
# "divisible" names the arguments compiled as multiples of 16, as Triton specializes them at a launch)
CASES = [
    ("tree attention, 27B shape, 65 rows, 2 tokens a program", tree_attention._tree_attn_fwd, ATTENTION,
     dict(G=6, G_P2=8, TOK=2, BLOCK_M=16, BLOCK_N=64, T_P2=128, SPLIT=512, SPLIT_BLOCKS_P2=8, D=256, D_P2=256, FP32_DOT=False,
          ROUND_P=True, WRITE_OUT=True, PDL=True, PREFETCH=True), dict(num_warps=4, num_stages=2, enable_fp_fusion=False)),
    ("tree attention, 8B shape, decode, split keys merged in the kernel (5 blocks a split)",
     tree_attention._tree_attn_fwd, ATTENTION,
     dict(G=4, G_P2=4, TOK=1, BLOCK_M=16, BLOCK_N=64, T_P2=2, SPLIT=320, SPLIT_BLOCKS_P2=8, D=128, D_P2=128, FP32_DOT=False,
          ROUND_P=True, WRITE_OUT=False, PDL=True, PREFETCH=True), dict(num_warps=2, num_stages=3, enable_fp_fusion=False)),
    ("tree attention, 8B shape, c8 verify, 4 tokens a program", tree_attention._tree_attn_fwd, ATTENTION,
     dict(G=4, G_P2=4, TOK=4, BLOCK_M=16, BLOCK_N=64, T_P2=16, SPLIT=512, SPLIT_BLOCKS_P2=8, D=128, D_P2=128, FP32_DOT=False,
          ROUND_P=True, WRITE_OUT=True, PDL=True, PREFETCH=False), dict(num_warps=2, num_stages=2, enable_fp_fusion=False)),
    ("rmsnorm with residual", fused._rmsnorm_kernel, dict(x_ptr=BF16, res_ptr=BF16, w_ptr=BF16, y_ptr=BF16,
                                                          h_ptr=BF16, ys_ptr=BF16, eps="fp32"),
     dict(HAS_RES=True, QUANT=False, BLOCK=4096, SOFT_RNE=False, PDL=True), dict(num_warps=4)),
    ("rmsnorm with residual into int8 rows (a w8a8 draft's)", fused._rmsnorm_kernel,
     dict(x_ptr=BF16, res_ptr=BF16, w_ptr=BF16, y_ptr=ptr("i8"), h_ptr=BF16, ys_ptr=F32, eps="fp32"),
     dict(HAS_RES=True, QUANT=True, BLOCK=4096, SOFT_RNE=False, PDL=True), dict(num_warps=8)),
    ("silu_mul", fused._silu_mul_kernel, dict(gu_ptr=BF16, out_ptr=BF16, h_ptr=BF16, norm_eps="fp32"),
     dict(BLOCK=1024, HAS_SCALE=False, BLOCK_H=1, SOFT_RNE=False, PDL=True), dict(num_warps=4)),
    ("silu_mul after a folded norm (8B)", fused._silu_mul_kernel,
     dict(gu_ptr=BF16, out_ptr=BF16, h_ptr=BF16, norm_eps="fp32"),
     dict(BLOCK=1024, HAS_SCALE=True, BLOCK_H=4096, SOFT_RNE=False, PDL=True), dict(num_warps=4)),
    ("sigmoid_mul (gated attention's output gate)", fused._sigmoid_mul_kernel,
     dict(x_ptr=BF16, g_ptr=BF16, out_ptr=BF16), dict(BLOCK=1024, SOFT_RNE=False, PDL=True), dict(num_warps=4)),
    ("compact_kv", tree_ops._compact_kv_kernel, dict(k_ptr=BF16, v_ptr=BF16, start_ptr=I64, path_ptr=I64,
                                                     accepted_ptr=I64),
     dict(B=4, H=8, DH=128, P=16, BLOCK_D=128), dict(num_warps=1)),
    ("build_tree budget 64", tree_ops._build_tree_kernel, BUILD,
     dict(DP=15, K=8, BUDGET=64, CAP=128, NCAP=64, VMAX=255, CODE_BITS=13, PACKED=True, FILL=512, WCAP=128),
     dict(num_warps=1)),
    ("walk_tree", tree_ops._walk_tree_kernel, dict(post_ptr=I64, tokens_ptr=I64, parents_ptr=I64, count_ptr=I64,
                                                   path_ptr=I64, accepted_ptr=I64, bonus_ptr=I64),
     dict(N=64, NCAP=64, MAXD=15, PCAP=16), dict(num_warps=1)),
    ("commit_tokens", tree_ops._commit_tokens_kernel,
     dict(path_ptr=I64, accepted_ptr=I64, bonus_ptr=I64, ids_ptr=I64, start_ptr=I64, tokens_ptr=I64, out_ptr=I64,
          nf_ptr=I64), dict(P=16, PCAP=16, HAS_NF=True), dict(num_warps=1)),
    ("qk_norm_rope_store", fused._qk_norm_rope_store_kernel, QK_STORE,
     dict(HAS_QN=True, HAS_KN=True, HAS_SCALE=False, BLOCK_H=1, D=128, D_P2=128, R=128, SOFT_RNE=False, PDL=True),
     dict(num_warps=1, enable_fp_fusion=False)),
    ("qk_norm_rope_store after a folded norm (8B)", fused._qk_norm_rope_store_kernel, QK_STORE,
     dict(HAS_QN=True, HAS_KN=True, HAS_SCALE=True, BLOCK_H=4096, D=128, D_P2=128, R=128, SOFT_RNE=False, PDL=True),
     dict(num_warps=1, enable_fp_fusion=False)),
    ("qk_norm_rope_store after a folded norm, 8192 wide (two chunks)", fused._qk_norm_rope_store_kernel, QK_STORE,
     dict(HAS_QN=False, HAS_KN=False, HAS_SCALE=True, BLOCK_H=4096, D=128, D_P2=128, R=128, SOFT_RNE=False, PDL=True),
     dict(num_warps=1, enable_fp_fusion=False)),
    ("skinny linear, norm + residual prologue (SmolLM2 qkv)", skinny_linear._skinny_kernel, SKINNY,
     dict(NORM=True, HAS_RES=True, GLU=False, HAS_BIAS=False, **skinny_constexprs(960, 576)),
     dict(num_warps=4, enable_fp_fusion=False, divisible=ALIGNED_SKINNY)),
    ("skinny linear, SiLU * up epilogue (SmolLM2 gate/up)", skinny_linear._skinny_kernel, SKINNY,
     dict(NORM=True, HAS_RES=True, GLU=True, HAS_BIAS=False, **skinny_constexprs(1536, 576)),
     dict(num_warps=4, enable_fp_fusion=False, divisible=ALIGNED_SKINNY)),
    ("skinny linear, plain with bias (SmolLM2 down)", skinny_linear._skinny_kernel, SKINNY,
     dict(NORM=False, HAS_RES=False, GLU=False, HAS_BIAS=True, **skinny_constexprs(576, 1536)),
     dict(num_warps=2, enable_fp_fusion=False, divisible=ALIGNED_SKINNY)),
    ("skinny qkv with RoPE and the cache store (SmolLM2)", skinny_linear._skinny_rope_kernel,
     dict({k: v for k, v in SKINNY.items() if k != "y_ptr"}, cos_ptr=BF16, sin_ptr=BF16, slots_ptr=I64, q_ptr=BF16,
          kc_ptr=BF16, vc_ptr=BF16),
     dict(D=64, NORM=True, HAS_RES=True, HAS_BIAS=False, BLOCK_M=skinny_linear.BLOCK_M,
          BLOCK_K=skinny_linear.skinny_config(960, 576)[1], NUM_STAGES=3, SOFT_RNE=False, K_CHUNKS=3, UNROLL=1,
          PDL=True, PREFETCH=True),
     dict(num_warps=4, enable_fp_fusion=False,
          divisible=tuple(n for n in ALIGNED_SKINNY if n not in ("y_ptr", "s_ym")))),
    ("fused all-reduce + RMSNorm, width 2, 8B hidden", all_reduce._all_reduce_rmsnorm_kernel,
     dict(bufs_ptr=I64, pads_ptr=I64, offset="i64", res_ptr=BF16, w_ptr=BF16, y_ptr=BF16, h_ptr=BF16, eps="fp32"),
     dict(WORLD=2, HAS_RES=True, BLOCK=4096, SOFT_RNE=False, ALIGNED=True), dict(num_warps=8)),
    ("fused all-reduce + RMSNorm, width 8, no residual", all_reduce._all_reduce_rmsnorm_kernel,
     dict(bufs_ptr=I64, pads_ptr=I64, offset="i64", res_ptr=BF16, w_ptr=BF16, y_ptr=BF16, h_ptr=BF16, eps="fp32"),
     dict(WORLD=8, HAS_RES=False, BLOCK=1024, SOFT_RNE=False, ALIGNED=False), dict(num_warps=4)),
    ("gated delta recurrence, 27B shape", gated_delta._gated_delta_kernel,
     dict(mixed=BF16, a_ptr=BF16, b_ptr=BF16, A_log=F32, dt_bias=F32, state=F32, state_out=F32, out=BF16,
          paths=I32, lengths=I32, starts=I32, scale="fp32"),
     dict(KH=16, HV=48, DK=128, DV=128, DKP=128, BV=gated_delta.TILE_COLUMNS),
     dict(num_warps=gated_delta.WARPS, enable_fp_fusion=gated_delta.FP_FUSION)),
    ("tree schedule of the Gated DeltaNet layers, a DDTree-64 verify", gated_delta._tree_schedule_kernel,
     dict(parents=I64, mask=U8, scratch=I32, ancestors=I64, paths=I32, lengths=I32, starts=I32),
     dict(K1=3, TP=128, BR=16), dict(num_warps=4)),
    ("verify_rows, the 8B's DDTree-15 verify", verify_rows._verify_rows_kernel,
     dict(tokens_ptr=I64, start_ptr=I64, tree_ptr=I64, depth_ptr=I64, mask_ptr=ptr("i1"), emb_ptr=BF16,
          table_ptr=BF16, ids_ptr=I64, x_ptr=BF16, cos_ptr=BF16, sin_ptr=BF16, slots_ptr=I64, vis_ptr=I32),
     dict(EMBED=True, BLOCK_H=1024, BLOCK_R=128, BLOCK_T=16, PDL=True), dict(num_warps=1)),
    ("argmax, SmolLM2's float32 logits (49,152: 12 chunks merged in the kernel)", argmax._argmax_kernel,
     dict(x_ptr=F32, part_ptr=I64, count_ptr=I32, out_ptr=I64),
     dict(CHUNK=4096, CP=16, ONE_CHUNK=False, PDL=True),
     dict(num_warps=8, divisible=("x_ptr", "stride_row", "V", "part_ptr", "count_ptr", "out_ptr"))),
    int8_case("an 8B draft's qkv over context and block (32 rows)", 32, 6144, 4096),
    int8_case("an 8B draft's down projection (16 rows)", 16, 4096, 12288),
    int8_case("the 8B's LM head into float32 (15 rows)", 15, 151936, 4096, out=F32),
    int8_case("an 8B draft's fc over 64 context rows", 64, 4096, 20480),
    int8_case("a prompt's context rows through fc (300 rows)", 300, 4096, 20480),
    int8_case("an 8B draft's qkv over context and block (32 rows)", 32, 6144, 4096, a8=True),
    int8_case("an 8B draft's gate/up (16 rows)", 16, 24576, 4096, a8=True),
    int8_case("an 8B draft's o (16 rows)", 16, 4096, 4096, a8=True),
    int8_case("the 8B's LM head into float32 (15 rows)", 15, 151936, 4096, out=F32, a8=True),
]


@pytest.mark.cpu
@pytest.mark.parametrize("name,kernel,types,constexprs,options", CASES, ids=[c[0] for c in CASES])
def test_kernel_compiles_for_the_h200(name, kernel, types, constexprs, options):
    names = list(inspect.signature(kernel.fn).parameters)
    assert set(types) | set(constexprs) <= set(names), f"{name}: unknown arguments"
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    options = dict(options)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in options.pop("divisible", ())}
    compiled = triton.compile(compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=H200, options=options)
    assert compiled.asm.get("cubin"), f"{name}: no cubin"
    assert compiled.metadata.shared <= HOPPER_SHARED, f"{name}: {compiled.metadata.shared} bytes of shared memory"
    if constexprs.get("PDL") and constexprs.get("PREFETCH"):  # the L2 prefetch overlaps the kernel before: no later
        ptx = compiled.asm["ptx"]
        wait = ptx.find("griddepcontrol.wait")
        assert wait > 0 and "cp.async.bulk.prefetch" in ptx[:wait], f"{name}: no prefetch before the PDL wait"
        assert "cp.async.bulk.prefetch" not in ptx[wait:], f"{name}: a prefetch after the PDL wait"
