"""Backbone / MRP losses on tiny real models, with test doubles for the MRP head."""

import warnings
from collections import Counter

import pytest
import torch

from training_fixtures import make_tokenizer, one_thread, subprocess_env, tiny_backbone, write_corpus  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

from hf_integration.kv_cache import AttentionInputs
from training.config import TrainConfig
from training.data import build_datasets
from training.kd_loss import top_choice
from training.losses import backbone_loss_sum, block_picks, draft_agreement, mrp_loss_sum
from training.noising import (BlockDiffusionMasks, block_diffusion_mask, make_generators, pack_noisy_clean,
                              reveal_one_per_block, sample_mask)

T, BS = 16, 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("loss")
    tok = make_tokenizer(str(root / "tok"))
    paths = write_corpus(str(root / "corpus"))
    train, _ = build_datasets([paths["text"], paths["pairs"]], tok, T, BS, 0.0)
    return tok, train


class ExactResidualMRP:
    """Test double: an MRP head that outputs exactly h_B - h_in (the backbone on its ids minus its
    input hidden), i.e. the residual the real head is trained to predict."""

    def __init__(self, model):
        self.model, self.lm_head, self.config = model.model, model.lm_head, model.config

    def mrp_forward(self, input_ids, hidden_states, position_ids, attention_mask=None, attn=None):
        return self.model(input_ids, position_ids, attention_mask=attention_mask, attn=attn) - hidden_states


class ZeroMRP(ExactResidualMRP):
    def mrp_forward(self, input_ids, hidden_states, position_ids, attention_mask=None, attn=None):
        return torch.zeros_like(hidden_states)


def _batch(train, n=6, seed=0):
    ids, isp = train.input_ids[:n], train.is_prompt[:n]
    seeds = [seed * 1000 + i for i in range(n)]
    return ids, isp, seeds


def _grads(model, trained_only: bool = True) -> dict:
    """Copies of the parameters' gradients by name: of every trained parameter, or of those that got one."""
    return {n: q.grad.clone() for n, q in model.named_parameters()
            if (q.requires_grad if trained_only else q.grad is not None)}


def _assert_grads_close(got: dict, want: dict, rtol: float, atol_scale: float) -> None:
    """Each gradient within rtol and ``atol_scale`` x its largest magnitude in ``want``."""
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=rtol, atol=atol_scale * float(w.abs().max()), msg=name)


@pytest.mark.parametrize("K", [1, 2, 3])
def test_exact_residual_gives_zero_kd(setup, K):
    tok, train = setup
    model = tiny_backbone(tok).eval()
    ids, isp, seeds = _batch(train)
    gens = make_generators(seeds)
    masked, p = sample_mask(isp, gens)
    masks = BlockDiffusionMasks.build(T, BS)
    with torch.no_grad():
        exact, st = mrp_loss_sum(ExactResidualMRP(model), ids, masked, p, masks, tok.mask_token_id, BS, gens, K)
        gens = make_generators(seeds)
        masked, p = sample_mask(isp, gens)
        zero, _ = mrp_loss_sum(ZeroMRP(model), ids, masked, p, masks, tok.mask_token_id, BS, gens, K)
    assert st["scored"] > 0
    assert abs(float(exact)) < 1e-5 * max(1.0, float(zero))
    assert float(zero) > 1e-4  # the backbone's own step-to-step change is not zero


def test_exact_residual_agrees_everywhere_and_a_zero_head_does_not(setup):
    tok, train = setup
    model = tiny_backbone(tok).eval()
    ids, isp, seeds = _batch(train)
    masks = BlockDiffusionMasks.build(T, BS)
    results = {}
    for name, head in (("exact", ExactResidualMRP(model)), ("zero", ZeroMRP(model))):
        gens = make_generators(seeds)
        masked, p = sample_mask(isp, gens)
        with torch.no_grad():
            _, st = mrp_loss_sum(head, ids, masked, p, masks, tok.mask_token_id, BS, gens, 2, agreement=True)
        results[name] = st["agreement"]
    for k in results["exact"]:
        assert k["tokens"] > 0 and k["tokens_agree"] == k["tokens"] and k["picks_agree"] == k["blocks"] > 0
    zero = results["zero"]  # the backbone's stale picks: its step-to-step change moves some of them
    assert [k["tokens"] for k in zero] == [k["tokens"] for k in results["exact"]]
    assert sum(k["tokens_agree"] for k in zero) < sum(k["tokens"] for k in zero)


