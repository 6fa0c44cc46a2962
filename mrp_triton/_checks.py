"""Argument checks (and the row layout) shared by the op launchers; every error names the offending argument.

Decode ops (select, verify, remask) work on a ``block``: int64 [B, L], updated in place, with
the other tensors on its device. Row ops (rms_norm, swiglu) pair an operand with another
that it must match in shape, dtype and device.
"""

from __future__ import annotations

import numbers
import struct

import torch

from .backend import interpreter_on

_KIND = {None: "a float", torch.bool: "a bool", torch.int64: "an int64"}


def check_kernel_device(device: torch.device, op: str) -> None:
    """Refuse non-CUDA tensors unless the Triton interpreter is on; ``op`` names the public
    ``mrp_triton`` function that would run the reference instead."""
    if device.type != "cuda" and not interpreter_on():
        raise RuntimeError(f"the Triton kernel needs CUDA tensors (got {device}); set "
                           "TRITON_INTERPRET=1 before importing mrp_triton, or call "
                           f"mrp_triton.{op}() (reference path on CPU)")


def wide(*operands: torch.Tensor | None) -> bool:
    """Whether an operand is float64: the kernels compute in fp32, so the public ops run the reference for it."""
    return any(t is not None and t.dtype == torch.float64 for t in operands)


def check_ids_on_cpu(name: str, ids: torch.Tensor, low: int, high: int) -> None:
    """Refuse ids outside [low, high) (an ``IndexError``, as torch's gathers raise) where that costs no host sync:
    on CPU, where the interpreter would read past a table and the reference would wrap a negative id around. On
    CUDA the ids are the caller's to keep in range."""
    if ids.device.type == "cpu" and ids.numel() and (int(ids.min()) < low or int(ids.max()) >= high):
        raise IndexError(f"{name} must lie in [{low}, {high}), got values in [{int(ids.min())}, {int(ids.max())}]")


def check_block(block, desc: str = "[B, L]") -> tuple[int, int]:
    """``block`` must be an int64 tensor [B, L]; returns (B, L). ``desc`` extends the shape in the message."""
    if not isinstance(block, torch.Tensor) or block.dim() != 2 or block.dtype != torch.int64:
        raise ValueError(f"block must be an int64 tensor {desc} (it is updated in place)")
    return tuple(block.shape)


def check_block_shaped(name: str, t, shape: tuple[int, int], dtype: torch.dtype | None = None) -> None:
    """``t`` must be a tensor of block's ``shape`` [B, L] with ``dtype`` (bool or int64), or any
    floating dtype when ``dtype`` is None."""
    B, L = shape
    ok = isinstance(t, torch.Tensor) and tuple(t.shape) == (B, L) and \
        (t.is_floating_point() if dtype is None else t.dtype == dtype)
    if not ok:
        raise ValueError(f"{name} must be {_KIND[dtype]} tensor of block's shape [{B}, {L}]"
                         + (" (float32 preferred)" if dtype is None else ""))


def check_on_block_device(block: torch.Tensor, **tensors: torch.Tensor) -> None:
    """Every keyword tensor must live on ``block``'s device."""
    for name, t in tensors.items():
        if t.device != block.device:
            raise ValueError(f"{name} is on {t.device} but block on {block.device}; move them together")


def check_contiguous_block(block: torch.Tensor) -> None:
    """The kernels write ``block`` in place through a flat pointer: it must be contiguous."""
    if not block.is_contiguous():
        raise ValueError("block must be contiguous (it is updated in place)")


def check_token_id(mask_token_id) -> None:
    """``mask_token_id`` must be an integer (Python or numpy), not a bool."""
    if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, numbers.Integral):
        raise TypeError(f"mask_token_id must be an int, got {type(mask_token_id).__name__}")


def check_skip_rows(skip_rows, rows: int, device: torch.device, data: str) -> None:
    """``skip_rows`` must be None or a bool tensor [rows] on ``device``, one per row of the tensor named ``data``."""
    if skip_rows is not None:
        check_row_flags("skip_rows", skip_rows, rows, device, data, "or None")


