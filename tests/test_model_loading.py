"""Config reading, checkpoint layout, save/load round trips, remote code, offline Hub cache, push_to_hub."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_integration import SDARMRPConfig, SDARMRPForCausalLM
from tiny_models import MASK_ID, random_prompts, tiny_config, tiny_model

REPO_ROOT = Path(__file__).resolve().parents[1]

AUTHORS_MRP_CONFIG = {  # the layout of heavyball/sdar-*-mrp-3lyr (shapes shrunk)
    "architectures": ["SDARMRPForCausalLM"], "model_type": "sdar", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "head_dim": 8, "hidden_act": "silu",
    "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 48, "max_position_embeddings": 512,
    "max_window_layers": 2, "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.52.4",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 67, "num_nextn_predict_layers": 3,
    "num_mrp_heads": 1, "block_size": 16, "mask_token_id": MASK_ID,
}


def test_reads_authors_config_as_is(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(AUTHORS_MRP_CONFIG))
    config = SDARMRPConfig.from_pretrained(tmp_path)
    assert (config.num_nextn_predict_layers, config.block_size, config.mask_token_id) == (3, 16, MASK_ID)
    assert config.rope_theta == 1e6 and config.rope_parameters["rope_type"] == "default"
    assert config.has_mrp and config.eos_token_id == 2


def test_plain_sdar_config_gets_defaults_and_new_rope_spelling():
    config = SDARMRPConfig(vocab_size=151936, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert config.block_size == 4 and config.mask_token_id == 151669 and not config.has_mrp
    assert config.rope_theta == 5e5
    legacy = SDARMRPConfig(vocab_size=151936, rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0})
    assert legacy.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}


@pytest.mark.parametrize("kw,message", [
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope type"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 0.0}), "positive 'factor'"),
    (dict(rope_theta=0.0), "rope_theta must be > 0"),
    (dict(vocab_size=10, mask_token_id=10), "mask_token_id"),
    (dict(num_attention_heads=6, num_key_value_heads=4), "must be a multiple of num_key_value_heads"),
    (dict(head_dim=7), "head_dim must be even"),
    (dict(block_size=0), "block_size must be >= 1"),
    (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
])
def test_config_rejects_bad_values(kw, message):
    with pytest.raises(ValueError, match=message):
        SDARMRPConfig(**kw)


@pytest.mark.parametrize("override", [dict(mask_token_id=5000), dict(mask_token_id=-1), dict(block_size=0)])
def test_a_load_override_is_checked_as_the_config_is(tmp_path, override):
    """from_pretrained sets its keyword overrides on the config after building it: they are checked all the same (a
    mask id outside the vocabulary used to load, then fail in the embedding lookup of generate)."""
    tiny_model(dtype=torch.float32).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"config.{next(iter(override))}"):
        SDARMRPForCausalLM.from_pretrained(tmp_path, **override)


def test_config_head_dim_none_is_hidden_over_query_heads():
    assert SDARMRPConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=None).head_dim == 8
    assert SDARMRPConfig(rope_scaling={"rope_type": "linear", "factor": 2.0}).rope_parameters["factor"] == 2.0


def test_config_defaults_and_which_rope_spelling_wins():
    assert SDARMRPConfig(num_attention_heads=4, num_key_value_heads=None).num_key_value_heads == 4  # no GQA
    assert SDARMRPConfig().rope_parameters == {"rope_type": "default", "rope_theta": 1_000_000.0}
    both = dict(rope_scaling={"type": "linear", "factor": 4.0}, rope_theta=1e4)
    assert SDARMRPConfig(rope_parameters={"rope_type": "linear", "factor": 2.0}, **both).rope_parameters == \
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}  # the new spelling wins key by key
    assert SDARMRPConfig(rope_parameters={"rope_type": "default"}, **both).rope_parameters["rope_type"] == "default"
    plain = SDARMRPConfig(num_nextn_predict_layers=0, num_mrp_heads=2)  # a head count means nothing without a head
    assert not plain.has_mrp and plain.num_mrp_heads == 2


def test_an_mrp_head_needs_a_layer():
    model = tiny_model(dtype=torch.float32)
    with pytest.raises(ValueError, match="num_layers must be >= 1, got 0"):
        model.add_mrp_head(0)
    assert len(model.add_mrp_head(1).model.layers) == 1 and model.config.num_nextn_predict_layers == 1


def _hub_state_dict(config) -> dict[str, torch.Tensor]:
    """Tensor names and shapes of the Hub checkpoints, written out from the spec (method.md 1 and 3)."""
    H, F, D = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv, V = config.num_attention_heads * D, config.num_key_value_heads * D, config.vocab_size

    def layer(prefix):
        return {f"{prefix}.self_attn.q_proj.weight": (q, H), f"{prefix}.self_attn.k_proj.weight": (kv, H),
                f"{prefix}.self_attn.v_proj.weight": (kv, H), f"{prefix}.self_attn.o_proj.weight": (H, q),
                f"{prefix}.self_attn.q_norm.weight": (D,), f"{prefix}.self_attn.k_norm.weight": (D,),
                f"{prefix}.mlp.gate_proj.weight": (F, H), f"{prefix}.mlp.up_proj.weight": (F, H),
                f"{prefix}.mlp.down_proj.weight": (H, F), f"{prefix}.input_layernorm.weight": (H,),
                f"{prefix}.post_attention_layernorm.weight": (H,)}

    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(config.num_hidden_layers):
        shapes.update(layer(f"model.layers.{i}"))
    mrp = "mrp_modules.0.model"
    shapes.update({f"{mrp}.enorm.weight": (H,), f"{mrp}.hnorm.weight": (H,), f"{mrp}.eh_proj.weight": (H, 2 * H),
                   f"{mrp}.norm.weight": (H,)})
    for d in range(config.num_nextn_predict_layers):
        shapes.update(layer(f"{mrp}.layers.{d}"))
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def test_state_dict_in_hub_naming_loads_strictly():
    model = SDARMRPForCausalLM(tiny_config())
    state = _hub_state_dict(model.config)
    model.load_state_dict(state, strict=True)
    assert torch.equal(model.mrp_modules[0].model.eh_proj.weight, state["mrp_modules.0.model.eh_proj.weight"])


def _write_checkpoint(path: Path, config_dict: dict, state: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_dict))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))


def test_authors_checkpoint_and_legacy_mtp_keys_load(tmp_path):
    config = SDARMRPConfig.from_dict(AUTHORS_MRP_CONFIG)
    state = _hub_state_dict(config)
    _write_checkpoint(tmp_path / "mrp", AUTHORS_MRP_CONFIG, state)
    legacy = {k.replace("mrp_modules.", "mtp_modules."): v for k, v in state.items()}
    _write_checkpoint(tmp_path / "mtp", AUTHORS_MRP_CONFIG, legacy)
    for name in ("mrp", "mtp"):
        model = SDARMRPForCausalLM.from_pretrained(tmp_path / name)
        assert model.has_mrp
        loaded = model.state_dict()
        for key, value in state.items():
            assert torch.equal(loaded[key], value), (name, key)
    model.save_pretrained(tmp_path / "resaved")
    keys = load_file(str(tmp_path / "resaved" / "model.safetensors")).keys()
    assert any(k.startswith("mrp_modules.0.") for k in keys) and not any(k.startswith("mtp_") for k in keys)


def test_mrp_generate_runs_release_checkpoints_on_our_code(tmp_path):
    """A release checkpoint's auto_map points at its own remote code (which AutoModelForCausalLM would run, and
    which is not there offline): mrp-generate loads it into this package's class all the same."""
    from hf_integration.cli import SHIPPED_MODEL, load

    config = dict(AUTHORS_MRP_CONFIG, auto_map={"AutoConfig": "configuration_sdar.SDARConfig",
                                                 "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"})
    _write_checkpoint(tmp_path, config, _hub_state_dict(SDARMRPConfig.from_dict(AUTHORS_MRP_CONFIG)))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED_MODEL / name, tmp_path / name)
    tokenizer, model = load(str(tmp_path), "cpu", None)
    assert type(model) is SDARMRPForCausalLM and model.has_mrp and tokenizer.mask_token == "<|MASK|>"
    assert model.dtype == torch.float32  # --dtype left out: float32 on CPU (bfloat16 is for CUDA)
    out = model.generate(random_prompts(1, 4, seed=3), max_new_tokens=4, strategy="speculative")
    assert out.shape == (1, 8)


