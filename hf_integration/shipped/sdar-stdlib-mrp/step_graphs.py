"""CUDA graphs of decoding steps, keyed by the kind of step and its input shapes.

A decoding step (a backbone forward over one block, over K+1 candidate copies, an MRP head step, or a
whole step: forwards plus the decode ops that pick, commit and verify between them) is a long chain of
small kernels whose launch cost dominates at small batch. :class:`StepGraphs` captures each distinct
step once and replays it: inputs are copied into the captured (static) buffers, the graph is replayed,
inputs the step updates in place are copied back, outputs are cloned out of the graph's pool.

A step may be captured only if it never synchronises with the host, reads no host value that changes
between calls, and reads no tensor other than its inputs and buffers whose storage never moves. The
decoder guarantees it: with graphs on, the KV cache is read over its full width (rows' committed
lengths live in a device tensor the masks derive from), cache writes go to per-row offsets on the
device, and the per-row state (working rows, tokens committed, stats) lives in the engine's fixed
buffers (:mod:`.decode_engine`).

Without CUDA (``capture=False``) a replay calls the step function recorded at the first call on the
static buffers: the data flow of a replayed graph, so the CPU tests catch a step that depends on a
tensor it was not given (a closure over the first call's positions, a buffer that moved).

A step may hold work that runs only when a device flag says so (:func:`run_if`): in a captured graph a
conditional node (CUDA 12.4+, exposed by torch 2.12+) tests the flag on the device, so a graph can run
"up to n more steps, while there is work" without asking the host; elsewhere the host tests the flag.
Without conditional nodes the host may still read such a flag a step late (:class:`LaggedFlags`), which stops
the steps one step after the work, without idling the device.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch


def conditional_nodes_supported() -> bool:
    """Whether this torch can capture :func:`run_if` into a CUDA graph (conditional nodes: torch >= 2.12)."""
    return hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")


def run_if(flag: torch.Tensor, body: Callable, *args: torch.Tensor) -> None:
    """``body(*args)`` if the 0-d bool tensor ``flag`` is true when the work before it has run. Inside a CUDA
    graph capture ``body`` is captured into a conditional node that tests ``flag`` on the device at every
    replay (no host synchronisation); outside a capture the host reads ``flag``. ``body`` updates tensors in
    place and returns nothing (what it allocates is not defined after a replay that skipped it)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
        graph.begin_capture_to_if_node(flag)
        try:
            body(*args)
        finally:
            graph.end_capture_to_conditional_node()
    elif bool(flag):
        body(*args)


class LaggedFlags:
    """Device flags (0-d bool tensors, one a step) that the host reads a step late, so reading one does not leave the
    device idle: on CUDA each pushed flag is copied into pinned host memory behind the work queued so far and an event
    marks the copy, so reading flag i waits for step i only, while the steps launched after it keep the device busy.
    Elsewhere (a CPU model, where a read costs no idle device) a read is the flag's value."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.host = torch.zeros(0, dtype=torch.bool)
        self.flags: list = []  # per pushed flag: its event (CUDA) or the flag itself

    def start(self, count: int) -> None:
        """Forget the flags pushed so far; up to ``count`` will be pushed."""
        if self.cuda and self.host.shape[0] < count:
            self.host = torch.zeros(count, dtype=torch.bool, pin_memory=True)
        self.flags.clear()

    def push(self, flag: torch.Tensor) -> None:
        if not self.cuda:
            self.flags.append(flag)
            return
        self.host[len(self.flags)].copy_(flag, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.flags.append(event)

    def read(self, i: int) -> bool:
        """The value of the i-th flag pushed since :meth:`start` (waiting for the work before it)."""
        if not self.cuda:
            return bool(self.flags[i])
        self.flags[i].synchronize()
        return bool(self.host[i])


def _copy_back(inputs, static_inputs, mutated) -> None:
    """Inputs a step updates in place take their new values from the static buffers it ran on."""
    for i in mutated:
        inputs[i].copy_(static_inputs[i])


def _clone(output):
    """Clone a step's output: a tensor, a tuple of tensors, or None."""
    if output is None or isinstance(output, torch.Tensor):
        return None if output is None else output.clone()
    return tuple(t.clone() for t in output)


class StepGraphs:
    """Captured steps of the decode engine: ``run(key, fn, *inputs, mutated=())`` -> ``fn(*inputs)``.

    ``fn`` returns a tensor, a tuple of tensors or None; it may update the inputs whose indices are in
    ``mutated`` in place and must read only its tensor arguments and buffers whose storage never moves
    (weights, the KV cache, the engine's per-row state); ``key`` must determine everything else it
    depends on. The first call of a key runs ``fn`` for real on the buffers it records (it is also the
    warm-up) and then records it; steps run inside a recorded step are part of its graph, not graphs of
    their own."""

    def __init__(self, capture: bool):
        self.capture = capture
        self.graphs: dict = {}
        self.pool = None
        self._inside = False  # running (or capturing) a step: nested steps are part of it

    def run(self, key, fn: Callable, *inputs: torch.Tensor, mutated: tuple[int, ...] = (), branches: bool = False):
        """``branches``: ``fn`` holds :func:`run_if` bodies, which the first call may skip, so their kernels may
        first load during the capture; the capture then runs in "relaxed" mode, which allows that."""
        if self._inside:
            return fn(*inputs)
        entry = self.graphs.get(key)
        if entry is None:
            static_inputs = [t.clone() for t in inputs]
            output, self.graphs[key] = self._record(key, fn, static_inputs, branches)
            _copy_back(inputs, static_inputs, mutated)
            return _clone(output)  # it may alias the buffers the next call overwrites
        if entry == "eager":
            return self._call(fn, inputs)
        recorded, static_inputs, graph, static_output = entry
        for buffer, value in zip(static_inputs, inputs):
            buffer.copy_(value)
        if graph is None:
            static_output = self._call(recorded, static_inputs)
        else:
            graph.replay()
        _copy_back(inputs, static_inputs, mutated)
        return _clone(static_output)

    def clear(self) -> None:
        """Drop every captured step and its memory pool (the engine is released)."""
        self.graphs.clear()
        self.pool = None

    def _call(self, fn, inputs):
        self._inside = True
        try:
            return fn(*inputs)
        finally:
            self._inside = False

    def _record(self, key, fn, static_inputs, branches: bool = False):
        """Run ``fn`` for real on the buffers it will be replayed on (on a side stream on CUDA: the warm-up,
        which compiles Triton kernels for exactly the tensors the capture sees, since a compilation during
        capture is not allowed, and sets up library handles), then capture it on them (capture does not
        execute). Returns this call's output and the entry; a step that cannot be captured runs eagerly
        from then on, with a warning naming it."""
        if not self.capture:
            return self._call(fn, static_inputs), (fn, static_inputs, None, None)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            output = self._call(fn, static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream()
        try:
            # "thread_local": another thread's unsafe call (a second model decoding) neither fails this capture nor
            # is failed by it; "relaxed" for run_if bodies, whose kernels may first load during the capture
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="relaxed" if branches else "thread_local"):
                static_output = self._call(fn, static_inputs)
        except RuntimeError as err:
            torch.cuda.set_stream(stream)  # a failed capture_end leaves the thread on the capture stream
            warnings.warn(f"CUDA graph capture of the {key} step failed ({err}); it runs eagerly", stacklevel=3)
            return output, "eager"
        # a captured step keeps no reference to fn, whose closure holds the first call's decoder (and so the engine)
        return output, (None, static_inputs, graph, static_output)
