"""CUDA graphs of the decoding forwards, keyed by the kind of forward and its input shapes.

A decoding forward (backbone over one block, over a finished block plus the next, over K+1 candidate
copies; an MRP head step) is a long chain of small kernels whose launch cost dominates at small batch.
:class:`StepGraphs` captures each distinct forward once and replays it: inputs are copied into the
captured (static) buffers, the graph is replayed, the output is cloned out of the graph's pool.

A forward may be captured only if it never synchronises with the host and reads no host value that
changes between calls. The decoder guarantees it: with graphs on, the KV cache is read over its full
width (rows' committed lengths live in a device tensor the masks derive from) and cache writes go to
per-row offsets on the device. With ``capture=False`` (CPU, or a failed capture) the same forwards run
eagerly, which is how the CPU tests exercise this code path.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch


class StepGraphs:
    """Captured forwards of one ``generate`` call: ``run(key, fn, *inputs)`` -> ``fn(*inputs)``.

    ``fn`` must read only its tensor arguments and buffers whose storage never moves (weights, the KV
    cache); ``key`` must determine everything else it depends on (the caller passes the kind of forward
    and the input shapes)."""

    def __init__(self, capture: bool):
        self.capture = capture
        self.graphs: dict = {}
        self.pool = None

    def run(self, key, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        if not self.capture:
            return fn(*inputs)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(key, fn, inputs)
        if entry == "eager":
            return fn(*inputs)
        graph, static_inputs, static_output = entry
        for buffer, value in zip(static_inputs, inputs):
            buffer.copy_(value)
        graph.replay()
        return static_output.clone()

    def _capture(self, key, fn, inputs):
        """Warm up on a side stream (compiles Triton kernels, sets up library handles), then capture.
        A forward that cannot be captured runs eagerly from then on, with a warning naming it."""
        static_inputs = [t.clone() for t in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                static_output = fn(*static_inputs)
        except RuntimeError as err:
            warnings.warn(f"CUDA graph capture of the {key} forward failed ({err}); it runs eagerly", stacklevel=3)
            return "eager"
        return graph, static_inputs, static_output
