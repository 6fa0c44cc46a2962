"""Contracts every op keeps on either backend (the Triton kernel under the interpreter, and the reference): the
arguments each refuses, float64 on the reference, NaN / +inf rankings, and the launchers' refusal of CPU tensors
without the interpreter."""

import pytest
import torch

import mrp_triton
from mrp_triton import use_backend

pytestmark = pytest.mark.triton
BACKENDS = ["reference", "triton"]
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_and_inf_entropies_tie_and_the_lowest_index_goes_first(backend):
    """NaN ranks as +inf (the reference turned +inf into the largest float, ranking NaN after it)."""
    block = torch.full((1, 3), 9)
    with use_backend(backend):
        committed = mrp_triton.select_commit(block, torch.tensor([[1, 2, 3]]), torch.zeros(1, 3), mask_token_id=9,
                                             n=1, entropy=torch.tensor([[NAN, INF, INF]]), entropy_bound=0.0)
    assert committed.tolist() == [[True, False, False]] and block.tolist() == [[1, 9, 9]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_lm_head_confidence_refuses_what_confidence_refuses(backend):
    """A temperature whose inverse overflows fp32 (the kernel read a 0 logit as NaN there) and a mask token id that
    is no int (True blanked every row of the reference; 2.7 became column 2 in the kernel)."""
    h, w = torch.randn(2, 4), torch.randn(5, 4)
    with use_backend(backend):
        with pytest.raises(ValueError, match=r"temperature must be a finite float in \[1e-20, 1e\+20\]"):
            mrp_triton.lm_head_confidence(h, w, temperature=1e-40)
        for bad in (True, 2.7):
            with pytest.raises(TypeError, match="mask_token_id must be an int"):
                mrp_triton.lm_head_confidence(h, w, mask_token_id=bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ids_outside_their_table_are_refused_on_cpu(backend):
    """An MRP input id of -1 (the reference read the table's last row), a listed candidate id of V (the kernel read
    past the lm_head) and a block size < 1: refused on CPU by both backends (the references' gathers raise on their
    own, with no host sync inside the decoder's steps; the launchers check CPU ids, which the interpreter would read
    out of bounds); cache lengths past the cache's width, which the reference clamps, by the kernel."""
    embed, norm, hidden = torch.randn(3, 4), torch.ones(4), torch.randn(1, 4)
    q = k = v = torch.randn(1, 1, 2, 16)
    cache = torch.randn(1, 1, 8, 16)
    triton = backend == "triton"
    with use_backend(backend):
        with pytest.raises(IndexError, match=r"ids must lie in \[0, 3\)" if triton else "index out of range"):
            mrp_triton.mrp_input(torch.tensor([-1]), embed, hidden, norm, norm, 1e-6)
        with pytest.raises(IndexError, match=r"ids must lie in \[-1, 10\)" if triton else "index"):
            mrp_triton.candidate_confidence(torch.randn(1, 8), torch.randn(10, 8), torch.tensor([[1, 10, -1]]),
                                            torch.tensor([-1.0]), seed_hidden=torch.randn(1, 8),
                                            vocab_mean=torch.randn(8))
        with pytest.raises(ValueError, match="block_size must be an int >= 1, got 0"):
            mrp_triton.cached_attention(q, k, v, cache, cache, torch.tensor([4]), torch.tensor([[4, 5]]), 0)
    if triton:
        with pytest.raises(IndexError, match=r"lengths must lie in \[0, 9\)"):
            mrp_triton.cached_attention_triton(q, k, v, cache, cache, torch.tensor([11]), torch.tensor([[11, 12]]), 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_settle_refuses_tokens_outside_the_eos_table(backend):
    """is_eos is read by token id: -1 read the table's last entry in the reference, V read past it in the kernel."""
    is_eos = torch.tensor([False, False, False, True])
    for token in (-1, 4):
        message = r"block must lie in \[0, 4\)" if backend == "triton" else "index out of range"
        with use_backend(backend), pytest.raises(IndexError, match=message):
            mrp_triton.settle_rows(torch.tensor([[token, 1, 1]]), torch.tensor([[10, 11, 12]]), torch.tensor([0]),
                                   torch.tensor([100]), is_eos, mask_token_id=1, filler=0)


def test_a_nan_rest_mass_gives_a_nan_probability_on_both_backends():
    """The kernel's clamp of the normaliser swallowed a NaN rest (a 'probability' of 6e29)."""
    torch.manual_seed(0)
    args = (torch.randn(1, 8), torch.randn(10, 8), torch.tensor([[1, 4, -1]]), torch.tensor([NAN]))
    kw = dict(seed_hidden=torch.randn(1, 8), vocab_mean=torch.randn(8))
    results = []
    for backend in BACKENDS:
        with use_backend(backend):
            results.append(mrp_triton.candidate_confidence(*args, **kw))
    (ref_tok, ref_prob), (tok, prob) = results
    assert torch.equal(tok, ref_tok) and prob.isnan().all() and ref_prob.isnan().all()


def test_float64_runs_the_reference_whatever_the_backend():
    """The kernels compute in fp32: float64 operands go to the reference, so forcing the Triton backend loses no
    precision (it gave swiglu to fp32's 1e-8 before)."""
    x = torch.tensor([[1.0 + 1e-12, 2.0, 3.0, 4.0]], dtype=torch.float64)
    w = torch.full((4,), 1.5, dtype=torch.float64)
    q = torch.randn(1, 2, 2, 4, dtype=torch.float64)
    cos, sin = torch.rand(1, 2, 4, dtype=torch.float64), torch.rand(1, 2, 4, dtype=torch.float64)
    ops = {"swiglu": lambda: mrp_triton.swiglu(x, x), "rms_norm": lambda: mrp_triton.rms_norm(x, w, 1e-6),
           "qk_norm_rope": lambda: mrp_triton.qk_norm_rope(q, q, w, w, cos, sin, 1e-6)[0],
           "mrp_input": lambda: mrp_triton.mrp_input(torch.tensor([0]), x, x, w, w, 1e-6)}
    for name, op in ops.items():
        with use_backend("reference"):
            want = op()
        with use_backend("triton"):
            got = op()
        assert got.dtype == torch.float64 and torch.equal(got, want), name


def test_every_launcher_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    """Naming the public op that runs the reference there (six launchers failed inside Triton with '0 active
    drivers')."""
    from mrp_triton import _checks

    monkeypatch.setattr(_checks, "interpreter_on", lambda: False)
    x, w = torch.randn(2, 4), torch.ones(4)
    q = torch.randn(1, 2, 2, 4)
    cos = sin = torch.ones(1, 2, 4)
    launchers = {"rms_norm": lambda: mrp_triton.rms_norm_triton(x, w, 1e-6),
                 "swiglu": lambda: mrp_triton.swiglu_triton(x, x),
                 "qk_norm_rope": lambda: mrp_triton.qk_norm_rope_triton(q, q, w, w, cos, sin, 1e-6),
                 "mrp_input": lambda: mrp_triton.mrp_input_triton(torch.tensor([0, 1]), x, x, w, w, 1e-6),
                 "lm_head_confidence": lambda: mrp_triton.lm_head_confidence_triton(x, torch.randn(5, 4)),
                 "candidate_confidence": lambda: mrp_triton.candidate_confidence_triton(
                     x, torch.randn(5, 4), torch.tensor([[0], [1]]), torch.zeros(2), seed_hidden=x, vocab_mean=w)}
    for op, launch in launchers.items():
        with pytest.raises(RuntimeError, match=rf"needs CUDA tensors .* call mrp_triton.{op}\(\)"):
            launch()