def test_block_picks_and_agreement_by_hand():
    """Two blocks of 4, five scored positions. The mask token (id 0) is never picked, so positions 0 and 2 tie
    in block 0 (the lower wins); position 6 wins block 1."""
    M = 0  # the mask token id
    sel = torch.tensor([[True, False, True, True, False, True, True, False]])
    teacher = torch.tensor([[0, 3, 1, 0, 0],   # position 0: token 1
                            [9, 3, 1, 0, 0],   # position 2: as position 0 once the mask column is out
                            [0, 0, 0, 0, 1],   # position 3: token 4, less confident
                            [0, 0, 1, 0, 0],   # position 5: token 2
                            [0, 4, 0, 0, 0]],  # position 6: token 1, the most confident of block 1
                           dtype=torch.float)
    top = teacher.index_fill(-1, torch.tensor([M]), float("-inf")).log_softmax(-1).max(-1)
    position, token, has = block_picks(top.values, top.indices, sel, 4)
    assert position.tolist() == [[0, 2]] and token.tolist() == [[1, 1]] and has.tolist() == [[True, True]]
    student = teacher.clone()
    student[2] = torch.tensor([0, 0, 5, 0, 1.0])  # position 3: token 2 (not 4), and now block 0's pick
    assert draft_agreement(top_choice(teacher, M), top_choice(student, M), sel, 4) == {
        "tokens_agree": 4, "tokens": 5, "picks_agree": 1, "blocks": 2}
    shifted = teacher.clone()
    shifted[1] = torch.tensor([9, 5, 1, 0, 0.0])  # position 2: still token 1, now surer than position 0
    assert draft_agreement(top_choice(teacher, M), top_choice(shifted, M), sel, 4) == {
        "tokens_agree": 5, "tokens": 5, "picks_agree": 1, "blocks": 2}  # the same token at another position


def test_kd_matches_hand_computation(setup):
    """K = 1 with a zero head: sum over still-masked positions of KL(P_B || P_A) / p. In float64: in float32 the
    attention kernel a torch release picks moves this small KL by up to 4e-4 relative (torch 2.11)."""
    tok, train = setup
    model = tiny_backbone(tok).double().eval()
    ids, isp, seeds = _batch(train)
    masks = BlockDiffusionMasks.build(T, BS)
    am = masks.full
    gens = make_generators(seeds)
    masked, p = sample_mask(isp, gens)
    with torch.no_grad():
        got, _ = mrp_loss_sum(ZeroMRP(model), ids, masked, p, masks, tok.mask_token_id, BS, gens, 1)
        gens = make_generators(seeds)
        masked, p = sample_mask(isp, gens)
        reveal = reveal_one_per_block(masked, BS, gens)
        noisy = ids.masked_fill(masked, tok.mask_token_id)
        after = torch.where(reveal, ids, noisy)
        la = model.lm_head(model.model(*pack_noisy_clean(noisy, ids), attention_mask=am)[:, :T])
        lb = model.lm_head(model.model(*pack_noisy_clean(after, ids), attention_mask=am)[:, :T])
        want = 0.0
        for b in range(ids.shape[0]):
            for i in range(T):
                if masked[b, i] and not reveal[b, i]:
                    teacher, student = lb[b, i].double().softmax(-1), la[b, i].double().softmax(-1)
                    want += float((teacher * (teacher / student).log()).sum()) / float(p[b])
    assert float(got) == pytest.approx(want, rel=1e-6)


def test_backbone_loss_is_weighted_masked_ce(setup):
    tok, train = setup
    model = tiny_backbone(tok).eval()
    ids, isp, seeds = _batch(train, 3)
    masked, p = sample_mask(isp, make_generators(seeds))
    masks = BlockDiffusionMasks.build(T, BS)
    am = masks.full
    with torch.no_grad():
        got, n = backbone_loss_sum(model, ids, masked, p, masks, tok.mask_token_id)
        logits = model.lm_head(model.model(*pack_noisy_clean(ids.masked_fill(masked, tok.mask_token_id), ids),
                                           attention_mask=am))[:, :T]  # no shift: position i predicts token i
        lp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
        want = -(lp * masked / p[:, None]).sum()
    assert n == int(masked.sum())
    assert float(got) == pytest.approx(float(want), rel=1e-5)


