"""``stopping_criteria``: transformers' criteria, called once per new token in order, as transformers' generate calls
them, as soon as every row has decoded that token; a row they stop keeps its tokens up to that step. ``max_time``:
every row ends with the block it is decoding once the time has run out."""

from __future__ import annotations

import pytest
import torch
from transformers import EosTokenCriteria, GenerationConfig, MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList

from hypothesis import given, settings
from hypothesis import strategies as st

from tiny_models import LetterTokenizer, RecordingStreamer, padded_batch, random_prompts, tiny_model

LENS = [4, 7, 2]
WIDTH = max(LENS)
PAD = 65  # a token the tiny model does not write in these tests: the padding shows


@pytest.fixture(scope="module")
def model():
    return tiny_model()


class StopAtSteps(StoppingCriteria):
    """Records its calls; stops row b from new-token step ``steps[b]`` on (None: never), or every row from step
    ``everyone`` on (a plain bool, as lm-eval's criteria return); ``width``: the prompts'."""

    def __init__(self, steps=(), everyone=None, width=WIDTH):
        self.steps, self.everyone, self.width, self.calls = list(steps), everyone, width, []

    def __call__(self, input_ids, scores, **kwargs):
        assert scores is None
        self.calls.append(input_ids.clone())
        t = input_ids.shape[1] - self.width
        if self.everyone is not None:
            return t >= self.everyone
        return torch.tensor([step is not None and t >= step for step in self.steps])  # done stays done


def _batch(side: str):
    return padded_batch([random_prompts(1, n, seed=40 + b)[0] for b, n in enumerate(LENS)], side)


def _laid_out(ids, mask, out, kept, t, appended=False):
    """The batch (ids, mask [B, W]) as the output ``out`` lays it out had decoding stopped at t new tokens: each row's
    prompt on its padding side, then its first min(kept, t) new tokens, padding elsewhere; ``appended``: as transformers
    passes it to its stopping criteria, every row's new tokens from column W on (after a right-padded row's padding)."""
    width = ids.shape[1]
    rows = torch.full((len(kept), width + t), PAD)
    for b, n in enumerate(mask.sum(1).tolist()):
        start = width - n if mask[b, 0] == 0 else 0
        new = out[b, start + n: start + n + min(kept[b], t)]
        rows[b, start: start + n] = ids[b][mask[b] == 1]
        first_new = width if appended else start + n
        rows[b, first_new: first_new + len(new)] = new
    return rows


@pytest.mark.parametrize("kwargs", [dict(strategy="static"), dict(strategy="dynamic", threshold=0.3),
                                    dict(strategy="speculative", mrp_steps=2)], ids=lambda k: k["strategy"])
@pytest.mark.parametrize("side, graphs", [("left", False), ("left", True), ("right", False)])
def test_criteria_are_called_token_by_token_and_stop_each_row_at_its_step(model, kwargs, side, graphs):
    """Rows stopped at new-token steps 3 and 9 (by two criteria; one row never): each criterion sees steps 1..20
    once each, in order, each call holding the batch the output would be at that step (stopped rows padded past their
    end); each row keeps the free run's tokens up to its step, padding after; a stopped row commits no more than it
    would free (it ends with the block in which it stopped), and row 0, stopped in its first block, commits fewer."""
    ids, mask = _batch(side)
    common = dict(max_new_tokens=20, pad_token_id=PAD, eos_token_id=[], return_dict_in_generate=True, **kwargs)
    free = model.generate(ids, attention_mask=mask, **common)
    criteria = [StopAtSteps(steps=[3, None, None]), StopAtSteps(steps=[None, None, 9])]
    out = model.generate(ids, attention_mask=mask, stopping_criteria=criteria, cuda_graphs=graphs, **common)
    kept = [3, 20, 9]
    assert out.new_tokens.tolist() == kept
    for criterion in criteria:
        assert [c.shape[1] - WIDTH for c in criterion.calls] == list(range(1, 21))
        for t, call in enumerate(criterion.calls, 1):
            assert torch.equal(call, _laid_out(ids, mask, free.sequences, kept, t, appended=True)), t
    assert torch.equal(out.sequences, _laid_out(ids, mask, free.sequences, kept, 20))
    assert all(out.stats.tokens_committed <= free.stats.tokens_committed)
    assert out.stats.tokens_committed[0] < free.stats.tokens_committed[0]


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(1, 9), min_size=1, max_size=3), side=st.sampled_from(["left", "right"]),
       kwargs=st.sampled_from([dict(strategy="static"), dict(strategy="dynamic", threshold=0.3),
                               dict(strategy="direct", mrp_steps=2), dict(strategy="speculative", mrp_steps=3),
                               dict(strategy="remask")]),
       max_new=st.integers(1, 12), own=st.booleans(), eos=st.integers(0, 62), graphs=st.booleans(),
       loop=st.booleans(), seed=st.integers(0, 10**4), data=st.data())
