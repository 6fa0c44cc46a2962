"""cached_attention: the Triton kernel (interpreter on CPU, real kernel on CUDA) vs the PyTorch reference, and
the reference vs attention over the full sequence (what the cache stands for)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_utils import DEV, DTYPES, LAUNCHER_RAN, forbid_triton_launcher, poisoned_allocations
from mrp_triton import cached_attention
from mrp_triton import reference as ref
from mrp_triton.cached_attention import cached_attention_triton

attention_module = importlib.import_module("mrp_triton.cached_attention")  # the package's name is the op

# attention outputs are convex combinations of values ~N(0, 1): absolute tolerances per dtype
ATOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


@st.composite
def problems(draw):
    """A decoding forward: B rows with their own committed lengths in a cache of width W (a slice of a
    wider buffer, as the KV cache hands it out), T new positions past each row's prefix, as one block,
    a finished block plus the next (fused commit), K+1 candidate copies of a block (segments), a finished
    block (shared segment -1) plus K+1 copies of the next, or a prefill of several blocks (more keys than one
    tile: the query tiles of early blocks skip the key tiles of later ones)."""
    B, Hkv, group = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    D = draw(st.sampled_from([8, 13, 16, 32]))
    block = draw(st.sampled_from([1, 4, 8, 16]))
    kind = draw(st.sampled_from(["block", "commit", "copies", "commit+copies", "prefill"]))
    copies = draw(st.integers(2, 4)) if kind.endswith("copies") else 1
    n_blocks = {"commit": 2, "prefill": -(-draw(st.integers(65, 160)) // block)}.get(kind, 1)
    lengths = torch.tensor([draw(st.integers(0, 5)) * block for _ in range(B)])
    W = int(lengths.max()) + draw(st.integers(0, 20))
    starts = lengths[:, None] + torch.arange(n_blocks * block)
    positions = starts.repeat(1, copies)
    segments = torch.arange(copies).repeat_interleave(n_blocks * block) if kind.endswith("copies") else None
    if kind == "commit+copies":
        positions = torch.cat([starts, positions + block], 1)
        segments = torch.cat([torch.full((block,), -1), segments])
    return dict(B=B, Hkv=Hkv, Hq=Hkv * group, T=positions.shape[1], D=D, W=W, block=block, lengths=lengths,
                positions=positions, segments=segments, dtype=draw(st.sampled_from(DTYPES)),
                seed=draw(st.integers(0, 2**16)))


def _tensors(p, device=DEV):
    g = torch.Generator().manual_seed(p["seed"])
    r = lambda *shape: torch.randn(*shape, generator=g).to(device, p["dtype"])  # noqa: E731
    B, Hq, Hkv, T, D, W = (p[k] for k in ("B", "Hq", "Hkv", "T", "D", "W"))
    q = r(B, T, Hq, D).transpose(1, 2)  # the model's layout: a transposed view
    k, v = r(B, Hkv, T, D), r(B, Hkv, T, D)
    buffer_k, buffer_v = r(B, Hkv, W + 7, D), r(B, Hkv, W + 7, D)
    return q, k, v, buffer_k[:, :, :W], buffer_v[:, :, :W]


@settings(max_examples=30, deadline=None)
@given(p=problems(), splits=st.sampled_from([None, 1, 2, 3, 5]))
def test_kernel_matches_reference(p, splits):
    """Grouped heads in one program, the committed slots cut into ``splits`` pieces (more pieces than tiles
    too: empty pieces) and merged."""
    q, k, v, ck, cv = _tensors(p)
    args = (p["lengths"].to(DEV), p["positions"].to(DEV), p["block"],
            None if p["segments"] is None else p["segments"].to(DEV))
    with poisoned_allocations():
        out = cached_attention_triton(q, k, v, ck, cv, *args, splits=splits)
    expect = ref.cached_attention(q.float(), k.float(), v.float(), ck.float(), cv.float(), *args)
    assert out.shape == expect.shape and out.dtype == p["dtype"]
    torch.testing.assert_close(out.float(), expect, atol=ATOL[p["dtype"]], rtol=0)


@settings(max_examples=20, deadline=None)
@given(p=problems(), limit=st.sampled_from([20000, 8000]), async_copy=st.booleans(), splits=st.sampled_from([1, 3]))
def test_tiles_fitted_to_a_small_shared_memory_match_reference(p, limit, async_copy, splits):
    """On a GPU whose shared memory holds less than two stages of 64-slot key/value tiles, the launcher takes
    narrower tiles (``_tiles``: 32 or 16 slots); on one without asynchronous copies (sm_75), whose dots convert
    through shared memory, also fewer query positions a program (BLOCK_M 8 or 4 for a group of 2 or 4 query heads
    in 8000 bytes): they give the reference's attention too."""
    from mrp_triton.cached_attention import _tiles

    group_p2 = 1 << (p["Hq"] // p["Hkv"] - 1).bit_length()
    block_m, block_n, stages = _tiles(p["dtype"], max(16, 1 << (p["D"] - 1).bit_length()), group_p2, limit,
                                      async_copy)
    assert (block_n, stages) != (64, 3) and (block_n == 16 or limit > 8000), (block_m, block_n, stages)
    if async_copy:
        assert block_m == 16
    else:  # fewer query positions, down to the dots' 16 rows
        assert 16 // group_p2 <= block_m <= 16 and (limit > 8000 or block_m == 16 // group_p2), (block_m, group_p2)
    q, k, v, ck, cv = _tensors(p)
    args = (p["lengths"].to(DEV), p["positions"].to(DEV), p["block"],
            None if p["segments"] is None else p["segments"].to(DEV))
    with poisoned_allocations():
        out = cached_attention_triton(q, k, v, ck, cv, *args, splits=splits, shared_limit=limit,
                                      async_copy=async_copy)
    expect = ref.cached_attention(q.float(), k.float(), v.float(), ck.float(), cv.float(), *args)
    torch.testing.assert_close(out.float(), expect, atol=ATOL[p["dtype"]], rtol=0)


@settings(max_examples=25, deadline=None)
@given(p=problems(), splits=st.sampled_from([None, 1, 3]), data=st.data())
def test_ragged_kernel_matches_reference(p, splits, data):
    """A ragged forward: a drawn subset of the [B, T] grid computed (at least one position; all of them too), held
    as one row of L places in a drawn order. The kernel equals the reference (the positions not computed are
    neither queries nor keys, the programs of query tiles with none computed return at once), and with every
    position computed both equal the dense attention, place by place; given the grid rows that hold the computed
    places (``rows``), the reference attends those alone and gives the same, and the kernel the same as without."""
    B, T = p["B"], p["T"]
    keep = torch.tensor(data.draw(st.one_of(st.just([True] * (B * T)),
                                            st.lists(st.booleans(), min_size=B * T, max_size=B * T).filter(any))))
    L = int(keep.sum())
    places = torch.full((B * T,), -1, dtype=torch.long)
    places[keep] = torch.randperm(L, generator=torch.Generator().manual_seed(p["seed"]))
    places = places.view(B, T)
    q_grid, k_grid, v_grid, ck, cv = _tensors(p)

    def ragged(x):  # [B, H, T, D] -> [1, H, L, D]: grid position (b, t) at index places[b, t]
        out = x.new_empty((L, x.shape[1], x.shape[3]))
        out[places[keep.view(B, T)].to(DEV)] = x.transpose(1, 2)[keep.view(B, T).to(DEV)]
        return out[None].transpose(1, 2)

    q, k, v = ragged(q_grid), ragged(k_grid), ragged(v_grid)
    args = (p["lengths"].to(DEV), p["positions"].to(DEV), p["block"],
            None if p["segments"] is None else p["segments"].to(DEV))
    with poisoned_allocations():
        out = cached_attention_triton(q, k, v, ck, cv, *args, places=places.to(DEV), splits=splits)
    expect = ref.cached_attention(q.float(), k.float(), v.float(), ck.float(), cv.float(), *args,
                                  places=places.to(DEV))
    assert out.shape == expect.shape == (1, p["Hq"], L, p["D"]) and out.dtype == p["dtype"]
    torch.testing.assert_close(out.float(), expect, atol=ATOL[p["dtype"]], rtol=0)
    rows = keep.view(B, T).any(1).nonzero().flatten().to(DEV)
    torch.testing.assert_close(ref.cached_attention(q.float(), k.float(), v.float(), ck.float(), cv.float(), *args,
                                                    places=places.to(DEV), rows=rows), expect, atol=1e-6, rtol=0)
    assert torch.equal(cached_attention_triton(q, k, v, ck, cv, *args, places=places.to(DEV), rows=rows,
                                               splits=splits), out)
    if L == B * T:
        dense = ref.cached_attention(q_grid.float(), k_grid.float(), v_grid.float(), ck.float(), cv.float(), *args)
        torch.testing.assert_close(expect, ragged(dense), atol=1e-5, rtol=0)


def test_uncommitted_slots_are_never_read():
    """Slots past a row's length (stale entries of an earlier call) change nothing; the kernel does not
    even read them (NaN there stays out), the reference masks them (finite values only: SDPA's masked
    products with NaN are NaN)."""
    p = dict(B=2, Hkv=2, Hq=4, T=4, D=16, W=12, block=4, seed=1, dtype=torch.float32)
    q, k, v, ck, cv = _tensors(p)
    lengths, positions = torch.tensor([4, 8], device=DEV), torch.tensor([[4, 5, 6, 7], [8, 9, 10, 11]], device=DEV)
    clean = cached_attention_triton(q, k, v, ck, cv, lengths, positions, 4)
    stale_k, stale_v = ck.clone(), cv.clone()
    stale_k[0, :, 4:], stale_v[0, :, 4:], stale_k[1, :, 8:], stale_v[1, :, 8:] = 1e4, -1e4, 1e4, 1e4
    torch.testing.assert_close(ref.cached_attention(q, k, v, stale_k, stale_v, lengths, positions, 4), clean,
                               atol=2e-5, rtol=0)
    stale_k[0, :, 4:], stale_v[0, :, 4:] = float("nan"), float("nan")
    assert torch.equal(cached_attention_triton(q, k, v, stale_k, stale_v, lengths, positions, 4), clean)
    split = cached_attention_triton(q, k, v, stale_k, stale_v, lengths, positions, 4, splits=3)
    torch.testing.assert_close(split, clean, atol=2e-5, rtol=0)


def test_empty_row_whose_first_key_tile_it_cannot_see():
    """A row with no committed slots whose second copy's queries find no visible key in the first tile of new keys
    (16-slot tiles, the first copy's block): the online softmax must not compute exp(-inf - -inf) there. Each copy
    equals plain attention over its own block."""
    from mrp_triton.cached_attention import _tiles

    block, copies, D = 16, 2, 16
    assert _tiles(torch.float32, D, 1, 8000)[1] == block  # a tile holds one copy's keys only
    p = dict(B=1, Hkv=1, Hq=2, T=copies * block, D=D, W=4, block=block, seed=4, dtype=torch.float32)
    q, k, v, ck, cv = _tensors(p)
    positions = torch.arange(block, device=DEV).repeat(1, copies)
    segments = torch.arange(copies, device=DEV).repeat_interleave(block)
    out = cached_attention_triton(q, k, v, ck, cv, torch.tensor([0], device=DEV), positions, block, segments,
                                  splits=1, shared_limit=8000)
    for c in range(copies):
        span = slice(c * block, (c + 1) * block)
        expect = F.scaled_dot_product_attention(q[:, :, span], k[:, :, span], v[:, :, span], enable_gqa=True)
        torch.testing.assert_close(out[:, :, span], expect, atol=2e-5, rtol=0)


@pytest.mark.parametrize("sign", [1, -1])
def test_scores_far_from_zero_merge_across_splits(sign):
    """Scores near +-200 (exp overflows or underflows fp32): the merge of 3 splits (a power-of-2 lane left empty)
    rescales each split by exp(m_s - max m), so the result is plain softmax attention all the same."""
    B, Hkv, Hq, T, D, W = 1, 1, 2, 4, 16, 300
    g = torch.Generator().manual_seed(5)
    q = 7 + 0.3 * torch.randn(B, Hq, T, D, generator=g)
    k, ck = (sign * 7 + 0.3 * torch.randn(B, Hkv, n, D, generator=g) for n in (T, W))
    v, cv = (torch.randn(B, Hkv, n, D, generator=g) for n in (T, W))
    positions = torch.arange(W, W + T)[None]
    out = cached_attention_triton(*(x.to(DEV) for x in (q, k, v, ck, cv)), torch.tensor([W], device=DEV),
                                  positions.to(DEV), T, splits=3)
    scores = q.double() @ torch.cat([ck, k], 2).double().repeat_interleave(Hq // Hkv, 1).transpose(-1, -2) / D ** 0.5
    assert scores.abs().min() > 150
    expect = scores.softmax(-1) @ torch.cat([cv, v], 2).double().repeat_interleave(Hq // Hkv, 1)
    torch.testing.assert_close(out.cpu().double(), expect, atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", ["columns-strided", "cache-v-own-strides", "segments-int32-strided"])
def test_operand_layouts_match_reference(layout):
    """Views the kernel cannot read with its unit column stride and the key cache's strides: q, k, v whose columns
    are strided (copied first), a value cache laid out unlike the key cache, int32 segments that are a strided view.
    Each gives what the reference gives on the same values."""
    p = dict(B=2, Hkv=1, Hq=2, T=8, D=16, W=12, block=4, seed=6, dtype=torch.float32)
    q, k, v, ck, cv = _tensors(p)
    lengths = torch.tensor([4, 8], device=DEV)
    positions = torch.cat([lengths[:, None] + torch.arange(4, device=DEV)] * 2, 1)
    segments = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1], device=DEV)
    if layout == "columns-strided":
        q, k, v = (x.transpose(-1, -2).contiguous().transpose(-1, -2) for x in (q, k, v))
        assert q.stride(-1) != 1
    elif layout == "cache-v-own-strides":
        cv = cv.contiguous()
        assert cv.stride() != ck.stride()
    else:
        segments = segments.repeat_interleave(2).to(torch.int32)[::2]
        assert not segments.is_contiguous()
    out = cached_attention_triton(q, k, v, ck, cv, lengths, positions, 4, segments)
    expect = ref.cached_attention(q, k, v, ck, cv, lengths, positions, 4, segments)
    torch.testing.assert_close(out, expect, atol=ATOL[p["dtype"]], rtol=0)


def test_splits_fill_the_gpu_only_when_rows_and_heads_do_not(monkeypatch):
    """On a 132-SM GPU: batch 1 of an 8-KV-head model, one block (8 programs), over a 768-slot cache is cut
    into 6 pieces of >= 128 slots; 32 rows with 5 query tiles (1280 programs) are not cut; a short cache is
    not cut below 128 slots a piece; the interpreter never cuts unasked."""
    monkeypatch.setattr(attention_module, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert attention_module._splits(8, 768, cuda) == 6
    assert attention_module._splits(1280, 768, cuda) == 1
    assert attention_module._splits(8, 200, cuda) == 1
    assert attention_module._splits(8, 1 << 16, cuda) == 16
    assert attention_module._splits(8, 768, torch.device("cpu")) == 1


@pytest.mark.parametrize("segments", ["none", "copies", "shared+copies"])
def test_reference_equals_attention_over_the_whole_sequence(segments):
    """Row by row, cached attention equals block-causal attention over prefix + new positions computed
    from scratch; copies in their own segments equal each copy attended alone; a finished block in the
    shared segment (-1) in front of the copies is seen by every copy, as if it were in the cache."""
    torch.manual_seed(0)
    B, H, D, T, block = 2, 2, 8, 4, 4
    lengths = torch.tensor([4, 8])
    prefix_k, prefix_v = torch.randn(B, H, 8, D, dtype=torch.float64), torch.randn(B, H, 8, D, dtype=torch.float64)
    copies = 1 if segments == "none" else 3
    shared = T if segments == "shared+copies" else 0
    q, k, v = (torch.randn(B, H, shared + copies * T, D, dtype=torch.float64) for _ in range(3))
    positions = (lengths[:, None] + torch.arange(shared, shared + T)).repeat(1, copies)
    positions = torch.cat([lengths[:, None] + torch.arange(shared), positions], 1)
    seg = None if segments == "none" else torch.cat([torch.full((shared,), -1),
                                                     torch.arange(copies).repeat_interleave(T)])
    out = ref.cached_attention(q, k, v, prefix_k, prefix_v, lengths, positions, block, seg)
    for b in range(B):
        n = int(lengths[b])
        for c in range(copies):
            span = slice(shared + c * T, shared + (c + 1) * T)
            keys = torch.cat([prefix_k[b, :, :n], k[b, :, :shared], k[b, :, span]], 1)
            values = torch.cat([prefix_v[b, :, :n], v[b, :, :shared], v[b, :, span]], 1)
            expect = F.scaled_dot_product_attention(q[b, :, span], keys, values)  # all visible
            torch.testing.assert_close(out[b, :, span], expect)
        if shared:  # the finished block sees the prefix and itself only
            keys = torch.cat([prefix_k[b, :, :n], k[b, :, :shared]], 1)
            values = torch.cat([prefix_v[b, :, :n], v[b, :, :shared]], 1)
            expect = F.scaled_dot_product_attention(q[b, :, :shared], keys, values)
            torch.testing.assert_close(out[b, :, :shared], expect)


def test_float64_and_cpu_dispatch_to_the_reference():
    p = dict(B=1, Hkv=1, Hq=2, T=3, D=8, W=4, block=4, seed=2, dtype=torch.float64)
    q, k, v, ck, cv = _tensors(p, "cpu")
    args = (torch.tensor([4]), torch.tensor([[4, 5, 6]]), 4)
    assert torch.equal(cached_attention(q, k, v, ck, cv, *args), ref.cached_attention(q, k, v, ck, cv, *args))


@pytest.mark.parametrize("op", [cached_attention_triton, cached_attention], ids=["triton", "dispatch"])
@pytest.mark.parametrize("bad,message", [
    (dict(k=torch.zeros(1, 3, 3, 8)), "multiple of key/value heads"),
    (dict(v=torch.zeros(1, 1, 3, 4)), "k and v must be"),
    (dict(lengths=torch.tensor([4.0])), "lengths must be an int64"),
    (dict(lengths=torch.tensor([4, 4])), "lengths must be an int64"),
    (dict(positions=torch.tensor([[4, 5]])), "positions must be an int64 tensor"),
    (dict(positions=torch.tensor([[4, 5, 6]], dtype=torch.int32)), "positions must be an int64 tensor"),
    (dict(segments=torch.tensor([0, 1])), "segments must be a tensor"),
    (dict(cache_k=torch.zeros(1, 1, 4, 4)), "cache_k and cache_v must be"),
    (dict(cache_v=torch.zeros(1, 1, 5, 8)), "cache_k and cache_v must be"),
    (dict(cache_k=torch.zeros(2, 1, 4, 8), cache_v=torch.zeros(2, 1, 4, 8)), "cache_k and cache_v must be"),
    (dict(v=torch.zeros(1, 1, 3, 8, dtype=torch.float16)), "share one floating dtype"),
    (dict(lengths=torch.tensor([4], device="meta")), "lengths is on meta"),
    (dict(places=torch.tensor([[0, 1, 2]], dtype=torch.int32)), "with places"),
    (dict(places=torch.tensor([[0, 1, 2]], device="meta")), "with places"),
    (dict(q=torch.zeros(2, 2, 3, 8), k=torch.zeros(2, 1, 3, 8), places=torch.tensor([[0, 1, 2]])), "with places"),
    (dict(rows=torch.tensor([0])), "rows .* given with places"),
    (dict(places=torch.tensor([[0, 1, 2]]), rows=torch.tensor([0], dtype=torch.int32)), "rows .* must be an int64"),
], ids=lambda x: None if isinstance(x, dict) else x)
def test_bad_arguments_are_named(bad, message, op):
    """Each check of ``_check`` (which the reference path runs too) names its argument: a wrong shape, dtype or
    device of any operand, a ragged forward's q of more than one row or places not int64 on q's device, and rows
    without places or not int64."""
    p = dict(B=1, Hkv=1, Hq=2, T=3, D=8, W=4, block=4, seed=3, dtype=torch.float32)
    q, k, v, ck, cv = _tensors(p, "cpu")
    args = dict(q=q, k=k, v=v, cache_k=ck, cache_v=cv, lengths=torch.tensor([4]), positions=torch.tensor([[4, 5, 6]]),
                block_size=4, segments=None, places=None)
    args.update(bad)
    if "k" in bad:
        args["v"] = bad["k"]
    with pytest.raises((ValueError, TypeError), match=message):
        op(**args)


def test_integer_operands_are_refused():
    """q, k, v and the caches sharing one dtype is not enough: it must be a floating one."""
    p = dict(B=1, Hkv=1, Hq=2, T=3, D=8, W=4, block=4, seed=3, dtype=torch.float32)
    q, k, v, ck, cv = (x.to(torch.int64) for x in _tensors(p, "cpu"))
    with pytest.raises(TypeError, match="share one floating dtype"):
        cached_attention_triton(q, k, v, ck, cv, torch.tensor([4]), torch.tensor([[4, 5, 6]]), 4)


@pytest.mark.triton
def test_float64_runs_the_reference_under_the_triton_backend(monkeypatch):
    """The public op sends float64 to the reference even where the backend is Triton (float32 reaches the kernel)."""
    forbid_triton_launcher(monkeypatch, "cached_attention")
    p = dict(B=1, Hkv=1, Hq=2, T=3, D=8, W=4, block=4, seed=2, dtype=torch.float64)
    q, k, v, ck, cv = _tensors(p, "cpu")
    args = (torch.tensor([4]), torch.tensor([[4, 5, 6]]), 4)
    assert torch.equal(cached_attention(q, k, v, ck, cv, *args), ref.cached_attention(q, k, v, ck, cv, *args))
    with pytest.raises(AssertionError, match=LAUNCHER_RAN):
        cached_attention(q.float(), k.float(), v.float(), ck.float(), cv.float(), *args)


@pytest.mark.parametrize("splits", [0, -1, 2.0, True])
def test_bad_splits_are_named(splits):
    p = dict(B=1, Hkv=1, Hq=2, T=3, D=8, W=4, block=4, seed=3, dtype=torch.float32)
    q, k, v, ck, cv = _tensors(p)
    with pytest.raises(ValueError, match="splits must be a positive int"):
        cached_attention_triton(q, k, v, ck, cv, torch.tensor([4], device=DEV), torch.tensor([[4, 5, 6]], device=DEV),
                                4, splits=splits)
