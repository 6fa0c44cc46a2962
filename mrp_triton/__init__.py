"""Fused Triton kernels for SDAR block-diffusion decoding with MRP, each with a PyTorch reference.

Every public op dispatches per call (see :mod:`mrp_triton.backend`): CUDA tensors run the Triton
kernel, CPU tensors run :mod:`mrp_triton.reference` unless ``TRITON_INTERPRET=1``.
"""

from .backend import select_backend, use_backend
from .cached_attention import cached_attention, cached_attention_triton
from .candidate_confidence import candidate_confidence, candidate_confidence_triton
from .confidence import confidence, confidence_triton
from .lm_head_confidence import lm_head_confidence, lm_head_confidence_triton
from .mrp_input import mrp_input, mrp_input_triton
from .qk_norm_rope import qk_norm_rope, qk_norm_rope_triton
from .remask import remask, remask_triton
from .rms_norm import rms_norm, rms_norm_triton
from .select import select_commit, select_commit_triton
from .settle import settle_rows, settle_rows_triton
from .softmax_kl import softmax_kl, softmax_kl_triton
from .swiglu import swiglu, swiglu_triton
from .verify import verify_drafts, verify_drafts_triton

__all__ = [
    "confidence", "confidence_triton", "remask", "remask_triton", "select_commit", "select_commit_triton",
    "verify_drafts", "verify_drafts_triton", "settle_rows", "settle_rows_triton",
    "lm_head_confidence", "lm_head_confidence_triton", "mrp_input", "mrp_input_triton",
    "qk_norm_rope", "qk_norm_rope_triton", "rms_norm", "rms_norm_triton", "swiglu", "swiglu_triton",
    "cached_attention", "cached_attention_triton", "candidate_confidence", "candidate_confidence_triton",
    "softmax_kl", "softmax_kl_triton",
    "select_backend", "use_backend"]