def test_any_batch_keeps_the_free_run_up_to_each_rows_first_stop(model, lens, side, kwargs, max_new, own, eos, graphs,
                                                                   loop, seed, data):
    """Drawn prompts, padding side, strategy, new tokens (drawn: one count for the call, or one per prompt), EOS,
    engine (steps replayed or not, in a device loop or not) and step at which a criterion stops each row (or never):
    each row keeps the free run's tokens up to its EOS or its step, whichever comes first; the criterion is called for
    steps 1, 2, ... up to the last row's end, each call holding the batch as the output would be at that step."""
    ids, mask = padded_batch([random_prompts(1, n, seed=seed + b)[0] for b, n in enumerate(lens)], side)
    limits = data.draw(st.lists(st.integers(1, max_new), min_size=len(lens), max_size=len(lens))) if own else max_new
    max_new = max(limits) if own else max_new
    common = dict(max_new_tokens=limits, eos_token_id=eos, pad_token_id=PAD, return_dict_in_generate=True, **kwargs)
    free = model.generate(ids, attention_mask=mask, **common)
    steps = data.draw(st.lists(st.none() | st.integers(1, max_new), min_size=len(lens), max_size=len(lens)))
    criterion = StopAtSteps(steps, width=ids.shape[1])
    out = model.generate(ids, attention_mask=mask, stopping_criteria=[criterion], cuda_graphs=graphs,
                         device_loop=graphs and loop, **common)
    kept = [min(n, step or max_new) for n, step in zip(free.new_tokens.tolist(), steps)]
    assert out.new_tokens.tolist() == kept
    assert torch.equal(out.sequences, _laid_out(ids, mask, free.sequences, kept, max_new))
    assert len(criterion.calls) == max(kept)
    for t, call in enumerate(criterion.calls, 1):
        assert torch.equal(call, _laid_out(ids, mask, free.sequences, kept, t, appended=True)), t


@pytest.mark.parametrize("graphs", [False, True])
def test_criteria_reading_the_last_column_stop_each_right_padded_row_where_it_stops_alone(model, graphs):
    """transformers' criteria read each row's newest token in the last column of input_ids (its EosTokenCriteria;
    here also one reading the newest token's confidence): on a right-padded batch, whose output puts a row's new
    tokens right after its prompt, they are passed transformers' layout, so each row stops where it stops alone, also
    when the padding is the very token a criterion stops at."""
    ids, mask = _batch("right")
    common = dict(max_new_tokens=12, eos_token_id=[], return_dict_in_generate=True, output_confidences=True,
                  cuda_graphs=graphs)
    rows = [ids[b][mask[b] == 1][None] for b in range(len(LENS))]
    free = [model.generate(row, pad_token_id=PAD, **common) for row in rows]
    news = [out.sequences[0, n:].tolist() for out, n in zip(free, LENS)]
    stop = next(t for i, t in enumerate(news[2]) if i >= 2 and t not in news[2][:i])  # row 2 writes it later
    floor = torch.cat([out.confidences[0, n:] for out, n in zip(free, LENS)]).median().item()
    for make, pad in ((lambda: EosTokenCriteria(stop), stop), (lambda: StopBelowConfidence(floor), PAD)):
        alone = [model.generate(row, pad_token_id=pad, stopping_criteria=[make()], **common).new_tokens.item()
                 for row in rows]
        out = model.generate(ids, attention_mask=mask, pad_token_id=pad, stopping_criteria=[make()], **common)
        assert out.new_tokens.tolist() == alone and min(alone) < 12, (make(), alone)
        assert pad != stop or alone[2] > 2  # (the padding, read as its newest token, stopped it at its first before)


