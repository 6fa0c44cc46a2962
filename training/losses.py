"""Losses. Each returns the weighted **sum** over the batch plus statistics; the trainer divides
by the number of answer tokens of the whole global batch (clamped to >= 1), which makes
gradient accumulation and multi-process runs equal to one big batch.

No logit shift anywhere: the logits at position i predict the token at position i.

Model interface used (``hf_integration.SDARMRPForCausalLM``):
``model.model(input_ids, position_ids, attention_mask) -> hidden`` (after the final norm),
``model.lm_head(h) -> logits``, ``model.mrp_forward(input_ids, hidden_states, position_ids,
attention_mask) -> h_p`` (after the MRP's final norm).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from hf_integration.kv_cache import AttentionInputs

from .kd_loss import kd_loss_sum, top_choices
from .noising import BlockDiffusionMasks, pack_noisy_clean, reveal_one_per_block


def _weights(p: torch.Tensor, T: int) -> torch.Tensor:
    return (1.0 / p.float())[:, None].expand(-1, T)


def backbone_loss_sum(model, ids, masked, p, masks: BlockDiffusionMasks, mask_token_id: int):
    """Masked-token cross entropy on the noisy half, each masked token weighted by 1/p.

    ids: [B, T] clean tokens; masked: [B, T] bool; p: [B]; masks: the attention masks of length T.
    Returns ``(sum_b sum_{i masked} CE_i / p_b, n_masked)``.
    """
    B, T = ids.shape
    noisy = ids.masked_fill(masked, mask_token_id)
    inp, pos = pack_noisy_clean(noisy, ids)
    h = model.model(inp, pos, attention_mask=masks.full)[:, :T]
    logits = model.lm_head(h[masked]).float()
    ce = F.cross_entropy(logits, ids[masked], reduction="none")
    w = _weights(p, T)[masked]
    return (ce * w).sum(), int(masked.sum())


AGREEMENT_COUNTS = ("tokens_agree", "tokens", "picks_agree", "blocks")  # the counts of draft_agreement


def block_picks(log_conf: torch.Tensor, token: torch.Tensor, sel: torch.Tensor, block_size: int):
    """What one decoding step would commit in each block: among the positions of ``sel`` (bool [B, T], T a
    multiple of block_size) the most confident one (ties: the lowest) and its token. log_conf, token: [n] at
    those positions. Returns (position [B, T / bs], token [B, T / bs], has_candidates bool [B, T / bs])."""
    B, T = sel.shape
    conf = torch.full((B, T), float("-inf"), device=sel.device)
    conf[sel] = log_conf
    tokens = torch.full((B, T), -1, dtype=torch.long, device=sel.device)
    tokens[sel] = token
    position = conf.view(B, -1, block_size).argmax(-1)  # first maximal index
    picked = tokens.view(B, -1, block_size).gather(-1, position[..., None])[..., 0]
    return position, picked, sel.view(B, -1, block_size).any(-1)


def draft_agreement(teacher_top: tuple[torch.Tensor, torch.Tensor], student_top: tuple[torch.Tensor, torch.Tensor],
                    sel: torch.Tensor, block_size: int) -> dict[str, int]:
    """How often the student (the MRP-corrected logits) agrees with the teacher (the backbone on the same
    state), as counts: at ``tokens_agree`` of the ``tokens`` scored positions the argmax token is the same,
    and in ``picks_agree`` of the ``blocks`` blocks with a scored position the step's pick
    (:func:`block_picks`) is the same position and token, which is what gets a speculative draft accepted.
    teacher_top, student_top: (log-probability [n], token [n]) of each side's top choice
    (:func:`training.kd_loss.top_choice`) at the positions of ``sel`` (bool [B, T])."""
    (t_conf, t_tok), (s_conf, s_tok) = teacher_top, student_top
    t_pos, t_pick, has = block_picks(t_conf, t_tok, sel, block_size)
    s_pos, s_pick, _ = block_picks(s_conf, s_tok, sel, block_size)
    return {"tokens_agree": int((t_tok == s_tok).sum()), "tokens": int(sel.sum()),
            "picks_agree": int(((t_pos == s_pos) & (t_pick == s_pick) & has).sum()), "blocks": int(has.sum())}


def _clean_half(kv: dict, T: int) -> dict:
    """Each layer's keys and values (``AttentionInputs.kv_out`` of a ``[state | clean]`` forward) at the clean
    half's positions T..2T-1."""
    return {layer: (k[:, :, T:].contiguous(), v[:, :, T:].contiguous()) for layer, (k, v) in kv.items()}


def check_checkpointing(model) -> None:
    """Refuse reentrant activation checkpointing of ``model``'s layers (a ``ValueError``): the reentrant checkpoint
    runs a layer without gradients, so the keys and values the MRP head's first forward keeps for the later ones
    (``AttentionInputs.kv_out``) would carry none, and the head's gradients through them would be lost without a
    sound. Layers checkpointed with ``use_reentrant=False`` (transformers' default) pass."""
    for module in model.modules():
        if module.training and getattr(module, "gradient_checkpointing", False):
            func = getattr(module, "_gradient_checkpointing_func", None)
            if getattr(func, "keywords", {}).get("use_reentrant") is not False:
                raise ValueError("mrp_loss_sum: the model's layers are checkpointed with torch's reentrant checkpoint, "
                                 "which drops the MRP head's gradients through its kept keys and values; enable "
                                 "activation checkpointing with use_reentrant=False (transformers' default), e.g. "
                                 "training.models.set_activation_checkpointing(model, True)")