def test_clean_half_never_sees_noisy(setup):
    """Changing the noisy half must not change the clean half's hidden states."""
    tok, train = setup
    model = tiny_backbone(tok).eval()
    ids = train.input_ids[:2]
    am = block_diffusion_mask(T, BS)
    with torch.no_grad():
        all_masked = ids.masked_fill(torch.ones_like(ids, dtype=torch.bool), 1)
        a = model.model(*pack_noisy_clean(all_masked, ids), attention_mask=am)
        b = model.model(*pack_noisy_clean(ids, ids), attention_mask=am)
    assert torch.allclose(a[:, T:], b[:, T:], atol=1e-6)
    assert not torch.allclose(a[:, :T], b[:, :T])


def test_teacher_forward_over_the_noisy_half_equals_the_full_forward(setup):
    """What mrp_loss_sum's teacher forwards rest on: the noisy half of a [state | clean] forward equals a forward
    over the state alone that attends to the clean half's keys and values kept from another state's forward
    (the clean half never sees the noisy one), in float64 to rounding."""
    tok, train = setup
    model = tiny_backbone(tok).double().eval()
    ids, isp, seeds = _batch(train, 3)
    gens = make_generators(seeds)
    masked, _ = sample_mask(isp, gens)
    am = block_diffusion_mask(T, BS)
    noisy = ids.masked_fill(masked, tok.mask_token_id)
    state = torch.where(reveal_one_per_block(masked, BS, gens), ids, noisy)
    with torch.no_grad():
        kv = {}
        model.model(*pack_noisy_clean(noisy, ids), attn=AttentionInputs(mask=am, kv_out=kv))
        inp, pos = pack_noisy_clean(state, ids)
        full = model.model(inp, pos, attention_mask=am)[:, :T]
        half = model.model(state, pos[:, :T], attn=AttentionInputs(
            mask=am[..., :T, :], kv_in={i: (k[:, :, T:], v[:, :, T:]) for i, (k, v) in kv.items()}))
    assert sorted(kv) == list(range(model.config.num_hidden_layers))
    torch.testing.assert_close(half, full, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(half, model.model(state, pos[:, :T], attention_mask=am[..., :T, :T]))  # needs them


def _full_forward_loss(model, ids, masked, p, am, mask_id, gens, K, loss_type):
    """mrp_loss_sum's value written with whole [state | clean] forwards everywhere (its oracle), float64."""
    noisy = ids.masked_fill(masked, mask_id)
    inp, pos = pack_noisy_clean(noisy, ids)
    h = model.model(inp, pos, attention_mask=am)
    h_a, h_a_clean, acc, state, state_mask, total = h[:, :T], h[:, T:], 0.0, noisy, masked, 0.0
    for _ in range(K):
        reveal = reveal_one_per_block(state_mask, BS, gens)
        state, state_mask = torch.where(reveal, ids, state), state_mask & ~reveal
        inp, _ = pack_noisy_clean(state, ids)
        h_b = model.model(inp, pos, attention_mask=am)[:, :T]
        h_in = h_a + acc if loss_type == "kd_diff_sum" else (h_a if isinstance(acc, float) else acc)
        h_p = model.mrp_forward(inp, torch.cat([h_in, h_a_clean], 1), pos, attention_mask=am)[:, :T]
        acc = acc + h_p if loss_type == "kd_diff_sum" else h_p
        student = h_a + acc if loss_type == "kd_diff_sum" else h_p
        log_p, log_q = model.lm_head(h_b).log_softmax(-1), model.lm_head(student).log_softmax(-1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)
        total = total + (kl * state_mask * (1.0 / p.float())[:, None]).sum()  # 1/p in fp32, as the loss takes it
    return total / K


@pytest.mark.parametrize("loss_type,K", [("kd_diff_sum", 3), ("direct", 2)])
def test_loss_and_head_gradients_equal_whole_forwards(setup, loss_type, K):
    """The teacher forwards and the MRP forwards after the first run over the state's half with the clean half's
    keys and values kept: the loss and every gradient of the head equal those of whole forwards (float64 model;
    its RMSNorms compute in fp32)."""
    from training.models import freeze_all_but_mrp

    tok, train = setup
    model = tiny_backbone(tok).double()
    model.add_mrp_head(2)
    model.double()
    freeze_all_but_mrp(model)
    ids, isp, seeds = _batch(train)
    masks = BlockDiffusionMasks.build(T, BS)
    results = []
    for fn in (mrp_loss_sum, _full_forward_loss):
        gens = make_generators(seeds)
        masked, p = sample_mask(isp, gens)
        model.zero_grad()
        loss = fn(model, ids, masked, p, masks, tok.mask_token_id, BS, gens, K, loss_type) if fn is mrp_loss_sum \
            else fn(model, ids, masked, p, masks.full, tok.mask_token_id, gens, K, loss_type)
        loss = loss[0] if isinstance(loss, tuple) else loss
        loss.backward()
        results.append((loss.detach(), _grads(model)))
    (got, got_grads), (want, want_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert got_grads.keys() == want_grads.keys() and any(g.abs().sum() > 0 for g in want_grads.values())
    # the norms compute in fp32 (Qwen3's), so the sums of shared paths round there
    _assert_grads_close(got_grads, want_grads, rtol=1e-6, atol_scale=1e-6)


def _counted_forwards(model) -> Counter:
    """Counts, by stack ("backbone", "mrp"), the forwards of the first decoder layer of ``model`` and of its MRP
    head, its recomputations under activation checkpointing included (a pre-hook on the layer's q_proj, which the
    recomputation runs before it stops)."""
    runs = Counter()
    stacks = {"backbone": model.model.layers}
    if model.has_mrp:
        stacks["mrp"] = model.mrp_modules[0].model.layers
    for name, layers in stacks.items():
        layers[0].self_attn.q_proj.register_forward_pre_hook(lambda *_, name=name: runs.update([name]))
    return runs


@pytest.mark.parametrize("mode", ["backbone", "mrp"])
def test_activation_checkpointing_recomputes_the_trained_layers_and_changes_no_gradient(setup, mode):
    """With activation checkpointing each decoder layer that trains (the backbone's; the MRP head's, whose first
    forward's keys and values leave the layer for the later forwards) runs again in the backward pass, the frozen
    backbone's (no gradients) never, and the loss and every gradient are bit for bit those without it. Turned off,
    nothing is recomputed and the input embeddings' outputs need no gradient again."""
    from training.models import freeze_all_but_mrp, set_activation_checkpointing

    tok, train = setup
    model = tiny_backbone(tok)
    if mode == "mrp":
        model.add_mrp_head(2)
        freeze_all_but_mrp(model)
    model.train()
    runs = _counted_forwards(model)
    ids, isp, seeds = _batch(train)
    masks = BlockDiffusionMasks.build(T, BS)
    results = []
    for checkpointing in (False, True, False):
        set_activation_checkpointing(model, checkpointing)
        runs.clear()
        model.zero_grad()
        gens = make_generators(seeds)
        masked, p = sample_mask(isp, gens)
        if mode == "mrp":
            loss = mrp_loss_sum(model, ids, masked, p, masks, tok.mask_token_id, BS, gens, 3)[0]
        else:
            loss = backbone_loss_sum(model, ids, masked, p, masks, tok.mask_token_id)[0]
        loss.backward()
        results.append((loss.detach(), _grads(model), dict(runs)))
    (want, want_grads, plain), (got, got_grads, checkpointed), (again, again_grads, after) = results
    trained = "mrp" if mode == "mrp" else "backbone"
    assert checkpointed[trained] == 2 * plain[trained] > 0 and plain == after
    assert checkpointed["backbone"] == plain["backbone"] or mode == "backbone"
    assert torch.equal(got, want) and torch.equal(again, want) and any(g.abs().sum() > 0 for g in want_grads.values())
    for name, grad in want_grads.items():
        assert torch.equal(got_grads[name], grad) and torch.equal(again_grads[name], grad), name
    if mode == "mrp":  # frozen embeddings: only the checkpointing made their outputs need a gradient
        assert not model.get_input_embeddings()(ids).requires_grad


def test_reentrant_checkpointing_is_refused_by_the_mrp_loss(setup):
    """torch's reentrant checkpoint runs a layer without gradients, so the keys and values the head's first forward
    keeps would carry none (the head's gradients through them lost without a sound): mrp_loss_sum refuses it
    naming the fix, while a forward without gradients (an evaluation) still runs."""
    from training.models import freeze_all_but_mrp

    tok, train = setup
    model = tiny_backbone(tok)
    model.add_mrp_head(1)
    freeze_all_but_mrp(model)
    with warnings.catch_warnings():  # newer transformers name it activation_checkpointing_enable
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    ids, isp, seeds = _batch(train, n=2)
    gens = make_generators(seeds)
    masked, p = sample_mask(isp, gens)
    args = (model, ids, masked, p, BlockDiffusionMasks.build(T, BS), tok.mask_token_id, BS, gens, 2)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        mrp_loss_sum(*args)
    with torch.no_grad():
        assert mrp_loss_sum(*args)[0] > 0


@pytest.mark.triton
def test_head_gradients_through_the_backward_kernels_equal_the_reference(setup):
    """Default dispatch (the interpreter here, CUDA on a GPU): an MRP training step runs the head's input, norms,
    q/k-norm + RoPE and SwiGLU through their backward kernels, with the same loss and head gradients as autograd
    through the reference ops."""
    from kernel_utils import KERNEL_BACKWARDS, backward_nodes

    from mrp_triton import use_backend
    from training.models import freeze_all_but_mrp

    tok, train = setup
    model = tiny_backbone(tok)
    model.add_mrp_head(2)
    freeze_all_but_mrp(model)
    ids, isp, seeds = _batch(train, n=2)
    masks = BlockDiffusionMasks.build(T, BS)
    results = []
    for kernels in (False, True):
        gens = make_generators(seeds)
        masked, p = sample_mask(isp, gens)
        model.zero_grad()
        with use_backend("reference") if not kernels else torch.enable_grad():
            loss = mrp_loss_sum(model, ids, masked, p, masks, tok.mask_token_id, BS, gens, 2)[0]
            assert (KERNEL_BACKWARDS | {"_MRPInputBackward"} <= backward_nodes(loss)) == kernels
            loss.backward()
        results.append((loss.detach(), _grads(model)))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == want_grads.keys() and all(g.abs().sum() > 0 for g in want_grads.values())
    _assert_grads_close(got_grads, want_grads, rtol=1e-4, atol_scale=1e-5)


@pytest.mark.parametrize("mode", ["backbone", "mrp"])
def test_flex_attention_gives_the_sdpa_loss(setup, mode):
    """Training's attention on CUDA (``attention="auto"`` there): FlexAttention with block masks gives the loss of
    SDPA with dense masks, and on CUDA the same gradients of the trained parameters (on CPU, where FlexAttention has
    no backward, the loss alone, under no_grad)."""
    import warnings

    from training.models import freeze_all_but_mrp
    from training.trainer import LossModule

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok, train = setup
    model = tiny_backbone(tok)
    if mode == "mrp":
        model.add_mrp_head(2)
        freeze_all_but_mrp(model)
    model.to(device)
    ids, isp, seeds = _batch(train)
    results = []
    for attention in ("sdpa", "flex"):
        lm = LossModule(model, TrainConfig(mode=mode, seq_len=T, block_size=BS, unroll_k=2, attention=attention),
                        tok.mask_token_id)
        model.zero_grad()
        with torch.no_grad() if device == "cpu" else torch.enable_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flex_attention "called without torch.compile": the CPU path
            loss = lm(ids.to(device), isp, seeds)
            if loss.requires_grad:
                loss.backward()
        results.append((loss.detach(), _grads(model, trained_only=False)))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == want_grads.keys() and (device == "cpu") == (not want_grads)
    _assert_grads_close(got_grads, want_grads, rtol=1e-4, atol_scale=1e-5)


@pytest.mark.parametrize("kd_precision", ["fp32", "bf16"])
def test_the_kd_precision_reaches_every_lm_head_gemm(setup, kd_precision):
    """``TrainConfig.kd_precision`` is what the loss and the agreement statistics compute their logits with."""
    from unittest import mock

    import training.losses as losses
    from training.trainer import LossModule

    tok, train = setup
    model = tiny_backbone(tok)
    model.add_mrp_head(1)
    seen = []

    def spy(fn):
        def call(*a, precision, **kw):
            seen.append((fn.__name__, precision))
            return fn(*a, precision=precision, **kw)
        return call

    cfg = TrainConfig(mode="mrp", seq_len=T, block_size=BS, unroll_k=2, kd_precision=kd_precision)
    with mock.patch.object(losses, "kd_loss_sum", spy(losses.kd_loss_sum)), \
            mock.patch.object(losses, "top_choices", spy(losses.top_choices)), torch.no_grad():
        LossModule(model, cfg, tok.mask_token_id)(*_batch(train), with_stats=True)
    assert {name for name, _ in seen} == {"kd_loss_sum", "top_choices"}
    assert {precision for _, precision in seen} == {kd_precision}


def test_frozen_projections_in_bf16_change_nothing_under_bf16_autocast(setup):
    """A backbone holding bf16 values (a bf16 checkpoint loaded in fp32): with its frozen projections stored in
    bf16, an MRP training step under bf16 autocast gives the same loss and head gradients as with them in fp32;
    only the backbone's decoder-layer projections convert, and restoring gives back the very weights."""
    from torch import nn

    from training.models import freeze_all_but_mrp, frozen_projections_in_bf16, restore_dtypes
    from training.trainer import LossModule

    tok, train = setup
    model = tiny_backbone(tok)
    with torch.no_grad():
        for prm in model.parameters():
            prm.copy_(prm.to(torch.bfloat16))
    model.add_mrp_head(1)
    freeze_all_but_mrp(model)
    before = {n: q.detach().clone() for n, q in model.named_parameters()}
    lm = LossModule(model, TrainConfig(mode="mrp", seq_len=T, block_size=BS, unroll_k=2), tok.mask_token_id)
    ids, isp, seeds = _batch(train, n=2)
    results = []
    for lowered in (False, True):
        converted = frozen_projections_in_bf16(model) if lowered else []
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm(ids, isp, seeds)
        loss.backward()
        results.append((loss.detach(), _grads(model, trained_only=False)))
    backbone_linears = [m for m in model.model.layers.modules() if isinstance(m, nn.Linear)]
    assert [m for m, _ in converted] == backbone_linears and len(backbone_linears) == 7 * len(model.model.layers)
    assert {n for n, q in model.named_parameters() if q.dtype == torch.bfloat16} == \
        {n for n in before if n.startswith("model.layers.") and n.endswith("proj.weight")}
    (want, want_grads), (got, got_grads) = results
    assert torch.equal(got, want) and got_grads.keys() == want_grads.keys() and want_grads
    for name in want_grads:
        assert torch.equal(got_grads[name], want_grads[name]), name
    restore_dtypes(converted)
    assert all(q.dtype == torch.float32 and torch.equal(q, before[n]) for n, q in model.named_parameters())


def test_projections_bf16_cannot_hold_stay_fp32(setup):
    from training.models import freeze_all_but_mrp, frozen_projections_in_bf16

    tok, _ = setup
    model = tiny_backbone(tok)  # fp32 values
    model.add_mrp_head(1)
    freeze_all_but_mrp(model)
    assert frozen_projections_in_bf16(model) == []
    assert all(q.dtype == torch.float32 for q in model.parameters())


@pytest.mark.parametrize("loss_type,K", [("kd_diff_sum", 2), ("direct", 1)])
def test_only_mrp_gets_gradients(setup, tmp_path, loss_type, K):
    from training.models import freeze_all_but_mrp
    from training.trainer import LossModule

    tok, train = setup
    model = tiny_backbone(tok)
    model.add_mrp_head(1)
    names = freeze_all_but_mrp(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = TrainConfig(mode="mrp", seq_len=T, block_size=BS, unroll_k=K, mrp_loss=loss_type)
    lm = LossModule(model, cfg, tok.mask_token_id)
    ids, isp, seeds = _batch(train)
    lm(ids, isp, seeds).backward()
    for n, prm in model.named_parameters():
        if n in names:
            assert prm.requires_grad and prm.grad is not None, n
        else:
            assert not prm.requires_grad and prm.grad is None, n
    assert any(float(model.get_parameter(n).grad.abs().sum()) > 0 for n in names if "eh_proj" in n)
    assert all(n.startswith("mrp_modules.") for n in names)
    assert not any(n.startswith("mrp_modules.") for n in before if n not in names)


def test_a_step_with_nothing_left_to_score_still_reaches_every_mrp_parameter(setup):
    """One masked position per block and K = 1: the reveal leaves nothing to score, yet the loss stays connected to
    the head (DDP expects a gradient for every trained parameter), with zero gradients."""
    from training.models import freeze_all_but_mrp

    tok, train = setup
    model = tiny_backbone(tok)
    model.add_mrp_head(1)
    names = freeze_all_but_mrp(model)
    ids, isp, seeds = _batch(train)
    masked = torch.zeros_like(isp)
    masked[:, ::BS] = True
    p = torch.full((len(ids),), 0.5)
    loss, st = mrp_loss_sum(model, ids, masked, p, BlockDiffusionMasks.build(T, BS), tok.mask_token_id, BS,
                            make_generators(seeds), 1)
    assert st["scored"] == 0 and float(loss.detach()) == 0.0
    loss.backward()
    for n in names:
        grad = model.get_parameter(n).grad
        assert grad is not None and not grad.any(), n


class _WithMaskFavoured(torch.nn.Module):
    """Test double: the backbone's hidden states with a constant 1 appended, read by an lm_head whose extra column
    adds 100 to the mask token's logit only: every pick is the mask token unless it is excluded, and the other
    tokens keep the backbone's order."""

    def __init__(self, model, mask_token_id: int):
        super().__init__()
        self.inner, self.config = model.model, model.config
        extra = torch.zeros(model.lm_head.weight.shape[0], 1)
        extra[mask_token_id] = 100.0
        self.lm_head = torch.nn.Linear(1, 1, bias=False)
        self.lm_head.weight = torch.nn.Parameter(torch.cat([model.lm_head.weight.detach(), extra], dim=1))

    def model(self, *args, **kwargs):
        h = self.inner(*args, **kwargs)
        return torch.cat([h, h.new_ones(*h.shape[:-1], 1)], dim=-1)

    def mrp_forward(self, input_ids, hidden_states, position_ids, attention_mask=None, attn=None):
        return torch.zeros_like(hidden_states)


def test_agreement_never_counts_the_mask_token_as_a_pick(setup):
    tok, train = setup
    model = tiny_backbone(tok).eval()
    ids, isp, seeds = _batch(train)
    masks = BlockDiffusionMasks.build(T, BS)
    results = []
    for head in (ZeroMRP(model), _WithMaskFavoured(model, tok.mask_token_id)):
        gens = make_generators(seeds)
        masked, p = sample_mask(isp, gens)
        with torch.no_grad():
            _, st = mrp_loss_sum(head, ids, masked, p, masks, tok.mask_token_id, BS, gens, 2, agreement=True)
        results.append(st["agreement"])
    assert results[0] == results[1]
    assert sum(k["tokens_agree"] for k in results[1]) < sum(k["tokens"] for k in results[1])


@pytest.mark.parametrize("K", [1, 3])
def test_scored_is_the_mean_number_of_positions_still_masked_per_step(setup, K):
    tok, train = setup
    model = tiny_backbone(tok).eval()
    ids, isp, seeds = _batch(train)
    masked, p = sample_mask(isp, make_generators(seeds))
    with torch.no_grad():
        _, st = mrp_loss_sum(ZeroMRP(model), ids, masked, p, BlockDiffusionMasks.build(T, BS), tok.mask_token_id,
                             BS, make_generators(seeds), K)
    gens, left, counts = make_generators(seeds), masked, []
    for _ in range(K):
        left = left & ~reveal_one_per_block(left, BS, gens)
        counts.append(int(left.sum()))
    assert sum(counts) > 0 and st["scored"] == sum(counts) / K