class StopBelowConfidence(StoppingCriteria):
    """Takes each new token's confidence (``takes_confidences``): records them, and stops a row at its first new token
    less likely than ``floor``."""

    takes_confidences = True

    def __init__(self, floor: float):
        self.floor, self.calls = floor, []

    def __call__(self, input_ids, scores, confidences=None):
        assert confidences.shape == input_ids.shape and confidences.dtype == torch.float32
        self.calls.append((confidences.clone(),))
        return (confidences[:, -1] > 0) & (confidences[:, -1] < self.floor)  # (0: a row that ended: padding)


class StopOnCloseCalls(StoppingCriteria):
    """Takes each new token's most likely tokens (``takes_top_logprobs``): records them, and stops a row at its first
    new token whose two most likely tokens lie closer than ``margin`` (in log-probability)."""

    takes_top_logprobs = True

    def __init__(self, margin: float):
        self.margin, self.calls = margin, []

    def __call__(self, input_ids, scores, top_logprobs=None, top_token_ids=None):
        assert top_logprobs.shape == top_token_ids.shape == (*input_ids.shape, 2)
        self.calls.append((top_logprobs.clone(), top_token_ids.clone()))
        return top_logprobs[:, -1, 0] - top_logprobs[:, -1, 1] < self.margin  # (nan in padding: False)


@pytest.mark.parametrize("taken", ["confidences", "top_logprobs"])
@pytest.mark.parametrize("kwargs", [dict(strategy="static"), dict(strategy="speculative", mrp_steps=3),
                                    dict(strategy="remask")], ids=lambda k: k["strategy"])
@pytest.mark.parametrize("graphs", [False, True])
def test_a_criterion_that_takes_notes_sees_each_new_tokens_and_can_stop_on_them(model, kwargs, graphs, taken):
    """A criterion with takes_confidences=True gets, at step t, the confidences of output_confidences laid out as
    input_ids (0 at the prompts and past each row's end), one with takes_top_logprobs=True the top log-probabilities
    and token ids of output_top_logprobs (-inf and -1 there); stopping each row at its first token less likely than
    the free run's median (or whose two most likely tokens lie closer than the median) keeps the free run up to that
    token."""
    ids, mask = _batch("left")
    asked = dict(output_confidences=True) if taken == "confidences" else dict(output_top_logprobs=2)
    common = dict(max_new_tokens=12, pad_token_id=PAD, eos_token_id=[], return_dict_in_generate=True, **asked,
                  **kwargs)
    free = model.generate(ids, attention_mask=mask, **common)
    if taken == "confidences":
        notes, scores = [(free.confidences, 0.0)], free.confidences[:, WIDTH:]
    else:
        notes = [(free.top_logprobs, float("-inf")), (free.top_token_ids, -1)]
        scores = free.top_logprobs[:, WIDTH:, 0] - free.top_logprobs[:, WIDTH:, 1]
    floor = scores.median().item()
    criterion = StopBelowConfidence(floor) if taken == "confidences" else StopOnCloseCalls(floor)
    out = model.generate(ids, attention_mask=mask, stopping_criteria=[criterion], cuda_graphs=graphs, **common)
    kept = [next((j + 1 for j, c in enumerate(row) if c < floor), 12) for row in scores.tolist()]
    assert out.new_tokens.tolist() == kept and min(kept) < 12
    assert len(criterion.calls) == max(kept)
    for t, call in enumerate(criterion.calls, 1):
        shown = torch.arange(t)[None, :] < torch.tensor(kept)[:, None]
        for got, (note, pad) in zip(call, notes, strict=True):
            new = note[:, WIDTH : WIDTH + t]
            where = shown[(...,) + (None,) * (new.dim() - 2)]
            assert torch.equal(got, torch.cat([torch.full_like(note[:, :WIDTH], pad), torch.where(where, new, pad)],
                                              1)), t
    assert torch.equal(out.sequences, _laid_out(ids, mask, free.sequences, kept, 12))


