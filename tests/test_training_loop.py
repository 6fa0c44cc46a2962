"""The training loop: loss falls, bit-exact resume, crash / kill recovery, bad configs, CLI."""

import copy
import glob
import json
import os
import signal
import subprocess
import sys
import time
from unittest import mock

import pytest
import torch
from huggingface_hub import ModelCard
from torch import nn

from training_fixtures import (make_tokenizer, one_thread, single_thread, subprocess_env, tiny_backbone,  # noqa: F401
                               write_corpus)

pytestmark = pytest.mark.usefixtures("one_thread")

from training.config import ConfigError, TrainConfig
from training.data import build_datasets, read_records, split_records
from training.noising import sample_seed
from training.tokenizer import CHAT_TEMPLATE
from training.trainer import (CKPT_DIR, GlobalBatchSampler, LossModule, build_optimizer, check_only_trainable_grads,
                              evaluate, list_checkpoints, train)

T, BS = 16, 4
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("loop")
    tok_dir = str(root / "tok")
    tok = make_tokenizer(tok_dir)
    paths = write_corpus(str(root / "corpus"))
    train_ds, held = build_datasets([paths["text"], paths["pairs"]], tok, T, BS, 0.1)
    bb = str(root / "backbone")
    m = tiny_backbone(tok)
    m.save_pretrained(bb)
    tok.save_pretrained(bb)
    return {"root": root, "tok": tok, "tok_dir": tok_dir, "paths": paths, "train": train_ds, "held": held,
            "backbone": bb}


def _cfg(out, mode="backbone", **kw):
    base = dict(mode=mode, out_dir=str(out), seq_len=T, block_size=BS, micro_batch_size=4, max_steps=8,
                lr=1e-2, warmup_steps=2, progress=False, eval_batches=2, num_mrp_layers=1)
    base.update(kw)
    return TrainConfig(**base)


def _model(env, mode, seed=0):
    if mode == "backbone":
        return tiny_backbone(env["tok"], seed=seed)
    from training.models import prepare_mrp_model

    torch.manual_seed(seed)
    return prepare_mrp_model(env["backbone"], 1)[0]


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("mode,kw", [("backbone", {}), ("mrp", {"unroll_k": 2, "lr": 3e-3})])
def test_loss_falls(env, tmp_path, mode, kw):
    model = _model(env, mode)
    cfg = _cfg(tmp_path, mode, max_steps=40, micro_batch_size=8, **kw)
    before = evaluate(LossModule(model, cfg, env["tok"].mask_token_id), env["train"], cfg, torch.device("cpu"))
    res = train(cfg, model, env["train"], env["train"])
    assert res["eval_loss"] < 0.8 * before["eval_loss"], (before, res["eval_loss"])
    if mode == "mrp":  # the head learns to agree with the backbone's next state (K = 2 unroll steps)
        for name in ("eval_token_agreement", "eval_pick_agreement"):
            assert len(res[name]) == 2 and all(0 <= a <= 1 for a in res[name] + before[name])
            assert sum(res[name]) > sum(before[name]), (name, before[name], res[name])
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert lines[0] == {"step": 0, "setup": {
        "device": "cpu", "world_size": 1, "ops": "reference", "attention": "sdpa", "bf16_autocast": False,
        "projections_in_bf16": 0, "activation_checkpointing": False,
        "kd_precision": "tf32" if mode == "mrp" else None, "global_batch": 8,
        "total_steps": 40, "torch": torch.__version__}}
    assert [x["step"] for x in lines if "loss" in x] == list(range(1, 41))
    assert all({"lr", "tokens_per_s", "grad_norm"} <= set(x) for x in lines if "loss" in x)
    assert any("eval_loss" in x for x in lines)


@pytest.mark.parametrize("mode,kw", [("backbone", {}), ("mrp", {"unroll_k": 2, "lr": 3e-3})])
def test_gradient_accumulation_equals_one_large_micro_batch(env, tmp_path, mode, kw):
    """A global batch of 8 as 1 x 8, 2 x 4 or 4 x 2 (grad_accum x micro_batch_size) takes the same steps: the
    same loss and gradient norm at each step (AdamW would hide a gradient scaled by a constant, the norm does not)
    and the same weights after them."""
    runs = {}
    for accum in (1, 2, 4):
        model = _model(env, mode)
        res = train(_cfg(tmp_path / str(accum), mode, max_steps=3, micro_batch_size=8 // accum, grad_accum=accum,
                         **kw), model, env["train"], None)
        runs[accum] = res["history"], _weights(model)
    one_hist, one_w = runs[1]
    for accum in (2, 4):
        hist, w = runs[accum]
        for a, b in zip(one_hist, hist, strict=True):
            for key in ("loss", "grad_norm"):
                assert b[key] == pytest.approx(a[key], rel=1e-5), (accum, a["step"], key)
        for k in one_w:
            assert torch.allclose(one_w[k], w[k], rtol=1e-4, atol=1e-6), (accum, k)


@pytest.mark.parametrize("mode,kw", [("backbone", {}), ("mrp", {"unroll_k": 2})])
def test_activation_checkpointing_takes_the_same_steps(env, tmp_path, mode, kw):
    """--activation-checkpointing: the model's layers are checkpointed while the run trains, and the run takes the
    same steps (loss and gradient norm at each, the weights after them: bit for bit on CPU); the setup line says
    which, and the model is not checkpointed after the run."""
    runs = {}
    for on in (False, True):
        model = _model(env, mode)
        during = []

        def checkpointed(step, info, model=model, during=during):
            during.append(any(getattr(m, "gradient_checkpointing", False) for m in model.modules()))

        res = train(_cfg(tmp_path / str(on), mode, max_steps=3, activation_checkpointing=on, **kw), model,
                    env["train"], None, callbacks=[checkpointed])
        assert during == [on] * 3 and not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        assert json.loads(open(tmp_path / str(on) / "metrics.jsonl").readline())["setup"]["activation_checkpointing"] \
            is on
        runs[on] = [(r["loss"], r["grad_norm"]) for r in res["history"]], _weights(model)
    (want, want_w), (got, got_w) = runs[False], runs[True]
    assert got == want
    for k in want_w:
        assert torch.equal(got_w[k], want_w[k]), k


@pytest.fixture(scope="module")
def short_run(env, tmp_path_factory):
    """One short run that several tests read: 4 steps of 2 accumulated micro-batches of 2 sequences, a loss line every
    3rd step, an evaluation every 2nd, no gradient clipping. Returns its config, the model before and after, the
    result, the metrics.jsonl records and the noise seeds of each training forward."""
    from mrp_triton import use_backend

    cfg = _cfg(tmp_path_factory.mktemp("short"), max_steps=4, micro_batch_size=2, grad_accum=2, log_every=3,
               eval_every=2, grad_clip=0.0)
    model = _model(env, "backbone")
    initial = copy.deepcopy(model)
    seeds, forward = [], LossModule.forward

    def spy(self, ids, is_prompt, sample_seeds, with_stats=False):
        if self.training:
            seeds.append(list(sample_seeds))
        return forward(self, ids, is_prompt, sample_seeds, with_stats)

    # a module fixture runs outside the one_thread and backend fixtures
    with single_thread(), use_backend("reference"), mock.patch.object(LossModule, "forward", spy):
        res = train(cfg, model, env["train"], env["held"])
    lines = [json.loads(x) for x in open(os.path.join(cfg.out_dir, "metrics.jsonl"))]
    return {"cfg": cfg, "initial": initial, "model": model, "res": res, "lines": lines, "seeds": seeds}