def test_checkpoint_without_mrp_weights_warns_then_refuses_mrp_decoding(tmp_path, caplog):
    config = SDARMRPConfig.from_dict(AUTHORS_MRP_CONFIG)
    state = {k: v for k, v in _hub_state_dict(config).items() if not k.startswith("mrp_modules.")}
    _write_checkpoint(tmp_path / "no_mrp", AUTHORS_MRP_CONFIG, state)
    plain = {k: v for k, v in AUTHORS_MRP_CONFIG.items()
             if k not in ("num_nextn_predict_layers", "num_mrp_heads", "block_size", "mask_token_id")}
    plain["mask_token_id"] = MASK_ID  # the stock default 151669 lies outside this tiny vocabulary
    _write_checkpoint(tmp_path / "plain", plain, state)
    ids = random_prompts(1, 5)
    for name in ("no_mrp", "plain"):
        with caplog.at_level(logging.WARNING):
            model = SDARMRPForCausalLM.from_pretrained(tmp_path / name)
        assert "MRP" in caplog.text
        caplog.clear()
        assert not model.has_mrp
        assert model.generate(ids, max_new_tokens=4).shape == (1, 9)
        with pytest.raises(ValueError, match="needs MRP weights"):
            model.generate(ids, max_new_tokens=4, strategy="speculative")
        # No randomly initialised head is kept: saving writes the backbone alone, which reloads as one.
        model.save_pretrained(tmp_path / f"{name}_resaved")
        assert not any(k.startswith("mrp_modules.") for k in load_file(tmp_path / f"{name}_resaved/model.safetensors"))
        resaved = SDARMRPForCausalLM.from_pretrained(tmp_path / f"{name}_resaved")
        assert not resaved.has_mrp and resaved.config.num_nextn_predict_layers == 0


