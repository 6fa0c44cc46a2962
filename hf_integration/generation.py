"""``generate()``: validate, lay out the prompts, run the chosen strategy over every row's blocks, assemble."""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch
from transformers import GenerationConfig

from .decoding import DYNAMIC, STATIC, BlockDecoder, SDARGenerateOutput
from .generation_settings import GenerationSettings
from .mrp_decoding import MRP_DECODING
from .prompts import PromptBatch

# sequential decoding runs static decoding's schedule and entropy-bounded decoding dynamic's (a step may fill the
# block): decode_scheduled commits by each one's rule
DECODING = {"static": STATIC, "dynamic": DYNAMIC, "sequential": STATIC, "entropy_bounded": DYNAMIC, **MRP_DECODING}


class _OneCallAtATime:
    """The lock of one model's generate calls and the thread holding it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.owner: int | None = None


_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _OneCallAtATime
_CALLS_LOCK = threading.Lock()


@contextlib.contextmanager
def one_call_at_a_time(model):
    """Graphed calls share the model's decode engine (KV cache, per-row state, captured graphs), so calls on one
    model run one at a time: another thread's call waits for this one. A call from inside a call on the same
    model (a streamer that generates) is refused: it would wait for itself."""
    with _CALLS_LOCK:
        calls = _CALLS.setdefault(model, _OneCallAtATime())
    if calls.owner == threading.get_ident():
        raise RuntimeError("generate() was called on this model from inside its own generate() call (a streamer "
                           "or callback?); calls on one model run one at a time: generate after this call returns")
    with calls.lock:
        calls.owner = threading.get_ident()
        try:
            yield
        finally:
            calls.owner = None


def _one_device(model) -> torch.device:
    """The device all of ``model``'s parameters sit on: decoding's steps, kernels and KV cache run on one device
    (not Apple's MPS, which has no float64: the decode engine keeps the settings its steps read in float64)."""
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1 or next(iter(devices)).type == "meta":
        raise ValueError(f"generate() runs the whole model on one device, but its parameters are on "
                         f"{sorted(map(str, devices))} (split by a device_map, or offloaded): load it onto one device "
                         f"(device_map={{'': 0}}, or model.to('cuda'))")
    device = next(iter(devices))
    if device.type == "mps":
        raise ValueError("generate() does not run on Apple's MPS: the decode engine keeps the settings its steps "
                         "read in float64, which MPS lacks; decode on the CPU (model.to('cpu'))")
    return device


def generate_blocks(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, generation_config,
                    kwargs: dict):
    """input_ids: [B, P] -> [B * num_return_sequences, P + max_new_tokens] (or :class:`SDARGenerateOutput`),
    with the settings :class:`GenerationSettings` resolves from ``generation_config`` and ``kwargs``."""
    if "inputs" in kwargs:  # transformers' name for the prompt ids
        if input_ids is not None:
            raise TypeError("generate() got the prompt twice, as input_ids and as inputs: pass one of them")
        input_ids = kwargs.pop("inputs")
    if input_ids is None:
        raise TypeError("generate() needs input_ids, the prompt's token ids [batch, prompt_len] (inputs_embeds is "
                        "not supported: decoding embeds the ids it writes)")
    if isinstance(attention_mask, GenerationConfig):  # transformers' generate(inputs, generation_config) order
        raise TypeError("attention_mask got a GenerationConfig: pass it as generation_config=... (this generate "
                        "takes input_ids, attention_mask, generation_config in that order)")
    device = _one_device(model)
    if isinstance(input_ids, torch.Tensor) and input_ids.device != device:
        raise ValueError(f"input_ids are on {input_ids.device} but the model is on {device}; move them with "
                         f".to({str(device)!r})")
    prompts = PromptBatch.from_inputs(model.config, input_ids, attention_mask)
    settings = GenerationSettings.resolve(model, generation_config, kwargs, prompt_width=input_ids.shape[-1],
                                          prompts=len(prompts.lens))
    prompts = prompts.repeat(settings.num_return_sequences)
    if settings.streamer is not None and len(prompts.lens) != 1:
        raise ValueError(f"streamer streams one prompt at a time (as transformers' streamers do), got a batch of "
                         f"{len(prompts.lens)}; generate the rows one by one or drop streamer")
    # Decoding runs in the model's dtype (load it in bf16 for bf16 decoding): an enclosing autocast would hand the
    # static KV cache keys of another dtype. It runs outside inference mode, gradients off (leaving inference mode
    # turns them on): the engine a call keeps for the next (KV cache, captured steps) and the packed weights must be
    # normal tensors, which a call outside inference mode, or training, then updates in place.
    # On the model's GPU (its streams, graphs and events), whichever GPU is current.
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with one_call_at_a_time(model), on_device, torch.autocast(device.type, enabled=False), \
            torch.inference_mode(False), torch.no_grad():
        decoder = BlockDecoder(model, prompts, settings)
        x = decoder.run(DECODING[settings.strategy])
        sequences, kept = prompts.assemble(x, settings.max_new_tokens, settings.eos_ids, settings.pad_token_id,
                                           decoder.mask_id, decoder.kept_at_most)
        if settings.return_dict_in_generate:
            def new_positions(noted: torch.Tensor, asked: bool, pad=0) -> torch.Tensor | None:
                """The engine's per-position notes [B', total, ...] laid out as ``sequences`` (``pad`` off the new
                tokens)."""
                return prompts.lay_out(noted, kept, settings.max_new_tokens, pad=pad, prompt=False) if asked else None

            engine, k = decoder.engine, settings.output_top_logprobs
            top = engine.top_notes.get(k, (None, None))
            return SDARGenerateOutput(sequences=sequences, stats=decoder.stats.clone(rows=len(prompts.lens)),
                                      batch_steps=decoder.batch_steps,
                                      reveal_steps=new_positions(engine.reveal_steps, settings.output_reveal_steps),
                                      confidences=new_positions(engine.confidences, settings.output_confidences),
                                      top_logprobs=new_positions(top[0], bool(k), pad=float("-inf")),
                                      top_token_ids=new_positions(top[1], bool(k), pad=-1),
                                      new_tokens=torch.tensor(kept, dtype=torch.long, device=device))
    return sequences