SHORT_G = 2 * 2  # short_run's global batch: micro-batch x accumulation


def test_a_steps_loss_is_its_global_batchs_loss_sum_over_its_answer_tokens(env, short_run):
    cfg, ds = short_run["cfg"], env["train"]
    idx = GlobalBatchSampler(len(ds), SHORT_G, cfg.seed).step_indices(0)
    with torch.no_grad():
        total = float(LossModule(short_run["initial"], cfg, env["tok"].mask_token_id)(
            ds.input_ids[idx], ds.is_prompt[idx], [sample_seed(cfg.seed, "train", 0, int(i)) for i in idx]))
    answers = (~ds.is_prompt[idx]).sum(dim=1)
    assert int(answers[1:].sum()) > 0  # not only the first sequence holds answer tokens
    assert short_run["res"]["history"][0]["loss"] == pytest.approx(total / int(answers.sum()), rel=1e-5)


def test_the_noise_of_a_sequence_is_seeded_by_the_step_and_its_index(env, short_run):
    """A sequence seen again in a later step (another epoch) gets other noise."""
    cfg = short_run["cfg"]
    sampler = GlobalBatchSampler(len(env["train"]), SHORT_G, cfg.seed)
    want = [[sample_seed(cfg.seed, "train", step, int(i)) for i in sampler.step_indices(step)] for step in range(4)]
    got = short_run["seeds"]
    assert [a + b for a, b in zip(got[::2], got[1::2], strict=True)] == want  # 2 micro-batches a step


def test_tokens_count_every_sequence_of_the_global_batch(short_run):
    assert [r["tokens"] for r in short_run["res"]["history"]] == [step * SHORT_G * T for step in range(1, 5)]


def test_the_last_step_is_always_logged_and_evaluated_once(short_run):
    lines = short_run["lines"]
    assert [x["step"] for x in lines if "loss" in x] == [3, 4]  # log_every 3, and the last step
    assert [x["step"] for x in lines if "eval_loss" in x] == [2, 4]  # eval_every 2; step 4 by the final evaluation


def test_grad_clip_zero_turns_clipping_off(short_run):
    """Not a clip to norm 0, which would zero every gradient (no weight decay here: the weights would not move)."""
    assert [r["grad_norm"] for r in short_run["res"]["history"]] == [None] * 4
    assert not torch.equal(short_run["model"].lm_head.weight, short_run["initial"].lm_head.weight)


def _bf16_valued_mrp_model(env, device: str = "cpu"):
    """An MRP model whose frozen weights hold bf16 values in fp32 (what a bf16 checkpoint loaded in fp32 holds), on
    ``device``, and a copy of those frozen weights by name."""
    model = _model(env, "mrp")
    with torch.no_grad():
        for prm in model.parameters():
            if not prm.requires_grad:
                prm.copy_(prm.to(torch.bfloat16))
    model.to(device)
    return model, {n: q.detach().clone() for n, q in model.named_parameters() if not q.requires_grad}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 autocast is the trainer's on CUDA")
def test_cuda_mrp_training_keeps_bf16_valued_projections_in_bf16_then_restores_them(env, tmp_path):
    model, frozen = _bf16_valued_mrp_model(env, "cuda")
    seen = []

    def exported(m):
        seen.append({n: q.dtype for n, q in m.named_parameters()})

    def during(step, rec):
        seen.append(model.model.layers[0].self_attn.q_proj.weight.dtype)

    train(_cfg(tmp_path, "mrp", max_steps=2), model, env["train"], export=exported, callbacks=[during],
          device=torch.device("cuda"))
    assert seen[:2] == [torch.bfloat16] * 2 and set(seen[2].values()) == {torch.float32}
    assert all(torch.equal(q, frozen[n]) for n, q in model.named_parameters() if n in frozen)


class Crash(RuntimeError):
    pass


def _crash_at(n):
    def cb(step, rec):
        if step == n:
            raise Crash(step)
    return cb


def test_a_failed_run_restores_the_projections_it_stored_in_bf16(env, tmp_path, monkeypatch):
    """Under bf16 autocast (here the CPU's, standing in for CUDA's), a run that fails leaves the frozen projections
    as they were loaded: fp32 tensors with the same values, not the bf16 copies it trained with."""
    from training import trainer

    monkeypatch.setattr(trainer, "_autocasts", lambda cfg, device: True)
    monkeypatch.setattr(trainer, "_autocast", lambda cfg, device: torch.autocast("cpu", dtype=torch.bfloat16))
    model, frozen = _bf16_valued_mrp_model(env)
    seen = []

    def during(step, rec):
        seen.append(model.model.layers[0].self_attn.q_proj.weight.dtype)

    with pytest.raises(Crash):
        train(_cfg(tmp_path, "mrp", max_steps=3), model, env["train"], callbacks=[during, _crash_at(2)])
    assert seen == [torch.bfloat16] * 2  # the run trained with them in bf16
    assert {q.dtype for q in model.parameters()} == {torch.float32}
    assert all(torch.equal(q, frozen[n]) for n, q in model.named_parameters() if n in frozen)