def test_plain_backbone_plus_separate_mrp_state_dict_combine(tmp_path):
    full = tiny_model(seed=3)
    backbone = SDARMRPForCausalLM(tiny_config(num_nextn_predict_layers=0)).double()
    backbone.load_state_dict({k: v for k, v in full.state_dict().items() if not k.startswith("mrp_modules.")})
    head = {k.replace("mrp_modules.", "mtp_modules."): v for k, v in full.state_dict().items()
            if k.startswith("mrp_modules.")}
    backbone.load_mrp_state_dict(head)
    ids = random_prompts(2, 6)
    kwargs = dict(max_new_tokens=8, strategy="speculative", mrp_steps=2)
    assert torch.equal(backbone.generate(ids, **kwargs), full.generate(ids, **kwargs))
    with pytest.raises(ValueError, match="does not belong"):
        backbone.load_mrp_state_dict({"lm_head.weight": torch.zeros(1)})


def test_load_mrp_state_dict_takes_a_whole_checkpoint_head_keys_first_or_last():
    """The head's keys of a whole state dict are loaded and the backbone's left out, whichever come first (bare
    ``model.layers.*`` keys of the backbone never fill the head's layers)."""
    full = tiny_model(seed=3)
    state = full.state_dict()
    head = {k: v for k, v in state.items() if k.startswith("mrp_modules.")}
    for order in (state, {**head, **state}, {**{k: v for k, v in state.items() if k not in head}, **head}):
        for strict in (True, False):
            model = SDARMRPForCausalLM(tiny_config(num_nextn_predict_layers=0)).double()
            model.load_mrp_state_dict(order, strict=strict)
            got = {k: v for k, v in model.state_dict().items() if k.startswith("mrp_modules.")}
            assert got.keys() == head.keys() and all(torch.equal(got[k], head[k]) for k in head)
            assert model.config.num_nextn_predict_layers == full.config.num_nextn_predict_layers
    twice = {**head, **{k.replace("mrp_modules.", "mtp_modules."): v for k, v in head.items()}}
    with pytest.raises(ValueError, match="given twice"):
        SDARMRPForCausalLM(tiny_config(num_nextn_predict_layers=0)).load_mrp_state_dict(twice)


@pytest.mark.parametrize("case", ["wrong_hidden", "missing_layer", "unexpected_key", "prefixed", "empty",
                                  "not_a_tensor"])
def test_a_refused_mrp_state_dict_leaves_the_model_as_it_was(case):
    """A head that does not fit raises a ValueError naming the keys, and changes nothing: a plain backbone stays
    without a head (no random one to decode with), a model's own head keeps its weights and its config. With
    strict=False too where no key is the head's (a DDP-saved head's 'module.' keys, an empty dict), and for a value
    that is no tensor."""
    head = {k[len("mrp_modules.0."):]: v for k, v in tiny_model(seed=3).state_dict().items()
            if k.startswith("mrp_modules.")}
    strict = True
    if case == "wrong_hidden":
        head = {k: torch.zeros(*(2 * n for n in v.shape)) for k, v in head.items()}
        message = "shapes do not fit"
    elif case == "missing_layer":
        head = {k: v for k, v in head.items() if not k.startswith("model.layers.0.")}
        message = "missing"
    elif case == "unexpected_key":
        head["model.extra.weight"] = torch.zeros(1)
        message = "unexpected"
    elif case in ("prefixed", "empty"):
        head, strict = ({"module." + k: v for k, v in head.items()} if case == "prefixed" else {}), False
        message = "none of the state dict's .* keys is a weight of this"
    else:
        head["model.enorm.weight"] = 1.0
        message = r"\['model.enorm.weight'\] hold no weights"
    plain = SDARMRPForCausalLM(tiny_config(num_nextn_predict_layers=0)).double()
    with pytest.raises(ValueError, match=message):
        plain.load_mrp_state_dict(head, strict=strict)
    assert not plain.has_mrp and plain.config.num_nextn_predict_layers == 0
    with pytest.raises(ValueError, match="needs MRP weights"):
        plain.generate(random_prompts(1, 4), max_new_tokens=4, strategy="direct")
    model = tiny_model(seed=1)
    before = {k: v.clone() for k, v in model.mrp_modules.state_dict().items()}
    layers = model.config.num_nextn_predict_layers
    with pytest.raises(ValueError, match=message):
        model.load_mrp_state_dict(head, strict=strict)
    after = model.mrp_modules.state_dict()
    assert model.config.num_nextn_predict_layers == layers and all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("tied", [False, True])
