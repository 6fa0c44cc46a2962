"""Plain-PyTorch twins of every op in :mod:`mrp_triton`: the test oracle and the CPU path."""

from .mrp_input import mrp_input
from .qk_norm_rope import qk_norm_rope
from .rms_norm import rms_norm
from .swiglu import swiglu

__all__ = ["mrp_input", "qk_norm_rope", "rms_norm", "swiglu"]
