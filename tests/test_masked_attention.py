"""modeling_sdar.masked_attention: the attention of forwards without a cache (training, the oracle tests)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_integration.modeling_sdar import masked_attention


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_expanded_heads_equal_grouped_heads(data):
    """The CUDA path's expanded key/value heads (what keeps masked attention off SDPA's math kernel there) give
    the grouped-head attention and gradients, float64."""
    B, kv, group = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    T, S, D = data.draw(st.integers(1, 9)), data.draw(st.integers(1, 12)), data.draw(st.sampled_from([4, 8]))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 999)))
    q, k, v = (torch.randn(B, h, n, D, generator=g, dtype=torch.float64)
               for h, n in ((kv * group, T), (kv, S), (kv, S)))
    mask = torch.rand(1, 1, T, S, generator=g) < 0.6
    mask[..., 0] = True  # every query sees at least one key
    outputs = []
    for expand in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = masked_attention(*leaves, mask, expand_kv=expand)
        out.square().sum().backward()
        outputs.append((out.detach(), [t.grad for t in leaves]))
    (a, grads_a), (b, grads_b) = outputs
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for x, y in zip(grads_a, grads_b):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    reference = (q @ k.repeat_interleave(group, 1).transpose(-1, -2) / D ** 0.5).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(a, reference.softmax(-1) @ v.repeat_interleave(group, 1), rtol=1e-10, atol=1e-12)