def test_save_load_round_trip_is_bit_identical(tmp_path, tied):
    model = tiny_model(seed=1, dtype=torch.float32, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_sdar_mrp.SDARMRPForCausalLM"
    assert (tmp_path / "modeling_sdar_mrp.py").exists() and (tmp_path / "mrp_decoding.py").exists()
    loaded = SDARMRPForCausalLM.from_pretrained(tmp_path)
    assert (loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()) == tied
    ids = random_prompts(2, 9)
    assert torch.equal(model(ids).logits, loaded(ids).logits)


REMOTE_CODE_SCRIPT = textwrap.dedent("""
    import sys, torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    source = sys.argv[1]
    config = AutoConfig.from_pretrained(source, trust_remote_code=True)
    for auto in (AutoModel, AutoModelForCausalLM):
        model = auto.from_pretrained(source, trust_remote_code=True)
        assert type(model).__name__ == "SDARMRPForCausalLM", type(model)
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    out = model.generate(ids, max_new_tokens=6, strategy="speculative", mrp_steps=2)
    print(type(config).__name__, tuple(out.shape))
""")


def _run_without_package_import(source: str, env_extra: dict) -> str:
    """Load through transformers only (hf_integration never imported), as a user of the Hub would."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", **env_extra}
    result = subprocess.run([sys.executable, "-c", REMOTE_CODE_SCRIPT, source], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_trust_remote_code_from_directory(tmp_path):
    tiny_model(dtype=torch.float32).save_pretrained(tmp_path / "ckpt")
    out = _run_without_package_import(str(tmp_path / "ckpt"), {"HF_HOME": str(tmp_path / "home")})
    assert "SDARMRPConfig (1, 11)" in out


def test_trust_remote_code_from_offline_hub_cache(tmp_path):
    """A pre-populated Hugging Face cache (the layout hf_hub_download writes) resolves a repo id offline."""
    repo_id, revision = "mrp-triton/tiny-sdar-mrp", "0123456789abcdef0123456789abcdef01234567"
    hub = tmp_path / "home" / "hub"
    snapshot = hub / f"models--{repo_id.replace('/', '--')}" / "snapshots" / revision
    tiny_model(dtype=torch.float32).save_pretrained(snapshot)
    refs = snapshot.parents[1] / "refs"
    refs.mkdir()
    (refs / "main").write_text(revision)
    out = _run_without_package_import(repo_id, {"HF_HOME": str(tmp_path / "home")})
    assert "SDARMRPConfig (1, 11)" in out


def test_push_to_hub_uploads_a_loadable_folder(tmp_path, monkeypatch):
    """push_to_hub goes through huggingface_hub's HfApi; stub its network calls at that boundary."""
    import huggingface_hub
    from huggingface_hub import HfApi

    uploaded = tmp_path / "uploaded"
    calls = {}

    def fake_create_repo(self, repo_id, **kwargs):
        calls["create_repo"] = repo_id
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

    def fake_create_commit(self, repo_id, operations, **kwargs):
        calls["create_commit"] = (repo_id, sorted(op.path_in_repo for op in operations))
        for op in operations:
            target = uploaded / op.path_in_repo
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(op.path_or_fileobj, target)
        return None

    monkeypatch.setattr(HfApi, "create_repo", fake_create_repo)
    monkeypatch.setattr(HfApi, "create_commit", fake_create_commit)
    model = tiny_model(dtype=torch.float32)
    model.push_to_hub("someone/tiny-sdar-mrp")
    assert calls["create_repo"] == "someone/tiny-sdar-mrp"
    assert "model.safetensors" in calls["create_commit"][1] and "modeling_sdar_mrp.py" in calls["create_commit"][1]
    out = _run_without_package_import(str(uploaded), {"HF_HOME": str(tmp_path / "home")})
    assert "SDARMRPConfig (1, 11)" in out
