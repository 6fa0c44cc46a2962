"""CUDA-graph decoding on a GPU: replayed steps give the tokens and counts of eager decoding.

Skipped without CUDA (the CPU suite replays the recorded step functions on the same fixed buffers, in
test_generate.py, and traces every graphed step as one graph, in test_step_graphs.py).
The ``triton`` case captures the Triton kernels too; it needs TRITON_INTERPRET=0.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from hf_integration.step_graphs import StepGraphs, conditional_nodes_supported
from tiny_models import padded_batch, random_prompts, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STRATEGIES = [dict(strategy="static"), dict(strategy="dynamic", threshold=0.3), dict(strategy="direct", mrp_steps=2),
              dict(strategy="speculative", mrp_steps=3), dict(strategy="remask", threshold=0.4),
              dict(strategy="speculative", mrp_steps=2, draft_vocab=list(range(1, 67, 2))),  # rows in a buffer
              dict(strategy="speculative", mrp_steps=2, draft_candidates=4),  # the seed's lists carried over
              # written by each captured step
              dict(strategy="remask", threshold=0.4, output_reveal_steps=True, output_confidences=True),
              dict(strategy="speculative", mrp_steps=3, output_confidences=True)]
NOTES = ("reveal_steps", "confidences")  # what output_<note>=True returns


def _name(kwargs: dict) -> str:
    return " ".join([kwargs["strategy"], *(k for k in ("draft_vocab", "draft_candidates", "output_reveal_steps",
                                                       "output_confidences") if k in kwargs)])


def _record_without_capture(self, key, fn, inputs, branches=False):
    """StepGraphs._record as off CUDA: the step runs, and each replay calls it again on the same buffers."""
    return self._call(fn, inputs), (fn, inputs, None, None)


def _graphed_equals_eager(kwargs, monkeypatch, device_loop=False):
    captured = []
    original = StepGraphs._record

    def spy(self, key, fn, inputs, branches=False):
        output, entry = original(self, key, fn, inputs, branches)
        captured.append((key, entry))
        return output, entry

    model = tiny_model(seed=0, dtype=torch.float32).cuda()
    lens = [2, 11, 6, 1, 9, 4]  # with an EOS, rows finish at different steps: the batch shrinks by buckets
    ids, mask = (t.cuda() for t in padded_batch([random_prompts(1, n, seed=30 + n)[0] for n in lens], "right"))
    settings = dict(attention_mask=mask, max_new_tokens=24, eos_token_id=1, pad_token_id=0,
                    return_dict_in_generate=True, **kwargs)
    eager = model.generate(ids, cuda_graphs=False, **settings)
    # The same steps on the same buffers and cache width, run each time instead of replayed: what capture alone
    # may change (nothing: the graphed run must equal it bit for bit, batch steps included).
    monkeypatch.setattr(StepGraphs, "_record", _record_without_capture)
    recorded = model.generate(ids, cuda_graphs=True, device_loop=device_loop, **settings)
    model.release_decode_engine()
    monkeypatch.setattr(StepGraphs, "_record", spy)
    graphed = model.generate(ids, device_loop=device_loop, **settings)  # graphs: on by default for a CUDA model
    assert captured and all(entry != "eager" for _, entry in captured), captured
    assert torch.equal(graphed.sequences, recorded.sequences) and graphed.batch_steps == recorded.batch_steps
    for name, value in vars(recorded.stats).items():
        assert torch.equal(getattr(graphed.stats, name), value), name
    for note in NOTES:
        if kwargs.get(f"output_{note}"):
            assert torch.equal(getattr(graphed, note), getattr(recorded, note)), note
    kinds = {key[0] for key, _ in captured}
    assert {"denoise", "speculate", "remask"} & kinds, kinds  # whole steps, not only forwards
    assert ("loop" in kinds) == device_loop, kinds
    assert {key[-1][0] for key, _ in captured} <= {8, 4, 2, 1}  # the bucket of 6 rows, then smaller ones
    assert torch.equal(graphed.sequences, eager.sequences)
    # With an EOS, eager decoding checks the host after every step; replayed steps without the device loop keep the
    # checks of decoding without one (static: once a block; speculative: after the rounds that surely have work).
    if device_loop or kwargs["strategy"] in ("dynamic", "remask"):
        assert graphed.batch_steps == eager.batch_steps
    else:
        assert graphed.batch_steps >= eager.batch_steps
    for name, value in vars(eager.stats).items():
        assert torch.equal(getattr(graphed.stats, name), value), name
    if kwargs.get("output_reveal_steps"):
        assert torch.equal(graphed.reveal_steps, eager.reveal_steps)
    if kwargs.get("output_confidences"):  # a graphed engine's wider cache may round the attention otherwise
        torch.testing.assert_close(graphed.confidences, eager.confidences, rtol=1e-4, atol=0)


@pytest.mark.parametrize("kwargs", STRATEGIES, ids=_name)
def test_graph_replay_equals_eager_reference_ops(kwargs, monkeypatch):
    _graphed_equals_eager(kwargs, monkeypatch)


@pytest.mark.triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter cannot be captured")
@pytest.mark.parametrize("kwargs", STRATEGIES, ids=_name)
def test_graph_replay_equals_eager_triton_ops(kwargs, monkeypatch):
    _graphed_equals_eager(kwargs, monkeypatch)


@pytest.mark.triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter cannot be captured")
@pytest.mark.skipif(not conditional_nodes_supported(), reason="CUDA-graph conditional nodes need torch >= 2.12")
@pytest.mark.parametrize("kwargs", STRATEGIES, ids=_name)
def test_device_loop_equals_eager(kwargs, monkeypatch):
    """The steps after the surely busy ones, captured into conditional nodes (each run while no row has filled
    its block, tested on the device), decode as eager decoding does: same tokens, counts and steps (static and
    direct too: with an EOS, their steps after a check's first run in the loop)."""
    _graphed_equals_eager(kwargs, monkeypatch, device_loop=True)


@pytest.mark.triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter cannot be captured")
@pytest.mark.parametrize("strategy,first,second", [
    ("dynamic", dict(threshold=0.9), dict(threshold=0.3)),
    ("remask", dict(threshold=0.9, remask_rule="delta", residual_delta=2.0),
     dict(threshold=0.3, remask_rule="delta", residual_delta=0.05)),
    ("static", dict(do_sample=True, temperature=2.0, top_k=30, top_p=0.9, seed=0),
     dict(do_sample=True, temperature=0.5, top_k=3, top_p=0.5, seed=1)),
    ("static", dict(denoising_steps=8), dict(denoising_steps=3)),
], ids=lambda v: v if isinstance(v, str) else None)
def test_other_setting_values_replay_the_captured_graphs(strategy, first, second):
    """The captured steps read the seed, temperature, top-k, top-p, thresholds and quotas (of the denoising steps)
    on the device: a call with other values replays the first call's graphs (captures nothing) and decodes as
    eager decoding does."""
    model = tiny_model(seed=5, dtype=torch.float32, block_size=8).cuda()
    ids = random_prompts(1, 6, seed=3).cuda()
    kw = dict(max_new_tokens=15, strategy=strategy, eos_token_id=[], return_dict_in_generate=True)
    model.generate(ids, **first, **kw)
    graphs = model._decode_engine[1].graphs.graphs
    captured = {key: id(entry) for key, entry in graphs.items()}
    assert captured and all(entry != "eager" for entry in graphs.values()), list(graphs)
    graphed = model.generate(ids, **second, **kw)
    assert model._decode_engine[1].graphs.graphs is graphs
    assert {key: id(entry) for key, entry in graphs.items()} == captured
    eager = model.generate(ids, cuda_graphs=False, **second, **kw)
    assert torch.equal(graphed.sequences, eager.sequences)
    for name, value in vars(eager.stats).items():
        assert torch.equal(getattr(graphed.stats, name), value), name


def test_a_step_that_cannot_be_captured_runs_eagerly_from_then_on():
    """A step that reads the host (``.item()``, not capturable) fails its capture: a warning names it, the thread is
    back on its own stream, and the step runs eagerly at every later call (no second capture, no second warning),
    updating its mutated inputs in place, with the outputs eager calls give."""
    graphs = StepGraphs(capture=True)

    def step(x):
        shift = int(x.sum().item())
        x.add_(1)
        return x * shift

    stream = torch.cuda.current_stream()
    x = torch.arange(4.0, device="cuda")
    with pytest.warns(UserWarning, match=r"capture of the \('host_read',\) step failed"):
        first = graphs.run(("host_read",), step, x, mutated=(0,))
    assert torch.cuda.current_stream() == stream
    assert graphs.graphs[("host_read",)] == "eager"
    assert torch.equal(x, torch.arange(1.0, 5.0, device="cuda")) and torch.equal(first, x * 6)
    y = torch.ones(4, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = graphs.run(("host_read",), step, y, mutated=(0,))
    assert torch.equal(y, torch.full((4,), 2.0, device="cuda")) and torch.equal(again, y * 4)
