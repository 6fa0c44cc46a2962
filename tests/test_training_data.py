import json
import os

import pytest

from training_fixtures import make_tokenizer, write_corpus


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("corpus")))


def test_formats_and_flags(tok, corpus):
    from training.data import read_records, record_to_segments, tokenize_documents

    for kind in ("text", "plain"):
        recs = read_records([corpus[kind]])
        ids, flags = tokenize_documents([record_to_segments(r, tok) for r in recs], tok, tok.eos_token_id)
        assert not any(flags), "plain text has no prompt tokens"
        assert ids.count(tok.eos_token_id) == len(recs)
        assert ids[-1] == tok.eos_token_id
    assert len(read_records([corpus["plain"]])) == 1  # a text file is one document

    recs = read_records([corpus["pairs"]])
    segs = record_to_segments(recs[0], tok)
    assert [f for _, f in segs] == [True, False]
    ids, flags = tokenize_documents([segs], tok, tok.eos_token_id)
    n_prompt = len(tok(segs[0][0], add_special_tokens=False)["input_ids"])
    assert flags == [True] * n_prompt + [False] * (len(ids) - n_prompt)
    assert tok.decode(ids[n_prompt:-1]) == recs[0]["response"] + "\n"  # a user and an assistant turn

    recs = read_records([corpus["chat"]])
    segs = record_to_segments(recs[0], tok)
    answers = "".join(t for t, f in segs if not f)
    msgs = recs[0]["messages"]
    assert msgs[2]["content"] in answers and msgs[4]["content"] in answers
    assert "be brief" not in answers and "again" not in answers
    prompts = "".join(t for t, f in segs if f)
    assert "be brief" in prompts and "again" in prompts


def test_pack_multiple_of_block_and_padding(tok, corpus):
    from training.data import build_datasets

    train, held = build_datasets([corpus["pairs"], corpus["text"]], tok, seq_len=16, block_size=4,
                                 heldout_fraction=0.1)
    assert train.input_ids.shape[1] == 16 and train.input_ids.shape == train.is_prompt.shape
    assert len(held) > 0
    # the tail is padded with pad flagged as prompt (never masked / scored)
    assert (~train.is_prompt).any() and train.is_prompt.any()
    from training.data import pack

    ds = pack([5, 6, 7, 8, 9], [True, False, False, False, False], seq_len=4, pad_id=0)
    assert ds.input_ids.tolist() == [[5, 6, 7, 8], [9, 0, 0, 0]]
    assert ds.is_prompt.tolist() == [[True, False, False, False], [False, True, True, True]]


def test_split_is_by_content_whatever_the_order_or_the_other_documents(corpus):
    """A backbone run and a later MRP run on the same documents hold out the same ones (in another file order, with
    documents added, with another --seed: the split takes none), and copies of a document fall on the same side."""
    from training.data import read_records, split_records

    recs = read_records([corpus["text"]]) + [{"text": f"document {i}"} for i in range(200)]
    tr, he = split_records(recs, 0.2)
    assert 0 < len(he) < len(recs) and len(tr) + len(he) == len(recs)
    assert abs(len(he) - 0.2 * len(recs)) < 0.1 * len(recs)
    assert not {r["text"] for r in tr} & {r["text"] for r in he}
    held = {r["text"] for r in he}
    tr2, he2 = split_records(list(reversed(recs)) + [{"text": "new"}, dict(recs[0], source="elsewhere")], 0.2)
    assert held <= {r["text"] for r in he2} and not held & {r["text"] for r in tr2}  # recs[0]'s copy with it
    assert held <= {r["text"] for r in split_records(recs, 0.3)[1]}  # a larger fraction holds out a superset
    pair = {"prompt": "p", "response": "r"}
    assert split_records([pair, dict(pair, id=7)] * 3 + recs, 0.5)[1].count(pair) in (0, 3)


