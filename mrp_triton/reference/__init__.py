"""Plain-PyTorch twins of every op in :mod:`mrp_triton`: the test oracle and the CPU path."""

from .cached_attention import cached_attention
from .candidate_confidence import candidate_confidence
from .confidence import confidence
from .lm_head_confidence import lm_head_confidence
from .mrp_input import mrp_input
from .qk_norm_rope import qk_norm_rope
from .remask import remask
from .rms_norm import rms_norm
from .select import select_commit
from .settle import settle_rows
from .softmax_kl import softmax_kl
from .swiglu import swiglu
from .verify import verify_drafts

__all__ = ["cached_attention", "candidate_confidence", "confidence", "remask", "select_commit", "settle_rows",
           "verify_drafts", "lm_head_confidence", "mrp_input", "qk_norm_rope", "rms_norm", "softmax_kl", "swiglu"]