@pytest.mark.parametrize("mode", ["backbone", "mrp"])
def test_resume_is_bit_identical(env, tmp_path, mode):
    kw = dict(max_steps=8, save_every=4, grad_accum=2, micro_batch_size=2, eval_every=3)
    full = _model(env, mode)
    full_res = train(_cfg(tmp_path / "full", mode, **kw), full, env["train"], env["held"])

    part = _model(env, mode)
    with pytest.raises(Crash):
        train(_cfg(tmp_path / "part", mode, **kw), part, env["train"], env["held"], callbacks=[_crash_at(5)])
    assert [s for s, _ in list_checkpoints(str(tmp_path / "part"))] == [4]
    torch.manual_seed(1234)  # the resumed run must not depend on the process's RNG state
    resumed = _model(env, mode, seed=99)  # different init: the checkpoint must overwrite it
    res = train(_cfg(tmp_path / "part", mode, resume=True, **kw), resumed, env["train"], env["held"])
    assert res["step"] == 8
    # the token count goes on from the checkpoint's
    assert [r["tokens"] for r in res["history"]] == [r["tokens"] for r in full_res["history"][4:]]
    a, b = _weights(full), _weights(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the metrics log of the resumed run has each step once
    steps = [json.loads(x)["step"] for x in open(tmp_path / "part" / "metrics.jsonl") if '"loss"' in x]
    assert steps == list(range(1, 9))


def test_crash_with_corrupt_leftovers_resumes_from_last_good(env, tmp_path):
    kw = dict(max_steps=9, save_every=3, keep_checkpoints=3)
    full = _model(env, "backbone")
    train(_cfg(tmp_path / "full", **kw), full, env["train"])
    part = _model(env, "backbone")
    with pytest.raises(Crash):
        train(_cfg(tmp_path / "part", **kw), part, env["train"], callbacks=[_crash_at(7)])
    ck = tmp_path / "part" / CKPT_DIR
    assert sorted(os.listdir(ck)) == ["step_00000003.pt", "step_00000006.pt"]
    # leftovers of a kill during a write: a temp file, and (had the write not been atomic) a torn file
    (ck / ".step_00000009.pt.tmp.4242").write_bytes(b"\x80garbage")
    good = (ck / "step_00000006.pt").read_bytes()
    (ck / "step_00000009.pt").write_bytes(good[: len(good) // 2])
    # and a checkpoint under another step's name (copied or renamed by hand): it does not hold step 12
    (ck / "step_00000012.pt").write_bytes((ck / "step_00000003.pt").read_bytes())
    resumed = _model(env, "backbone", seed=5)
    with pytest.warns(UserWarning, match="step_00000009") as warned:
        res = train(_cfg(tmp_path / "part", resume=True, **kw), resumed, env["train"])
    assert any("step_00000012.pt: step 3 in a file named for step 12" in str(w.message) for w in warned)
    assert res["step"] == 9 and [r["step"] for r in res["history"]] == [7, 8, 9]  # resumed from step 6
    for k, v in _weights(full).items():
        assert torch.equal(v, _weights(resumed)[k]), k


def _cli_args(env, out, *extra):
    return ["backbone", "--data", env["paths"]["text"], "--tokenizer", env["tok_dir"], "--out", str(out),
            "--seq-len", str(T), "--block-size", str(BS), "--hidden-size", "32", "--intermediate-size", "64",
            "--num-layers", "2", "--num-heads", "4", "--num-kv-heads", "2", "--micro-batch-size", "4",
            "--heldout-fraction", "0.1", "--no-progress", "--lr", "1e-2", *extra]


def _without(args, *flags):
    """``args`` with each of ``flags`` and the value after it left out."""
    out = list(args)
    for flag in flags:
        at = out.index(flag)
        del out[at:at + 2]
    return out


def _safetensors(folder):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        out.update(load_file(f))
    assert out
    return out


@pytest.mark.slow
def test_killed_subprocess_resumes(env, tmp_path):
    from training.cli import run

    steps = "60"
    out = tmp_path / "killed"
    args = _cli_args(env, out, "--max-steps", steps, "--save-every", "5")
    envv = subprocess_env(REPO)
    proc = subprocess.Popen([sys.executable, "-m", "training.cli", *args], env=envv, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ck = out / CKPT_DIR
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        if ck.exists() and list_checkpoints(str(out)):
            break
        time.sleep(0.005)
    killed = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert killed, proc.stderr.read().decode()[-2000:]
    first = list_checkpoints(str(out))
    assert first and first[0][0] < 60
    assert not os.path.exists(out / "model.safetensors")
    run(_cli_args(env, out, "--max-steps", steps, "--save-every", "5", "--resume"))
    run(_cli_args(env, tmp_path / "straight", "--max-steps", steps, "--save-every", "5"))
    a, b = _safetensors(out), _safetensors(tmp_path / "straight")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_cli_backbone_then_mrp_export(env, tmp_path, caplog, capfd):
    from transformers import AutoTokenizer

    from hf_integration import SDARMRPForCausalLM
    from training.cli import run

    bb = tmp_path / "bb"
    res = run(_cli_args(env, bb, "--max-steps", "3"))
    assert res["step"] == 3 and res["eval_loss"] is not None
    assert [s for s, _ in list_checkpoints(str(bb))] == [3]  # by default a run ends with a checkpoint to resume
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
              "training_config.json"):
        assert (bb / f).exists(), f
    gen = json.load(open(bb / "generation_config.json"))
    assert gen["mask_token_id"] == 1 and gen["block_size"] == BS
    card = ModelCard.load(bb / "README.md")  # the Hub's metadata and what the model is, how to load it, its training
    assert (card.data.library_name, card.data.pipeline_tag, card.data.base_model) == ("transformers",
                                                                                   "text-generation", None)
    assert "mrp-triton" in card.data.tags and "mrp" not in card.data.tags and card.text.startswith("\n# bb\n")
    assert "without an MRP head" in card.text and 'strategy="static"' in card.text
    assert f"Held-out loss at step 3: {res['eval_loss']:.4g}." in card.text and "| steps | 3 |" in card.text
    mrp = tmp_path / "mrp"
    res = run(["mrp", "--model", str(bb), "--data", env["paths"]["pairs"], "--out", str(mrp), "--seq-len", str(T),
               "--mrp-layers", "1", "--unroll-k", "2", "--micro-batch-size", "2", "--max-steps", "3",
               "--mrp-init", "normal", "--no-progress", "--gradient-checkpointing"])
    assert res["step"] == 3
    assert "Loading weights" not in capfd.readouterr().err  # --no-progress: transformers' bars hidden too
    setup = json.loads(open(mrp / "metrics.jsonl").readline())["setup"]
    assert setup["activation_checkpointing"] is True  # transformers' older name for the flag
    assert "no MRP head" not in caplog.text  # loading the backbone to give it a head does not warn that it has none
    m = SDARMRPForCausalLM.from_pretrained(str(mrp))
    assert m.config.num_nextn_predict_layers == 1 and m.has_mrp
    base = SDARMRPForCausalLM.from_pretrained(str(bb))
    for k, v in base.state_dict().items():  # the backbone did not move
        assert torch.equal(v, m.state_dict()[k]), k
    card = ModelCard.load(mrp / "README.md")
    assert "mrp" in card.data.tags
    card = card.text
    assert "with a 1-layer Multi-token Residual Prediction (MRP) head" in card and 'strategy="speculative"' in card
    assert f"{res['eval_token_agreement']}" in card and "| unroll K | 2 |" in card and "--mrp-init normal" in card
    exported = AutoTokenizer.from_pretrained(str(mrp))
    assert exported.mask_token_id == 1
    assert exported.chat_template == CHAT_TEMPLATE  # chats at inference are laid out as training laid them out
    # mrp-train eval: the trained head's held-out loss and draft agreement, per unroll step
    ev = run(["eval", "--model", str(mrp), "--data", env["paths"]["pairs"], "--seq-len", str(T), "--unroll-k", "3",
              "--micro-batch-size", "2", "--eval-batches", "2"])
    assert ev["sequences"] == 4 and ev["eval_loss"] > 0
    assert all(len(ev[k]) == 3 and all(0 <= a <= 1 for a in ev[k]) for k in ("eval_token_agreement",
                                                                           "eval_pick_agreement"))
    # without settings it evaluates as the head's training did (its sequence length, K and chaining, from
    # training_config.json): on the run's held-out documents it repeats the run's final held-out evaluation
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps(r) + "\n" for r in
                            split_records(read_records([env["paths"]["pairs"]]), 0.01)[1]))
    ev = run(["eval", "--model", str(mrp), "--data", str(held), "--micro-batch-size", "2",
              "--eval-batches", str(TrainConfig().eval_batches)])
    assert (ev["seq_len"], ev["block_size"], ev["unroll_k"], ev["mrp_loss"]) == (T, BS, 2, "kd_diff_sum")
    for k in ("eval_loss", "eval_token_agreement", "eval_pick_agreement"):
        assert ev[k] == res[k], k
    everything = run(["eval", "--model", str(mrp), "--data", str(held), "--eval-batches", "1000"])
    held_ds, _ = build_datasets([str(held)], exported, T, BS, 0.0)
    assert everything["sequences"] == len(held_ds) < 1000  # what it evaluated, not what it was allowed
    with pytest.raises(ConfigError, match="has no MRP head"):
        run(["eval", "--model", str(bb), "--data", env["paths"]["pairs"], "--seq-len", str(T)])
    with pytest.raises(ConfigError, match="--eval-batches must be >= 1, got 0"):
        run(["eval", "--model", str(mrp), "--data", env["paths"]["pairs"], "--eval-batches", "0"])
    with pytest.raises(ConfigError, match="give the held-out data"):
        run(["eval", "--model", str(mrp)])
    with pytest.raises(ConfigError, match=r"--stdlib: no manifest at .*--stdlib-manifest FILE"):
        run(["eval", "--model", str(mrp), "--stdlib"])  # a head trained on --data records no stdlib split
    # Training a model's head on: the head's own depth and weights (flags that would change them are refused), the
    # record says so, and the folder's generation config (here a draft vocabulary and its own EOS and pad ids, not
    # the tokenizer's 0) carries over.
    assert json.load(open(mrp / "training_config.json"))["mrp_init"] == "normal"
    gen = json.load(open(mrp / "generation_config.json"))
    own = {"draft_vocab": [2, 3, 4], "eos_token_id": [0, 5], "pad_token_id": 7}
    (mrp / "generation_config.json").write_text(json.dumps({**gen, **own}))
    on = ["mrp", "--model", str(mrp), "--data", env["paths"]["pairs"], "--seq-len", str(T), "--micro-batch-size",
          "2", "--max-steps", "1", "--no-progress"]
    for flags, message in ((["--mrp-layers", "2"], "--mrp-layers 2: --model .* has a 1-layer MRP head"),
                           (["--mrp-init", "normal"], "--mrp-init normal initialises a new head")):
        with pytest.raises(ConfigError, match=message):
            run([*on, "--out", str(tmp_path / "refused"), *flags])
    (tmp_path / "more").mkdir()
    own_card = "---\ntags: [unclosed\n---\n# my own card\n"  # metadata the Hub's reader cannot parse
    (tmp_path / "more" / "README.md").write_text(own_card)  # a card mrp-train did not write is kept
    run([*on, "--out", str(tmp_path / "more"), "--mrp-layers", "1"])
    assert (tmp_path / "more" / "README.md").read_text() == own_card
    record = json.load(open(tmp_path / "more" / "training_config.json"))
    assert (record["num_mrp_layers"], record["mrp_init"]) == (1, "continued")
    carried = json.load(open(tmp_path / "more" / "generation_config.json"))
    assert {k: carried[k] for k in own} == own
    # --resume restores the optimizer's settings: another --lr is refused, not silently replaced
    with pytest.raises(ConfigError, match="--resume: the checkpoint was made with --lr 0.01, this run has --lr 0.005"):
        run(_cli_args(env, bb, "--max-steps", "3", "--resume", "--lr", "5e-3"))
    # and the learning-rate schedule, which the checkpoint's LambdaLR state does not hold
    with pytest.raises(ConfigError, match="--resume: the checkpoint was made with min_lr_ratio=0.1, this run has "
                                          "min_lr_ratio=0.5"):
        run(_cli_args(env, bb, "--max-steps", "3", "--resume", "--min-lr-ratio", "0.5"))
    # and the clipping, and an MRP run's loss (its K, kind and KD precision), which no state holds either
    with pytest.raises(ConfigError, match="--resume: the checkpoint was made with grad_clip=1.0, this run has "
                                          "grad_clip=0.5"):
        run(_cli_args(env, bb, "--max-steps", "3", "--resume", "--grad-clip", "0.5"))
    again = ["mrp", "--model", str(bb), "--data", env["paths"]["pairs"], "--out", str(mrp), "--seq-len", str(T),
             "--mrp-layers", "1", "--micro-batch-size", "2", "--max-steps", "3", "--no-progress", "--resume"]
    for flags, message in ((["--unroll-k", "3"], "unroll_k=2, this run has unroll_k=3"),
                           (["--unroll-k", "2", "--mrp-loss", "direct"], "mrp_loss='kd_diff_sum', this run has "
                                                                          "mrp_loss='direct'"),
                           (["--unroll-k", "2", "--kd-precision", "bf16"], "kd_precision='tf32', this run has "
                                                                            "kd_precision='bf16'")):
        with pytest.raises(ConfigError, match="--resume: the checkpoint was made with " + message):
            run([*again, *flags])
    # and the model the flags build: its shapes (the restore would crash on them), and a setting that changes none
    for flags, message in ((["--hidden-size", "48"], "config.hidden_size=32, this run has config.hidden_size=48"),
                           (["--rope-theta", "500"], "config.rope_parameters=")):
        with pytest.raises(ConfigError, match="--resume: the checkpoint was made with " + message):
            run(_cli_args(env, bb, "--max-steps", "3", "--resume", *flags))


def test_an_mrp_run_longer_than_the_models_positions_is_refused_before_the_data_is_read(env, tmp_path, monkeypatch):
    """As mrp-train backbone refuses a --seq-len past --max-position-embeddings, mrp-train mrp refuses one past the
    model's."""
    from training import cli, data

    positions = json.loads(open(os.path.join(env["backbone"], "config.json")).read())["max_position_embeddings"]
    monkeypatch.setattr(data, "read_records", lambda *a, **k: pytest.fail("read the data despite bad flags"))
    with pytest.raises(ConfigError, match=rf"--seq-len \({2 * positions}\) must be <= --model's "
                                          rf"max_position_embeddings \({positions}\)"):
        cli.run(["mrp", "--model", env["backbone"], "--data", env["paths"]["pairs"], "--out", str(tmp_path / "o"),
                 "--seq-len", str(2 * positions), "--no-progress"])


def test_a_tokenizer_with_more_ids_than_the_models_vocabulary_is_refused_before_tokenizing(env, tmp_path,
                                                                                           monkeypatch):
    """mrp-train mrp --tokenizer whose ids the model's embeddings do not hold: refused naming the flag before the
    data is tokenized (an IndexError mid-training before; on CUDA, a device-side assert)."""
    import shutil

    from training import cli, data

    small = tmp_path / "small"
    shutil.copytree(env["backbone"], small)
    config = json.loads((small / "config.json").read_text())
    config["vocab_size"] = len(env["tok"]) - 1
    (small / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(data, "build_datasets", lambda *a, **k: pytest.fail("tokenized the data"))
    with pytest.raises(ConfigError, match=rf"--tokenizer: its {len(env['tok'])} token ids are more than the model's "
                                          rf"vocabulary \({len(env['tok']) - 1}\)"):
        cli.run(["mrp", "--model", str(small), "--data", env["paths"]["pairs"], "--out", str(tmp_path / "out"),
                 "--seq-len", str(T), "--max-steps", "1", "--no-progress"])


def test_cli_takes_hub_repo_ids_from_the_offline_cache(env, tmp_path, monkeypatch):
    """--model / --tokenizer may name a Hub repo: huggingface_hub resolves it (here offline, from a pre-populated
    cache in the layout it writes); a repo it cannot find is a ConfigError naming the flag."""
    import shutil

    from huggingface_hub import constants

    from training.cli import run

    repo_id, revision = "someone/tiny-sdar", "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "hub" / f"models--{repo_id.replace('/', '--')}" / "snapshots" / revision
    shutil.copytree(env["backbone"], snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(revision)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert constants.HF_HUB_OFFLINE  # tests/conftest.py: no network
    res = run(["mrp", "--model", repo_id, "--tokenizer", repo_id, "--data", env["paths"]["pairs"], "--out",
               str(tmp_path / "mrp"), "--seq-len", str(T), "--mrp-layers", "1", "--micro-batch-size", "2",
               "--max-steps", "2", "--no-progress"])
    assert res["step"] == 2 and (tmp_path / "mrp" / "model.safetensors").exists()
    assert ModelCard.load(tmp_path / "mrp" / "README.md").data.base_model == repo_id  # the Hub repo it started from
    for flag in ("--model", "--tokenizer"):
        args = {"--model": repo_id, "--tokenizer": repo_id, flag: "someone/not-cached"}
        with pytest.raises(ConfigError, match=f"{flag}: 'someone/not-cached' is neither a local folder nor a Hub repo"):
            run(["mrp", "--data", env["paths"]["pairs"], "--out", str(tmp_path / "x"), *sum(args.items(), ())])


def test_push_to_hub_uploads_the_model_folder_without_checkpoints(env, tmp_path, monkeypatch):
    """--push-to-hub REPO: checked before training (a repo id that cannot be, offline, no login, a login the Hub does
    not confirm: refused, nothing trained), then the exported folder is uploaded in one commit, its checkpoints left
    out, the repo created if missing (--private), the card titled and loaded by the repo id; a failed upload keeps the
    model and says how to upload it by hand. (huggingface_hub's HfApi is replaced: no network here.)"""
    from huggingface_hub import HfApi, constants

    from training import hub
    from training.cli import run

    calls = []

    class Commit:
        commit_url = "https://huggingface.co/someone/tiny/commit/abc"

    def upload_folder(self, **kw):
        calls.append(("upload_folder", kw, sorted(os.listdir(kw["folder_path"]))))
        return Commit()

    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: calls.append(("create_repo", repo_id, kw)))
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    monkeypatch.setattr(hub, "get_token", lambda: "hf_token")
    monkeypatch.setattr(HfApi, "whoami", lambda self, token=None: {"name": "someone"})
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    out = tmp_path / "bb"
    res = run(_cli_args(env, out, "--max-steps", "2", "--push-to-hub", "someone/tiny", "--private"))
    assert res["pushed_to"] == Commit.commit_url
    (_, repo, create), (_, upload, files) = calls
    assert repo == "someone/tiny" and create == dict(private=True, exist_ok=True, repo_type="model")
    assert upload["repo_id"] == "someone/tiny" and upload["folder_path"] == str(out)
    assert upload["ignore_patterns"] == ["checkpoints/*"] and "checkpoints" in files and "README.md" in files
    assert upload["commit_message"] == "mrp-train backbone: step 2"
    card = ModelCard.load(out / "README.md").text
    assert card.startswith("\n# someone/tiny\n") and 'path = "someone/tiny"' in card

    def fail(self, **kw):
        raise OSError("403 Forbidden")

    monkeypatch.setattr(HfApi, "upload_folder", fail)
    with pytest.raises(ConfigError, match=r"--push-to-hub someone/tiny: the upload failed \(OSError: 403 Forbidden\); "
                                          rf"the model is saved in {tmp_path}/again: upload it with hf upload"):
        run(_cli_args(env, tmp_path / "again", "--max-steps", "1", "--push-to-hub", "someone/tiny"))
    assert (tmp_path / "again" / "model.safetensors").exists()
    for flags, message in ((["--push-to-hub", "not a repo"], "--push-to-hub 'not a repo' is not a Hub repo id"),
                           (["--push-to-hub", "tiny"], r"--push-to-hub 'tiny': give the owner too \('your-name/tiny'"),
                           (["--private"], "--private goes with --push-to-hub")):
        with pytest.raises(ConfigError, match=message):
            run(_cli_args(env, tmp_path / "refused", "--max-steps", "1", *flags))

    def unreachable(self, token=None):
        raise ConnectionError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(HfApi, "whoami", unreachable)  # no network (or a token the Hub refuses): refused before
    with pytest.raises(ConfigError, match=r"the Hub did not confirm the login \(ConnectionError: .*name resolution\)"):
        run(_cli_args(env, tmp_path / "refused", "--max-steps", "1", "--push-to-hub", "someone/tiny"))
    monkeypatch.setattr(hub, "get_token", lambda: None)
    with pytest.raises(ConfigError, match="no Hub token: log in first"):
        run(_cli_args(env, tmp_path / "refused", "--max-steps", "1", "--push-to-hub", "someone/tiny"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set"):
        run(_cli_args(env, tmp_path / "refused", "--max-steps", "1", "--push-to-hub", "someone/tiny"))
    assert not (tmp_path / "refused").exists()  # refused before anything was written


@pytest.mark.parametrize("flags, message", [
    (["--vocab-size", "100"], "--vocab-size must be >= 258"),
    (["--num-kv-heads", "0"], "--num-kv-heads must be >= 1, got 0"),  # not read as "default: --num-heads"
    (["--intermediate-size", "0"], "--intermediate-size must be >= 1, got 0"),
    (["--num-layers", "0"], "--num-layers must be >= 1, got 0"),
    (["--num-heads", "3"], r"--hidden-size \(256\) must be a multiple of --num-heads \(3\) or give --head-dim"),
    (["--num-kv-heads", "3"], r"--num-heads \(4\) must be a multiple of --num-kv-heads \(3\)"),
    (["--head-dim", "7"], "--head-dim must be even"),
    (["--max-position-embeddings", "8"], r"--max-position-embeddings \(8\) must be >= --seq-len \(256\)"),
    (["--rope-theta", "0"], "--rope-theta must be > 0"),
    (["--max-steps", "0"], "--max-steps must be >= 1, got 0"),
    (["--adam-beta2", "1.5"], r"--adam-beta2 must be in \[0, 1\), got 1.5"),
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (["--device", "gpu0"], "--device 'gpu0' is not a device"),
    pytest.param(["--device", "cuda"], "--device cuda: this machine has no CUDA GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine trains there")),
    pytest.param(["--attention", "flex"], "--attention flex needs a CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine trains there")),
])
def test_backbone_flags_are_refused_before_the_data_is_read(flags, message, tmp_path, monkeypatch):
    """Flags that make no model or no run (sizes, optimizer values, a device this machine lacks or an attention it
    cannot run) end the run before it reads the data and trains a tokenizer (minutes on a large corpus), with the
    flag named."""
    from training import cli, data

    monkeypatch.setattr(data, "read_records", lambda *a, **k: pytest.fail("read the data despite bad flags"))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "def f(): pass"}\n')
    with pytest.raises(ConfigError, match=message):
        cli.run(["backbone", "--data", str(corpus), "--out", str(tmp_path / "out"), *flags])


def test_device_cuda_is_this_processs_gpu_and_a_gpu_it_lacks_is_refused(monkeypatch):
    """--device cuda (no index) is the process's own GPU, cuda:LOCAL_RANK as under torchrun (torch.cuda.set_device
    refused a device without an index); a GPU the machine lacks is refused naming the flag."""
    from training.trainer import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda", local_rank=1) == resolve_device(None, local_rank=1) == torch.device("cuda:1")
    assert resolve_device("cuda:0", local_rank=1) == torch.device("cuda:0")
    assert resolve_device("cpu", local_rank=1) == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"--device cuda:2: GPU 2 does not exist \(this machine has 2\)"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("flags", [["--max-position-embeddings", "256"], ["--vocab-size", "258"]])
def test_backbone_flags_at_their_bounds_pass_the_checks(flags, tmp_path, monkeypatch):
    """The bounds themselves are valid (max positions = --seq-len, the smallest vocabulary): the run gets as far
    as reading the data."""
    from training import cli, data

    class DataRead(Exception):
        pass

    def read(*args, **kwargs):
        raise DataRead

    monkeypatch.setattr(data, "read_records", read)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "def f(): pass"}\n')
    with pytest.raises(DataRead):
        cli.run(["backbone", "--data", str(corpus), "--out", str(tmp_path / "out"), "--seq-len", "256", *flags])


