"""What each Triton kernel of mrp_triton asks of an sm_90 GPU (H100 / H200), read from its compiled code on a machine
without one: registers a thread, spilled bytes, shared memory, programs per SM, the width of its global loads,
whether its K loop's loads are pipelined (asynchronous copies into shared memory), whether tiles come through the
TMA copy engine and whether they multiply on wgmma.

    python benchmarks/sm90_kernels.py                  # every kernel variant the library launches
    python benchmarks/sm90_kernels.py --lm-head-sweep  # lm_head_confidence: the tile table and bench_mrp_head's SWEEP

Each variant is compiled as a launch at real shapes specialises it: the pointers and the sizes and strides that
are multiples of 16 there (V = 151936, H = 2048, head_dim 128, ...) are marked so (Triton marks each such
argument at launch), the counts that vary (rows, query length, splits) are not. Registers and spills come from
the cubin (Triton's bundled cuobjdump). These figures rule things out, they time nothing: a 2-byte load per
element where 16-byte vectors could stream, a config that spills or fits one program per SM. Speed comes from
the benchmarks on the GPU. tests/test_decode_kernels_compile.py compiles every variant and checks the loads.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REGISTERS_PER_SM = 65536
SHARED_PER_SM = 233472  # bytes; each program also reserves 1 KiB
_LOAD = re.compile(r"ld\.global(?:\.[a-z_:0-9]+)*?(?:\.v(\d))?\.[bfsu](\d+)\s")


@dataclass(frozen=True)
class Variant:
    """One compiled form of a kernel: ``module``/``kernel`` names it, ``signature`` types every argument (the
    constexprs as "constexpr"), ``constexprs`` sets those, ``divisible`` lists the arguments a launch at real
    shapes finds to be multiples of 16 (besides every pointer)."""

    name: str
    module: str
    kernel: str
    signature: dict
    constexprs: dict
    num_warps: int
    num_stages: int | None = None
    divisible: tuple[str, ...] = field(default=())

    def function(self):
        return getattr(importlib.import_module(f"mrp_triton.{self.module}"), self.kernel)


def _ptrs_divisible(signature: dict, *more: str) -> tuple[str, ...]:
    return tuple(name for name, kind in signature.items() if kind.startswith("*")) + more


def _confidence() -> list[Variant]:
    out = []
    for dt in ("*bf16", "*fp16", "*fp32"):
        for has_res, has_skip, ban, pen, offs, sample, cut, ent, final, t_tensor, prefetch, bv, nw in [
                (True, True, False, False, False, False, False, False, True, False, True, 2048, 8),
                (True, False, False, False, False, True, True, False, False, True, True, 1024, 4),  # top-k / top-p
                (False, True, False, False, False, True, False, False, True, False, True, 2048, 8),
                (False, False, False, False, False, False, False, False, False, True, True, 1024, 4),
                (False, True, False, False, False, False, False, False, True, False, True, 2048, 8),
                (False, True, True, False, False, False, False, False, True, False, True, 2048, 8),  # banned tokens
                (False, True, False, True, False, False, False, False, True, True, True, 2048, 8),  # repetition penalty
                # presence / frequency penalties and a logit bias
                (False, True, False, False, True, False, False, False, True, True, True, 2048, 8),
                # sampled entropy-bounded
                (False, True, False, False, False, True, False, True, True, True, True, 2048, 8),
                (False, True, False, False, False, False, False, False, True, False, False, 2048, 8)]:
            sig = {"logits_ptr": dt, "stride_ln": "i64", "res_ptr": dt, "stride_rr": "i64", "stride_rn": "i64",
                   "R": "i32", "skip_ptr": "*u8", "keys_ptr": "*i64", "cut_ptr": "*fp32", "ban_tok_ptr": "*u8",
                   "ban_rows_ptr": "*u8", "sample_ptr": "*u8", "seen_ptr": "*u8", "off_ptr": "*fp32",
                   "bias_ptr": "*fp32", "seen_rows_ptr": "*i64", "pen_ptr": "*fp64",
                   "part_ptr": "*fp32", "part_idx_ptr": "*i64", "tok_ptr": "*i64", "prob_ptr": "*fp32",
                   "lse_ptr": "*fp32", "ent_ptr": "*fp32", "V": "i32", "tiles": "i32", "S": "i32", "scale": "fp32",
                   "inv_t": "fp32",
                   "t_ptr": "*fp64", "t_stride": "i64", "mask_id": "i32", "seed_h": "i64", "HAS_RES": "constexpr",
                   "HAS_SKIP": "constexpr", "HAS_BAN": "constexpr", "HAS_PENALTY": "constexpr",
                   "HAS_OFFSETS": "constexpr", "HAS_BIAS": "constexpr", "DO_SAMPLE": "constexpr",
                   "SAMPLE_ROWS": "constexpr",
                   "HAS_CUT": "constexpr",
                   "ENTROPY": "constexpr", "FINAL": "constexpr", "T_TENSOR": "constexpr", "PREFETCH": "constexpr",
                   "BLOCK_V": "constexpr"}
            rows = sample and t_tensor  # a sampled launch with a temperature a row: greedy rows among them too
            consts = {"HAS_RES": has_res, "HAS_SKIP": has_skip, "HAS_BAN": ban, "HAS_PENALTY": pen,
                      "HAS_OFFSETS": offs, "HAS_BIAS": offs, "DO_SAMPLE": sample, "SAMPLE_ROWS": rows, "HAS_CUT": cut,
                      "ENTROPY": ent, "FINAL": final, "T_TENSOR": t_tensor, "PREFETCH": prefetch, "BLOCK_V": bv}
            out.append(Variant(f"confidence {dt[1:]} res={has_res} sample={'rows' if rows else sample}"
                               f"{' cut' if cut else ''}"
                               f"{' ban' if ban else ''}{' penalty' if pen else ''}"
                               f"{' offsets bias' if offs else ''}{' entropy' if ent else ''} "
                               f"prefetch={prefetch} {bv}",
                               "confidence",
                               "_conf_partial_kernel", sig, consts, nw,
                               divisible=_ptrs_divisible(sig, "stride_ln", "stride_rr", "stride_rn", "V")))
    sig = {"part_ptr": "*fp32", "part_idx_ptr": "*i64", "tok_ptr": "*i64", "prob_ptr": "*fp32", "lse_ptr": "*fp32",
           "ent_ptr": "*fp32", "S": "i32", "ENTROPY": "constexpr", "BLOCK_S": "constexpr"}
    out += [Variant(f"confidence merge entropy={ent}", "confidence", "_conf_merge_kernel", sig,
                    {"ENTROPY": ent, "BLOCK_S": 64}, 1, divisible=_ptrs_divisible(sig)) for ent in (False, True)]
    return out


def _decisions() -> list[Variant]:
    out = []
    sig = {"block_ptr": "*i64", "tok_ptr": "*i64", "conf_ptr": "*fp32", "n_ptr": "*i64", "out_ptr": "*u8", "L": "i32",
           "n_scalar": "i32", "mask_id": "i32", "thr": "fp32", "thr_ptr": "*fp64", "N_TENSOR": "constexpr",
           "DYNAMIC": "constexpr", "BY_ENTROPY": "constexpr", "THR_TENSOR": "constexpr", "BLOCK_L": "constexpr",
           "JB": "constexpr"}
    for n_t in (True, False):
        for dyn, eb, thr_t in ((True, False, True), (True, False, False), (False, False, False), (False, True, True)):
            out.append(Variant(f"select n_tensor={n_t} dynamic={dyn} entropy={eb} thr_tensor={thr_t}", "select",
                               "_select_kernel", sig, {"N_TENSOR": n_t, "DYNAMIC": dyn, "BY_ENTROPY": eb,
                                                       "THR_TENSOR": thr_t, "BLOCK_L": 16, "JB": 16},
                               4, divisible=_ptrs_divisible(sig)))
    sig = {"block_ptr": "*i64", "dpos_ptr": "*i64", "dtok_ptr": "*i64", "ttok_ptr": "*i64", "tconf_ptr": "*fp32",
           "acc_ptr": "*i32", "bonus_ptr": "*i64", "L": "i32", "K": "i32", "mask_id": "i32", "BLOCK_L": "constexpr"}
    out.append(Variant("verify", "verify", "_verify_kernel", sig, {"BLOCK_L": 16}, 1, divisible=_ptrs_divisible(sig)))
    sig = {"block_ptr": "*i64", "rev_ptr": "*u8", "score_ptr": "*fp32", "out_ptr": "*u8", "L": "i32", "thr": "fp32",
           "thr_ptr": "*fp64", "mask_id": "i32", "IS_TAU": "constexpr", "THR_TENSOR": "constexpr",
           "BLOCK_L": "constexpr"}
    for tau in (True, False):
        for thr_t in (True, False):
            out.append(Variant(f"remask tau={tau} thr_tensor={thr_t}", "remask", "_remask_kernel", sig,
                               {"IS_TAU": tau, "THR_TENSOR": thr_t, "BLOCK_L": 16}, 1, divisible=_ptrs_divisible(sig)))
    sig = {"block_ptr": "*i64", "pos_ptr": "*i64", "starts_ptr": "*i64", "ends_ptr": "*i64", "eos_ptr": "*u8",
           "L": "i32", "mask_id": "i32", "filler": "i32", "BLOCK_L": "constexpr"}
    out.append(Variant("settle_rows", "settle", "_settle_kernel", sig, {"BLOCK_L": 16}, 1,
                       divisible=_ptrs_divisible(sig)))
    return out


def attention_variant(dt: str, seg: bool, d: int, group: int, splits: int, ragged: bool, block_n: int | None = None,
                      num_stages: int | None = None, block_m: int | None = None) -> Variant:
    """The cached-attention kernel for ``dt`` ("*bf16", ...) keys, head dim ``d`` and ``group`` query heads a
    key/value head, with query tiles of ``block_m`` positions a head and key/value tiles of ``block_n`` slots
    (defaults: the launcher's on an H200) in ``num_stages``."""
    attention = importlib.import_module("mrp_triton.cached_attention")
    strides = ("sq_b", "sq_h", "sq_t", "sk_b", "sk_h", "sk_t", "sv_b", "sv_h", "sv_t", "sc_b", "sc_h", "sc_t",
               "sp_b", "sp_t", "spl_b", "spl_t", "so_b", "so_h", "so_t")
    consts = ("GROUP", "GROUP_P2", "ONE_SPLIT", "HAS_SEG", "RAGGED", "DOT_FP32", "IEEE", "BLOCK_M", "BLOCK_N",
              "BLOCK_D")
    sig = {"q_ptr": dt, "k_ptr": dt, "v_ptr": dt, "ck_ptr": dt, "cv_ptr": dt, "len_ptr": "*i64", "pos_ptr": "*i64",
           "seg_ptr": "*i64", "place_ptr": "*i64", "o_ptr": dt, "part_ptr": "*fp32", "ml_ptr": "*fp32",
           **{s: "i64" for s in strides}, "T": "i32", "Hq": "i32", "Hkv": "i32", "HEAD_DIM": "i32",
           "block_size": "i32", "scale": "fp32", "splits": "i32", **{c: "constexpr" for c in consts}}
    return Variant(f"cached_attention {dt[1:]} seg={seg} D={d} group={group} splits={splits} ragged={ragged}",
                   "cached_attention", "_cached_attention_kernel", sig,
                   {"GROUP": group, "GROUP_P2": 1 << (group - 1).bit_length(), "ONE_SPLIT": splits == 1,
                    "HAS_SEG": seg, "RAGGED": ragged, "DOT_FP32": False, "IEEE": dt == "*fp32",
                    "BLOCK_M": block_m or attention._BLOCK_M, "BLOCK_N": block_n or attention._BLOCK_N, "BLOCK_D": d},
                   attention._NUM_WARPS, num_stages,
                   divisible=_ptrs_divisible(sig, *(s for s in strides if s not in ("sp_t", "spl_t")), "HEAD_DIM"))


def _cached_attention() -> list[Variant]:
    out = [attention_variant(*case) for case in (("*bf16", False, 128, 2, 1, False), ("*bf16", True, 128, 2, 6, False),
                                                 ("*bf16", False, 128, 4, 8, False), ("*fp16", False, 64, 3, 1, False),
                                                 ("*fp32", True, 128, 2, 2, False), ("*bf16", False, 128, 2, 1, True),
                                                 ("*bf16", True, 128, 2, 6, True))]
    sig = {"part_ptr": "*fp32", "ml_ptr": "*fp32", "place_ptr": "*i64", "o_ptr": "*bf16", "spl_b": "i64",
           "spl_t": "i64", "so_b": "i64", "so_h": "i64", "so_t": "i64", "T": "i32", "Hq": "i32", "HEAD_DIM": "i32",
           "splits": "i32", "RAGGED": "constexpr", "SPLITS_P2": "constexpr", "BLOCK_D": "constexpr"}
    for ragged in (False, True):
        out.append(Variant(f"cached_attention merge splits=6 ragged={ragged}", "cached_attention",
                           "_merge_splits_kernel", sig, {"RAGGED": ragged, "SPLITS_P2": 8, "BLOCK_D": 128}, 1,
                           divisible=_ptrs_divisible(sig, "spl_b", "so_b", "so_h", "so_t", "HEAD_DIM")))
    return out


LM_HEAD_SIGNATURE = {"h_ptr": "*bf16", "w_ptr": "*bf16", "w_desc": "*bf16", "base_ptr": "*fp32", "order_ptr": "*i64",
                     "kept_ptr": "*i64", "ban_tok_ptr": "*u8", "ban_rows_ptr": "*u8", "seen_ptr": "*u8",
                     "off_ptr": "*fp32", "bias_ptr": "*fp32", "seen_rows_ptr": "*i64", "pen_ptr": "*fp64",
                     "m_ptr": "*fp32", "d_ptr": "*fp32", "t_ptr": "*fp32", "idx_ptr": "*i32", "topv_ptr": "*fp32",
                     "topi_ptr": "*i32", "N": "i32",
                     "V": "i32", "H": "i32", "stride_h": "i64", "stride_w": "i64", "stride_base": "i64",
                     "inv_temp": "fp32", "mask_token": "i32", "v_per_split": "i32", "n_splits": "i32"}
LM_HEAD_CONSTEXPRS = ("HAS_BASE", "HAS_MASK", "HAS_SKIP", "HAS_BAN", "HAS_PENALTY", "HAS_OFFSETS", "HAS_BIAS",
                      "DOT_FP32", "IEEE", "ROWS_MAJOR", "W_TMA", "FLATTEN", "TOP_M", "ENTROPY", "BLOCK_N", "BLOCK_V",
                      "BLOCK_K")


def lm_head_variant(name: str, config: dict, dtype: str = "bf16", base: str | None = None,
                    skip: bool = True, ban: bool = False, entropy: bool = False, penalty: bool = False,
                    offsets: bool = False) -> Variant:
    """The partials kernel of lm_head_confidence with tile ``config`` (the keys of its ``_config``; ``ban``: with
    banned tokens; ``entropy``: with the entropy's running sum; ``penalty``: with a repetition penalty; ``offsets``:
    with logit offsets and a logit bias)."""
    tma = bool(config.get("tma"))
    w_desc = f"tensordesc<{dtype}[{config['BLOCK_V']}, {config['BLOCK_K']}]>" if tma else f"*{dtype}"
    sig = dict(LM_HEAD_SIGNATURE, h_ptr=f"*{dtype}", w_ptr=f"*{dtype}", w_desc=w_desc, base_ptr=f"*{base or 'fp32'}",
               **{c: "constexpr" for c in LM_HEAD_CONSTEXPRS})
    consts = {"HAS_BASE": base is not None, "HAS_MASK": True, "HAS_SKIP": skip, "HAS_BAN": ban,
              "HAS_PENALTY": penalty, "HAS_OFFSETS": offsets, "HAS_BIAS": offsets,
              "DOT_FP32": False,
              "IEEE": dtype == "fp32", "ROWS_MAJOR": config.get("rows_major", False), "W_TMA": tma,
              "FLATTEN": bool(config.get("flatten")), "TOP_M": config.get("top_m", 0), "ENTROPY": entropy,
              "BLOCK_N": config["BLOCK_N"],
              "BLOCK_V": config["BLOCK_V"], "BLOCK_K": config["BLOCK_K"]}
    return Variant(name, "lm_head_confidence", "_partials_kernel", sig, consts, config["num_warps"],
                   config.get("num_stages"),
                   divisible=_ptrs_divisible(sig, "V", "H", "stride_h", "stride_w", "stride_base", "v_per_split"))


def _lm_head() -> list[Variant]:
    out = [lm_head_variant(f"lm_head_confidence {dt} base={base} skip={skip} rows_major={rm} tma={tma} "
                           f"flatten={tma} {bn}x{bv}x{bk}",
                           dict(BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, num_warps=nw, num_stages=3, rows_major=rm, tma=tma,
                                flatten=tma), dt, base, skip)
           for dt, base, skip, rm, tma, (bn, bv, bk, nw) in (("bf16", None, True, False, False, (64, 256, 64, 8)),
                                                             ("bf16", None, True, False, True, (64, 256, 64, 8)),
                                                             ("bf16", None, True, True, False, (128, 128, 64, 8)),
                                                             ("bf16", None, True, True, True, (128, 128, 64, 8)),
                                                             ("bf16", "bf16", False, False, False, (16, 128, 128, 4)),
                                                             ("bf16", "bf16", False, True, False, (64, 128, 64, 4)),
                                                             ("fp32", "fp32", True, False, True, (64, 64, 32, 4)),
                                                             ("fp32", "fp32", True, False, False, (64, 64, 32, 4)))]
    # a verify forward's call with the drafts' candidate lists (draft_candidates=16): the default tile of N <= 64
    out.append(lm_head_variant("lm_head_confidence bf16 skip=True top_m=16 64x128x128", dict(
        BLOCK_N=64, BLOCK_V=128, BLOCK_K=128, num_warps=4, num_stages=4, top_m=16)))
    # a decoding step before min_new_tokens: EOS banned in the rows that have not reached it
    out.append(lm_head_variant("lm_head_confidence bf16 skip=True ban 64x128x128", dict(
        BLOCK_N=64, BLOCK_V=128, BLOCK_K=128, num_warps=4, num_stages=4), ban=True))
    # a greedy entropy-bounded step: the entropy's running sum beside the softmax's
    out.append(lm_head_variant("lm_head_confidence bf16 skip=True entropy 64x128x128", dict(
        BLOCK_N=64, BLOCK_V=128, BLOCK_K=128, num_warps=4, num_stages=4), entropy=True))
    # a greedy step under a repetition penalty: the seen bytes of each tile's columns beside the logits
    out.append(lm_head_variant("lm_head_confidence bf16 skip=True penalty 64x128x128", dict(
        BLOCK_N=64, BLOCK_V=128, BLOCK_K=128, num_warps=4, num_stages=4), penalty=True))
    # a greedy step under presence / frequency penalties and a logit bias: each tile's fp32 offsets and bias beside
    # the logits
    out.append(lm_head_variant("lm_head_confidence bf16 skip=True offsets bias 64x128x128", dict(
        BLOCK_N=64, BLOCK_V=128, BLOCK_K=128, num_warps=4, num_stages=4), offsets=True))
    # a greedy step of a model loaded in float16
    out.append(lm_head_variant("lm_head_confidence fp16 skip=True 64x128x128", dict(
        BLOCK_N=64, BLOCK_V=128, BLOCK_K=128, num_warps=4, num_stages=4), "fp16"))
    sig = {"skip_ptr": "*u8", "order_ptr": "*i64", "kept_ptr": "*i64", "N": "i32", "BLOCK": "constexpr"}
    out.append(Variant("lm_head_confidence kept rows first", "lm_head_confidence", "_kept_first_kernel", sig,
                       {"BLOCK": 1024}, 4, divisible=_ptrs_divisible(sig)))
    sig = {"m_ptr": "*fp32", "d_ptr": "*fp32", "t_ptr": "*fp32", "idx_ptr": "*i32", "order_ptr": "*i64",
           "kept_ptr": "*i64", "tok_ptr": "*i64", "prob_ptr": "*fp32", "lse_ptr": "*fp32", "ent_ptr": "*fp32",
           "n_splits": "i32", "HAS_SKIP": "constexpr", "ENTROPY": "constexpr", "BLOCK_S": "constexpr"}
    out += [Variant(f"lm_head_confidence merge skip={skip} entropy={ent}", "lm_head_confidence", "_merge_kernel", sig,
                    {"HAS_SKIP": skip, "ENTROPY": ent, "BLOCK_S": 64}, 4, divisible=_ptrs_divisible(sig))
            for skip, ent in ((True, False), (False, False), (True, True))]
    return out


def _model_ops() -> list[Variant]:
    out = []
    for dt in ("bf16", "fp16", "fp32"):  # fp16: a model loaded in float16 (as on a GPU without bf16 units: sm_75)
        sig = {"x_ptr": f"*{dt}", "r_ptr": f"*{dt}", "w_ptr": f"*{dt}", "y_ptr": f"*{dt}", "s_ptr": f"*{dt}",
               "n_cols": "i32", "eps": "fp32", "stride_x": "i64", "stride_r": "i64", "stride_y": "i64",
               "stride_s": "i64", "HAS_RESIDUAL": "constexpr", "BLOCK": "constexpr"}
        out += [Variant(f"rms_norm {dt} residual={res}", "rms_norm", "_rms_norm_kernel", sig,
                        {"HAS_RESIDUAL": res, "BLOCK": 2048}, 8,
                        divisible=_ptrs_divisible(sig, "n_cols", "stride_x", "stride_r", "stride_y", "stride_s"))
                for res in (False, True)]
        sig = {"g_ptr": f"*{dt}", "u_ptr": f"*{dt}", "o_ptr": f"*{dt}", "F": "i32", "stride_g": "i32",
               "stride_u": "i32", "BLOCK": "constexpr"}
        swiglu = importlib.import_module("mrp_triton.swiglu")
        out.append(Variant(f"swiglu {dt}", "swiglu", "_swiglu_kernel", sig, {"BLOCK": swiglu._BLOCK},
                           swiglu._NUM_WARPS, divisible=_ptrs_divisible(sig, "F", "stride_g", "stride_u")))
        sig = {"q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "qw_ptr": f"*{dt}", "kw_ptr": f"*{dt}", "cos_ptr": "*fp32",
               "sin_ptr": "*fp32", "qo_ptr": f"*{dt}", "ko_ptr": f"*{dt}", "T": "i32", "Hq": "i32", "Hkv": "i32",
               "D": "i32", "eps": "fp32", "stride_qb": "i64", "stride_qt": "i64", "stride_kb": "i64",
               "stride_kt": "i64", "stride_cb": "i64", "stride_ct": "i64", "stride_sb": "i64", "stride_st": "i64",
               "BLOCK_HQ": "constexpr", "BLOCK_HK": "constexpr", "BLOCK_HALF": "constexpr"}
        strides = [name for name in sig if name.startswith("stride_")]
        out.append(Variant(f"qk_norm_rope {dt}", "qk_norm_rope", "_qk_norm_rope_kernel", sig,
                           {"BLOCK_HQ": 16, "BLOCK_HK": 8, "BLOCK_HALF": 64}, 4,
                           divisible=_ptrs_divisible(sig, "Hq", "D", *strides)))
        sig = {"ids_ptr": "*i64", "e_ptr": f"*{dt}", "h_ptr": f"*{dt}", "ew_ptr": f"*{dt}", "hw_ptr": f"*{dt}",
               "o_ptr": f"*{dt}", "V": "i32", "H": "i32", "eps": "fp32", "stride_e": "i64", "stride_h": "i64",
               "stride_o": "i64", "ROUND_E": "constexpr", "ROUND_H": "constexpr", "BLOCK": "constexpr"}
        out.append(Variant(f"mrp_input {dt}", "mrp_input", "_mrp_input_kernel", sig,
                           {"ROUND_E": True, "ROUND_H": True, "BLOCK": 2048}, 8,
                           divisible=_ptrs_divisible(sig, "V", "H", "stride_e", "stride_h", "stride_o")))
        out += _backward_kernels(dt) if dt != "fp16" else []  # training runs in bf16 autocast or fp32
    # a draft step among 16 listed tokens a position (draft_candidates=16), greedy and sampled (and a float16 model's)
    sig = {"h_ptr": "*bf16", "hs_ptr": "*bf16", "w_ptr": "*bf16", "mean_ptr": "*fp32", "ids_ptr": "*i64",
           "rest_ptr": "*fp32", "skip_ptr": "*u8", "inv_t": "fp32", "t_ptr": "*fp64", "t_stride": "i64",
           "seen_ptr": "*u8", "off_ptr": "*fp32", "bias_ptr": "*fp32", "seen_rows_ptr": "*i64",
           "pen_ptr": "*fp64", "z_ptr": "*fp32", "lse_ptr": "*fp32",
           "tok_ptr": "*i64", "prob_ptr": "*fp32", "M": "i32", "H": "i32", "V": "i32", "stride_h": "i64",
           "stride_hs": "i64", "stride_w": "i64", "stride_ids": "i64", "HAS_SKIP": "constexpr", "GREEDY": "constexpr",
           "T_TENSOR": "constexpr", "HAS_PENALTY": "constexpr", "HAS_OFFSETS": "constexpr",
           "HAS_BIAS": "constexpr", "BLOCK_M": "constexpr", "BLOCK_H": "constexpr"}
    out += [Variant(f"candidate_confidence bf16 greedy={greedy}{' penalty' if pen else ''}"
                    f"{' offsets bias' if offs else ''}",
                    "candidate_confidence", "_listed_kernel", sig,
                    {"HAS_SKIP": True, "GREEDY": greedy, "T_TENSOR": not greedy, "HAS_PENALTY": pen,
                     "HAS_OFFSETS": offs, "HAS_BIAS": offs, "BLOCK_M": 16, "BLOCK_H": 256}, 4,
                    divisible=_ptrs_divisible(sig, "H", "stride_h", "stride_hs", "stride_w", "stride_ids"))
            for greedy, pen, offs in ((True, False, False), (False, False, False), (True, True, False),
                                      (True, False, True))]
    fp16 = dict(sig, h_ptr="*fp16", hs_ptr="*fp16", w_ptr="*fp16")
    out.append(Variant("candidate_confidence fp16 greedy=True", "candidate_confidence", "_listed_kernel", fp16,
                       {"HAS_SKIP": True, "GREEDY": True, "T_TENSOR": False, "HAS_PENALTY": False,
                        "HAS_OFFSETS": False, "HAS_BIAS": False, "BLOCK_M": 16, "BLOCK_H": 256}, 4,
                       divisible=_ptrs_divisible(fp16, "H", "stride_h", "stride_hs", "stride_w", "stride_ids")))
    return out


def _backward_kernels(dt: str) -> list[Variant]:
    """The backward kernels training runs (weight-gradient partials in fp32), at the 1.7B shape's sizes."""
    sig = {"s_ptr": f"*{dt}", "w_ptr": f"*{dt}", "dy_ptr": f"*{dt}", "ds_ptr": f"*{dt}", "dx_ptr": f"*{dt}",
           "dw_ptr": "*fp32", "n_rows": "i32", "n_cols": "i32", "eps": "fp32", "stride_s": "i64", "stride_dy": "i64",
           "stride_ds": "i64", "rows_per_program": "i32", "HAS_DS": "constexpr", "WANT_DX": "constexpr",
           "BLOCK": "constexpr"}
    out = [Variant(f"rms_norm_backward {dt} residual={ds}", "rms_norm", "_rms_norm_backward_kernel", sig,
                   {"HAS_DS": ds, "WANT_DX": True, "BLOCK": 2048}, 8,
                   divisible=_ptrs_divisible(sig, "n_cols", "stride_s", "stride_dy", "stride_ds"))
           for ds in (False, True)]
    sig = {"g_ptr": f"*{dt}", "u_ptr": f"*{dt}", "do_ptr": f"*{dt}", "dg_ptr": f"*{dt}", "du_ptr": f"*{dt}",
           "F": "i32", "stride_g": "i32", "stride_u": "i32", "stride_do": "i32", "BLOCK": "constexpr"}
    swiglu = importlib.import_module("mrp_triton.swiglu")
    out.append(Variant(f"swiglu_backward {dt}", "swiglu", "_swiglu_backward_kernel", sig, {"BLOCK": swiglu._BLOCK},
                       swiglu._NUM_WARPS, divisible=_ptrs_divisible(sig, "F", "stride_g", "stride_u", "stride_do")))
    sig = {"q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "qw_ptr": f"*{dt}", "kw_ptr": f"*{dt}", "cos_ptr": "*fp32",
           "sin_ptr": "*fp32", "dqo_ptr": f"*{dt}", "dko_ptr": f"*{dt}", "dq_ptr": f"*{dt}", "dk_ptr": f"*{dt}",
           "dqw_ptr": "*fp32", "dkw_ptr": "*fp32", "n_tok": "i32", "T": "i32", "Hq": "i32", "Hkv": "i32", "D": "i32",
           "eps": "fp32", "stride_qb": "i64", "stride_qt": "i64", "stride_kb": "i64", "stride_kt": "i64",
           "stride_cb": "i64", "stride_ct": "i64", "stride_sb": "i64", "stride_st": "i64", "tokens_per_program": "i32",
           "BLOCK_HQ": "constexpr", "BLOCK_HK": "constexpr", "BLOCK_HALF": "constexpr"}
    strides = [name for name in sig if name.startswith("stride_")]
    out.append(Variant(f"qk_norm_rope_backward {dt}", "qk_norm_rope", "_qk_norm_rope_backward_kernel", sig,
                       {"BLOCK_HQ": 16, "BLOCK_HK": 8, "BLOCK_HALF": 64}, 4,
                       divisible=_ptrs_divisible(sig, "Hq", "D", *strides)))
    return out


def _softmax_kl() -> list[Variant]:
    """The KD loss's two passes over a chunk's fp32 logits (fp64: what tests differentiate against), 2048-wide
    tiles on 8 warps as a V = 151936 launch picks."""
    out = []
    for dt in ("fp32", "fp64"):
        sig = {"s_ptr": f"*{dt}", "t_ptr": f"*{dt}", "part_ptr": f"*{dt}", "V": "i32", "stride_s": "i64",
               "stride_t": "i64", "span": "i32", "S": "i32", "BLOCK": "constexpr"}
        out.append(Variant(f"softmax_kl_stats {dt}", "softmax_kl", "_stats_kernel", sig, {"BLOCK": 2048}, 8,
                           divisible=_ptrs_divisible(sig, "V", "stride_s", "stride_t", "span")))
        sig = {"s_ptr": f"*{dt}", "t_ptr": f"*{dt}", "scale_ptr": f"*{dt}", "part_ptr": f"*{dt}", "kl_ptr": f"*{dt}",
               "V": "i32", "stride_s": "i64", "stride_t": "i64", "span": "i32", "S": "i32", "GRAD": "constexpr",
               "BLOCK": "constexpr", "BLOCK_S": "constexpr"}
        out += [Variant(f"softmax_kl {dt} grad={grad}", "softmax_kl", "_kl_kernel", sig,
                        {"GRAD": grad, "BLOCK": 2048, "BLOCK_S": 4}, 8,
                        divisible=_ptrs_divisible(sig, "V", "stride_s", "stride_t", "span"))
                for grad in (True, False)]
    return out


def variants() -> list[Variant]:
    """Every kernel variant the library launches (dtypes, flags and tile shapes a launch may pick)."""
    return _confidence() + _decisions() + _cached_attention() + _lm_head() + _model_ops() + _softmax_kl()


def compile_variant(v: Variant, arch: int | str = 90):
    """The kernel compiled for sm_``arch`` (an int), or for the AMD GPU ``arch`` names ("gfx942": MI300); needs
    Triton's NVIDIA (or AMD) backend, not a GPU; the interpreter must be off."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = v.function()
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in v.divisible}
    options = {"num_warps": v.num_warps, **({} if v.num_stages is None else {"num_stages": v.num_stages})}
    source = ASTSource(fn=fn, signature=v.signature, constexprs=v.constexprs, attrs=attrs)
    target = GPUTarget("cuda", arch, 32) if isinstance(arch, int) else GPUTarget("hip", arch, 64)
    return triton.compile(source, target=target, options=options)


def report(v: Variant, compiled) -> dict:
    """registers, spill_bytes, shared_kib, programs_per_sm, loads (Counter: bytes per global load instruction
    -> how many in the code), pipelined, tma, wgmma."""
    import triton

    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(cuobjdump), "-res-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
    fields = dict(item.split(":", 1) for item in usage.split(f"Function {v.kernel}:")[1].split()
                  if ":" in item)
    registers, spilled, shared = int(fields["REG"]), int(fields["LOCAL"]), compiled.metadata.shared
    per_sm = min(REGISTERS_PER_SM // (registers * 32 * v.num_warps), SHARED_PER_SM // (shared + 1024))
    loads = Counter(int(vec or 1) * int(bits) // 8 for vec, bits in _LOAD.findall(compiled.asm["ptx"]))
    return dict(registers=registers, spill_bytes=spilled, shared_kib=shared / 1024, programs_per_sm=per_sm,
                loads=loads,
                pipelined=re.search(r"async_(tma_)?copy_global_to_local", compiled.asm["ttgir"]) is not None,
                tma="cp.async.bulk.tensor" in compiled.asm["ptx"], wgmma="wgmma.mma_async" in compiled.asm["ptx"])


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm-head-sweep", action="store_true",
                    help="lm_head_confidence instead: its tile table at --rows x --hidden and every SWEEP config")
    ap.add_argument("--rows", default="64,128", help="with --lm-head-sweep: comma-separated N")
    ap.add_argument("--hidden", default="2048,4096", help="with --lm-head-sweep: comma-separated H")
    ap.add_argument("--only", default="", help="only the variants whose name contains this")
    return ap.parse_args(argv)


def _lm_head_sweep(rows: str, hidden: str) -> list[Variant]:
    """The configs the tile table picks at (N, H), V = 151936, and bench_mrp_head's SWEEP (BLOCK_N 128 unless
    set), one variant per distinct config, named by all that use it."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_mrp_head import SWEEP
    from mrp_triton.lm_head_confidence import _config

    named: dict[tuple, tuple[dict, list[str]]] = {}
    for n in (int(r) for r in rows.split(",")):
        for h in (int(x) for x in hidden.split(",")):
            config = _config(n, 151936, h, torch.bfloat16)
            named.setdefault(tuple(sorted(config.items())), (config, []))[1].append(f"default N={n} H={h}")
    for i, config in enumerate(SWEEP):
        config = {"BLOCK_N": 128, **config}
        named.setdefault(tuple(sorted(config.items())), (config, []))[1].append(f"sweep_{i}")
    return [lm_head_variant(f"{', '.join(names)}: {config}", config) for config, names in named.values()]


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # before mrp_triton's kernels are decorated
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    sys.path.insert(0, str(ROOT))
    import triton

    chosen = _lm_head_sweep(args.rows, args.hidden) if args.lm_head_sweep else variants()
    print(f"# sm_90 (H100 / H200), triton {triton.__version__}")
    print("| variant | warps | registers | spilled bytes | shared KiB | programs / SM | global loads (bytes x count) "
          "| pipelined | TMA | wgmma |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for v in chosen:
        if args.only not in v.name:
            continue
        r = report(v, compile_variant(v))
        loads = ", ".join(f"{size}B x{count}" for size, count in sorted(r["loads"].items(), reverse=True))
        print(f"| {v.name} | {v.num_warps} | {r['registers']} | {r['spill_bytes']} | {r['shared_kib']:.0f} | "
              f"{r['programs_per_sm']} | {loads} | {r['pipelined']} | {r['tma']} | {r['wgmma']} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
