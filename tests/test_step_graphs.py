"""StepGraphs on CPU: replays have a captured graph's data flow, and every step the decoder graphs is
capturable (traces as one graph: no host synchronisation, no Python branch on tensor values), the steps
that carry a finished block's commit included."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_integration.decoding as decoding
from hf_integration.step_graphs import LaggedFlags, StepGraphs, run_if
from tiny_models import padded_batch, random_prompts, tiny_model


def test_a_replay_reads_the_recorded_inputs_and_buffers_only():
    """Every call copies the inputs into the recorded buffers, runs the step recorded at the first call (so a
    tensor it closed over is the first call's, as in a CUDA graph) on them, copies the updated inputs back
    and returns a fresh output. The first call runs for real on those buffers too (the warm-up sees the very
    tensors the capture will)."""
    graphs = StepGraphs(capture=False)

    def make_step(offset):
        def step(x, acc):
            acc.add_(x)
            return x * 2 + offset

        return step

    acc = torch.zeros(3)
    first = graphs.run("k", make_step(torch.ones(3)), torch.tensor([1.0, 2.0, 3.0]), acc, mutated=(1,))
    assert first.tolist() == [3.0, 5.0, 7.0] and acc.tolist() == [1.0, 2.0, 3.0]
    again = graphs.run("k", make_step(torch.full((3,), 100.0)), torch.tensor([0.0, 1.0, 0.0]), acc, mutated=(1,))
    assert again.tolist() == [1.0, 3.0, 1.0]  # the recorded step's offset, not the new closure's
    assert acc.tolist() == [1.0, 3.0, 3.0]  # updated in place through the recorded buffer
    kept = graphs.run("k", make_step(None), torch.zeros(3), acc, mutated=(1,))
    assert again.tolist() == [1.0, 3.0, 1.0] and kept.tolist() == [1.0, 1.0, 1.0]  # outputs are not aliased


def test_the_first_call_has_a_replays_data_flow():
    """An input the step updates without declaring it stays as it was, on the first call as on replays; an
    output that is an input's buffer is not overwritten by the next call (the first's, as a replay's)."""
    graphs = StepGraphs(capture=False)

    def step(x, undeclared):
        undeclared.add_(1)
        return x

    outs = []
    for value in (1.0, 2.0, 3.0):
        undeclared = torch.zeros(2)
        outs.append(graphs.run("k", step, torch.full((2,), value), undeclared))
        assert undeclared.tolist() == [0.0, 0.0] and outs[-1].tolist() == [value, value]
    assert [out.tolist() for out in outs] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]


def test_lagged_flags_read_the_flag_pushed_at_that_index():
    """Off CUDA a lagged read is the value of the i-th flag pushed since start (not the latest one), and start
    forgets the flags pushed before it."""
    flags = LaggedFlags(torch.device("cpu"))
    flags.start(3)
    for value in (True, False, True):
        flags.push(torch.tensor(value))
    assert [flags.read(i) for i in range(3)] == [True, False, True]
    flags.start(1)
    flags.push(torch.tensor(False))
    assert flags.read(0) is False


def test_steps_inside_a_step_are_part_of_it():
    graphs = StepGraphs(capture=False)
    inner = lambda x: x + 1  # noqa: E731
    outer = lambda x: graphs.run("inner", inner, x) * 3  # noqa: E731
    for value in (1.0, 2.0):
        assert graphs.run("outer", outer, torch.tensor([value])).item() == (value + 1) * 3
    assert list(graphs.graphs) == ["outer"]


def test_run_if_runs_its_body_only_while_the_flag_is_set():
    """Outside a capture the host reads the flag; the body may clear it, and the rest are skipped."""
    calls, flag = [], torch.tensor(True)

    def body(flag, x):
        calls.append(x.item())
        x.add_(1)
        flag.copy_(x < 3)

    x = torch.tensor(0)
    for _ in range(5):
        run_if(flag, body, flag, x)
    assert calls == [0, 1, 2] and x.item() == 3