def check_row_flags(name: str, flags, rows: int, device: torch.device, data: str, instead: str) -> None:
    """Argument ``name`` must be a bool tensor [rows] on ``device``, one per row of the tensor named ``data``
    (``instead``: what else it may be, for the message)."""
    if not isinstance(flags, torch.Tensor) or flags.dtype != torch.bool or tuple(flags.shape) != (rows,):
        raise ValueError(f"{name} must be a bool tensor of shape [{rows}] (one per row of {data}), {instead}")
    if flags.device != device:
        raise ValueError(f"{name} is on {flags.device} but {data} is on {device}")


def sample_operands(do_sample, dummy: torch.Tensor) -> tuple[bool, torch.Tensor, bool]:
    """What a kernel with ``DO_SAMPLE`` and ``SAMPLE_ROWS`` reads (checked by :func:`check_row_flags`): ``(sample,
    rows, per_row)``. A bool gives whether the launch samples, ``dummy`` and False; a bool tensor [N] (the rows that
    sample, the others picking greedily) gives True, the tensor as uint8 and True."""
    if isinstance(do_sample, torch.Tensor):
        return True, do_sample.contiguous().view(torch.uint8), True
    return bool(do_sample), dummy, False


BAN_DTYPES = (torch.bool, torch.uint8)


def check_banned(banned_tokens, ban_rows, rows: int, vocab: int, device: torch.device, data: str) -> None:
    """``banned_tokens`` must be None or a bool / uint8 tensor [vocab] on ``device`` (the tokens excluded like the
    mask column; uint8: each bit a class of ban), and ``ban_rows`` None or a bool / uint8 tensor [rows] there (the
    classes in force in each row of ``data``; None: all), given only with ``banned_tokens``."""
    if banned_tokens is None:
        if ban_rows is not None:
            raise ValueError("ban_rows marks the rows banned_tokens are excluded in: pass banned_tokens too (or drop "
                             "ban_rows)")
        return
    for name, t, shape, what in (("banned_tokens", banned_tokens, vocab, f"one per token of {data}'s vocabulary"),
                                 ("ban_rows", ban_rows, rows, f"one per row of {data}")):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype not in BAN_DTYPES or tuple(t.shape) != (shape,):
            raise ValueError(f"{name} must be a bool or uint8 tensor of shape [{shape}] ({what}), or None")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but {data} is on {device}")


