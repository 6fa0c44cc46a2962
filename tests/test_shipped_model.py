"""The small SDAR+MRP model shipped in the repo: loads offline with remote code, generates, and the
mrp-generate CLI and the end-to-end benchmark run on it."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_integration
from hf_integration.cli import SHIPPED_MODEL, UsageError
from tiny_models import LetterTokenizer, tiny_model

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_shipped_folder_is_complete_and_small():
    files = {p.name for p in SHIPPED_MODEL.iterdir()}
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "stdlib_manifest.json", "training_log_backbone.jsonl",
                 "training_log_mrp.jsonl", "training_log_mrp_stage2.jsonl", "training_log_mrp_stage3.jsonl",
                 "modeling_sdar_mrp.py"):
        assert name in files, name
    size = sum(p.stat().st_size for p in SHIPPED_MODEL.iterdir())
    assert size <= 25 * 2**20, size
    config = json.loads((SHIPPED_MODEL / "config.json").read_text())
    assert config["block_size"] == 16 and config["num_nextn_predict_layers"] == 3
    manifest = json.loads((SHIPPED_MODEL / "stdlib_manifest.json").read_text())
    assert manifest["train"] and manifest["heldout"] and not set(manifest["train"]) & set(manifest["heldout"])


def test_shipped_remote_code_matches_the_package():
    """The checkpoint carries copies of hf_integration's modeling files; they must not drift.
    Fix with: cp hf_integration/<file>.py hf_integration/shipped/sdar-stdlib-mrp/"""
    package = Path(hf_integration.__file__).parent
    for copy in SHIPPED_MODEL.glob("*.py"):
        assert copy.read_text() == (package / copy.name).read_text(), f"{copy.name} is stale"


def test_remote_code_imports_only_torch_transformers_einops_mrp_triton_and_the_standard_library():
    """The files ``save_pretrained`` copies into a checkpoint (the shipped one's) are its remote code: where it loads,
    what the design card promises is installed (torch, transformers, einops, mrp_triton); any other import, also one
    inside a function, would fail there. hf_integration's other files (the CLI and the server, installed with the
    package, never copied) may import the package's dependencies too."""
    remote = {"torch", "transformers", "einops", "mrp_triton"} | set(sys.stdlib_module_names)
    dependencies = {"tokenizers", "huggingface_hub", "safetensors", "tqdm", "triton"}  # pyproject's, beside those
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    assert all(f'"{name.replace("_", "-")}' in pyproject for name in dependencies)
    installed = remote | dependencies
    shipped = {p.name for p in SHIPPED_MODEL.glob("*.py")}
    assert "modeling_sdar_mrp.py" in shipped and "server.py" not in shipped
    for path in sorted(Path(hf_integration.__file__).parent.glob("*.py")):
        allowed = remote if path.name in shipped else installed
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:  # relative imports stay in the package
                modules = [node.module]
            else:
                continue
            assert all(m.split(".")[0] in allowed for m in modules), f"{path.name}:{node.lineno} imports {modules}"