STRATEGIES = [dict(strategy="static"), dict(strategy="dynamic", threshold=0.3),
              dict(strategy="direct", mrp_steps=2), dict(strategy="speculative", mrp_steps=3),
              dict(strategy="remask", threshold=0.4),
              dict(strategy="speculative", mrp_steps=2, do_sample=True, seed=3, temperature=0.8, top_k=20),
              dict(strategy="speculative", mrp_steps=2, draft_candidates=4, do_sample=True, seed=3, top_p=0.9)]
DEVICE_LOOPS = [dict(strategy="dynamic", threshold=0.3, device_loop=True),
                dict(strategy="speculative", mrp_steps=3, device_loop=True),
                dict(strategy="speculative", mrp_steps=3, draft_candidates=4, device_loop=True),
                dict(strategy="remask", threshold=0.4, device_loop=True)]


@pytest.mark.parametrize("kwargs", STRATEGIES + DEVICE_LOOPS + [
    dict(strategy="static", eos_token_id=1, device_loop=True),
    dict(strategy="direct", mrp_steps=2, eos_token_id=1, device_loop=True),
    dict(strategy="remask", threshold=0.4, output_reveal_steps=True, output_confidences=True, device_loop=True),
    dict(strategy="speculative", mrp_steps=3, output_confidences=True)],
                         ids=lambda k: "-".join(str(v) for v in k.values()))
def test_every_graphed_step_traces_as_one_graph(kwargs, monkeypatch):
    """Each step the decoder hands to StepGraphs (forwards, whole denoising / verify / remask steps) is
    traced by TorchDynamo with ``fullgraph=True`` on the reference ops: a host synchronisation
    (``.item()``, ``bool(tensor)``) or a Python branch on a tensor's value would break the graph and fail
    here, before a CUDA capture would; so would a replay whose trace no longer holds (a host value the step
    reads, which a captured graph bakes in, changed between replays). The traced steps decode exactly as the
    plain path. A device loop's branches are the host's on CPU: there each body (a whole step, and the test of
    the flag for the next) traces as one graph."""
    traced = []
    record = StepGraphs._record

    def traced_once(fn):
        compiled = torch.compile(fn, fullgraph=True, backend="eager", dynamic=False)
        calls = []

        def step(*args):
            # Every call runs on the same recorded buffers, so a new trace can only be forced by a host value
            # the step reads (which a captured graph would have baked in) having changed.
            calls.append(None)
            if len(calls) == 1:
                return compiled(*args)
            with torch.compiler.set_stance("fail_on_recompile"):
                return compiled(*args)

        return step

    def record_traced(self, key, fn, inputs, branches=False):
        traced.append(key[0])
        if key[1] == "commit":
            traced.append(f"{key[0]}+commit")
        return record(self, key, fn if branches else traced_once(fn), inputs, branches)

    bodies = {}

    def run_if_traced(flag, body, *args):
        run_if(flag, bodies.setdefault(body, traced_once(body)), *args)

    model = tiny_model(seed=0, dtype=torch.float32)
    ids = random_prompts(2, 6, seed=60)
    settings = dict(max_new_tokens=8, return_dict_in_generate=True, **kwargs)
    plain = model.generate(ids, cuda_graphs=False, **{k: v for k, v in settings.items() if k != "device_loop"})
    monkeypatch.setattr(StepGraphs, "_record", record_traced)
    monkeypatch.setattr(decoding, "run_if", run_if_traced)
    torch._dynamo.reset()
    graphed = model.generate(ids, cuda_graphs=True, **settings)
    kinds = {"static": "denoise", "dynamic": "denoise", "direct": "direct_mrp", "speculative": "speculate",
             "remask": "remask"}
    # (direct with a device loop and an EOS: only a block's first step runs outside the loop, a backbone step)
    assert kinds[kwargs["strategy"]] in traced or kwargs["strategy"] == "direct" and "loop" in traced, traced
    first_step = {"remask": "remask", "speculative": "open"}.get(kwargs["strategy"], "denoise")
    assert f"{first_step}+commit" in traced, traced  # a block's first step carries the previous block's commit
    if kwargs == dict(strategy="speculative", mrp_steps=3):  # here the rows fill their blocks at different
        assert "speculate+commit" in traced, traced  # rounds: a verify round carries the finished blocks
    if kwargs.get("device_loop"):
        assert "loop" in traced and bodies, traced
    assert torch.equal(graphed.sequences, plain.sequences)
    for name, value in vars(plain.stats).items():
        assert torch.equal(getattr(graphed.stats, name), value), name
    if kwargs.get("output_reveal_steps"):
        assert torch.equal(graphed.reveal_steps, plain.reveal_steps)
    if kwargs.get("output_confidences"):  # (a graphed engine's wider cache may round the float32 attention otherwise)
        torch.testing.assert_close(graphed.confidences, plain.confidences, rtol=1e-5, atol=0)