def test_the_heldout_fraction_defaults_to_one_percent(env, tmp_path, monkeypatch):
    from training import cli, data

    class Split(Exception):
        pass

    fractions = []

    def split(records, fraction, *args, **kwargs):
        fractions.append(fraction)
        raise Split

    monkeypatch.setattr(data, "split_records", split)
    with pytest.raises(Split):
        cli.run(_without(_cli_args(env, tmp_path), "--heldout-fraction"))
    assert fractions == [0.01]


def test_an_mrp_run_on_the_stdlib_takes_its_backbones_split_by_default(tmp_path):
    """mrp --stdlib without --stdlib-manifest: MODEL/stdlib_manifest.json when the backbone recorded one, else
    OUT/stdlib_manifest.json."""
    import argparse

    from training.cli import _default_manifest

    mrp = argparse.Namespace(command="mrp", model=str(tmp_path))
    out_manifest = os.path.join("out", "stdlib_manifest.json")
    assert _default_manifest(mrp, "out") == out_manifest
    (tmp_path / "stdlib_manifest.json").write_text("{}")
    assert _default_manifest(mrp, "out") == str(tmp_path / "stdlib_manifest.json")
    assert _default_manifest(argparse.Namespace(command="backbone"), "out") == out_manifest


def test_eval_defaults_come_from_an_mrp_run_only(tmp_path):
    """mrp-train eval's sequence length, K and chaining: the flags, else the MRP run's training_config.json, else
    EVAL_DEFAULTS (a folder whose training_config.json is a backbone run's: that run trained no head)."""
    import argparse

    from training.cli import EVAL_DEFAULTS, _eval_defaults

    def resolved(**flags):
        args = argparse.Namespace(model=str(tmp_path), **{k: flags.get(k) for k in EVAL_DEFAULTS})
        _eval_defaults(args)
        return {k: getattr(args, k) for k in EVAL_DEFAULTS}

    trained = {"seq_len": 64, "unroll_k": 2, "mrp_loss": "direct"}
    (tmp_path / "training_config.json").write_text(json.dumps({"mode": "mrp", **trained}))
    assert resolved() == trained and resolved(unroll_k=4) == {**trained, "unroll_k": 4}
    (tmp_path / "training_config.json").write_text(json.dumps({"mode": "backbone", **trained}))
    assert resolved() == EVAL_DEFAULTS


