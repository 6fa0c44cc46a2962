"""The model card (``README.md``) ``mrp-train`` writes into every model folder it exports: the Hub's metadata, what the
model is, how to load and decode it, how it was trained and its last held-out evaluation, so a folder published with
``hf upload`` explains itself."""

from __future__ import annotations

import json
import os
import shlex
import sys

from huggingface_hub import ModelCard, ModelCardData

from .trainer import METRICS

TAGS = ["sdar", "block-diffusion", "mrp", "mrp-triton"]
CARD = "README.md"


def last_evaluation(out_dir: str) -> dict | None:
    """The last held-out evaluation record of ``out_dir``'s ``metrics.jsonl`` (None: no file, or no evaluation)."""
    path = os.path.join(out_dir, METRICS)
    if not os.path.exists(path):
        return None
    last = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if record.get("eval_loss") is not None:
                last = record
    return last


def model_card(name: str, config, training: dict, evaluation: dict | None, base_model: str | None) -> str:
    """The card's text: ``name`` (its title), ``config`` (the model's :class:`SDARMRPConfig`), ``training`` (the
    run's ``training_config.json``), ``evaluation`` (:func:`last_evaluation`), ``base_model`` (a Hub repo id the
    run started from, or None)."""
    mrp = config.num_nextn_predict_layers > 0
    data = ModelCardData(library_name="transformers", pipeline_tag="text-generation",
                         tags=[tag for tag in TAGS if mrp or tag != "mrp"], base_model=base_model)
    size = (f"{config.num_hidden_layers} layers, hidden size {config.hidden_size}, vocabulary {config.vocab_size}, "
            f"block size {config.block_size}")
    what = (f"An SDAR block-diffusion language model ({size}) with a {config.num_nextn_predict_layers}-layer "
            "Multi-token Residual Prediction (MRP) head" if mrp else
            f"An SDAR block-diffusion language model ({size}), without an MRP head")
    strategy = "speculative" if mrp else "static"
    lossless = (" Speculative decoding is lossless: it gives the tokens of static one-token-a-step decoding in fewer "
                "backbone forwards." if mrp else "")
    argv = training.get("extra", {}).get("argv")
    rows = [("command", f"`mrp-train {shlex.join(argv)}`" if argv else f"`mrp-train {training['mode']}`"),
            ("steps", training.get("max_steps") or f"{training.get('epochs')} epochs"),
            ("sequence length", training.get("seq_len")),
            ("micro-batch x gradient accumulation",
             f"{training.get('micro_batch_size')} x {training.get('grad_accum')}"),
            ("learning rate", training.get("lr"))]
    if training["mode"] == "mrp":
        rows += [("unroll K", training.get("unroll_k")), ("MRP loss", training.get("mrp_loss"))]
    table = "\n".join(f"| {key} | {value} |" for key, value in rows)
    results = "No held-out evaluation was recorded."
    if evaluation is not None:
        results = f"Held-out loss at step {evaluation.get('step')}: {evaluation['eval_loss']:.4g}."
        if evaluation.get("eval_token_agreement"):
            results += (" Draft agreement per unroll step k = 1..K (the corrected logits' top token equals the "
                        f"backbone's on the next state): {evaluation['eval_token_agreement']}; a decoding step picks "
                        f"the same position and token: {evaluation['eval_pick_agreement']}.")
    body = f"""# {name}

{what}, trained with mrp-triton's `mrp-train {training['mode']}`.

## Use

Its code (loaded with `trust_remote_code=True`) runs on the `mrp-triton` package, which must be installed where it
is loaded (`pip install mrp-triton`): fused Triton kernels on a GPU, their PyTorch references on a CPU.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

path = "{name}"  # this folder, or its Hub repo id once uploaded
tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
ids = tokenizer("def mean(values):", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=64, strategy="{strategy}")
print(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
```

or `mrp-generate --model {name} "def mean(values):"` (the same path or repo id).{lossless}

## Training

| setting | value |
|---|---|
{table}

## Evaluation

{results}
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}").content


def write_model_card(out_dir: str, config, training: dict, base_model: str | None, repo_id: str | None = None) -> None:
    """Write :func:`model_card` into ``out_dir`` (titled by ``repo_id``, the repo it goes to, else the folder's name;
    ``base_model``: the Hub repo the run started from, or None), unless the folder holds a card this module did not
    write (its tags lack ``mrp-triton``), which is kept."""
    path = os.path.join(out_dir, CARD)
    if os.path.exists(path):
        try:
            tags = ModelCard.load(path).data.tags or []
        except Exception:  # noqa: BLE001 - metadata the Hub's reader cannot parse: a card mrp-train did not write
            tags = []
        if "mrp-triton" not in tags:
            print(f"kept the model card {path}, which mrp-train did not write", file=sys.stderr)
            return
    name = repo_id or os.path.basename(os.path.normpath(out_dir))
    card = model_card(name, config, training, last_evaluation(out_dir), base_model)
    with open(path, "w", encoding="utf-8") as f:
        f.write(card)
