"""Tiny random SDAR(+MRP) models for CPU tests."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from hf_integration import SDARMRPConfig, SDARMRPForCausalLM

VOCAB = 67
MASK_ID = 66
# each decoding strategy, and a variant of most (greedy)
STRATEGIES = [
    dict(strategy="static"),
    dict(strategy="static", denoising_steps=2),
    dict(strategy="dynamic", threshold=0.3),
    dict(strategy="sequential"),
    dict(strategy="sequential", denoising_steps=3),
    dict(strategy="entropy_bounded", entropy_bound=3.0),
    dict(strategy="direct", mrp_steps=2),
    dict(strategy="speculative", mrp_steps=3),
    dict(strategy="speculative", mrp_steps=2, draft_schedule="authors"),
    dict(strategy="remask", threshold=0.4),
    dict(strategy="remask", threshold=0.4, remask_rule="delta", residual_delta=0.5),
]


def tiny_config(**overrides) -> SDARMRPConfig:
    kwargs = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, block_size=4, mask_token_id=MASK_ID, num_nextn_predict_layers=2,
                  max_position_embeddings=512, rope_theta=10000.0)
    kwargs.update(overrides)
    return SDARMRPConfig(**kwargs)


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float64, **overrides) -> SDARMRPForCausalLM:
    torch.manual_seed(seed)
    model = SDARMRPForCausalLM(tiny_config(**overrides)).to(dtype).eval()
    # Random init keeps logits nearly flat; sharpen them so greedy choices are well separated.
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


def random_prompts(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, MASK_ID - 3, (batch, length), generator=g)


def padded_batch(rows: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts ``rows`` (1-d token ids) padded with 0 on the ``side`` ("left" or "right") to the longest: ids and
    attention mask [len(rows), max length] (int64)."""
    assert side in ("left", "right"), side
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        span = slice(width - len(r), width) if side == "left" else slice(0, len(r))
        ids[b, span], mask[b, span] = r, 1
    return ids, mask