def test_eval_block_size_is_the_flag_else_the_model_config_else_4(tmp_path):
    import argparse

    from training.cli import _model_block_size

    (tmp_path / "config.json").write_text(json.dumps({"block_size": 8}))
    assert _model_block_size(argparse.Namespace(model=str(tmp_path), block_size=None)) == 8
    assert _model_block_size(argparse.Namespace(model=str(tmp_path), block_size=16)) == 16
    (tmp_path / "config.json").write_text("{}")
    assert _model_block_size(argparse.Namespace(model=str(tmp_path), block_size=None)) == 4


def test_steps_per_epoch_count_the_global_batch_of_every_process():
    from training.trainer import total_steps_for

    cfg = TrainConfig(micro_batch_size=4, grad_accum=2, epochs=2.5)
    assert [total_steps_for(cfg, 100, world) for world in (1, 2, 8)] == [30, 15, 2]  # 2.5 x (100 // (4 x 2 x world))
    assert total_steps_for(TrainConfig(micro_batch_size=4, max_steps=7), 100, 2) == 7


def test_a_set_of_exactly_one_global_batch_trains_and_each_epoch_has_its_own_order():
    one = GlobalBatchSampler(8, 8, seed=0)
    assert one.steps_per_epoch == 1 and sorted(one.step_indices(0).tolist()) == list(range(8))
    sampler = GlobalBatchSampler(10, 2, seed=0)  # 5 steps an epoch
    batches = [sampler.step_indices(step).tolist() for step in range(10)]
    assert sorted(sum(batches[:5], [])) == sorted(sum(batches[5:], [])) == list(range(10))
    assert batches[5:] != batches[:5]  # epoch 1 is shuffled anew
    fresh = GlobalBatchSampler(10, 2, seed=0)
    assert [fresh.step_indices(step).tolist() for step in range(5, 10)] == batches[5:]  # by the step alone


