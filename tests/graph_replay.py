"""A CUDA graph's semantics on the CPU, for the tests of :mod:`icefall_lite.train.cuda_graphs`.

:class:`RecordedGraphs` is a backend of :class:`icefall_lite.train.cuda_graphs.StepGraphs`: its capture runs
the step once under a ``TorchDispatchMode`` that records every aten op with its arguments and outputs, and its
replay runs the recorded ops again on the same tensors, copying each result into the tensor the capture made
(an op that wrote in place, or whose output is a view of its input, needs no copy). As with a CUDA graph:

- only the ops are replayed: Python code in the step (a counter, a branch, an attribute set) ran once, at
  capture, and its outcome is frozen, as are the Python numbers the ops were given;
- a host read during the capture is an error (``.item()``, ``float()``, ``.tolist()``, a boolean mask's
  index...), except in the CPU's loss recursion (:data:`CPU_RECURSION`, a Triton kernel on CUDA), whose loop
  bounds come from the batch's lengths: the batches replayed must have the capture's lengths;
- random ops draw new numbers on every replay, from the generator's state at that moment.

A capture here runs the step (a CUDA capture only records), so ``captures_run`` is True. What it cannot
show: memory (every recorded tensor stays alive; a CUDA graph's pool reuses memory, so a tensor of one graph
kept past another's replay may be overwritten), streams and threads (the capture's error mode), host reads
that only a GPU makes (CUDA's CTC loss reading its lengths: refused by name instead), and the Triton kernel
(the PyTorch recursion is replayed in its place). Those are gpu_check's (check 11).
"""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from benchmarks.graph_safety import HOST_READ_OPS, MASK_INDEX_OPS, PATCHED_METHODS, caller

# The PyTorch loss recursion (the CPU's; CUDA runs the Triton kernel): its host reads are allowed.
CPU_RECURSION = ("icefall_lite/nn/mutual_information_pytorch.py:", "icefall_lite/nn/boundary.py:")


class HostReadInCapture(RuntimeError):
    """A host read while capturing (on CUDA: an error of the capture, or a value frozen at it)."""


def _read_kind(func: Any, args: Tuple, kwargs: dict) -> Any:
    kind = HOST_READ_OPS.get(func)
    if func in MASK_INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
            kind = "bool-index"
    return kind


def _check_read(kind: str) -> None:
    where = caller()
    if where is None or not where.startswith(CPU_RECURSION):
        raise HostReadInCapture(f"{kind} at {where or 'outside icefall_lite'} while capturing the step")


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: List[Tuple[Any, Tuple, dict, Any, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _read_kind(func, args, kwargs)
        if kind is not None:
            _check_read(kind)
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out, torch.is_grad_enabled()))
        return out


class RecordedGraph:
    """The ops of one capture, in order."""

    def __init__(self, ops: List[Tuple[Any, Tuple, dict, Any, bool]]) -> None:
        self.ops = ops

    def replay(self) -> None:
        # Below autograd, as the ops ran at capture (the dispatch mode sees them there), each in the grad mode it
        # ran in (an op may return more with it on: mkldnn's LSTM layer its workspace).
        with torch._C._AutoDispatchBelowADInplaceOrView():
            for func, args, kwargs, out, grad_enabled in self.ops:
                with torch.set_grad_enabled(grad_enabled):
                    result = func(*args, **kwargs)
                inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
                storages = {t.untyped_storage().data_ptr() for t in inputs}
                recorded, _ = tree_flatten(out)
                fresh, _ = tree_flatten(result)
                for o, r in zip(recorded, fresh):
                    if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in storages:
                        o.copy_(r)


class RecordedGraphs:
    """:class:`icefall_lite.train.cuda_graphs.StepGraphs`'s backend on the CPU (see the module's docstring)."""

    captures_run = True

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    @staticmethod
    def eager(fn: Callable[[], Any]) -> Any:
        return fn()

    def capture(self, fn: Callable[[], Any]) -> Tuple[Any, RecordedGraph]:
        patches = [(name, getattr(torch.Tensor, name)) for name in PATCHED_METHODS]

        def patched(name: str, original: Any) -> Any:
            def method(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                _check_read(name)
                return original(tensor, *args, **kwargs)

            return method

        recorder = _Recorder()
        for name, original in patches:
            setattr(torch.Tensor, name, patched(name, original))
        try:
            with recorder:
                out = fn()
        finally:
            for name, original in patches:
                setattr(torch.Tensor, name, original)
        self.captures += 1
        return out, RecordedGraph(recorder.ops)

    def replay(self, graph: RecordedGraph) -> None:
        self.replays += 1
        graph.replay()