def test_loading_the_checkpoint_without_mrp_triton_says_what_to_install(tmp_path):
    """Where mrp_triton cannot be imported, loading a checkpoint with its remote code fails with an error naming the
    package to install, not a bare ModuleNotFoundError from deep in the decoding code."""
    code = f"""
import sys
class NoMrpTriton:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "mrp_triton":
            raise ModuleNotFoundError("No module named 'mrp_triton'", name="mrp_triton")
sys.meta_path.insert(0, NoMrpTriton())
from transformers import AutoModelForCausalLM
try:
    AutoModelForCausalLM.from_pretrained({str(SHIPPED_MODEL)!r}, trust_remote_code=True)
except ImportError as err:
    print(type(err).__name__, err)
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"),
           "PYTHONPATH": ""}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.stdout.startswith("ImportError this SDAR+MRP checkpoint's code runs on the mrp-triton package"), (
        result.stdout + result.stderr[-2000:])
    assert "pip install mrp-triton" in result.stdout


def test_shipped_model_loads_offline_with_remote_code_and_generates():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SHIPPED_MODEL, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, trust_remote_code=True).eval()
    assert model.has_mrp
    ids = tok("def add(a, b):\n", return_tensors="pt").input_ids
    static = model.generate(ids, max_new_tokens=16)
    spec = model.generate(ids, max_new_tokens=16, strategy="speculative", mrp_steps=3, return_dict_in_generate=True)
    assert torch.equal(static, spec.sequences)
    assert spec.stats.tokens_per_forward[0] >= 1.0
    assert tok.decode(static[0, ids.shape[1]:]).strip()


def test_shipped_model_runs_in_a_text_generation_pipeline():
    """transformers' pipeline passes its own keywords through to generate() (max_new_tokens,
    num_return_sequences, the pipeline's generation config)."""
    from transformers import pipeline

    generator = pipeline("text-generation", model=str(SHIPPED_MODEL), trust_remote_code=True)
    prompt = "def add(a, b):\n"
    torch.manual_seed(0)  # the samples draw their seed from torch's generator; some draws end with an EOS at once
    samples = generator(prompt, max_new_tokens=16, strategy="speculative", do_sample=True, num_return_sequences=3)
    texts = [s["generated_text"] for s in samples]
    assert len(texts) == 3 and all(t.startswith(prompt) and len(t) > len(prompt) for t in texts)
    # The pipeline samples unless told otherwise (its own default); greedy speculative equals static.
    greedy = generator(prompt, max_new_tokens=32, do_sample=False)[0]["generated_text"]
    assert greedy == generator(prompt, max_new_tokens=32, do_sample=False, strategy="speculative")[0]["generated_text"]
    # min_p reaches generate() too: at 1 a sampled run keeps the most likely token alone, greedy's (at temperature 1:
    # the same confidences; the pipeline's sampled calls default to 0.7)
    sampled = generator(prompt, max_new_tokens=32, do_sample=True, temperature=1.0, min_p=1.0)
    assert sampled[0]["generated_text"] == greedy
    new_text = greedy[len(prompt):]
    stop = new_text[len(new_text) // 2 : len(new_text) // 2 + 2]  # stop strings need the tokenizer, as in transformers
    stopped = generator(prompt, max_new_tokens=32, do_sample=False, stop_strings=stop, tokenizer=generator.tokenizer)
    cut = stopped[0]["generated_text"]
    assert stop in cut[len(prompt):] and greedy.startswith(cut) and len(cut) < len(greedy)


def test_shipped_model_streams_its_completion_through_a_text_streamer(capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

    tok = AutoTokenizer.from_pretrained(SHIPPED_MODEL, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, trust_remote_code=True).eval()
    ids = tok("import os\n", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=40, strategy="speculative",
                         streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True))
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert text.strip() and capsys.readouterr().out == text + "\n"


def test_transformers_stop_string_criterion_stops_rows_where_stop_strings_do():
    """transformers' own StopStringCriteria (it reads the tail of input_ids each step) passed as stopping_criteria
    cuts a left-padded batch of the shipped model where stop_strings does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, StopStringCriteria

    tok = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, trust_remote_code=True).eval()
    batch = tok(["def add(a, b):\n", "import os\n"], return_tensors="pt", padding=True, padding_side="left")
    free = model.generate(**batch, max_new_tokens=32)
    new_text = tok.decode(free[0, batch.input_ids.shape[1]:])
    stop = new_text[len(new_text) // 2: len(new_text) // 2 + 2]
    common = dict(max_new_tokens=32, return_dict_in_generate=True)
    by_strings = model.generate(**batch, stop_strings=stop, tokenizer=tok, **common)
    by_criterion = model.generate(**batch, stopping_criteria=[StopStringCriteria(tok, [stop])], **common)
    assert torch.equal(by_criterion.sequences, by_strings.sequences)
    assert torch.equal(by_criterion.new_tokens, by_strings.new_tokens) and by_strings.new_tokens[0] < 32


def test_min_new_tokens_holds_a_line_end_back_on_the_shipped_model():
    """With its newline token as EOS, the shipped model ends each row of a left-padded batch at its first line end;
    ``min_new_tokens`` holds it back, so each row runs to a line end after the minimum (or to its last new token),
    none among its first new tokens, and speculative decoding gives static's tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, trust_remote_code=True).eval()
    batch = tok(["def add(a, b):\n", "import os\n"], return_tensors="pt", padding=True, padding_side="left")
    newline = tok.convert_tokens_to_ids(tok.tokenize("\n"))
    assert len(newline) == 1
    common = dict(max_new_tokens=40, eos_token_id=newline, pad_token_id=tok.pad_token_id,
                  return_dict_in_generate=True)
    free = model.generate(**batch, **common)
    assert (free.new_tokens < 12).all(), free.new_tokens  # a line ends early
    held = model.generate(**batch, min_new_tokens=12, strategy="static", **common)
    assert (held.new_tokens > 12).all(), held.new_tokens
    for row, n in zip(held.sequences[:, batch.input_ids.shape[1]:], held.new_tokens.tolist()):
        assert newline[0] not in row[:12].tolist() and (n == 40 or row[n - 1] == newline[0])
    speculative = model.generate(**batch, min_new_tokens=12, strategy="speculative", **common)
    assert torch.equal(speculative.sequences, held.sequences)


def test_an_evaluation_harness_style_call_scores_as_the_unbounded_run():
    """The call lm-eval-harness makes (max_length, pad_token_id, use_cache, do_sample=False and a stateful criterion
    per stop sequence that watches each row's decoded tail and says True, one bool for the batch, once every row
    holds it): decoding ends early, and each row's text up to the stop sequence is the unbounded run's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

    class UntilEveryRowHolds(StoppingCriteria):
        def __init__(self, text, prompt_width, rows):
            self.text, self.width, self.done = text, prompt_width, [False] * rows

        def __call__(self, input_ids, scores, **kwargs):
            tails = tok.batch_decode(input_ids[:, self.width:][:, -4:])
            self.done = [done or self.text in tail for done, tail in zip(self.done, tails)]
            return all(self.done)

    tok = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, trust_remote_code=True).eval()
    batch = tok(["def add(a, b):\n", "import os\n"], return_tensors="pt", padding=True, padding_side="left")
    width, stop = batch.input_ids.shape[1], "s"
    free = model.generate(**batch, max_new_tokens=48)
    out = model.generate(**batch, max_length=width + 48, pad_token_id=tok.pad_token_id, use_cache=True,
                         do_sample=False, return_dict_in_generate=True,
                         stopping_criteria=StoppingCriteriaList([UntilEveryRowHolds(stop, width, 2)]))
    assert (out.new_tokens < 48).all()
    for b in range(2):
        text, unbounded = (tok.decode(t[b, width:], skip_special_tokens=True) for t in (out.sequences, free))
        assert stop in text and text.split(stop)[0] == unbounded.split(stop)[0], b


def _run(args: list[str], timeout: int = 600) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout,
                            cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


@pytest.mark.slow
def test_mrp_generate_cli_runs_end_to_end():
    out = _run(["-m", "hf_integration.cli", "def add(a, b):", "--max-new-tokens", "8"])
    assert out.startswith("def add(a, b):") and "[speculative]" in out
    assert "custom code" not in out  # no trust prompt (it would wait for an answer in a terminal)
    stopped = _run(["-m", "hf_integration.cli", "def add(a, b):", "--max-new-tokens", "48", "--stop", "\n"])
    tokens = int(stopped.split("[speculative] ")[1].split(" new tokens")[0])
    assert tokens < 16 and "\n" in stopped[len("def add(a, b):"):]  # stopped in the first block, at a newline
    table = _run(["-m", "hf_integration.cli", "import os", "--max-new-tokens", "8", "--compare"])
    for strategy in ("static", "dynamic", "sequential", "entropy_bounded", "direct", "speculative", "remask"):
        assert strategy in table


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_mrp_generate_chat_sends_the_prompt_through_the_chat_template(tmp_path, monkeypatch, capsys):
    """--chat (and --system) render the prompt with the tokenizer's chat template, the assistant's turn
    opened; a tokenizer without one refuses --chat, and --system needs --chat."""
    from transformers import AutoTokenizer

    from hf_integration import cli

    chat_model = tmp_path / "chat"
    chat_model.mkdir()
    for f in SHIPPED_MODEL.iterdir():
        (chat_model / f.name).write_bytes(f.read_bytes())
    (chat_model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    seen = []
    run_one = cli.run_one
    monkeypatch.setattr(cli, "run_one", lambda model, ids, settings: seen.append(ids) or run_one(model, ids, settings))
    args = ["hello", "--model", str(chat_model), "--max-new-tokens", "4", "--strategy", "static"]
    assert cli.main([*args, "--chat", "--system", "be brief"]) == 0
    tok = AutoTokenizer.from_pretrained(chat_model)
    rendered = "<|system|>be brief\n<|user|>hello\n<|assistant|>"
    assert seen[0].tolist() == [tok(rendered, add_special_tokens=False).input_ids]
    out = capsys.readouterr()
    assert "<|assistant|>" not in out.out and "[static]" in out.err

    assert cli.main(args) == 0  # plain completion, with a hint that the model could chat
    assert seen[1].tolist() == [tok("hello").input_ids]
    out = capsys.readouterr()
    assert out.out.startswith("hello") and "--chat" in out.err
    with pytest.raises(SystemExit):
        cli.main(["hello", "--chat"])  # the shipped model's tokenizer has no chat template
    assert "has none" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["hello", "--system", "be brief"])
    assert "--system needs --chat" in capsys.readouterr().err


def test_mrp_generate_interactive_keeps_a_conversation_until_reset(tmp_path, monkeypatch, capsys):
    """--interactive --chat: each line is a user message of one conversation, which each reply joins as the
    assistant's turn (rendered by the chat template); /reset forgets it, /exit quits (later lines are never read),
    sampled turn t draws with seed --seed + t; without --chat each line is completed on its own."""
    import io

    from transformers import AutoTokenizer

    from hf_integration import cli

    chat_model = tmp_path / "chat"
    shutil.copytree(SHIPPED_MODEL, chat_model)
    (chat_model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(chat_model)
    calls = []
    run_one = cli.run_one

    def recorded(model, ids, settings):
        out, seconds = run_one(model, ids, settings)
        calls.append((ids.tolist()[0], settings["seed"], cli.completions(tok, out, ids.shape[1])[0]["completion"]))
        return out, seconds

    monkeypatch.setattr(cli, "run_one", recorded)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n\nagain\n/reset\nthird\n/exit\nnever read\n"))
    assert cli.main(["-i", "--chat", "--system", "be brief", "--model", str(chat_model), "--strategy", "static",
                     "--max-new-tokens", "8", "--do-sample", "--seed", "3"]) == 0
    first = calls[0][2]
    rendered = ["<|system|>be brief\n<|user|>hello\n<|assistant|>",
                f"<|system|>be brief\n<|user|>hello\n<|assistant|>{first}\n<|user|>again\n<|assistant|>",
                "<|system|>be brief\n<|user|>third\n<|assistant|>"]
    assert [ids for ids, _, _ in calls] == [tok(text, add_special_tokens=False).input_ids for text in rendered]
    assert [seed for _, seed, _ in calls] == [3, 4, 5]
    assert "(a new conversation)" in capsys.readouterr().err

    calls.clear()
    # a backslash at the end of a line goes on on the next; the end of input quits
    monkeypatch.setattr("sys.stdin", io.StringIO("def f(x):\nimport os\\\nimport re\n"))
    assert cli.main(["--interactive", "--strategy", "static", "--max-new-tokens", "8"]) == 0
    assert [ids for ids, _, _ in calls] == [tok("def f(x):").input_ids, tok("import os\nimport re").input_ids]
    out = capsys.readouterr()
    assert "def f(x):" + calls[0][2] in out.out and out.err.count("[static] ") == 2
    monkeypatch.setattr("sys.stdin", io.StringIO("def f(x):\n"))  # --show-steps: each reply's steps after it
    assert cli.main(["-i", "--strategy", "static", "--max-new-tokens", "4", "--show-steps"]) == 0
    steps = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(steps) >= 4 and steps == [f"step {k:>3}" for k in range(1, len(steps) + 1)]


def test_mrp_generate_interactive_refuses_a_message_it_cannot_decode_and_goes_on(monkeypatch, capsys):
    import io

    from hf_integration import cli

    monkeypatch.setattr(cli, "run_one", lambda *a: pytest.fail("decoded a refused prompt"))
    monkeypatch.setattr("sys.stdin", io.StringIO("b " * 40 + "\n/exit\n"))
    assert cli.main(["-i", "--strategy", "static", "--max-new-tokens", "2030"]) == 0
    assert "error: --strategy static: prompt + max_new_tokens need" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        cli.main(["def f():", "-i"])
    assert exit_.value.code == 2 and "--interactive reads its prompts from standard input" in capsys.readouterr().err


def test_mrp_generate_show_steps_lists_the_tokens_each_step_revealed(capsys):
    """--show-steps prints, after the completion, one line per decoding step with the places (among the new tokens),
    texts and probabilities of the tokens it revealed: with static decoding one token a step, every place once (the
    steps that revealed only the last block's positions past the last new token are not listed); with --compare it
    is refused."""
    from hf_integration import cli

    assert cli.main(["def f(x):", "--max-new-tokens", "8", "--strategy", "static", "--show-steps"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    steps = [int(line.split(":")[0].split()[1]) for line in lines]
    assert steps == list(range(1, len(lines) + 1))  # a step that kept nothing says so
    listed = [line for line in lines if "past the completion's end" not in line]
    places = [int(line.split(": ")[1].split(":")[0]) for line in listed]
    assert len(listed) == 8 and sorted(places) == list(range(8))
    probabilities = [float(line.rsplit("@", 1)[1]) for line in listed]
    assert all(0 < p <= 1 for p in probabilities), listed
    with pytest.raises(SystemExit):
        cli.main(["def f(x):", "--compare", "--show-steps"])
    assert "--show-steps lists one strategy's steps: drop --compare" in capsys.readouterr().err


def test_mrp_generate_on_a_model_without_an_mrp_head(tmp_path, capsys):
    """Without --strategy it decodes static (speculative needs the head it lacks), and --compare runs the four
    strategies that need none, printing the completions after the table."""
    from hf_integration import cli

    backbone = tmp_path / "backbone"
    shutil.copytree(SHIPPED_MODEL, backbone)
    config = json.loads((backbone / "config.json").read_text())
    (backbone / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    assert cli.main(["def f(x):", "--model", str(backbone), "--max-new-tokens", "4"]) == 0
    assert "[static] 4 new tokens" in capsys.readouterr().err
    assert cli.main(["def f(x):", "--model", str(backbone), "--max-new-tokens", "4", "--compare"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in table[1:5]] == ["static", "dynamic", "sequential", "entropy_bounded"]
    assert table[5] == "--- static's completion"
    assert not any(line.startswith(("direct", "speculative", "remask")) for line in table)


@pytest.mark.parametrize("args, message", [
    (["--model", "{tmp}/missing"], "--model: no folder '{tmp}/missing'"),
    (["--model", "owner/missing"], "--model: 'owner/missing' is neither a checkpoint folder nor a Hub repo"),
    (["--model", "{tmp}"], "--model: '{tmp}' is neither a checkpoint folder"),  # a folder without a checkpoint
    (["-K", "0"], "--strategy speculative: mrp_steps=0 must be >= 1"),
    (["--strategy", "dynamic", "--threshold", "1.5"], "--strategy dynamic: threshold=1.5 must be in (0, 1]"),
    (["--compare", "--top-p", "0"], "--strategy static: top_p=0.0 must be in (0, 1]"),
    (["--compare", "--strategy", "static"], "--compare runs every strategy: drop --strategy"),
    (["--strategy", "static", "--threshold", "0.5"],
     "--strategy static: threshold=0.5 steers strategy 'dynamic' or 'remask', not 'static': drop it"),
    (["--device", "cuda"], "--device cuda: this torch sees no CUDA GPU"),
    (["--max-new-tokens", "5000"], "--strategy speculative: prompt + max_new_tokens need 5008 positions"),
    (["--top-k", "5"], "--strategy speculative: top_k=5 steers sampling, which this call does not do"),
    (["--prompt-file", "{tmp}/missing.txt"], "--prompt-file: [Errno 2] No such file or directory"),
    (["--prompt-file", "{tmp}/binary.txt"], "--prompt-file: "),  # not text: a UnicodeDecodeError
    (["--model", "~/no-such-mrp-model"], "--model: no folder '~/no-such-mrp-model'"),  # a path, not a Hub repo
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--draft-vocab", "{tmp}/words.json"], "--strategy speculative: draft_vocab must be an int"),  # a TypeError
    (["--device", "gpu0"], "--device 'gpu0' is not a device (cpu, cuda, cuda:N)"),
    (["--device", "mps"], "--device mps: mrp-generate decodes on cpu or cuda"),
    (["--model", "{tmp}/gpt2"], "--model: '{tmp}/gpt2' could not be loaded as an SDAR checkpoint"),  # found, not SDAR
    (["--prompt-file", "{tmp}/words.json"], "--prompt-file holds the prompt: drop the prompt given on the command"),
])
def test_mrp_generate_refuses_bad_input_with_a_message_and_no_traceback(args, message, tmp_path, monkeypatch, capsys):
    """Bad options end mrp-generate with exit status 2 and one line naming the option, before anything is decoded."""
    from hf_integration import cli

    if "--device" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.setattr(cli, "run_one", lambda *a: pytest.fail("decoded despite bad input"))
    (tmp_path / "words.json").write_text('["def", "f"]')  # a JSON list, of words instead of token ids
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00def")
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 50}))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["def f():", *(a.format(tmp=tmp_path) for a in args)])
    err = capsys.readouterr().err  # after the weights' loading bar, if it got that far
    last = err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and last.startswith("mrp-generate: error: " + message.format(tmp=tmp_path)), err
    assert "Traceback" not in err


def test_mrp_generate_refuses_an_empty_prompt(monkeypatch, capsys):
    from hf_integration import cli

    monkeypatch.setattr(cli, "run_one", lambda *a: pytest.fail("decoded an empty prompt"))
    with pytest.raises(SystemExit) as exit_:
        cli.main([""])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "mrp-generate: error: the prompt: input_ids is empty" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("capability, hip, dtype", [((9, 0), None, "bfloat16"), ((8, 0), None, "bfloat16"),
                                                    ((7, 5), None, "float16"), ((9, 4), "6.4", "bfloat16")])
def test_mrp_generate_loads_a_gpu_model_in_bf16_where_it_has_bf16_units_else_in_fp16(capability, hip, dtype,
                                                                                      monkeypatch):
    """Without --dtype: bf16 on an H100 / A100 and an MI300, fp16 on a T4 (sm_75: bf16 only by conversion)."""
    from hf_integration import cli
    from mrp_triton import backend

    monkeypatch.setattr(backend, "_BEFORE_AMPERE", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    assert cli.default_dtype(torch.device("cuda:0")) == dtype
    assert cli.default_dtype(torch.device("cpu")) == "float32"


PROMPT_RECORDS = [{"id": 0, "prompt": "def parse_header(line):"}, {"id": 1, "text": "import os\n"},
                  {"id": 2, "prompt": "class Stack:\n    def push(self, item):", "answer": "kept"},
                  {"id": 3, "prompt": "x"}, {"id": 4, "text": "for i in range(10):\n"}]


@pytest.mark.parametrize("strategy", ["static", "speculative"])
def test_mrp_generate_prompts_completes_each_record_as_generate_does_alone(strategy, tmp_path, capsys):
    """--prompts: one JSON line a record, in the file's order (batches of --batch-size, the last one short), the
    record's own keys kept, its completion the one generate() gives the prompt alone (so padding and batch mates
    change nothing) with a stop string, its stats those of that call; then the totals (on standard error)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_integration import cli

    path = tmp_path / "prompts.jsonl"  # with a byte-order mark, CRLF line ends and a blank line
    path.write_text("\ufeff" + "\r\n".join(json.dumps(r) for r in PROMPT_RECORDS[:2]) + "\r\n\r\n"
                    + "\r\n".join(json.dumps(r) for r in PROMPT_RECORDS[2:]) + "\r\n", encoding="utf-8", newline="")
    out = tmp_path / "out.jsonl"
    assert cli.main(["--prompts", str(path), "--output", str(out), "--batch-size", "2", "--strategy", strategy,
                     "--max-new-tokens", "24", "--stop", "\n\n"]) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, trust_remote_code=True)
    assert [{k: v for k, v in r.items() if k not in cli.OUTPUT_KEYS} for r in results] == PROMPT_RECORDS
    for record, result in zip(PROMPT_RECORDS, results):
        ids = tokenizer(record.get("prompt", record.get("text")), return_tensors="pt").input_ids
        alone = model.generate(ids, strategy=strategy, max_new_tokens=24, stop_strings=["\n\n"], tokenizer=tokenizer,
                               return_dict_in_generate=True)
        kept = int(alone.new_tokens[0])
        stats = alone.stats.as_dict()
        assert result["completion"] == tokenizer.decode(alone.sequences[0, ids.shape[1]:][:kept])
        assert result["stats"] == {"new_tokens": kept, "tokens_decoded": stats["tokens_committed"][0],
                                   "backbone_forwards": stats["backbone_forwards"][0],
                                   "mrp_forwards": stats["mrp_forwards"][0],
                                   "tokens_per_forward": stats["tokens_per_forward"][0]}
    err = capsys.readouterr().err
    assert "2/5 prompts" in err and "4/5 prompts" in err and "5/5 prompts" in err
    assert f"[{strategy}] {sum(r['stats']['new_tokens'] for r in results)} new tokens" in err
    assert f"{sum(r['stats']['backbone_forwards'] for r in results)} backbone forwards, " in err
    assert " for 5 prompts (" in err

    assert cli.main(["--prompts", str(path), "--strategy", strategy, "--max-new-tokens", "24", "--stop", "\n\n"]) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == results  # to standard output