def test_the_calls_end_when_every_row_has_stopped_and_so_does_decoding(model):
    """A criterion that stops every row at step 2 (a plain True, as lm-eval's return) is called twice; decoding ends
    with the first block (fewer steps than the free run) and every row keeps 2 new tokens."""
    ids, mask = _batch("left")
    common = dict(max_new_tokens=20, pad_token_id=PAD, eos_token_id=[], return_dict_in_generate=True)
    free = model.generate(ids, attention_mask=mask, **common)
    criterion = StopAtSteps(everyone=2)
    out = model.generate(ids, attention_mask=mask, stopping_criteria=StoppingCriteriaList([criterion]), **common)
    assert len(criterion.calls) == 2 and out.new_tokens.tolist() == [2, 2, 2]
    assert torch.equal(out.sequences, _laid_out(ids, mask, free.sequences, [2] * 3, 20))
    assert out.batch_steps < free.batch_steps


def test_a_row_stopped_early_lets_the_calls_go_on_to_the_other_rows_last_step(model):
    """Row 1's criterion stops it at step 1, which it has decoded with step 2 (a block of 4 holds both); row 0's only
    block holds all 3 of its tokens: at that one check both rows end, and the calls go on for row 0 to step 3."""
    ids, mask = padded_batch([random_prompts(1, n, seed=b)[0] for b, n in enumerate([1, 2])], "left")
    criterion = StopAtSteps(steps=[None, 1], width=2)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=[], pad_token_id=PAD,
                         stopping_criteria=[criterion], return_dict_in_generate=True)
    assert out.new_tokens.tolist() == [3, 1] and len(criterion.calls) == 3


def test_rows_an_eos_ended_are_padded_in_later_calls_which_stop_after_the_last_row_ends(model):
    """Row 0 ends with an EOS: the calls after its EOS step hold padding there, as transformers' do; the calls stop
    at the step whose token ends the last row."""
    ids, mask = _batch("left")
    free = model.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=[])[:, WIDTH:]
    eos = next(t for t in free[0].tolist() if t not in free[0, :2].tolist())  # not among row 0's first two tokens
    ends = [row.index(eos) + 1 if eos in row else 20 for row in free.tolist()]
    assert ends[0] > 2
    criterion = StopAtSteps(steps=[None] * 3)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=PAD,
                         stopping_criteria=[criterion], return_dict_in_generate=True)
    assert out.new_tokens.tolist() == ends
    assert len(criterion.calls) == max(ends)
    full = torch.cat([ids, free], 1)
    for t, call in enumerate(criterion.calls, 1):
        assert torch.equal(call, _laid_out(ids, mask, full, ends, t, appended=True)), t


def test_transformers_max_length_criterion_stops_every_row_at_its_length(model):
    ids, mask = _batch("left")
    free = model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[], pad_token_id=PAD)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[], pad_token_id=PAD,
                         stopping_criteria=[MaxLengthCriteria(max_length=WIDTH + 5)])
    assert torch.equal(out[:, :WIDTH + 5], free[:, :WIDTH + 5]) and (out[:, WIDTH + 5:] == PAD).all()


def test_the_earlier_of_a_stop_string_and_a_criterion_ends_the_row(model):
    tok = LetterTokenizer()
    ids = random_prompts(1, 4, seed=40)
    common = dict(max_new_tokens=16, eos_token_id=[], pad_token_id=PAD, tokenizer=tok, return_dict_in_generate=True)
    free = model.generate(ids, max_new_tokens=16, eos_token_id=[])[0, 4:].tolist()
    stop = tok.decode(free[7:9])
    by_string = tok.decode(free).find(stop) + 2
    assert by_string > 2
    for step in (by_string - 2, by_string + 3):
        out = model.generate(ids, stop_strings=stop, stopping_criteria=[StopAtSteps(steps=[step], width=4)], **common)
        assert out.new_tokens.tolist() == [min(step, by_string)], step
        assert out.sequences[0, 4:].tolist() == free[:min(step, by_string)] + [PAD] * (16 - min(step, by_string))