def mrp_loss_sum(
    model,
    ids: torch.Tensor,
    masked: torch.Tensor,
    p: torch.Tensor,
    masks: BlockDiffusionMasks,
    mask_token_id: int,
    block_size: int,
    generators: Sequence[torch.Generator],
    unroll_k: int = 1,
    loss_type: str = "kd_diff_sum",
    agreement: bool = False,
    kd_precision: str = "fp32",
):
    """MRP distillation (method.md section 4), averaged over a K-step unroll.

    Pass A (frozen, no grad): backbone on ``[noisy | clean]`` -> h_A (post-norm).
    For k = 1..K: reveal one random still-masked position per block with its ground-truth token
    (state_k); teacher h_B_k = backbone on ``[state_k | clean]`` (no grad; the clean half's keys and values
    kept from pass A, so it runs over state_k's T positions only);
    ``h_p_k = MRP([state_k | clean], [h_in_k | h_A(clean)])`` with the same mask/positions (the clean half's
    keys and values kept from k = 1 likewise).
    - ``kd_diff_sum``: h_in_k = h_A + acc_{k-1}, acc_k = acc_{k-1} + h_p_k (acc_0 = 0), student
      logits lm_head(h_A + acc_k) with h_A detached (method.md section 3, "chaining", s = 1).
    - ``direct``: h_in_k = h_p_{k-1} (h_p_0 = h_A), student logits lm_head(h_p_k) alone.
    The clean half of the MRP input always carries h_A of the clean tokens (the MRP's prefix).
    Loss_k = sum over positions still masked in state_k of KL(teacher || student) / p.
    Gradients flow through the whole unroll (acc / h_p chain) into the MRP only. Teacher and
    student logits are computed in fp32 (also under bf16 autocast), chunk by chunk
    (:func:`training.kd_loss.kd_loss_sum`: no [n, V] tensor is kept for backward), their GEMMs at ``kd_precision``.

    Returns ``(sum_k Loss_k / K, stats)``; with ``agreement`` the stats also hold, per unroll step k, the
    counts of :func:`draft_agreement` (``"agreement"``: a list of K dicts).
    """
    if unroll_k < 1:
        raise ValueError(f"--unroll-k (K) must be >= 1, got {unroll_k}")
    if loss_type not in ("kd_diff_sum", "direct"):
        raise ValueError(f"--mrp-loss must be 'kd_diff_sum' or 'direct', got {loss_type!r}")
    if torch.is_grad_enabled():
        check_checkpointing(model)
    B, T = ids.shape
    w = _weights(p, T)
    noisy = ids.masked_fill(masked, mask_token_id)
    inp, pos = pack_noisy_clean(noisy, ids)
    kv: dict = {}
    with torch.no_grad():
        h = model.model(inp, pos, attn=AttentionInputs(mask=masks.full, kv_out=kv))
    h_a, h_a_clean = h[:, :T].detach(), h[:, T:].detach()
    # The clean half sees only clean positions, so its keys and values are the same in every forward over
    # [state | clean]: the teacher forwards (and the MRP's after its first) run over the state's half alone,
    # attending to the clean half's keys and values after their own (the mask's rows of the state's half).
    teacher = AttentionInputs(mask=masks.noisy, kv_in=_clean_half(kv, T))
    del kv
    mrp_half = None

    state, state_mask = noisy, masked
    acc = None
    prev = h_a
    total = torch.zeros((), device=ids.device, dtype=torch.float32)
    n_scored = 0
    agreements = []
    for _ in range(unroll_k):
        reveal = reveal_one_per_block(state_mask, block_size, generators).to(ids.device)
        state = torch.where(reveal, ids, state)
        state_mask = state_mask & ~reveal
        with torch.no_grad():
            h_b = model.model(state, pos[:, :T], attn=teacher)
        h_in = (h_a if acc is None else h_a + acc) if loss_type == "kd_diff_sum" else prev
        if mrp_half is None:  # the first step runs the whole input and keeps the clean half's keys and values
            kv = {}
            h_p = model.mrp_forward(pack_noisy_clean(state, ids)[0], torch.cat([h_in, h_a_clean], dim=1), pos,
                                    attn=AttentionInputs(mask=masks.full, kv_out=kv))[:, :T]
            mrp_half = AttentionInputs(mask=masks.noisy, kv_in=_clean_half(kv, T))
        else:  # gradients reach the head through the kept keys and values too
            h_p = model.mrp_forward(state, h_in, pos[:, :T], attn=mrp_half)
        if loss_type == "kd_diff_sum":
            acc = h_p if acc is None else acc + h_p
            student = h_a + acc
        else:
            prev = h_p
            student = h_p
        sel = state_mask
        if bool(sel.any()):
            head = model.lm_head.weight
            total = total + kd_loss_sum(student[sel], h_b[sel], head, w[sel], precision=kd_precision)
            if agreement:
                tops = [top_choices(h[sel], head, mask_token_id, precision=kd_precision)
                        for h in (h_b, student.detach())]
                agreements.append(draft_agreement(*tops, sel, block_size))
        else:
            total = total + student.sum() * 0.0  # keep the graph connected (DDP needs every grad)
            if agreement:
                agreements.append(dict.fromkeys(AGREEMENT_COUNTS, 0))
        n_scored += int(sel.sum())
    stats = {"scored": n_scored / unroll_k}
    if agreement:
        stats["agreement"] = agreements
    return total / unroll_k, stats
