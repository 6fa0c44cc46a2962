"""Training for SDAR block-diffusion backbones and their MRP heads.

Modules:
- :mod:`training.tokenizer`      byte-level BPE with ``<|endoftext|>`` / ``<|MASK|>``
- :mod:`training.data`           documents -> tokens -> packed sequences with ``is_prompt``
- :mod:`training.stdlib_corpus`  the CPython standard library as a file-split code corpus
- :mod:`training.noising`        block-diffusion noising and the ``[noisy | clean]`` mask
- :mod:`training.losses`         backbone masked CE and MRP distillation losses
- :mod:`training.trainer`        the loop: AdamW, cosine schedule, accumulation, DDP,
                                 atomic checkpoints, bit-exact resume
- :mod:`training.cli`            ``mrp-train backbone|mrp|eval|draft-vocab``
"""

from .config import ConfigError, TrainConfig

__all__ = ["ConfigError", "TrainConfig"]