def test_weight_decay_skips_one_dimensional_parameters():
    optim = build_optimizer(nn.Linear(2, 3), TrainConfig(weight_decay=0.1))
    assert [([q.dim() for q in g["params"]], g["weight_decay"]) for g in optim.param_groups] == [([2], 0.1),
                                                                                                 ([1], 0.0)]


def test_resume_refuses_another_weight_decay_but_takes_betas_stored_as_a_list():
    from training.trainer import _check_optimizer_settings

    model = nn.Linear(2, 3)
    saved = build_optimizer(model, TrainConfig(weight_decay=0.1)).state_dict()
    _check_optimizer_settings(saved, build_optimizer(model, TrainConfig(weight_decay=0.1)))
    with pytest.raises(ConfigError, match="made with --weight-decay 0.1, this run has --weight-decay 0.05"):
        _check_optimizer_settings(saved, build_optimizer(model, TrainConfig(weight_decay=0.05)))
    as_list = copy.deepcopy(saved)  # a checkpoint may hold Adam's betas as a list
    for group in as_list["param_groups"]:
        group["betas"] = list(group["betas"])
    _check_optimizer_settings(as_list, build_optimizer(model, TrainConfig(weight_decay=0.1)))


def test_a_parameter_outside_the_head_that_requires_grad_is_refused_before_it_gets_one():
    model = nn.Linear(2, 2)
    check_only_trainable_grads(model, {"weight", "bias"})
    with pytest.raises(AssertionError, match="parameter bias is outside the MRP head"):
        check_only_trainable_grads(model, {"weight"})
    model.bias.requires_grad_(False)
    check_only_trainable_grads(model, {"weight"})


