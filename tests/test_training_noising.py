import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_integration.modeling_sdar import masked_attention
from training.noising import (BlockDiffusionMasks, block_diffusion_mask, make_generators, pack_noisy_clean,
                              reveal_one_per_block, sample_mask, sample_seed)


@given(st.integers(1, 4), st.sampled_from([1, 2, 4]), st.integers(1, 6), st.integers(0, 2**31), st.floats(0, 1))
def test_mask_invariants(B, bs, nb, seed, prompt_frac):
    T = bs * nb
    g = torch.Generator().manual_seed(seed)
    is_prompt = torch.rand(B, T, generator=g) < prompt_frac
    gens = make_generators([seed + b for b in range(B)])
    masked, p = sample_mask(is_prompt, gens)
    assert masked.shape == (B, T) and masked.dtype == torch.bool
    assert not (masked & is_prompt).any(), "prompt tokens are never masked"
    has_answer = (~is_prompt).any(1)
    assert (masked.any(1) == has_answer).all(), "at least one masked where there is an answer"
    assert ((p >= 1e-3) & (p <= 1.0)).all()
    # reveal: one still-masked position per block that has one, a subset of masked
    r = reveal_one_per_block(masked, bs, gens)
    assert not (r & ~masked).any()
    per_block = r.view(B, nb, bs).sum(-1)
    assert (per_block == masked.view(B, nb, bs).any(-1).long()).all()


def test_noise_is_per_sample_and_reproducible():
    is_prompt = torch.zeros(3, 64, dtype=torch.bool)
    seeds = [sample_seed(0, "train", 5, i) for i in (10, 11, 12)]
    m1, p1 = sample_mask(is_prompt, make_generators(seeds))
    m2, p2 = sample_mask(is_prompt[1:], make_generators(seeds[1:]))  # same sample, other batch slot
    assert torch.equal(m1[1:], m2) and torch.equal(p1[1:], p2)
    assert len(set(seeds)) == 3


@pytest.mark.parametrize("eps", [1e-3, 0.5])
def test_p_is_drawn_in_eps_to_one(eps):
    """p = (1 - eps) t + eps with t ~ U(0, 1): the same generators give t, so p is recomputed exactly."""
    seeds = list(range(16))
    _, p = sample_mask(torch.zeros(16, 8, dtype=torch.bool), make_generators(seeds), eps=eps)
    t = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in make_generators(seeds)])
    assert torch.equal(p, ((1.0 - eps) * t + eps).float())
    assert (p >= eps).all() and (p <= 1.0).all()


def test_masking_rate_follows_p():
    T = 4096
    is_prompt = torch.zeros(8, T, dtype=torch.bool)
    masked, p = sample_mask(is_prompt, make_generators(range(8)))
    rate = masked.float().mean(1)
    assert torch.allclose(rate, p, atol=0.05)


def test_default_eps_is_one_in_a_thousand():
    seeds = list(range(8))
    is_prompt = torch.zeros(8, 16, dtype=torch.bool)
    default = sample_mask(is_prompt, make_generators(seeds))
    explicit = sample_mask(is_prompt, make_generators(seeds), eps=1e-3)
    assert all(torch.equal(a, b) for a, b in zip(default, explicit))


def test_forced_mask_picks_a_uniform_answer_position():
    """When the Bernoulli draws mask nothing, the one forced masked position is uniform over the answer."""
    n, T = 4000, 4
    masked, _ = sample_mask(torch.zeros(n, T, dtype=torch.bool), make_generators(range(n)))
    single = masked[masked.sum(1) == 1]
    assert len(single) > 200
    share = single.float().mean(0)
    assert ((share > 0.15) & (share < 0.35)).all(), share


def test_reveal_picks_a_uniform_position_in_each_block():
    bs, T, n = 4, 256, 8
    reveal = reveal_one_per_block(torch.ones(n, T, dtype=torch.bool), bs, make_generators(range(n)))
    share = reveal.view(-1, bs).float().mean(0)  # how often each in-block offset was picked
    assert ((share > 0.15) & (share < 0.35)).all(), share


def test_block_diffusion_mask_rules():
    T, bs = 8, 2
    m = block_diffusion_mask(T, bs)
    assert m.shape == (1, 1, 2 * T, 2 * T) and m.dtype == torch.bool
    m = m[0, 0]
    blk = lambda i: (i % T) // bs  # noqa: E731
    for i in range(2 * T):
        for j in range(2 * T):
            qi_noisy, kj_noisy = i < T, j < T
            if qi_noisy and kj_noisy:
                want = blk(i) == blk(j)
            elif qi_noisy:
                want = blk(j) < blk(i)
            elif kj_noisy:
                want = False
            else:
                want = blk(j) <= blk(i)
            assert bool(m[i, j]) == want, (i, j)
    with pytest.raises(ValueError):
        block_diffusion_mask(7, 2)


def test_dense_masks_are_the_rows_of_the_full_mask():
    T, bs = 12, 4
    masks = BlockDiffusionMasks.build(T, bs)
    assert torch.equal(masks.full, block_diffusion_mask(T, bs))
    assert torch.equal(masks.noisy, masks.full[..., :T, :])


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([1, 2, 4, 16]), st.integers(1, 160), st.sampled_from([(2, 1), (4, 2), (2, 2)]),
       st.integers(1, 2), st.integers(0, 2**31))
def test_flex_block_masks_attend_as_the_dense_masks(bs, T, heads, B, seed):
    """FlexAttention with the block masks (training's attention on CUDA) equals SDPA with the dense masks, for all
    2T queries and for the noisy half's T, grouped heads included, at lengths that cut FlexAttention's 128-wide
    tiles anywhere (forward only: FlexAttention has no backward on CPU)."""
    T = -(-T // bs) * bs
    hq, hkv = heads
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(B, hkv, 2 * T, 8, generator=g) for _ in range(2))
    dense, flex = BlockDiffusionMasks.build(T, bs), BlockDiffusionMasks.build(T, bs, flex=True)
    for rows, want_mask, got_mask in ((2 * T, dense.full, flex.full), (T, dense.noisy, flex.noisy)):
        q = torch.randn(B, hq, rows, 8, generator=g)
        want = masked_attention(q, k, v, want_mask, expand_kv=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "called without torch.compile": the unfused path is the CPU one
            got = masked_attention(q, k, v, got_mask, expand_kv=False)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_pack_noisy_clean():
    clean = torch.arange(8).view(2, 4)
    ids, pos = pack_noisy_clean(clean + 100, clean)
    assert ids.shape == (2, 8) and torch.equal(ids[:, 4:], clean)
    assert pos.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]] * 2