def test_mrp_generate_prompts_samples_each_record_with_its_own_seed(tmp_path, monkeypatch):
    """Sampled record r draws with seed --seed + r (modulo 2**64; a seed per prompt of each batch): a prompt repeated
    across records gets fresh samples, and a record's samples do not depend on --batch-size. With
    --num-return-sequences N each record gets N lines, numbered by "sample", each one of generate()'s N copies of the
    prompt (batches of --batch-size prompts, N rows each)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_integration import cli

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "def f(x):"}\n' * 5)
    seeds = []
    run_one = cli.run_one
    monkeypatch.setattr(cli, "run_one", lambda model, ids, settings: seeds.append((settings["seed"], ids.shape[0]))
                        or run_one(model, ids, settings))
    completions = []
    for size in ("2", "3"):
        assert cli.main(["--prompts", str(path), "--output", str(tmp_path / "o.jsonl"), "--batch-size", size,
                         "--do-sample", "--seed", "7", "--max-new-tokens", "8"]) == 0
        completions.append([json.loads(line)["completion"] for line in (tmp_path / "o.jsonl").read_text().splitlines()])
    assert seeds == [([7, 8], 2), ([9, 10], 2), ([11], 1), ([7, 8, 9], 3), ([10, 11], 2)]
    assert completions[0] == completions[1] and len(set(completions[0])) > 1
    seeds.clear()  # past the last seed generate() takes, the records' seeds go on from 0 (a ValueError mid-file before)
    assert cli.main(["--prompts", str(path), "--output", str(tmp_path / "o.jsonl"), "--batch-size", "5",
                     "--do-sample", "--seed", str(2**64 - 2), "--max-new-tokens", "2"]) == 0
    assert seeds == [([2**64 - 2, 2**64 - 1, 0, 1, 2], 5)]

    path.write_text('{"id": "a", "prompt": "def f(x):"}\n{"id": "b", "text": "import os"}\n')
    assert cli.main(["--prompts", str(path), "--output", str(tmp_path / "o.jsonl"), "--batch-size", "2",
                     "--do-sample", "--seed", "3", "--max-new-tokens", "6", "--num-return-sequences", "3"]) == 0
    results = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [(r["id"], r["sample"]) for r in results] == [(i, k) for i in "ab" for k in range(3)]
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, trust_remote_code=True)
    ids, mask = cli.left_padded([tokenizer("def f(x):").input_ids, tokenizer("import os").input_ids], "cpu")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, strategy="speculative", do_sample=True,
                         seed=[3, 4], num_return_sequences=3, return_dict_in_generate=True)
    expected = cli.completions(tokenizer, out, ids.shape[1])
    assert [r["completion"] for r in results] == [c["completion"] for c in expected]


@pytest.mark.parametrize("args, records, message", [
    (["def f():", "--prompts", "{file}"], None, "--prompts reads every prompt from its file: drop the prompt"),
    (["def f():", "--output", "{tmp}/o.jsonl"], None, "--output, --batch-size and --num-return-sequences go with"),
    (["--prompts", "{file}", "--batch-size", "0"], None, "--batch-size must be >= 1, got 0"),
    (["def f():", "--num-return-sequences", "2"], None, "--output, --batch-size and --num-return-sequences go with"),
    (["--prompts", "{file}", "--num-return-sequences", "2"], None,
     "--strategy speculative: num_return_sequences=2 without sampling gives identical copies"),  # not a record's
    (["--prompts", "{file}", "--compare"], None, "--prompts writes one strategy's completions: drop --compare"),
    (["--prompts", "{tmp}/missing.jsonl"], None, "--prompts: [Errno 2] No such file or directory"),
    (["--prompts", "{file}"], [], "--prompts {file}: no prompts"),
    (["--prompts", "{file}"], [{"prompt": "a"}, {"prompt": "b", "completion": "mine"}],
     "--prompts {file}:2: the record holds 'completion', which the output writes: rename it"),
    (["--prompts", "{file}", "--max-new-tokens", "2030"], [{"prompt": "a"}, {"prompt": "b " * 40}],
     "--prompts {file}:2: --strategy speculative: prompt + max_new_tokens need"),
    (["--prompts", "{file}"], [{"prompt": "a"}, {"prompt": "b <|MASK|>"}], "--prompts {file}:2: the prompt: input_ids "
     "contain the mask token"),
    (["--prompts", "{file}", "--do-sample", "--num-return-sequences", "0"], None,
     "--num-return-sequences must be >= 1, got 0"),
    (["--prompts", "{file}", "--output", "{tmp}/no/o.jsonl"], None,
     "--output {tmp}/no/o.jsonl: not a file in an existing folder"),
    (["--prompts", "{file}"], [{"prompt": "a"}, {"messages": [{"role": "user", "content": "hi"}]}],
     "--prompts {file}:2: a 'messages' record goes through the tokenizer's chat template, and "),
    (["--prompts", "{file}"], [{"messages": [{"role": "assistant", "content": "only"}]}],
     "--prompts {file}:1: the conversation holds only the reference answer"),
])
def test_mrp_generate_prompts_refuses_bad_input_naming_the_option_and_line(args, records, message, tmp_path,
                                                                            monkeypatch, capsys):
    """Every record is read and checked before anything is decoded; a bad one is named by its line."""
    from hf_integration import cli

    monkeypatch.setattr(cli, "run_one", lambda *a: pytest.fail("decoded despite bad input"))
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ([{"prompt": "a"}] if records is None else records)))
    with pytest.raises(SystemExit) as exit_:
        cli.main([a.format(tmp=tmp_path, file=path) for a in args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.strip().splitlines()[-1].startswith(
        "mrp-generate: error: " + message.format(tmp=tmp_path, file=path)), err
    assert "Traceback" not in err


@pytest.mark.parametrize("options, expected", [
    ([], dict(dynamic=dict(threshold=0.7), direct=dict(mrp_steps=2), speculative=dict(mrp_steps=3),
              remask=dict(threshold=0.5))),
    (["--threshold", "0.6", "-K", "4", "--draft-candidates", "8", "--remask-rule", "delta", "--denoising-steps", "8",
      "--entropy-bound", "0.5"],
     dict(static=dict(denoising_steps=8), dynamic=dict(threshold=0.6, denoising_steps=8),
          sequential=dict(denoising_steps=8), entropy_bounded=dict(entropy_bound=0.5, denoising_steps=8),
          direct=dict(mrp_steps=4),
          speculative=dict(mrp_steps=4, draft_candidates=8),
          remask=dict(threshold=0.6, remask_rule="delta", denoising_steps=8))),
])
def test_mrp_generate_compare_gives_each_strategy_the_options_it_reads(options, expected):
    """--compare runs every strategy with the options given (its own defaults where none is), each strategy with
    only the options it reads, so generate() accepts every run."""
    from hf_integration import cli
    from hf_integration.generation_settings import READ_BY

    args = cli.build_parser().parse_args(["def f():", "--compare", *options])
    runs = cli.compare_settings(cli.generate_settings(args, tokenizer=None))
    assert [r["strategy"] for r in runs] == [s for s, _ in cli.COMPARE]
    for run in runs:
        read = {k: v for k, v in run.items() if k in READ_BY and v is not None}
        assert read == expected.get(run["strategy"], {}), run["strategy"]
    cli.check_settings(tiny_model(seed=0, block_size=8), torch.zeros(1, 4, dtype=torch.long), runs)


def test_mrp_generate_passes_each_option_to_generate_as_its_keyword():
    """Every option reaches generate() as the keyword it names (a swapped or dropped mapping would decode with
    another setting and still run); left out, they pass None (generate()'s default), --max-new-tokens and
    --temperature generate()'s own defaults, --seed 0 (a sampled run repeats), and no tokenizer without --stop."""
    from hf_integration import cli
    from hf_integration.generation_settings import DEFAULT_MAX_NEW_TOKENS, GenerationSettings

    tokenizer = object()
    given = dict(max_new_tokens=300, min_new_tokens=3, block_length=8, denoising_steps=2, threshold=0.6,
                 entropy_bound=0.25, mrp_steps=4,
                 draft_schedule="authors", draft_vocab=20, draft_candidates=5, remask_rule="delta", residual_delta=0.25,
                 repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=-0.25,
                 do_sample=True, temperature=0.7, top_h=0.9, top_k=9, top_p=0.8, min_p=0.05, typical_p=0.95,
                 epsilon_cutoff=3e-4,
                 eta_cutoff=2e-3, seed=11, max_time=2.5, prefill_chunk_size=64)
    options = [part for name, value in given.items() if name != "do_sample"
               for part in (f"--{name.replace('_', '-')}", str(value))]
    args = cli.build_parser().parse_args(["def f():", *options, "--do-sample", "--stop", "x", "--stop", "y"])
    assert cli.generate_settings(args, tokenizer) == dict(given, progress=True, stop_strings=["x", "y"],
                                                          tokenizer=tokenizer)  # a bar for 256 tokens or more
    plain = cli.generate_settings(cli.build_parser().parse_args(["def f():"]), tokenizer)
    defaults = dict(max_new_tokens=DEFAULT_MAX_NEW_TOKENS, do_sample=False,
                    temperature=GenerationSettings().temperature, seed=0, progress=False, tokenizer=None)
    assert plain == {**{name: None for name in plain}, **defaults}


def test_mrp_generate_compare_table_counts_kept_tokens_and_compares_with_the_first_run():
    """--compare's table: each run's tokens are the new tokens its completion keeps (a stop string cut them: not
    the decoded width), and each run is compared with the first one (a run equal to it agrees 100% and prints no
    completion of its own, even after a run that differs)."""
    from hf_integration import cli

    model, tokenizer = tiny_model(seed=0), LetterTokenizer()
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    free = model.generate(ids, max_new_tokens=12, eos_token_id=[])[0, 5:].tolist()
    common = dict(max_new_tokens=12, eos_token_id=[], stop_strings=[tokenizer.decode(free[6:8])], tokenizer=tokenizer)
    runs = [dict(strategy="static", **common), dict(strategy="dynamic", threshold=0.05, **common),
            dict(strategy="static", **common)]
    outs = [model.generate(ids, return_dict_in_generate=True, **run) for run in runs]
    kept = [int(out.new_tokens[0]) for out in outs]
    assert kept[0] < 12 and not torch.equal(outs[1].sequences, outs[0].sequences)  # a cut, and a run that differs
    lines = cli.compare_table(model, tokenizer, ids, runs).splitlines()
    assert [int(row.split()[1]) for row in lines[1:4]] == kept, lines
    assert lines[3].split()[-1] == "100%" != lines[2].split()[-1], lines
    completions = [line for line in lines[4:] if line.startswith("--- ")]
    assert completions == ["--- static's completion", "--- dynamic's completion (differs from static)"], lines
    assert lines[5] == tokenizer.decode(free[:kept[0]]), lines


def _tiny_checkpoint(folder: Path, files=("tokenizer.json", "tokenizer_config.json", "stdlib_manifest.json")) -> Path:
    """A tiny random SDAR+MRP checkpoint with the shipped model's vocabulary and ``files`` of the shipped folder."""
    from hf_integration import SDARMRPConfig, SDARMRPForCausalLM

    shipped = json.loads((SHIPPED_MODEL / "config.json").read_text())
    config = SDARMRPConfig(vocab_size=shipped["vocab_size"], hidden_size=32, intermediate_size=48,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           block_size=4, mask_token_id=shipped["mask_token_id"], num_nextn_predict_layers=1,
                           eos_token_id=shipped.get("eos_token_id"), max_position_embeddings=1024)
    torch.manual_seed(0)
    SDARMRPForCausalLM(config).save_pretrained(folder)
    for name in files:
        (folder / name).write_bytes((SHIPPED_MODEL / name).read_bytes())
    return folder


@pytest.mark.slow
def test_e2e_benchmark_smoke_on_a_tiny_random_model(tmp_path):
    """The benchmark script runs on a tiny random model (with the shipped tokenizer and manifest)."""
    model_dir = _tiny_checkpoint(tmp_path / "tiny")
    out = _run(["benchmarks/bench_e2e.py", "--model", str(model_dir), "--prompts", "3", "--max-new-tokens", "8",
                "--modes", "static", "speculative K=2 mrp", "remask tau tau=0.5", "--out", str(tmp_path / "res")])
    assert "speculative K=2 mrp" in out
    rows = json.loads((tmp_path / "res" / "e2e_cpu.json").read_text())["rows"]
    spec = next(r for r in rows if r["mode"] == "speculative K=2 mrp")
    assert spec["identical_to_static"] == 1.0 and spec["tpf"] >= 1.0
    assert 0 < spec["verify_rounds"] == sum(spec["accepted_lengths"]) < spec["backbone_forwards"]  # + openings
    static = next(r for r in rows if r["mode"] == "static")
    assert static["verify_rounds"] == 0
    # lossless: the same completions, so the same output tokens, whatever either committed past an EOS
    assert spec["output_tokens"] == static["output_tokens"] <= min(spec["tokens"], static["tokens"])
    assert (tmp_path / "res" / "e2e_cpu.png").exists() and (tmp_path / "res" / "e2e_cpu.md").exists()


@pytest.mark.slow
def test_e2e_benchmark_runs_your_own_prompts_through_the_chat_template(tmp_path):
    """``--prompt-file`` with ``--chat``: a prompt record goes through the template as a user message after the
    --system message, a conversation keeps its own system message and loses its reference answer, a text record is
    read as it is; every completion is saved; without the manifest the most-frequent-ids modes are left out, and
    the code-parsing columns are absent."""
    from transformers import AutoTokenizer

    from training.tokenizer import CHAT_TEMPLATE

    model_dir = _tiny_checkpoint(tmp_path / "tiny", files=("tokenizer.json", "tokenizer_config.json"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    records = [{"prompt": "def mean(values):", "answer": "ignored"},
               {"messages": [{"role": "system", "content": "answer in code"}, {"role": "user", "content": "sort"},
                             {"role": "assistant", "content": "REFERENCE"}]},
               {"text": "import os\n"}]
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("\n".join(json.dumps(r) for r in records[:2]) + "\n\n" + json.dumps(records[2]) + "\n")
    out = _run(["benchmarks/bench_e2e.py", "--model", str(model_dir), "--prompt-file", str(prompt_file), "--chat",
                "--system", "be brief", "--max-new-tokens", "8", "--modes", "static", "speculative K=2 mrp",
                "most frequent", "--out", str(tmp_path / "res"), "--tag", "mine"])
    assert "left out the 'most frequent ids' modes" in out and "parses" not in out
    result = json.loads((tmp_path / "res" / "mine.json").read_text())
    modes = [r["mode"] for r in result["rows"]]
    assert modes == ["static", "speculative K=2 mrp"]  # "most frequent" selected two modes, both left out
    assert all(r["parses"] is None for r in result["rows"])
    assert "parses" not in (tmp_path / "res" / "mine.md").read_text()
    assert result["rows"][1]["identical_to_static"] == 1.0 and result["meta"]["prompts"] == 3
    saved = [json.loads(line) for line in (tmp_path / "res" / "mine_completions.jsonl").read_text().splitlines()]
    assert [(r["mode"], r["prompt_index"]) for r in saved] == [(m, i) for m in modes for i in range(3)]
    prompts = [r["prompt"] for r in saved[:3]]
    assert prompts[0] == "<|system|>\nbe brief\n<|user|>\ndef mean(values):\n<|assistant|>\n"
    assert prompts[1] == "<|system|>\nanswer in code\n<|user|>\nsort\n<|assistant|>\n"
    assert prompts[2] == "import os\n"


@pytest.mark.parametrize("line, error", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"question": "why"}', "a record needs a 'prompt' or 'text' string or a 'messages' list (got keys ['question'])"),
    ('{"messages": [{"role": "user"}]}', "'messages' must be a non-empty list"),
    ('{"text": ""}', "the prompt is empty"),
])
def test_a_bad_prompt_record_is_named_by_its_file_and_line(tmp_path, line, error):
    """mrp-generate --prompts and bench_e2e.py --prompt-file read prompt files with read_prompt_records."""
    from transformers import AutoTokenizer

    from hf_integration.cli_prompts import read_prompt_records

    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "x = 1"}\n' + line + "\n")
    with pytest.raises(UsageError, match=re.escape(f"--prompts {path}:2: {error}")):
        read_prompt_records(path, tokenizer, chat=False, system=None, model="m", option="--prompts")
    path.write_text('{"prompt": "x = 1"}\n')
    with pytest.raises(UsageError, match="--chat needs a tokenizer with a chat template"):
        read_prompt_records(path, tokenizer, chat=True, system=None, model="m")