def test_draft_agreements_are_the_ratios_of_their_counts(env):
    """eval_token_agreement: tokens_agree / tokens; eval_pick_agreement: picks_agree / blocks (counts summed over the
    micro-batches)."""
    from training.losses import AGREEMENT_COUNTS

    counts = dict(zip(AGREEMENT_COUNTS, (3, 10, 2, 4)))  # each count different, so any other ratio differs

    class FixedCounts(nn.Module):
        def forward(self, ids, is_prompt, seeds, with_stats=False):
            return torch.tensor(1.0), {"agreement": [counts]}

    cfg = _cfg("unused", "mrp", micro_batch_size=4, eval_batches=2, unroll_k=1)
    res = evaluate(FixedCounts(), env["train"], cfg, torch.device("cpu"))
    assert (res["eval_token_agreement"], res["eval_pick_agreement"]) == ([0.3], [0.5])


def test_pruning_keeps_the_newest_checkpoints(tmp_path):
    from training.trainer import _prune

    (tmp_path / CKPT_DIR).mkdir()
    for step in (3, 6, 9, 12):
        (tmp_path / CKPT_DIR / f"step_{step:08d}.pt").write_bytes(b"")
    _prune(str(tmp_path), 2)
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [12, 9]


def test_eval_loss_is_the_loss_per_answer_token(env):
    """evaluate's eval_loss: the loss sum of the sequences it scores (the noise fixed by their index) over their
    answer tokens."""
    from training.noising import sample_seed

    cfg = _cfg("unused", micro_batch_size=3, eval_batches=2)
    loss_mod = LossModule(_model(env, "backbone"), cfg, env["tok"].mask_token_id)
    ds = build_datasets([env["paths"]["pairs"]], env["tok"], T, BS, 0.0)[0]  # prompts and answers
    with torch.no_grad():
        total = sum(float(loss_mod(ds.input_ids[i:i + 3], ds.is_prompt[i:i + 3],
                                   [sample_seed(cfg.seed, "eval", j) for j in range(i, i + 3)])) for i in (0, 3))
    answers = int((~ds.is_prompt[:6]).sum())
    assert answers < 6 * T  # the data holds prompt tokens: per token and per sequence differ
    assert evaluate(loss_mod, ds, cfg, torch.device("cpu"))["eval_loss"] == pytest.approx(total / answers, rel=1e-6)


def test_lr_warms_up_linearly_from_its_first_step_then_follows_a_cosine_to_the_floor():
    from training.trainer import lr_lambda_factory

    f = lr_lambda_factory(total_steps=12, warmup_steps=4, min_lr_ratio=0.1)
    assert [f(s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]  # step 0 already trains, at lr / warmup
    assert f(8) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the cosine
    assert f(12) == pytest.approx(0.1) and f(40) == pytest.approx(0.1)
    assert lr_lambda_factory(10, 0, 0.0)(0) == 1.0


def test_bad_configs_rejected(env, tmp_path, monkeypatch):
    from training.cli import main, run

    with pytest.raises(ConfigError, match=r"--seq-len \(18\) must be a multiple of --block-size \(4\)"):
        run(_cli_args(env, tmp_path / "a", "--seq-len", "18"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ConfigError, match="--data"):
        run(["backbone", "--data", str(empty), "--tokenizer", env["tok_dir"], "--out", str(tmp_path / "b")])
    with pytest.raises(ConfigError, match="--data"):
        run(["backbone", "--out", str(tmp_path / "b")])
    with pytest.raises(ConfigError, match=r"--unroll-k \(K\) must be >= 1"):
        run(["mrp", "--model", env["backbone"], "--data", env["paths"]["text"], "--out", str(tmp_path / "c"),
             "--unroll-k", "0"])
    with pytest.raises(ConfigError, match="--tokenizer"):
        run(_cli_args(env, tmp_path / "d")[:4] + ["/nonexistent/tok"] + _cli_args(env, tmp_path / "d")[5:])
    no_tok = tmp_path / "no_tok"
    tiny_backbone(env["tok"]).save_pretrained(str(no_tok))
    with pytest.raises(ConfigError, match="--tokenizer"):
        run(["mrp", "--model", str(no_tok), "--data", env["paths"]["text"], "--out", str(tmp_path / "e")])
    with pytest.raises(ConfigError, match="--model"):
        run(["mrp", "--model", str(tmp_path / "nope"), "--data", env["paths"]["text"], "--out", str(tmp_path / "f")])
    with pytest.raises(ConfigError, match="--micro-batch-size"):  # fewer sequences than one global batch
        run(_cli_args(env, tmp_path / "g", "--micro-batch-size", "100000"))
    with pytest.raises(ConfigError, match="--attention flex needs a CUDA device .* use --attention sdpa or auto"):
        run(_cli_args(env, tmp_path / "i", "--attention", "flex", "--device", "cpu"))
    with monkeypatch.context() as patched:  # a T4 (sm_75): bf16 autocast and FlexAttention refused, auto -> SDPA
        from mrp_triton import backend
        from training.trainer import LossModule, check_gpu_support

        patched.setattr(backend, "_BEFORE_AMPERE", {})
        patched.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
        patched.setattr(torch.version, "hip", None)
        t4 = torch.device("cuda:0")
        with pytest.raises(ConfigError, match="needs a GPU with bf16 units .* is sm_75: pass --no-bf16"):
            check_gpu_support(TrainConfig(), t4)
        with pytest.raises(ConfigError, match="--attention flex needs NVIDIA sm_80 .* use --attention sdpa or auto"):
            check_gpu_support(TrainConfig(bf16=False, attention="flex"), t4)
        check_gpu_support(TrainConfig(bf16=False), t4)
        check_gpu_support(TrainConfig(attention="flex"), torch.device("cpu"))
        assert LossModule(torch.nn.Linear(1, 1), TrainConfig(), 0).attention(t4) == "sdpa"
        patched.setattr(backend, "_BEFORE_AMPERE", {})
        patched.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
        check_gpu_support(TrainConfig(attention="flex"), t4)
        assert LossModule(torch.nn.Linear(1, 1), TrainConfig(), 0).attention(t4) == "flex"
    with pytest.raises(ConfigError, match="--attention must be 'auto', 'flex' or 'sdpa', got 'math'"):
        TrainConfig(attention="math").validate()
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"heldout_fraction": 0.02, "seed": 0, "train": [], "heldout": []}))
    stdlib = _without(_cli_args(env, tmp_path / "j"), "--data")
    with pytest.raises(ConfigError, match="--heldout-fraction 0.1: the split comes from .*manifest.json, which holds "
                                          "out 0.02"):
        run([*stdlib, "--stdlib", "--stdlib-manifest", str(manifest)])
    with pytest.raises(ConfigError, match="--stdlib and --data are mutually exclusive"):
        run(_cli_args(env, tmp_path / "l", "--stdlib", "--stdlib-manifest", str(manifest)))
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps([{"text": "a"}], indent=2))
    with pytest.raises(ConfigError, match="pretty.json:1: not valid JSON .*one JSON object a line"):
        run(["backbone", "--data", str(pretty), "--tokenizer", env["tok_dir"], "--out", str(tmp_path / "k")])
    with pytest.raises(ConfigError, match="--kd-precision must be 'fp32', 'tf32' or 'bf16', got 'fp16'"):
        TrainConfig(kd_precision="fp16").validate()
    with pytest.raises(SystemExit) as e:
        main(_cli_args(env, tmp_path / "h", "--seq-len", "18"))
    assert e.value.code == 2


