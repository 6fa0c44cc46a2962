"""Fused Triton kernels for SDAR block-diffusion decoding with MRP, each with a PyTorch reference.

Every public op dispatches per call (see :mod:`mrp_triton.backend`): CUDA tensors run the Triton
kernel, CPU tensors run :mod:`mrp_triton.reference` unless ``TRITON_INTERPRET=1``.
"""

from .backend import select_backend, use_backend
from .mrp_input import mrp_input
from .qk_norm_rope import qk_norm_rope
from .rms_norm import rms_norm
from .swiglu import swiglu

__all__ = ["mrp_input", "qk_norm_rope", "rms_norm", "select_backend", "swiglu", "use_backend"]