def test_line_completion_benchmark_ends_rows_with_their_line(tmp_path):
    """The shipped model completes each cut line; speculative gives static's completions, and a static row alone
    stops at the step that commits its line's end (on a CPU model the host checks after every step): each step a
    forward doing work. With steps replayed as on a GPU (--replayed) the completions and forwards are the same, and a
    row runs at most one step past the one that settles it."""
    for replayed in ([], ["--replayed"]):
        _run(["benchmarks/line_completion.py", "--prompts", "3", "--max-new-tokens", "16", "--out", str(tmp_path),
              *replayed])
    plain, replayed = ({r["mode"]: r for r in json.loads((tmp_path / f"line_completion_cpu{suffix}.json").read_text())
                        ["rows"]} for suffix in ("", "_replayed"))
    assert set(plain) == {"static", "dynamic tau=0.9", "speculative K=3", "remask tau=0.9"}
    assert plain["speculative K=3"]["completions_md5"] == plain["static"]["completions_md5"]
    assert plain["static"]["batch_steps"] == plain["static"]["backbone_forwards"] > 0
    for mode, row in plain.items():
        assert {k: v for k, v in replayed[mode].items() if k != "batch_steps"} == \
            {k: v for k, v in row.items() if k != "batch_steps"}, mode
        assert row["batch_steps"] <= replayed[mode]["batch_steps"] <= row["batch_steps"] + 3, mode