@pytest.mark.parametrize("field,refused,accepted,flag", [
    ("block_size", 0, 1, "--block-size"), ("seq_len", 0, 4, "--seq-len"),
    ("micro_batch_size", 0, 1, "--micro-batch-size"), ("grad_accum", 0, 1, "--grad-accum"),
    ("max_steps", 0, 1, "--max-steps"), ("epochs", 0.0, 0.01, "--epochs"), ("lr", 0.0, 1e-9, "--lr"),
    ("min_lr_ratio", -0.01, 0.0, "--min-lr-ratio"), ("min_lr_ratio", 1.01, 1.0, "--min-lr-ratio"),
    ("warmup_ratio", 1.0, 0.99, "--warmup-ratio"), ("warmup_ratio", -0.01, 0.0, "--warmup-ratio"),
    ("warmup_steps", -1, 0, "--warmup-steps"), ("noise_eps", 0.0, 1e-9, "--noise-eps"),
    ("noise_eps", 1.0, 0.999, "--noise-eps"), ("log_every", 0, 1, "--log-every"), ("eval_every", -1, 0, "--eval-every"),
    ("eval_batches", -1, 0, "--eval-batches"), ("save_every", -1, 0, "--save-every"),
    ("keep_checkpoints", 0, 1, "--keep-checkpoints"), ("unroll_k", 0, 1, "--unroll-k"),
    ("num_mrp_layers", 0, 1, "--mrp-layers"), ("mrp_init_std", 0.0, 1e-6, "--mrp-init-std"),
    ("lr", float("inf"), 1e9, "--lr"), ("weight_decay", -0.01, 0.0, "--weight-decay"),
    ("weight_decay", float("nan"), 1e3, "--weight-decay"), ("adam_beta2", 1.0, 0.999, "--adam-beta2"),
    ("adam_beta2", -0.01, 0.0, "--adam-beta2"), ("adam_beta2", float("nan"), 0.5, "--adam-beta2"),
    ("grad_clip", float("nan"), -1.0, "--grad-clip"), ("mrp_init_std", float("inf"), 1e6, "--mrp-init-std"),
])
def test_config_bounds_are_exact(field, refused, accepted, flag):
    """Each bound refuses the first value outside it, naming the flag, and takes the last one inside."""
    with pytest.raises(ConfigError, match=f"{flag}.* got {refused}"):
        TrainConfig(**{field: refused}).validate()
    TrainConfig(**{field: accepted}).validate()


def test_cli_help(capsys):
    from training.cli import main

    for argv in (["--help"], ["backbone", "--help"], ["mrp", "--help"], ["eval", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--unroll-k" in out and "--block-size" in out and "--resume" in out and "--kd-precision" in out


def test_fresh_run_refuses_out_with_checkpoints(env, tmp_path):
    train(_cfg(tmp_path, max_steps=2, save_every=1), _model(env, "backbone"), env["train"])
    with pytest.raises(ConfigError, match="--resume"):
        train(_cfg(tmp_path, max_steps=2, save_every=1), _model(env, "backbone"), env["train"])


def test_a_fresh_backbone_run_refuses_a_run_folder_before_writing_its_tokenizer(env, tmp_path):
    """The refusal comes before a new tokenizer is trained into OUT/tokenizer, so the other run stays resumable.
    (The first run, without --intermediate-size and --max-position-embeddings, also shows their defaults.)"""
    from training.cli import run

    args = _without(_cli_args(env, tmp_path / "b", "--max-steps", "1", "--adam-beta2", "0.9"), "--tokenizer",
                    "--intermediate-size")
    run([*args, "--vocab-size", "300"])
    config = json.load(open(tmp_path / "b" / "config.json"))
    assert config["intermediate_size"] == 3 * 32  # 3 x --hidden-size
    assert config["max_position_embeddings"] == 4096  # max(--seq-len, 4096)
    assert json.load(open(tmp_path / "b" / "training_config.json"))["adam_beta2"] == 0.9  # not the default 0.95
    saved = torch.load(list_checkpoints(str(tmp_path / "b"))[0][1], weights_only=False)
    assert saved["optimizer"]["param_groups"][0]["betas"][1] == 0.9
    tokenizer = (tmp_path / "b" / "tokenizer" / "tokenizer.json").read_bytes()
    with pytest.raises(ConfigError, match="already holds checkpoints of another run; pass --resume"):
        run([*args, "--vocab-size", "280"])
    assert (tmp_path / "b" / "tokenizer" / "tokenizer.json").read_bytes() == tokenizer


def test_resume_without_a_checkpoint_starts_the_metrics_afresh(env, tmp_path):
    for resume in (False, True):
        train(_cfg(tmp_path, max_steps=2, save_every=0, resume=resume), _model(env, "backbone"), env["train"])
    steps = [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl") if '"loss"' in x]
    assert steps == [1, 2]


@pytest.mark.triton
def test_training_steps_run_the_backward_kernels_under_the_default_dispatch(env, tmp_path):
    """Nothing in the loop forces an op backend: with the kernels available (the interpreter here, CUDA on a GPU)
    the layers' norms are differentiated by their backward kernel, and the step's loss is the reference's."""
    import importlib
    from unittest import mock

    from mrp_triton import use_backend

    rms_norm_module = importlib.import_module("mrp_triton.rms_norm")  # the package's rms_norm is the function

    losses = []
    for kernels in (False, True):
        spy = mock.patch.object(rms_norm_module, "rms_norm_backward", wraps=rms_norm_module.rms_norm_backward)
        with spy as backward, (torch.enable_grad() if kernels else use_backend("reference")):
            train(_cfg(tmp_path / str(kernels), max_steps=1, micro_batch_size=2, eval_every=0),
                  _model(env, "backbone"), env["train"], env["train"])
        assert backward.called == kernels
        setup, first = (json.loads(x) for x in open(tmp_path / str(kernels) / "metrics.jsonl").readlines()[:2])
        assert setup["setup"]["ops"] == ("triton" if kernels else "reference")
        losses.append(first["loss"])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