def test_a_stop_string_after_a_criterion_stopped_the_row_mid_block_does_not_lengthen_it(model):
    """Rows moving on block by block on their own (dynamic): row 0 is a block ahead when the criterion stops it at
    step 3 (row 2 lags); the block it is decoding then completes a stop string at a later token: it keeps 3."""
    tok = LetterTokenizer()
    ids, mask = _batch("left")
    common = dict(max_new_tokens=20, pad_token_id=PAD, eos_token_id=[], return_dict_in_generate=True,
                  strategy="dynamic", threshold=0.3)
    free = model.generate(ids, attention_mask=mask, **common).sequences[:, WIDTH:].tolist()
    stop = tok.decode(free[0][5:7])
    by_string = [tok.decode(row).find(stop) + 2 if stop in tok.decode(row) else 20 for row in free]
    assert by_string[0] > 3
    out = model.generate(ids, attention_mask=mask, stop_strings=stop, tokenizer=tok,
                         stopping_criteria=[StopAtSteps(steps=[3, None, None])], **common)
    assert out.new_tokens.tolist() == [3] + by_string[1:]


def test_a_criterion_cuts_the_stream_too(model):
    ids = random_prompts(1, 4, seed=41)
    streamer = RecordingStreamer()
    out = model.generate(ids, max_new_tokens=16, eos_token_id=[], pad_token_id=PAD, streamer=streamer,
                         stopping_criteria=[StopAtSteps(steps=[5], width=4)])
    assert sum(streamer.puts[1:], []) == out[0, 4:9].tolist() and (out[0, 9:] == PAD).all()


@pytest.mark.parametrize("graphs", [False, True])
def test_a_criterion_that_raises_leaves_the_model_usable(model, graphs):
    """The error of a criterion raising mid-call (after another stopped a row) reaches the caller; the model's next
    calls, on the same batch and on a smaller one, decode as a fresh model does."""
    ids, mask = _batch("left")
    common = dict(max_new_tokens=20, eos_token_id=[], pad_token_id=PAD, strategy="speculative", cuda_graphs=graphs)

    def fails_at_step_6(input_ids, scores):
        if input_ids.shape[1] == WIDTH + 6:
            raise KeyError("criterion failed")
        return False

    with pytest.raises(KeyError, match="criterion failed"):
        model.generate(ids, attention_mask=mask, stopping_criteria=[StopAtSteps([2, None, None]), fails_at_step_6],
                       **common)
    fresh = tiny_model()
    for rows in (slice(None), slice(1, None)):
        assert torch.equal(model.generate(ids[rows], attention_mask=mask[rows], **common),
                           fresh.generate(ids[rows], attention_mask=mask[rows], **common))


class Clock:
    """A stand-in for the time module: monotonic() reads ``times`` in turn, then the last one again (the decoder
    reads it once when the call begins, then at each check of rows whose blocks filled)."""

    def __init__(self, *times):
        self.times = list(times)

    def monotonic(self):
        return self.times.pop(0) if len(self.times) > 1 else self.times[0]


@pytest.mark.parametrize("kwargs", [dict(strategy="static"), dict(strategy="dynamic", threshold=0.3),
                                    dict(strategy="speculative", mrp_steps=2)], ids=lambda k: k["strategy"])