def check_penalty(repetition_penalty, seen_tokens, seen_rows, rows: int, vocab: int, device: torch.device,
                  data: str, logit_offsets=None, logit_bias=None) -> None:
    """A repetition penalty (a finite number > 0, or a 0-d real tensor on ``device``, whose value the caller checks)
    with ``seen_tokens``, a bool / uint8 tensor [C, vocab] on ``device`` (the tokens each row of it has seen), or
    neither; ``logit_offsets`` None or a float32 tensor [C, vocab] there (an additive term each row of it adds to the
    logits); and ``seen_rows`` None (C == rows: row n reads row n of each table) or, with either table, an int64
    tensor [rows] there (row n reads row seen_rows[n], in [0, C): unchecked, a host check would synchronise).
    ``logit_bias``: None or a float32 tensor [vocab] there (a term every row adds before the penalty)."""
    if logit_bias is not None and (not isinstance(logit_bias, torch.Tensor) or logit_bias.dtype != torch.float32
                                   or tuple(logit_bias.shape) != (vocab,) or logit_bias.device != device):
        raise ValueError(f"logit_bias must be a float32 tensor [{vocab}] on {device} (a bias by token id), got "
                         f"{_shown(logit_bias)}" + (f" on {logit_bias.device}" if torch.is_tensor(logit_bias) else ""))
    if repetition_penalty is None and seen_tokens is not None:
        raise ValueError("seen_tokens is read by the repetition penalty: pass repetition_penalty too")
    if repetition_penalty is None and logit_offsets is None:
        if seen_rows is not None:
            raise ValueError("seen_rows picks the rows of seen_tokens / logit_offsets: pass one of them too")
        return
    tables = []
    if repetition_penalty is not None:
        if not check_device_scalar("repetition_penalty", repetition_penalty, device) and (
                isinstance(repetition_penalty, bool) or not isinstance(repetition_penalty, numbers.Real)
                or not 0 < float(repetition_penalty) < float("inf")):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1: no penalty), got "
                             f"{repetition_penalty!r}")
        if not isinstance(seen_tokens, torch.Tensor) or seen_tokens.dtype not in BAN_DTYPES or seen_tokens.dim() != 2 \
                or seen_tokens.shape[1] != vocab:
            raise ValueError(f"repetition_penalty needs seen_tokens: a bool or uint8 tensor [C, {vocab}] (the tokens "
                             f"each row has seen), got {_shown(seen_tokens)}")
        tables.append(("seen_tokens", seen_tokens))
    if logit_offsets is not None:
        if not isinstance(logit_offsets, torch.Tensor) or logit_offsets.dtype != torch.float32 \
                or logit_offsets.dim() != 2 or logit_offsets.shape[1] != vocab:
            raise ValueError(f"logit_offsets must be a float32 tensor [C, {vocab}] (each row's additive term), got "
                             f"{_shown(logit_offsets)}")
        tables.append(("logit_offsets", logit_offsets))
    if len(tables) == 2 and seen_tokens.shape[0] != logit_offsets.shape[0]:
        raise ValueError(f"seen_tokens has {seen_tokens.shape[0]} rows but logit_offsets {logit_offsets.shape[0]}: "
                         "seen_rows reads the same row of both")
    name, table = tables[0]
    if seen_rows is None and table.shape[0] != rows:
        raise ValueError(f"{name} has {table.shape[0]} rows but {data} {rows}: pass seen_rows (int64 [{rows}], the row "
                         f"of {name} each row reads)")
    if seen_rows is not None and (not isinstance(seen_rows, torch.Tensor) or seen_rows.dtype != torch.int64
                                  or tuple(seen_rows.shape) != (rows,)):
        raise ValueError(f"seen_rows must be an int64 tensor of shape [{rows}] (one per row of {data}), got "
                         f"{_shown(seen_rows)}")
    for name, t in (*tables, ("seen_rows", seen_rows)):
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but {data} is on {device}")


def _shown(t) -> str:
    """How an argument is described in an error: a tensor's dtype and shape, else its type."""
    return f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def penalty_args(repetition_penalty, seen_tokens, seen_rows, logit_offsets, logit_bias) -> dict:
    """A pick op's penalty arguments by name: what :func:`check_penalty`, :func:`penalty_operands` and the references
    take (``**penalty``)."""
    return dict(repetition_penalty=repetition_penalty, seen_tokens=seen_tokens, seen_rows=seen_rows,
                logit_offsets=logit_offsets, logit_bias=logit_bias)


def penalty_operands(rows: int, dummy: torch.Tensor, repetition_penalty, seen_tokens, seen_rows, logit_offsets,
                     logit_bias) -> tuple:
    """What a kernel with ``HAS_PENALTY`` / ``HAS_OFFSETS`` / ``HAS_BIAS`` reads (checked by :func:`check_penalty`):
    the seen table as uint8 [C, V] (contiguous), the offsets float32 [C, V] (contiguous), the bias float32 [V]
    (contiguous), each row's row of the tables (int64 [rows]) and the penalty as a 0-d float64 tensor on the device;
    ``dummy`` for what the call does not use (the kernel then reads none of it)."""
    table = offsets = which = pen = dummy
    bias = dummy if logit_bias is None else logit_bias.contiguous()
    if repetition_penalty is not None:
        table = seen_tokens.contiguous().view(torch.uint8)
        pen = torch.as_tensor(repetition_penalty, dtype=torch.float64, device=dummy.device)
    if logit_offsets is not None:
        offsets = logit_offsets.contiguous()
    if repetition_penalty is not None or logit_offsets is not None:
        which = torch.arange(rows, device=dummy.device) if seen_rows is None else seen_rows.contiguous()
    return table, offsets, bias, which, pen