def test_chats_split_by_their_messages_and_the_forced_picks_are_the_extreme_draws():
    from training.data import hash_draw, record_key, split_by_hash, split_records

    chats = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
             for i in range(200)]
    assert 20 <= len(split_records(chats, 0.2)[1]) <= 60
    items = [f"item {i}" for i in range(8)]
    draws = [hash_draw(x) for x in items]
    assert max(draws) < 0.99 and min(draws) > 1e-9
    assert split_by_hash(items, 1e-9)[1] == [items[draws.index(min(draws))]]  # nothing below: the lowest goes
    assert split_by_hash(items, 0.99)[0] == [items[draws.index(max(draws))]]  # all below: the highest stays
    # the forced picks take an item's copies with it
    low, high = items[draws.index(min(draws))], items[draws.index(max(draws))]
    assert split_by_hash([low, *items, low], 1e-9)[1] == [low] * 3
    assert split_by_hash([high, *items, high], 0.99)[0] == [high] * 3
    assert split_by_hash([low, low], 0.5) == ([low, low], [])  # copies of one item: all kept
    assert record_key(chats[0]) != record_key(chats[1])


def test_bad_inputs(tmp_path, tok):
    from training.config import ConfigError
    from training.data import build_datasets, read_records

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"foo": 1}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2"):
        read_records([str(bad)])
    bad.write_text("{not json\n")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_records([str(bad)])
    with pytest.raises(ConfigError, match="--data"):
        read_records([str(tmp_path / "missing.txt")])
    bad.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')  # latin-1
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not UTF-8 .*at byte 13"):
        read_records([str(bad)])
    bad.write_bytes(b'\xef\xbb\xbf{"text": "caf\xc3\xa9"}\n')  # UTF-8 with a byte-order mark, as some editors write
    assert read_records([str(bad)]) == [{"text": "caf\u00e9"}]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="--data.*empty"):
        build_datasets([str(empty)], tok, 16, 4)
    questions = tmp_path / "questions.jsonl"  # conversations without answers: nothing to learn
    questions.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n' * 3)
    with pytest.raises(ConfigError, match="no answer tokens"):
        build_datasets([str(questions)], tok, 16, 4, heldout_fraction=0.0)
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"text": "hello"}\n')
    with pytest.raises(ConfigError, match="--seq-len.*--block-size"):
        build_datasets([str(ok)], tok, 10, 4)


def test_stdlib_corpus(tmp_path):
    from training.stdlib_corpus import build_manifest, collect_stdlib_files, split_files, write_manifest, load_manifest

    files = collect_stdlib_files()
    assert "os.py" in files and "json/decoder.py" in files
    for f in files:
        parts = f.split("/")
        assert f.endswith(".py")
        assert not {"test", "tests", "idlelib", "__pycache__", "site-packages"} & set(parts), f
        assert not parts[-1].startswith("test_")
    tr, he = split_files(files, 0.05, seed=0)
    assert (tr, he) == split_files(list(reversed(files)), 0.05, seed=0)  # order-independent
    assert not set(tr) & set(he) and sorted(tr + he) == sorted(files)
    assert 0 < len(he) < 0.15 * len(files)
    # adding a file does not move any other file between the splits
    tr2, he2 = split_files(files + ["zzz_new.py"], 0.05, seed=0)
    assert set(he2) - {"zzz_new.py"} == set(he)
    m = build_manifest(0.05, seed=0)
    p = str(tmp_path / "m.json")
    write_manifest(p, m)
    m2 = load_manifest(p)
    assert m2["heldout"] and m2["train"] and not set(m2["train"]) & set(m2["heldout"])
    assert all(not os.path.isabs(f) for f in m2["train"])