def naive_static_decode(model, prompt: torch.Tensor, max_new: int, block: int, forwards: list | None = None,
                        reveal_steps: torch.Tensor | None = None, confidences: torch.Tensor | None = None,
                        eos_ids: tuple[int, ...] = (), min_new: int = 0, suppress: tuple[int, ...] = (),
                        begin_suppress: tuple[int, ...] = (), leftmost: bool = False,
                        entropy_bound: float | None = None, repetition_penalty: float | None = None,
                        presence_penalty: float = 0.0, frequency_penalty: float = 0.0, bias: dict | None = None,
                        top_logprobs: torch.Tensor | None = None):
    """One token per step, recomputing the whole block-causal sequence with no cache (the oracle): each block
    until its positions up to the last new token are committed (the last block's positions past it are masks
    the model sees, not decoded once the new tokens are). Returns the prompt and new tokens [P + max_new]; the
    forwards it ran are appended to ``forwards``, the step (1, 2, ...) that revealed each position is written
    into ``reveal_steps`` [P + max_new] and its token's softmax probability into ``confidences`` [P + max_new].
    ``eos_ids`` get a logit of -inf at the first ``min_new`` new tokens (as transformers' min_new_tokens processor
    sets them; nothing stops at them), ``suppress`` everywhere and ``begin_suppress`` at the first new token.
    ``leftmost``: each step commits the first masked position (SDAR's sequential rule) instead of the most
    confident; ``entropy_bound``: the masked positions in order of their softmax's entropy (torch's Categorical),
    lowest first, while the entropies before sum to at most the bound. ``repetition_penalty``: transformers'
    RepetitionPenaltyLogitsProcessor at each step, over the tokens the sequence holds (prompt and committed ones),
    after transformers' SequenceBiasLogitsProcessor with ``bias`` (token id -> bias); then ``presence_penalty`` /
    ``frequency_penalty`` subtracted as OpenAI defines them, over the new tokens committed so far (counted with
    ``torch.bincount``).
    ``top_logprobs`` [P + max_new, k]: each revealed position's k largest log-probabilities of that softmax."""
    P = prompt.shape[0]
    end = -(-(P + max_new) // block) * block
    x = torch.full((1, end), MASK_ID, dtype=torch.long)
    x[0, :P] = prompt
    step = 0
    for start in range(P // block * block, end, block):
        while (x[0, start : min(start + block, P + max_new)] == MASK_ID).any():
            step += 1
            if forwards is not None:
                forwards.append(start)
            logits = model(x[:, : start + block]).logits[0, start : start + block].clone()
            if bias:
                logits = SequenceBiasLogitsProcessor([[[token], float(b)] for token, b in bias.items()])(
                    x[:, : start + block].expand(block, -1), logits)
            if repetition_penalty is not None:
                seen = x[0, : start + block][x[0, : start + block] != MASK_ID]
                logits = RepetitionPenaltyLogitsProcessor(repetition_penalty)(seen.expand(block, -1), logits)
            generated = x[0, P : start + block][x[0, P : start + block] != MASK_ID]
            counts = torch.bincount(generated, minlength=logits.shape[1]).to(logits.dtype)
            logits = logits - presence_penalty * (counts > 0).to(logits.dtype) - frequency_penalty * counts
            logits[:, MASK_ID] = float("-inf")
            new_index = torch.arange(start, start + block)[:, None] - P
            bans = ((eos_ids, new_index < min_new), (suppress, new_index >= 0), (begin_suppress, new_index == 0))
            for ids, where in bans:
                banned = torch.isin(torch.arange(logits.shape[1]), torch.tensor(ids, dtype=torch.long))
                logits[where & banned] = float("-inf")
            probs = logits.softmax(-1)
            conf, tok = probs.max(-1)
            conf = torch.where(x[0, start : start + block] == MASK_ID, conf, torch.full_like(conf, -1.0))
            if entropy_bound is not None:
                entropy = torch.distributions.Categorical(logits=logits).entropy().tolist()
                ranked = sorted((i for i in range(block) if conf[i] >= 0), key=lambda i: (entropy[i], i))
                chosen = [i for k, i in enumerate(ranked) if sum(entropy[j] for j in ranked[:k]) <= entropy_bound]
            else:
                chosen = [int((conf >= 0).nonzero()[0]) if leftmost else int(conf.argmax())]
            for pos in chosen:
                x[0, start + pos] = tok[pos]
                if start + pos < P + max_new:
                    top = None if top_logprobs is None else \
                        logits[pos].log_softmax(-1).topk(top_logprobs.shape[1]).values
                    for noted, value in ((reveal_steps, step), (confidences, conf[pos]), (top_logprobs, top)):
                        if noted is not None:
                            noted[start + pos] = value
    return x[0, : P + max_new]


# speculative decoding's drafts: MRP drafts, the authors' schedule, a draft vocabulary, listed candidates
DRAFTS = [dict(mrp_steps=3), dict(mrp_steps=2, draft_schedule="authors"), dict(mrp_steps=3, draft_vocab=20),
          dict(mrp_steps=3, draft_candidates=4)]


def assert_speculative_is_static(model, drafts: dict, sampled: bool, **settings) -> None:
    """Speculative decoding with ``drafts`` (greedy, or sampled at temperature 1.2 among the top 30) gives static
    decoding's tokens and confidences, with ``settings``, on three random 5-token prompts and 14 new tokens."""
    ids = random_prompts(3, 5, seed=11)
    kw = dict(max_new_tokens=14, eos_token_id=[], return_dict_in_generate=True, output_confidences=True, **settings)
    if sampled:
        kw.update(do_sample=True, temperature=1.2, top_k=30, seed=3)
    static = model.generate(ids, **kw)
    spec = model.generate(ids, strategy="speculative", **drafts, **kw)
    assert torch.equal(spec.sequences, static.sequences)
    torch.testing.assert_close(spec.confidences, static.confidences, rtol=1e-5, atol=0)


def assert_rows_decode_as_alone(model, **settings) -> None:
    """In a left-padded batch of three random prompts (3, 7 and 5 tokens), every row decodes with ``settings`` what it
    decodes alone; so it does with the second row ending at its third new token (an EOS) and leaving the batch, with
    CUDA graphs' recorded steps (replayed on a CPU) or without."""
    rows = [random_prompts(1, n, seed=20 + n)[0] for n in (3, 7, 5)]
    ids, mask = padded_batch(rows, "left")
    alone = [model.generate(r[None], eos_token_id=[], **settings)[0, len(r):] for r in rows]
    batch = model.generate(ids, attention_mask=mask, eos_token_id=[], **settings)[:, ids.shape[1]:]
    assert all(torch.equal(b, a) for b, a in zip(batch, alone))
    eos = int(alone[1][2])
    ended = [model.generate(r[None], eos_token_id=eos, pad_token_id=0, **settings)[0, len(r):] for r in rows]
    for graphs in (False, True):
        out = model.generate(ids, attention_mask=mask, eos_token_id=eos, pad_token_id=0, cuda_graphs=graphs,
                             **settings)[:, ids.shape[1]:]
        assert all(torch.equal(b, a) for b, a in zip(out, ended)), graphs


def spy_on_drafts(monkeypatch) -> list[torch.Tensor]:
    """From now on, the draft tokens [B, K] of every verify round (``mrp_triton.verify_drafts``'s input), in order."""
    import mrp_triton

    drafts: list[torch.Tensor] = []
    verify = mrp_triton.verify_drafts

    def spy(block, draft_pos, draft_tok, *args, **kwargs):
        drafts.append(draft_tok.clone())
        return verify(block, draft_pos, draft_tok, *args, **kwargs)

    monkeypatch.setattr(mrp_triton, "verify_drafts", spy)
    return drafts


class LetterTokenizer:
    """Decodes id i as one letter (a..z, wrapping): enough to look for stop strings in."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + int(i) % 26) for i in ids)


class RecordingStreamer:
    """A transformers-style streamer that keeps what it is given."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, ids: torch.Tensor) -> None:
        assert ids.device.type == "cpu" and ids.dtype == torch.long, ids  # token ids as generate() gives them
        self.puts.append(ids.tolist())

    def end(self) -> None:
        self.ended += 1
