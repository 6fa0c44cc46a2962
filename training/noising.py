"""Block-diffusion noising and the ``[noisy | clean]`` training layout.

Randomness is counter-based: every sample gets its own ``torch.Generator`` seeded from
``(seed, step, dataset index)`` (:func:`sample_seed`). A sample's noise therefore does not depend
on which process or micro-batch it lands in (a 2-process run equals a 1-process run with the
same global batch), nor on what ran before (a resumed run repeats the uninterrupted one bit for
bit). All draws happen on CPU; the results are moved to the compute device.

Layout: the model sees ``x = [noisy | clean]`` of length 2T with position ids ``0..T-1`` twice
and the masks of :class:`BlockDiffusionMasks`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask


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


def block_diffusion_rule(T: int, block_size: int):
    """The ``[noisy | clean]`` attention rule of T tokens as a FlexAttention ``mask_mod``: ``rule(b, h, q, k)`` ->
    bool, True = query index ``q`` (of 2T) may attend key index ``k`` (broadcasting integer tensors; ``b`` and
    ``h`` are unused).

    Query in the noisy half, block b: the noisy tokens of block b (bidirectional) and the clean
    tokens of blocks < b. Query in the clean half, block b: the clean tokens of blocks <= b.
    Noisy never sees another noisy block; clean never sees noisy.
    """
    if T % block_size:
        raise ValueError(f"sequence length {T} is not a multiple of the block size {block_size}")

    def rule(b, h, q, k):
        q_block, k_block, k_clean = (q % T) // block_size, (k % T) // block_size, k >= T
        return torch.where(q >= T, k_clean & (k_block <= q_block),
                           torch.where(k_clean, k_block < q_block, k_block == q_block))

    return rule


def block_diffusion_mask(T: int, block_size: int, device=None, rows: int | None = None) -> torch.Tensor:
    """:func:`block_diffusion_rule` as a dense bool mask ``[1, 1, rows, 2T]`` (True = may attend): the first
    ``rows`` queries (default all 2T) over all 2T keys."""
    rule = block_diffusion_rule(T, block_size)
    q = torch.arange(2 * T if rows is None else rows, device=device)[:, None]
    return rule(None, None, q, torch.arange(2 * T, device=device)[None, :])[None, None]


@dataclass(frozen=True)
class BlockDiffusionMasks:
    """The two query sets training attends with over the 2T keys of ``[noisy | clean]``: ``full``, all 2T queries
    (pass A, the MRP's first forward); ``noisy``, the noisy half's T (the forwards that keep the clean half's keys
    and values: ``training.losses.mrp_loss_sum``). Each a dense bool mask (SDPA) or a FlexAttention ``BlockMask``
    (``flex``: only the tiles a query block may see are computed, about a quarter of the dense scores; the key and
    value heads are not repeated; CUDA only for training, since FlexAttention has no backward on CPU)."""

    full: torch.Tensor | BlockMask
    noisy: torch.Tensor | BlockMask

    @classmethod
    def build(cls, T: int, block_size: int, device="cpu", flex: bool = False) -> "BlockDiffusionMasks":
        if not flex:
            return cls(block_diffusion_mask(T, block_size, device), block_diffusion_mask(T, block_size, device, T))
        rule = block_diffusion_rule(T, block_size)
        return cls(*(create_block_mask(rule, None, None, rows, 2 * T, device=device) for rows in (2 * T, T)))


def pack_noisy_clean(noisy: torch.Tensor, clean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, 2T], position_ids [B, 2T])`` with positions 0..T-1 twice."""
    B, T = clean.shape
    pos = torch.arange(T, device=clean.device)
    return torch.cat([noisy, clean], dim=1), torch.cat([pos, pos]).expand(B, 2 * T)
