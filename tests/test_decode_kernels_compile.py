"""The decode kernels, cached_attention and lm_head_confidence compile for a real GPU (sm_90, H100/H200) even on
a machine without one.

The interpreter accepts things the CUDA lowering rejects (and vice versa), so this test compiles
every kernel variant to a cubin with Triton's bundled ptxas, in a subprocess with the interpreter off.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _compile_all() -> list[str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    C, S, Vf, Rm = [importlib.import_module("mrp_triton." + m) for m in ("confidence", "select", "verify", "remask")]
    target = GPUTarget("cuda", 90, 32)
    done = []

    def comp(fn, sig, consts, nw, name):
        triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target,
                       options={"num_warps": nw, "enable_fp_fusion": False})
        done.append(name)

    for dt in ("*bf16", "*fp16", "*fp32"):
        for has_res, has_skip, sample, final, t_tensor, bv, nw in [(True, True, False, True, False, 2048, 8),
                                                                   (True, False, True, False, True, 1024, 4),
                                                                   (False, True, True, True, False, 2048, 8),
                                                                   (False, False, False, False, True, 1024, 4)]:
            sig = {"logits_ptr": dt, "stride_ln": "i64", "res_ptr": dt, "stride_rr": "i64", "stride_rn": "i64",
                   "R": "i32", "skip_ptr": "*u8", "keys_ptr": "*i64", "part_ptr": "*fp32", "part_idx_ptr": "*i64",
                   "tok_ptr": "*i64", "prob_ptr": "*fp32", "lse_ptr": "*fp32", "V": "i32", "chunk": "i32",
                   "S": "i32", "scale": "fp32", "inv_t": "fp32", "t_ptr": "*fp64", "mask_id": "i32",
                   "seed_h": "i64", "HAS_RES": "constexpr", "HAS_SKIP": "constexpr", "DO_SAMPLE": "constexpr",
                   "FINAL": "constexpr", "T_TENSOR": "constexpr", "BLOCK_V": "constexpr"}
            comp(C._conf_partial_kernel, sig, {"HAS_RES": has_res, "HAS_SKIP": has_skip, "DO_SAMPLE": sample,
                                               "FINAL": final, "T_TENSOR": t_tensor, "BLOCK_V": bv}, nw,
                 f"confidence {dt} {bv}")
    comp(C._conf_merge_kernel, {"part_ptr": "*fp32", "part_idx_ptr": "*i64", "tok_ptr": "*i64", "prob_ptr": "*fp32",
                                "lse_ptr": "*fp32", "S": "i32", "BLOCK_S": "constexpr"}, {"BLOCK_S": 64}, 1, "merge")
    for n_t in (True, False):
        for dyn, thr_t in ((True, True), (True, False), (False, False)):
            comp(S._select_kernel, {"block_ptr": "*i64", "tok_ptr": "*i64", "conf_ptr": "*fp32", "n_ptr": "*i64",
                                    "out_ptr": "*u8", "L": "i32", "n_scalar": "i32", "mask_id": "i32", "thr": "fp32",
                                    "thr_ptr": "*fp64", "N_TENSOR": "constexpr", "DYNAMIC": "constexpr",
                                    "THR_TENSOR": "constexpr", "BLOCK_L": "constexpr", "JB": "constexpr"},
                 {"N_TENSOR": n_t, "DYNAMIC": dyn, "THR_TENSOR": thr_t, "BLOCK_L": 16, "JB": 16}, 4, "select")
    comp(Vf._verify_kernel, {"block_ptr": "*i64", "dpos_ptr": "*i64", "dtok_ptr": "*i64", "ttok_ptr": "*i64",
                             "tconf_ptr": "*fp32", "acc_ptr": "*i32", "bonus_ptr": "*i64", "L": "i32", "K": "i32",
                             "mask_id": "i32", "BLOCK_L": "constexpr"}, {"BLOCK_L": 16}, 1, "verify")
    for tau in (True, False):
        for thr_t in (True, False):
            comp(Rm._remask_kernel, {"block_ptr": "*i64", "rev_ptr": "*u8", "score_ptr": "*fp32", "out_ptr": "*u8",
                                     "L": "i32", "thr": "fp32", "thr_ptr": "*fp64", "mask_id": "i32",
                                     "IS_TAU": "constexpr", "THR_TENSOR": "constexpr", "BLOCK_L": "constexpr"},
                 {"IS_TAU": tau, "THR_TENSOR": thr_t, "BLOCK_L": 16}, 1, "remask")
    A = importlib.import_module("mrp_triton.cached_attention")
    strides = ("sq_b", "sq_h", "sq_t", "sk_b", "sk_h", "sk_t", "sv_b", "sv_h", "sv_t", "sc_b", "sc_h", "sc_t",
               "sp_b", "sp_t", "so_b", "so_h", "so_t")
    consts = ("GROUP", "HAS_SEG", "DOT_FP32", "IEEE", "BLOCK_M", "BLOCK_N", "BLOCK_D")
    for dt, seg, d in (("*bf16", False, 128), ("*bf16", True, 128), ("*fp16", False, 64), ("*fp32", True, 128)):
        sig = {"q_ptr": dt, "k_ptr": dt, "v_ptr": dt, "ck_ptr": dt, "cv_ptr": dt, "len_ptr": "*i64", "pos_ptr": "*i64",
               "seg_ptr": "*i64", "o_ptr": dt, **{s_: "i64" for s_ in strides}, "T": "i32", "Hq": "i32",
               "HEAD_DIM": "i32", "block_size": "i32", "scale": "fp32", **{c: "constexpr" for c in consts}}
        comp(A._cached_attention_kernel, sig, {"GROUP": 2, "HAS_SEG": seg, "DOT_FP32": False, "IEEE": dt == "*fp32",
                                              "BLOCK_M": A._BLOCK_M, "BLOCK_N": A._BLOCK_N, "BLOCK_D": d},
             A._NUM_WARPS, f"cached_attention {dt} seg={seg}")
    L = importlib.import_module("mrp_triton.lm_head_confidence")
    for dt, base, skip, (bn, bv, bk, nw) in (("*bf16", None, True, (64, 256, 64, 8)),
                                            ("*bf16", "*bf16", False, (16, 128, 128, 4)),
                                            ("*fp32", "*fp32", True, (64, 64, 32, 4))):
        sig = {"h_ptr": dt, "w_ptr": dt, "base_ptr": base or "*fp32", "order_ptr": "*i64", "kept_ptr": "*i64",
               "m_ptr": "*fp32", "d_ptr": "*fp32", "idx_ptr": "*i32", "N": "i32", "V": "i32", "H": "i32",
               "stride_h": "i64", "stride_w": "i64", "stride_base": "i64", "inv_temp": "fp32", "mask_token": "i32",
               "v_per_split": "i32", "n_splits": "i32"}
        consts = {"HAS_BASE": base is not None, "HAS_MASK": True, "HAS_SKIP": skip, "DOT_FP32": False,
                  "IEEE": dt == "*fp32", "BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_K": bk}
        comp(L._partials_kernel, {**sig, **{c: "constexpr" for c in consts}}, consts, nw,
             f"lm_head_confidence {dt} skip={skip}")
    comp(L._kept_first_kernel, {"skip_ptr": "*u8", "order_ptr": "*i64", "kept_ptr": "*i64", "N": "i32",
                                "BLOCK": "constexpr"}, {"BLOCK": 1024}, 4, "lm_head_confidence kept rows first")
    for skip in (True, False):
        comp(L._merge_kernel, {"m_ptr": "*fp32", "d_ptr": "*fp32", "idx_ptr": "*i32", "order_ptr": "*i64",
                               "kept_ptr": "*i64", "tok_ptr": "*i64", "prob_ptr": "*fp32", "lse_ptr": "*fp32",
                               "n_splits": "i32", "HAS_SKIP": "constexpr", "BLOCK_S": "constexpr"},
             {"HAS_SKIP": skip, "BLOCK_S": 64}, 4, f"lm_head_confidence merge skip={skip}")
    return done


def test_kernels_compile_for_sm90():
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "compiled 34 kernel variants" in r.stdout, r.stdout


if __name__ == "__main__":
    print(f"compiled {len(_compile_all())} kernel variants")