@pytest.mark.parametrize("graphs", [False, True])
def test_max_time_ends_every_row_with_the_block_it_is_decoding(model, kwargs, graphs, monkeypatch):
    """Out of time at the first check: each row keeps its first block's new tokens (prompts of 4, 7 and 2 in blocks
    of 4: 4, 1 and 2 of them), those of the free run, in fewer steps; the criteria are still called up to them. With
    time left, the free run's output."""
    from hf_integration import decoding

    ids, mask = _batch("left")
    common = dict(max_new_tokens=20, eos_token_id=[], pad_token_id=PAD, return_dict_in_generate=True,
                  cuda_graphs=graphs, **kwargs)
    free = model.generate(ids, attention_mask=mask, **common)
    criterion = StopAtSteps(steps=[None] * 3)
    monkeypatch.setattr(decoding, "time", Clock(0.0, 2.0))
    out = model.generate(ids, attention_mask=mask, max_time=1.0, stopping_criteria=[criterion], **common)
    assert out.new_tokens.tolist() == [4, 1, 2] and len(criterion.calls) == 4
    assert torch.equal(out.sequences, _laid_out(ids, mask, free.sequences, [4, 1, 2], 20))
    assert out.batch_steps < free.batch_steps
    monkeypatch.undo()
    assert torch.equal(model.generate(ids, attention_mask=mask, max_time=60.0, **common).sequences, free.sequences)


def test_max_time_running_out_later_keeps_the_blocks_decoded_by_then(model, monkeypatch):
    """Rows starting their blocks together: time left at the first check, out at the second: each row keeps two
    blocks' new tokens (4 + 4, 1 + 4, 2 + 4); as a keyword or from a GenerationConfig."""
    from hf_integration import decoding

    ids, mask = _batch("left")
    common = dict(max_new_tokens=20, eos_token_id=[], pad_token_id=PAD, return_dict_in_generate=True)
    free = model.generate(ids, attention_mask=mask, **common)
    for limit in (dict(max_time=1.0), dict(generation_config=GenerationConfig(max_time=1.0))):
        monkeypatch.setattr(decoding, "time", Clock(0.0, 0.5, 2.0))
        out = model.generate(ids, attention_mask=mask, **limit, **common)
        assert out.new_tokens.tolist() == [8, 5, 6], limit
        assert torch.equal(out.sequences, _laid_out(ids, mask, free.sequences, [8, 5, 6], 20))


@pytest.mark.parametrize("max_time, error, match", [(0, ValueError, "max_time=0 must be > 0 seconds"),
                                                     (-1.5, ValueError, "max_time=-1.5 must be > 0"),
                                                     ("1", TypeError, "max_time must be a number"),
                                                     (True, TypeError, "max_time must be a number")])
def test_max_time_must_be_a_positive_number(model, max_time, error, match):
    with pytest.raises(error, match=match):
        model.generate(random_prompts(1, 5), max_new_tokens=4, max_time=max_time)


def test_an_empty_list_asks_for_nothing(model):
    ids = random_prompts(2, 5)
    free = model.generate(ids, max_new_tokens=8)
    assert torch.equal(model.generate(ids, max_new_tokens=8, stopping_criteria=[]), free)
    assert torch.equal(model.generate(ids, max_new_tokens=8, stopping_criteria=StoppingCriteriaList()), free)


@pytest.mark.parametrize("criteria, error, match", [
    (StopAtSteps(steps=[1, 2]), TypeError, "stopping_criteria must be a list"),  # a criterion, not a list of them
    ([1], TypeError, r"stopping_criteria must be a list .* got \(1,\)"),
    ([lambda input_ids, scores: torch.zeros(3, dtype=torch.bool)], ValueError,
     r"stopping_criteria must return a bool or a bool tensor \[batch=2\].* of shape \(3,\)"),
    ([lambda input_ids, scores: torch.zeros(2, dtype=torch.long)], ValueError,
     r"stopping_criteria must return .*got torch.int64"),
    ([lambda input_ids, scores: None], ValueError, r"stopping_criteria must return a bool .*got NoneType"),
    ([StopBelowConfidence(0.5)], ValueError, r"takes each new token's confidence .* pass output_confidences=True"),
    ([StopOnCloseCalls(0.5)], ValueError, r"takes each new token's most likely tokens .* pass output_top_logprobs=k"),
])
def test_bad_criteria_are_refused_by_name(model, criteria, error, match):
    with pytest.raises(error, match=match):
        model.generate(random_prompts(2, 5), max_new_tokens=8, stopping_criteria=criteria)
