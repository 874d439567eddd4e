"""What stops a training step from being captured as a CUDA graph, found on any device (the CPU included).

A CUDA graph replays the kernels of one captured call: nothing in the step may wait for the device to hand a
value to Python (a *host read*: ``.item()``, ``float()``, ``bool()``, ``.tolist()``, ``.numpy()``, ``.cpu()``,
an op whose output size depends on values such as ``nonzero`` or a boolean-mask index, ``torch.equal``), nothing
may copy Python data to the device (``torch.tensor(list)``: a copy from pageable host memory, frozen at capture),
and no Python value that changes from step to step may reach an op (the graph keeps the value it saw at capture).

:class:`GraphSafetyProbe` is a ``TorchDispatchMode`` that records both while the step runs, each event with the
place in the code that caused it (the innermost frame under ``icefall_lite/``, as ``path:function``):

- :attr:`GraphSafetyProbe.host_reads`: a :class:`Site` per host read or copy from Python data. The ops are
  those whose *result* Python reads, so on the CPU (where every tensor is a host tensor) the probe finds what a
  GPU would wait for, and nothing that would stay on the device there. ``Tensor.tolist``, ``numpy`` and ``cpu``
  do not pass through the dispatcher: they are patched for the duration.
- :attr:`GraphSafetyProbe.trace`: every op with its non-tensor arguments (Python numbers, shapes, dtypes) and its
  tensors' shapes. :func:`changing_values` compares the traces of two steps of one batch shape at different
  step numbers: a position where they differ is a Python value (or a branch taken on one) that a graph
  would freeze.

Ops run inside Triton's CPU interpreter (``TRITON_INTERPRET=1``) are device code on a GPU and are not recorded.
"""

from __future__ import annotations

import collections
import difflib
import sys
from dataclasses import dataclass
from typing import Any, Counter, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

# Ops whose result Python reads, or whose output size depends on the values of their input (the device must
# finish before the host can allocate the output), by the name the probe reports.
HOST_READ_OPS = {
    aten._local_scalar_dense.default: "item",  # .item(), float(), int(), bool(), a tensor in an `if`
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten.equal.default: "equal",
    aten.lift_fresh.default: "from-python",  # torch.tensor(python data): a copy from pageable host memory
    aten._unique2.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.repeat_interleave.Tensor: "repeat_interleave",
}
# Ops that read a boolean mask's values to size their work (x[mask], x[mask] = v).
MASK_INDEX_OPS = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)
# Tensor methods that hand device memory to Python without the dispatcher seeing them.
PATCHED_METHODS = ("tolist", "numpy", "cpu")
PACKAGE = "icefall_lite"


@dataclass(frozen=True)
class Site:
    """A host read: its kind (a key's value of :data:`HOST_READ_OPS`, ``bool-index``, or a patched method's
    name) and where the code asked for it (``icefall_lite/...py:function``)."""

    kind: str
    where: str

    def __str__(self) -> str:
        return f"{self.where} ({self.kind})"


@dataclass(frozen=True)
class Op:
    """One op of a trace: its name, where it was called from, and its arguments with every tensor replaced by
    its (shape, dtype)."""

    name: str
    where: str
    args: Tuple[Any, ...]


def caller(package: str = PACKAGE) -> Optional[str]:
    """``<package>/<path>:<function>`` of the innermost frame in ``package`` (None: not called from it, or
    called from inside Triton's interpreter, i.e. a kernel)."""
    frame = sys._getframe(1)  # frame objects, not traceback.extract_stack: that reads every file's source lines
    where = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if "/triton/" in filename:
            return None
        if where is None and f"/{package}/" in filename:
            inner = filename[filename.rindex(f"/{package}/") + 1 :]
            where = f"{inner}:{frame.f_code.co_name}"
        frame = frame.f_back
    return where


def _describe(x: Any) -> Any:
    """A tensor as (shape, dtype); a number, string, dtype, device, memory format or layout as it is; any other
    object (a profiler's record, a scripted class) by its type."""
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.dtype)
    if isinstance(x, float) and x != x:
        return "nan"  # NaN != NaN: a constant NaN is the same value in both steps
    if x is None or isinstance(x, (bool, int, float, complex, str, torch.dtype, torch.device)):
        return x
    if isinstance(x, (torch.memory_format, torch.layout)):
        return x
    return type(x).__name__


class GraphSafetyProbe(TorchDispatchMode):
    """Records the host reads (:attr:`host_reads`) and the ops with their Python arguments (:attr:`trace`) of
    the code run inside it, each at its place in ``package`` (a directory name: the library's, or ``tests`` to
    check the probe). Use as a context manager; nothing is recorded for ops not called from the package."""

    def __init__(self, package: str = PACKAGE) -> None:
        super().__init__()
        self.package = package
        self.host_reads: List[Site] = []
        self.trace: List[Op] = []
        self._patches: List[Tuple[str, Any]] = []

    def _record_read(self, kind: str, where: Optional[str]) -> None:
        if where is not None:
            self.host_reads.append(Site(kind, where))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        where = caller(self.package)
        if where is not None:
            kind = HOST_READ_OPS.get(func)
            if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None:
                kind = None  # the output size is given: no read
            if func in MASK_INDEX_OPS:
                indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
                if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
                    kind = "bool-index"
            if kind is not None:
                self._record_read(kind, where)
            flat, _ = tree_flatten((args, kwargs))
            self.trace.append(Op(str(func), where, tuple(_describe(x) for x in flat)))
        return func(*args, **kwargs)

    def __enter__(self) -> "GraphSafetyProbe":
        for name in PATCHED_METHODS:
            original = getattr(torch.Tensor, name)
            self._patches.append((name, original))
            setattr(torch.Tensor, name, self._patched(name, original))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            return super().__exit__(*exc)
        finally:
            for name, original in self._patches:
                setattr(torch.Tensor, name, original)
            self._patches = []

    def _patched(self, name: str, original: Any) -> Any:
        probe = self

        def method(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            probe._record_read(name, caller(probe.package))
            return original(tensor, *args, **kwargs)

        return method

    def read_sites(self) -> Counter[Site]:
        """How many times each site read, over everything run inside the probe."""
        return collections.Counter(self.host_reads)


def changing_values(first: Sequence[Op], second: Sequence[Op]) -> List[str]:
    """The places (``path:function``) where two traces of the same code differ, each once, in order of first
    difference: an op whose Python arguments or tensor shapes differ, and ops that only one trace has (a branch
    taken on a Python value). The traces are aligned by (op, place) with difflib, so one branch does not hide
    the differences after it."""
    keys = [[(op.name, op.where) for op in trace] for trace in (first, second)]
    matcher = difflib.SequenceMatcher(None, keys[0], keys[1], autojunk=False)
    places: List[str] = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            places += [first[i1 + k].where for k in range(i2 - i1) if first[i1 + k].args != second[j1 + k].args]
        else:
            places += [op.where for op in (*first[i1:i2], *second[j1:j2])]
    return list(dict.fromkeys(places))
