"""Block-diffusion noising and the ``[noisy | clean]`` training layout.

Randomness is counter-based: every sample gets its own ``torch.Generator`` seeded from
``(seed, step, dataset index)`` (:func:`sample_seed`). A sample's noise therefore does not depend
on which process or micro-batch it lands in (a 2-process run equals a 1-process run with the
same global batch), nor on what ran before (a resumed run repeats the uninterrupted one bit for
bit). All draws happen on CPU; the results are moved to the compute device.

Layout: the model sees ``x = [noisy | clean]`` of length 2T with position ids ``0..T-1`` twice
and the mask of :func:`block_diffusion_mask`.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch


def sample_seed(*parts) -> int:
    """A 63-bit seed from any tuple of ints/strings (stable across processes and runs)."""
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") & ((1 << 63) - 1)


def make_generators(seeds: Sequence[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(int(s)) for s in seeds]


def sample_mask(is_prompt: torch.Tensor, generators: Sequence[torch.Generator], eps: float = 1e-3):
    """Draw the noise of a batch.

    is_prompt: [B, T] bool (True = prompt/padding: never masked). Per sample b:
    t ~ U(0, 1), p = (1 - eps) t + eps, every answer token masked independently with prob. p;
    if none got masked but the sample has answer tokens, one uniformly chosen answer token is.

    Returns ``(masked [B, T] bool, p [B] float32)`` on CPU.
    """
    is_prompt = is_prompt.cpu()
    B, T = is_prompt.shape
    masked = torch.zeros(B, T, dtype=torch.bool)
    p = torch.empty(B, dtype=torch.float32)
    for b, g in enumerate(generators):
        t = torch.rand((), generator=g, dtype=torch.float64)
        pb = (1.0 - eps) * t + eps
        u = torch.rand(T, generator=g, dtype=torch.float64)
        answer = ~is_prompt[b]
        mb = (u < pb) & answer
        n_answer = int(answer.sum())
        if n_answer and not bool(mb.any()):
            k = int(torch.randint(n_answer, (), generator=g))
            mb[answer.nonzero()[k, 0]] = True
        masked[b] = mb
        p[b] = float(pb)
    return masked, p


def reveal_one_per_block(masked: torch.Tensor, block_size: int, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Pick, in every block that still has masked positions, one of them uniformly at random.

    masked: [B, T] bool with T a multiple of ``block_size``. Returns the revealed positions as a
    [B, T] bool tensor (at most one True per block, always a subset of ``masked``), on CPU.
    """
    masked = masked.cpu()
    B, T = masked.shape
    nb = T // block_size
    reveal = torch.zeros(B, T, dtype=torch.bool)
    for b, g in enumerate(generators):
        score = torch.rand(T, generator=g)
        score = torch.where(masked[b], score, torch.full_like(score, -1.0)).view(nb, block_size)
        pick = score.argmax(dim=1)
        has = masked[b].view(nb, block_size).any(dim=1)
        r = torch.zeros(nb, block_size, dtype=torch.bool)
        r[torch.arange(nb)[has], pick[has]] = True
        reveal[b] = r.view(T)
    return reveal


def block_diffusion_mask(T: int, block_size: int, device=None) -> torch.Tensor:
    """Attention mask of ``[noisy | clean]`` (length 2T), shape [1, 1, 2T, 2T], True = may attend.

    Query in the noisy half, block b: the noisy tokens of block b (bidirectional) and the clean
    tokens of blocks < b. Query in the clean half, block b: the clean tokens of blocks <= b.
    Noisy never sees another noisy block; clean never sees noisy.
    """
    if T % block_size:
        raise ValueError(f"sequence length {T} is not a multiple of the block size {block_size}")
    blk = torch.arange(T, device=device) // block_size
    qi, kj = blk[:, None], blk[None, :]
    noisy_noisy = qi == kj
    noisy_clean = kj < qi
    clean_clean = kj <= qi
    clean_noisy = torch.zeros(T, T, dtype=torch.bool, device=device)
    top = torch.cat([noisy_noisy, noisy_clean], dim=1)
    bottom = torch.cat([clean_noisy, clean_clean], dim=1)
    return torch.cat([top, bottom], dim=0)[None, None]


def pack_noisy_clean(noisy: torch.Tensor, clean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, 2T], position_ids [B, 2T])`` with positions 0..T-1 twice."""
    B, T = clean.shape
    pos = torch.arange(T, device=clean.device)
    return torch.cat([noisy, clean], dim=1), torch.cat([pos, pos]).expand(B, 2 * T)