aten = torch.ops.aten
# Ops that wait for the device to hand the host a value or a data-dependent shape: a CUDA graph capture refuses them.
HOST_SYNCS = {aten.nonzero.default, aten.masked_select.default, aten._local_scalar_dense.default, aten.equal.default,
              aten.is_nonzero.default, aten._unique2.default, aten.unique_consecutive.default, aten.unique_dim.default}
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


class NoHostSync(TorchDispatchMode):
    """Fails on an op that would synchronise with the host under CUDA: what ``fullgraph`` tracing cannot see, since
    such ops sync inside ATen (boolean-mask indexing runs ``nonzero``), not in Python."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        boolean = func in INDEXING and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                           for i in args[1])
        unsized = func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor) and \
            kwargs.get("output_size") is None
        if func in HOST_SYNCS or boolean or unsized:
            raise AssertionError(f"{func} synchronises with the host inside a graphed step")
        return func(*args, **kwargs)


@pytest.mark.parametrize("kwargs", STRATEGIES + [
    dict(strategy="static", eos_token_id=1), dict(strategy="direct", mrp_steps=2, eos_token_id=1),
    dict(strategy="speculative", mrp_steps=3, draft_vocab=40, output_confidences=True),
    dict(strategy="remask", threshold=0.4, remask_rule="delta", output_reveal_steps=True, output_confidences=True)],
                         ids=lambda k: "-".join(str(v) for v in k.values()))
def test_no_graphed_step_synchronises_with_the_host(kwargs, monkeypatch):
    """Every op of every step the decoder graphs, on the reference ops (a float64 model, or the reference backend,
    runs them inside CUDA graphs too), runs under :class:`NoHostSync`; the ragged forwards (rows of a batch riding
    a commit in different rounds) included."""
    record = StepGraphs._record

    def record_checked(self, key, fn, inputs, branches=False):
        def step(*args):
            with NoHostSync():
                return fn(*args)

        return record(self, key, step, inputs, branches)

    model = tiny_model(seed=0, dtype=torch.float32)
    ids = random_prompts(3, 6, seed=60)
    settings = dict(max_new_tokens=12, return_dict_in_generate=True, **kwargs)
    plain = model.generate(ids, cuda_graphs=False, **settings)
    monkeypatch.setattr(StepGraphs, "_record", record_checked)
    graphed = model.generate(ids, cuda_graphs=True, **settings)
    assert torch.equal(graphed.sequences, plain.sequences)


def test_a_graphed_batch_shrinks_by_buckets_keeping_finished_rows_as_padding(monkeypatch):
    """Rows finishing one by one (6 -> 5 -> 4 -> 3 -> 1 rows): eager decoding drops each as it finishes; a
    graphed engine decodes a bucket of rows (1, 2, 4, 8, 16, 24, ...: 6 prompts and 2 padding rows) and only
    shrinks to the next bucket, finished rows riding along as padding, so it replays fewer captured batch
    sizes, and a call with another batch in the same bucket reuses the engine; tokens and per-row stats are
    the same."""
    from hf_integration.decode_engine import DecodeEngine
    from hf_integration.decoding import _graphed_batch

    shrinks = []
    keep_rows = DecodeEngine.keep_rows
    monkeypatch.setattr(DecodeEngine, "keep_rows", lambda self, kept: (shrinks.append(kept.shape[0]),
                                                                       keep_rows(self, kept))[1])
    model = tiny_model(seed=0)
    lens = [1, 3, 5, 7, 9, 11]
    ids, mask = padded_batch([random_prompts(1, n, seed=b)[0] for b, n in enumerate(lens)], "left")
    settings = dict(max_new_tokens=29, eos_token_id=1, pad_token_id=0, strategy="speculative", mrp_steps=2,
                    return_dict_in_generate=True)
    eager = model.generate(ids, attention_mask=mask, cuda_graphs=False, **settings)
    assert shrinks == [5, 4, 3, 1]  # the rows finish one by one
    shrinks.clear()
    graphed = model.generate(ids, attention_mask=mask, cuda_graphs=True, **settings)
    assert shrinks == [4, 1]  # 8 rows (6 prompts): 5 left, 8 kept; 4; 3 left, 4 kept; 1
    assert [_graphed_batch(n) for n in (1, 2, 3, 5, 8, 9, 17, 24)] == [1, 2, 4, 8, 8, 16, 24, 24]
    engine = model._decode_engine[1]
    assert {key[-1][0] for key in engine.graphs.graphs} == {8, 4, 1}
    assert torch.equal(graphed.sequences, eager.sequences)
    for name, value in vars(eager.stats).items():
        assert torch.equal(getattr(graphed.stats, name), value), name
    fewer = model.generate(ids[:5], attention_mask=mask[:5], cuda_graphs=True, **settings)
    assert model._decode_engine[1] is engine
    assert torch.equal(fewer.sequences, model.generate(ids[:5], attention_mask=mask[:5], **settings).sequences)
    assert fewer.stats.tokens_committed.shape == (5,)
    model.release_decode_engine()


def _count_host_checks(monkeypatch) -> list:
    """A list that gains an entry at each host check of the rows (``BlockDecoder._move_on``)."""
    checks = []
    move_on = decoding.BlockDecoder._move_on
    monkeypatch.setattr(decoding.BlockDecoder, "_move_on", lambda self, *a: (checks.append(1), move_on(self, *a))[1])
    return checks


@pytest.mark.parametrize("kwargs", DEVICE_LOOPS + [
    dict(strategy="speculative", mrp_steps=2, do_sample=True, seed=3, temperature=0.8, top_k=20, device_loop=True),
    dict(strategy="dynamic", threshold=0.3, per_row_blocks=False, device_loop=True)],
    ids=lambda k: "-".join(str(v) for v in k.values()))
def test_a_device_loop_checks_the_host_once_a_block_fills(kwargs, monkeypatch):
    """With ``device_loop`` the steps that may have work run in one graph, each only while no row has filled
    its block: one prompt checks the host once per block (step by step: after every step but the surely
    busy ones), a batch less often than step by step too (the padding row of its graphed bucket does not stop
    the loops), and the tokens, per-row counts and steps are those of step-by-step decoding. Loops come in a few
    sizes (powers of two), so few graphs."""
    checks = _count_host_checks(monkeypatch)
    model = tiny_model(seed=0)
    step_by_step = {k: v for k, v in kwargs.items() if k != "device_loop"}
    for ids, new in ((random_prompts(1, 5, seed=3), 40), (random_prompts(3, 6, seed=4), 17)):
        runs = {}
        for name, settings in (("plain", dict(cuda_graphs=False, **step_by_step)),
                               ("loop", dict(cuda_graphs=True, **kwargs))):
            checks.clear()
            out = model.generate(ids, max_new_tokens=new, eos_token_id=[], return_dict_in_generate=True, **settings)
            runs[name] = out, len(checks)
        (plain, plain_checks), (loop, loop_checks) = runs["plain"], runs["loop"]
        assert torch.equal(loop.sequences, plain.sequences) and loop.batch_steps == plain.batch_steps
        for name, value in vars(plain.stats).items():
            assert torch.equal(getattr(loop.stats, name), value), name
        blocks = -(-(ids.shape[1] + new) // 4) - ids.shape[1] // 4
        assert loop_checks < plain_checks, (loop_checks, plain_checks)  # 3 prompts: a padding row in the bucket of 4
        if ids.shape[0] == 1:
            assert loop_checks == blocks, (loop_checks, blocks)
    loops = {key[2] for key in model._decode_engine[1].graphs.graphs if key[0] == "loop"}
    assert loops and loops <= {1, 2, 4}, loops  # block 4: at most 3 steps may follow the first
    model.release_decode_engine()


def test_a_device_loop_runs_no_step_for_a_row_whose_block_is_full(monkeypatch):
    """Left-padded prompts of 3, 6 and 9 tokens start their blocks at other steps: the loop stops as soon as one row
    fills its block (its last one too), so no step runs while a row waits in a full block."""
    import mrp_triton

    select_commit, idle = mrp_triton.select_commit, []

    def spy(block, tokens, conf, *, mask_token_id, **rule):
        idle.append(int((~(block[:3] == mask_token_id).any(-1)).sum()))  # rows 0-2 (row 3 pads the graphed bucket)
        return select_commit(block, tokens, conf, mask_token_id=mask_token_id, **rule)

    monkeypatch.setattr(mrp_triton, "select_commit", spy)
    model = tiny_model(seed=0)
    ids, mask = padded_batch([random_prompts(1, n, seed=10 + b)[0] for b, n in enumerate((3, 6, 9))], "left")
    model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[], strategy="dynamic", threshold=0.3,
                   cuda_graphs=True, device_loop=True)
    assert len(idle) > 12 and sum(idle) == 0
    model.release_decode_engine()


@pytest.mark.parametrize("kwargs", [dict(strategy="static"), dict(strategy="direct", mrp_steps=2),
                                    dict(strategy="direct", mrp_steps=1, mrp_mix="none")],
                         ids=lambda k: "-".join(str(v) for v in k.values()))
def test_a_device_loop_stops_a_row_of_rows_moving_together_with_the_step_that_settles_it(kwargs, monkeypatch):
    """Static and direct decoding with an EOS: every step but the first of a check may find the row settled (its EOS
    and the tokens before it committed), so with ``device_loop`` those run in the loop, tested on the device (direct:
    backbone and MRP steps in their turn, from wherever the check left off): one check per block, and the row stops
    with the step that settles it, as step-by-step decoding without graphs does (same tokens, counts and steps),
    where replayed steps without the loop stop one step after it (the host reads whether a step left work one step
    late, so that the read never idles the device), not at the block's end."""
    checks = _count_host_checks(monkeypatch)
    model = tiny_model(seed=0)
    common = dict(max_new_tokens=16, pad_token_id=0, return_dict_in_generate=True, **kwargs)
    shorter = 0
    for n in (3, 4, 9):
        ids = random_prompts(1, n, seed=60 + n)
        free = model.generate(ids, eos_token_id=[], **common).sequences[0, n:].tolist()
        for k in [k for k, token in enumerate(free) if token not in free[:k]]:  # each token id's first
            settings = dict(eos_token_id=free[k], **common)
            plain = model.generate(ids, cuda_graphs=False, **settings)
            replayed = model.generate(ids, cuda_graphs=True, **settings)
            checks.clear()
            loop = model.generate(ids, cuda_graphs=True, device_loop=True, **settings)
            assert torch.equal(loop.sequences, plain.sequences) and torch.equal(replayed.sequences, plain.sequences)
            for name, value in vars(plain.stats).items():
                assert torch.equal(getattr(loop.stats, name), value), name
            assert loop.batch_steps == plain.batch_steps <= replayed.batch_steps <= plain.batch_steps + 1, (n, k)
            assert len(checks) == -(-(n + k + 1) // 4) - n // 4, (n, k)  # once per block, to the EOS's (blocks of 4)
            shorter += replayed.batch_steps - loop.batch_steps
    assert shorter > 0
    model.release_decode_engine()