def temperature_operands(temperature, dummy: torch.Tensor) -> tuple[float, torch.Tensor, int, bool]:
    """What a kernel with ``T_TENSOR`` (the temperature read on the device) or without reads: ``(inv_t, t, stride,
    on_device)``. A number gives ``inv_t`` = 1 / temperature divided in float64 and rounded to fp32 (as the
    reference), ``dummy`` and stride 0; a tensor (0-d, or one a row [N]) gives inv_t 1 (the kernel computes it from
    the tensor), the tensor and its row stride (0 for a 0-d one)."""
    if isinstance(temperature, torch.Tensor):
        return 1.0, temperature, temperature.stride(0) if temperature.dim() else 0, True
    return struct.unpack("f", struct.pack("f", 1.0 / float(temperature)))[0], dummy, 0, False


def ban_operands(banned_tokens, ban_rows, rows: int, dummy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a kernel with ``HAS_BAN`` reads (checked by :func:`check_banned`): the table and each of the ``rows``
    rows' classes as uint8 (every class, 0xFF, in every row without ``ban_rows``); ``dummy`` for both without a ban
    (the kernel then reads neither)."""
    if banned_tokens is None:
        return dummy, dummy
    classes = ban_rows.contiguous().view(torch.uint8) if ban_rows is not None else \
        torch.full((rows,), 0xFF, dtype=torch.uint8, device=banned_tokens.device)
    return banned_tokens.contiguous().view(torch.uint8), classes


MAX_TOP_M = 64


def check_top_m(top_m, vocab: int) -> None:
    """``top_m`` (how many top logits per row an op also returns) must be an int in [0, min(64, vocab)]."""
    if isinstance(top_m, bool) or not isinstance(top_m, numbers.Integral) or not 0 <= top_m <= min(MAX_TOP_M, vocab):
        raise ValueError(f"top_m must be an int in [0, {min(MAX_TOP_M, vocab)}] (at most {MAX_TOP_M} and the "
                         f"vocabulary, {vocab}), got {top_m!r}")


def check_device_scalar(name: str, value, device: torch.device, rows: int | None = None) -> bool:
    """Whether ``value`` (a setting such as a temperature, threshold or top-k) is given as a 0-d real tensor on
    ``device`` (or, where the op takes one a row, ``rows`` given, a [rows] one): the op then reads it there, so one
    captured CUDA graph serves every value (which is not checked on the host: that would synchronise). Any other
    tensor is refused; a Python number returns False."""
    if not isinstance(value, torch.Tensor):
        return False
    shapes = [()] if rows is None else [(), (rows,)]
    if tuple(value.shape) not in shapes or value.dtype == torch.bool or value.is_complex():
        raise ValueError(f"{name} must be a number or a 0-d real tensor" + ("" if rows is None else
                         f" (or one a row, [{rows}])") + f", got a {value.dtype} tensor of shape {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but the data on {device}; move them together")
    return True


def check_float(name: str, t: torch.Tensor) -> None:
    """``t`` must have a floating-point dtype."""
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def check_matches(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """``t`` must have ``ref``'s shape, dtype and device."""
    if t.shape != ref.shape:
        raise ValueError(f"{name} shape {tuple(t.shape)} != {ref_name} shape {tuple(ref.shape)}")
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} dtype {t.dtype} != {ref_name} dtype {ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{ref_name} is on {ref.device} but {name} is on {t.device}")


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., F] as [rows, F] for a kernel that takes a row stride: each row contiguous, one stride between rows
    (a view when x is laid out so, e.g. a column slice of a wider tensor; else a copy)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()