def test_stdlib_files_leave_out_tests_and_other_files_and_a_tiny_list_holds_one_out(tmp_path):
    from training.stdlib_corpus import collect_stdlib_files, split_files

    for rel in ("a.py", "test_a.py", "a_test.py", "notes.txt", "sub/c.py", "tests/b.py", "test_pkg/d.py", ".git/e.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    assert collect_stdlib_files(str(tmp_path)) == ["a.py", "sub/c.py"]
    for files in (["a.py", "b.py"], ["a.py", "b.py", "c.py"]):  # a fraction too small for a file still holds one out
        train, held = split_files(files, 1e-9, seed=0)
        assert len(held) == 1 and sorted(train + held) == files


def test_a_manifest_leaves_out_empty_and_non_utf8_files(tmp_path):
    from training.stdlib_corpus import build_manifest, manifest_records

    files = {"a.py": b"x = 1\n", "b.py": b"y = 2\n", "blank.py": b"\n  \n", "latin1.py": b"x = '\xe9'\n"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    manifest = build_manifest(0.5, seed=0, root=str(tmp_path))
    assert sorted(manifest["train"] + manifest["heldout"]) == ["a.py", "b.py"]
    # --heldout-fraction 0 holds out none: a manifest with no held-out file reads (its train files only)
    assert manifest_records(build_manifest(0.0, seed=0, root=str(tmp_path))) == ([{"text": "x = 1\n"},
                                                                                  {"text": "y = 2\n"}], [])


def test_a_manifest_from_another_machine_reads_this_pythons_files_of_its_names(tmp_path, capsys):
    """The shipped model's manifest records this machine's stdlib folder; elsewhere (another Python) the files of the
    same names are read from the running Python's, those it lacks left out with a note, and a split left empty is a
    ConfigError naming the fix."""
    from training.config import ConfigError
    from training.stdlib_corpus import manifest_records, stdlib_root

    manifest = {"python_version": "3.0.1", "stdlib_root": str(tmp_path / "gone"),
                "train": ["os.py", "no_such_module.py", "json"], "heldout": ["json/decoder.py"]}  # json: a folder
    train, held = manifest_records(manifest)
    with open(os.path.join(stdlib_root(), "os.py"), encoding="utf-8") as f:
        assert train == [{"text": f.read()}]
    assert len(held) == 1 and "class JSONDecoder" in held[0]["text"]
    err = capsys.readouterr().err
    assert f"recorded at {tmp_path / 'gone'} (Python 3.0.1)" in err and stdlib_root() in err
    assert "2 of the stdlib manifest's 4 files are not in" in err and "no_such_module.py, json" in err
    (tmp_path / "here").mkdir()  # the recorded folder exists but holds none of the held-out files
    (tmp_path / "here" / "os.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match="none of the stdlib manifest's heldout files is in .*--stdlib-manifest"):
        manifest_records({**manifest, "stdlib_root": str(tmp_path / "here")})


def test_chat_template_is_used_when_present(tok, corpus):
    import copy

    from training.data import read_records, record_to_segments

    t = copy.deepcopy(tok)
    t.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                       "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    rec = read_records([corpus["chat"]])[0]
    segs = record_to_segments(rec, t)
    full = t.apply_chat_template(rec["messages"], tokenize=False)
    assert "".join(s for s, _ in segs) == full
    answers = [s for s, f in segs if not f]
    assert answers == [rec["messages"][2]["content"] + "<|im_end|>\n", rec["messages"][4]["content"] + "<|im_end|>\n"]
    assert all(s.endswith("<|im_start|>assistant\n") for s, f in segs if f)


def test_a_tokenizer_trained_here_renders_chats_as_training_lays_them_out(tok, tmp_path):
    """Training lays out a conversation with CHAT_TEMPLATE when the tokenizer has no template, and a tokenizer trained
    here carries it (saved and loaded with it): its apply_chat_template, generation prompt included, gives the text
    training read before each answer, so a chat prompt at inference (mrp-generate --chat) looks as in training."""
    import copy

    from transformers import AutoTokenizer

    from training.data import record_to_segments
    from training.tokenizer import CHAT_TEMPLATE

    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.chat_template == loaded.chat_template == CHAT_TEMPLATE
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"},
            {"role": "assistant", "content": "bye"}]
    segs = record_to_segments({"messages": msgs}, loaded)
    assert segs == record_to_segments({"messages": msgs}, bare) == record_to_segments({"messages": msgs}, None)
    assert segs == [("<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n", True), ("hello\n", False),
                    ("<|user|>\nand?\n<|assistant|>\n", True), ("bye\n", False)]
    for turn in (2, 4):  # the prompt of each answer is the template's generation prompt for the turns before it
        prompt = loaded.apply_chat_template(msgs[:turn], tokenize=False, add_generation_prompt=True)
        assert prompt == "".join(t for t, _ in segs[:turn - 1])
    assert record_to_segments({"prompt": "p", "response": "r"}, loaded) == [("<|user|>\np\n<|assistant|>\n", True),
                                                                            ("r\n", False)]


def test_a_template_that_rewrites_history_trains_the_last_answer_and_one_that_moves_the_answer_is_refused(tok):
    """A template that renders earlier assistant turns differently once the conversation goes on (as Qwen3's drops
    their reasoning) is not a prefix of itself: training then takes the last answer only, after the history as the
    template renders it for that turn. A template whose conversation does not start with its generation prompt
    leaves no way to find the answer: a ConfigError, not another layout."""
    import copy

    from training.config import ConfigError
    from training.data import record_to_segments

    msgs = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]
    t = copy.deepcopy(tok)
    # the last assistant turn in full, earlier ones shortened to "..."
    t.chat_template = ("{% for m in messages %}[{{ m['role'] }}]{% if m['role'] == 'assistant' and not loop.last %}..."
                       "{% else %}{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}[assistant]"
                       "{% endif %}")
    assert record_to_segments({"messages": msgs}, t) == [("[user]u1[assistant]...[user]u2[assistant]", True),
                                                         ("a2", False)]
    t.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    with pytest.raises(ConfigError, match="chat template does not render a conversation up to an assistant turn"):
        record_to_segments({"messages": msgs}, t)


def test_a_conversation_without_answers_is_prompt_and_an_empty_document_is_skipped(tok):
    from training.data import record_to_segments, tokenize_documents

    assert record_to_segments({"messages": [{"role": "user", "content": "hi"}]}, tok) == [("<|user|>\nhi\n", True)]
    docs = [record_to_segments(r, tok) for r in ({"text": "ab"}, {"text": ""}, {"messages": []}, {"text": "cd"})]
    ids, flags = tokenize_documents(docs, tok, tok.eos_token_id)
    assert ids.count(tok.eos_token_id) == 2 and not any(flags)  # two documents, each ended by EOS


def test_split_keeps_a_training_document_and_directories_skip_dotfiles(tmp_path):
    from training.data import iter_files, split_records

    assert split_records([{"text": "a"}, {"text": "b"}], 0.99)[0] != []  # at least one document to train on
    assert len(split_records([{"text": "a"}, {"text": "b"}], 1e-9)[1]) == 1  # and one held out
    assert [len(part) for part in split_records([{"text": "a"}], 0.5)] == [1, 0]
    for folder in ("sub", ".git", ".git/objects"):
        (tmp_path / folder).mkdir()
    for name in ("a.txt", ".hidden", "sub/b.txt", "sub/.swp", ".git/HEAD", ".git/objects/ab"):
        (tmp_path / name).write_text("x")
    assert iter_files([str(tmp_path)]) == [str(tmp_path / "a.txt"), str(tmp_path / "sub" / "b.txt")]


def test_special_tokens_text_in_documents_stays_text_and_conversations_may_not_hold_the_mask(tok, tmp_path):
    """A document's "<|MASK|>" or "<|endoftext|>" is characters (else training would teach the model to predict the
    mask token, which decoding must never commit); a conversation's specials are its template's markup, where the
    mask token is refused; so is a conversation that opens with an assistant turn (no prompt to render)."""
    from training.config import ConfigError
    from training.data import build_datasets, read_records, tokenize_documents
    from training.draft_vocab import token_counts

    text = "the cat <|MASK|> sat <|endoftext|> on the mat " * 4
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": text}) + "\n")
    train, _ = build_datasets([str(path)], tok, seq_len=64, block_size=4, heldout_fraction=0.0)
    ids = train.input_ids[~train.is_prompt].tolist()
    assert tok.mask_token_id not in ids and ids.count(tok.eos_token_id) == 1  # the document's own EOS only
    counts = token_counts(read_records([str(path)]), tok)
    assert tok.mask_token_id not in counts and tok.eos_token_id not in counts
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "x"},
                                             {"role": "assistant", "content": "a <|MASK|> b"}]}) + "\n")
    with pytest.raises(ConfigError, match="mask token"):
        build_datasets([str(chat)], tok, seq_len=64, block_size=4, heldout_fraction=0.0)
    chat.write_text(json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}) + "\n")
    with pytest.raises(ConfigError, match=f"{chat}:1: the conversation opens with an assistant turn"):
        read_records([str(chat)])
    doc = [("a <|endoftext|> b", False)]  # not literal unless told so: a rendered conversation's markup
    assert tokenize_documents([doc], tok, tok.eos_token_id)[0].count(tok.eos_token_id) == 2
    assert tokenize_documents([doc], tok, tok.eos_token_id, literal=[True])[0].count(tok.eos_token_id) == 1


def test_token_counts_are_the_same_whatever_the_batch(tok, corpus):
    from collections import Counter

    from training.data import read_records
    from training.draft_vocab import token_counts

    recs = read_records([corpus["text"], corpus["chat"]])
    one_by_one = sum((token_counts([r], tok) for r in recs), Counter())
    assert token_counts(recs, tok, batch=2) == token_counts(recs, tok) == one_by_one
