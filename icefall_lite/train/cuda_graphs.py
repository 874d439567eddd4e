"""The training step as CUDA graphs, one per static batch shape (``train.py --cuda-graphs``).

A step of the icefall preset launches thousands of small kernels (cuDNN's LSTM launches per frame), so on
a GPU it waits on the host more than it computes. A CUDA graph records the launches of one step once and
replays them with a single call. What it needs, and where it comes from:

- the same shapes every replay: each batch is padded to one of a few static shapes
  (:func:`icefall_lite.data.static_batch.static_shape`) and copied into that shape's static input tensors;
  one graph per (shape, pruned-loss window);
- no host read and no Python value that changes between steps inside the step
  (:func:`icefall_lite.train.step.step_on_device`; ``tests/test_graph_safety.py`` lists what is left per
  configuration, and :func:`refusals` names the configurations that still read);
- the step's outputs read only after it: each replay's outputs are copied out of the graph's static
  outputs, since the next replay overwrites them.

The eager and the graphed step are one function: the first :data:`WARMUP_STEPS` batch of a shape runs it
eagerly (on a side stream, as torch asks before a capture, so that lazily made state exists), the next is
captured and replayed, and every later batch of that shape replays it. Until the model's warm-up is over
(``2 x --model-warm-step`` batches) the loss weights change between steps as Python floats, so the steps
run eagerly, unpadded. All graphs share one memory pool: what lives from step to step (the optimizer's
state, the gradient controls' histories, the filters' statistics and the clips' counts, updated in place) is
made by an eager step, outside every capture, so no graph's replay writes where another graph's state is
kept. Graphs live as long as the process: kept across epochs, made again after a resume.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from icefall_lite.data.static_batch import BatchTensors, pad_to, static_shape
from icefall_lite.nn import mutual_information
from icefall_lite.train.loss import LossInputs

CUDA_GRAPHS = ("auto", "true", "false")
# Eager steps of a shape before its capture, on the side stream the capture uses: what a step makes lazily
# (the optimizer's state, cuBLAS and cuDNN handles and workspaces of that stream, Triton's compiled kernels)
# exists after one. torch's examples warm up 3 (11 under DDP, which is refused here); a bucketing sampler
# spreads a run's first batches over many shapes (16 batches of train.py on the tiny corpus: 9 shapes, none
# more than 3 times), so each eager step of a shape is one replay fewer.
WARMUP_STEPS = 1


def add_cuda_graphs_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cuda-graphs",
        choices=CUDA_GRAPHS,
        default="auto",
        help="Replay the training step as CUDA graphs, one per static batch shape (batches padded to a few "
        "shapes; the step's statistics read at --log-interval only). auto: on with a CUDA device, where the "
        "configuration allows it (else a log line names what keeps it off); true: on, or an error naming "
        "why not; false: eager steps.",
    )


def refusals(params: Any, world_size: int, triton_missing: bool = False) -> List[str]:
    """What in this configuration keeps the step from being captured, each naming its flag (empty: none).

    These are the configurations whose step reads a value back from the device or changes Python state a
    replay would not change (``tests/test_graph_safety.py`` lists their places)."""
    out = []
    if world_size > 1:
        out.append(f"--world-size {world_size}: DDP's step reads whether a rank's batch has a finite loss")
    if params.scaled_adam_clipping_scale > 0:
        out.append("--scaled-adam-clipping-scale: its norm history is read on the host")
    if params.grad_filter_threshold > 0 and params.grad_filter_mode != "soft":
        out.append(f"--grad-filter-mode {params.grad_filter_mode}: its backward reads a flag on the host")
    if params.autoclip_percentile > 0:
        out.append("--autoclip-percentile: its history grows, a new shape every few steps")
    if params.log_sequence_gradients:
        out.append("--log-sequence-gradients: it logs each row of a batch, and graphed batches carry padding rows")
    if params.print_diagnostics:
        out.append("--print-diagnostics: its hooks keep Python state per step")
    if params.inf_check:
        out.append("--inf-check: its hooks read every module's output on the host")
    if params.ctc_loss_scale > 0:
        out.append("--ctc-loss-scale: torch's CUDA CTC loss copies its lengths to the host")
    if triton_missing:
        out.append("Triton is not installed (pip install triton): the loss recursion without it reads its lengths")
    return out


def use_cuda_graphs(params: Any, device: torch.device, world_size: int) -> bool:
    """Whether ``--cuda-graphs`` turns graphs on for this run; ValueError for ``true`` where they cannot be
    (no CUDA device, or :func:`refusals`), a log line for ``auto`` on CUDA where they cannot."""
    if params.cuda_graphs == "false":
        return False
    if device.type != "cuda":
        if params.cuda_graphs == "true":
            raise ValueError(
                f"--cuda-graphs true needs a CUDA GPU; this run trains on {device} (torch.cuda.is_available() "
                f"is {torch.cuda.is_available()}): use --cuda-graphs auto or false"
            )
        return False
    reasons = refusals(params, world_size, triton_missing=not mutual_information.triton_available())
    if reasons and params.cuda_graphs == "true":
        raise ValueError("--cuda-graphs true cannot capture this configuration's step: " + "; ".join(reasons))
    if reasons:
        logging.info("CUDA graphs off (--cuda-graphs auto): " + "; ".join(reasons))
        return False
    return True


class CudaGraphs:
    """torch's CUDA graphs: eager warm-up steps on a side stream, capture into one shared memory pool,
    replay."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()

    def eager(self, fn: Callable[[], Any]) -> Any:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            out = fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        return out

    def capture(self, fn: Callable[[], Any]) -> Tuple[Any, torch.cuda.CUDAGraph]:
        """``fn`` captured: its outputs (static tensors, filled by each replay) and the graph. Nothing has
        run yet: the caller replays it."""
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the data loader's pin-memory thread goes on allocating while the step is captured.
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            out = fn()
        return out, graph

    # A capture on CUDA records without running: the captured batch still has to be replayed.
    captures_run = False

    @staticmethod
    def replay(graph: torch.cuda.CUDAGraph) -> None:
        graph.replay()


@dataclass
class _Shape:
    """One static shape's eager steps so far, then its static inputs, its graph and its static outputs."""

    eager_steps: int = 0
    inputs: Optional[LossInputs] = None
    graph: Any = None
    outputs: Any = None


class StepGraphs:
    """The training step replayed as one graph per static batch shape.

    ``backend``: :class:`CudaGraphs` (the default), or an object with the same ``eager``, ``capture``,
    ``replay`` and ``captures_run`` (the tests' CPU recorder, which replays the recorded ops).
    ``start_batch``: the first global batch whose step may be captured (the end of the model's warm-up);
    before it the steps run as they come, unpadded. ``warmup_steps``: the eager steps of each shape before
    its capture (a number larger than the run: every step padded and eager, the run a graphed one is
    compared with).
    A capture that fails is an error naming the way out (``--cuda-graphs false``, resuming from the last
    checkpoint): after a failed capture CUDA's state (its random generator among it) is not known good.
    """

    def __init__(
        self, device: torch.device, start_batch: int, backend: Any = None, warmup_steps: int = WARMUP_STEPS
    ) -> None:
        self.device = device
        self.start_batch = start_batch
        self._backend = backend
        self.warmup_steps = warmup_steps
        self.shapes: Dict[Tuple[Tuple[int, int, int], int], _Shape] = {}

    @property
    def backend(self) -> Any:
        if self._backend is None:  # made at the first step that needs it (its stream and pool are CUDA's)
            self._backend = CudaGraphs()
        return self._backend

    def run(self, step: Callable[[Any, LossInputs], Any], t: Any, inputs: LossInputs) -> Any:
        """``step(t, inputs)`` on ``inputs`` padded to its static shape: eagerly, captured, or replayed;
        returns its outputs (copies, which the next replay does not overwrite)."""
        if t.params.batch_idx_train < self.start_batch:
            return step(t, inputs)
        tensors = pad_to(inputs.tensors, static_shape(*inputs.tensors.shape))
        padded = dataclasses.replace(inputs, tensors=tensors.pin_memory() if self.device.type == "cuda" else tensors)
        key = (padded.tensors.shape, padded.prune_range)
        shape = self.shapes.setdefault(key, _Shape())
        if shape.graph is None and shape.eager_steps < self.warmup_steps:
            shape.eager_steps += 1
            return self.backend.eager(lambda: step(t, padded))
        if shape.graph is None:
            shape.inputs = dataclasses.replace(padded, tensors=padded.tensors.to(self.device), cut_ids=[])
            try:
                shape.outputs, shape.graph = self.backend.capture(lambda: step(t, shape.inputs))
            except Exception as e:
                raise RuntimeError(
                    f"capturing the training step as a CUDA graph failed at global batch {t.params.batch_idx_train} "
                    f"(batch shape {key[0]}): {type(e).__name__}: {e}. Train without graphs: add --cuda-graphs "
                    "false (the run resumes from its last checkpoint)"
                ) from e
            logging.info(
                f"Captured the training step for batches of shape {key[0]} (pruned window {key[1]}): "
                f"{len(self.shapes)} graph(s)"
            )
            if not self.backend.captures_run:
                self.backend.replay(shape.graph)
            return copy_tensors(shape.outputs)
        _copy_into(shape.inputs.tensors, padded.tensors)
        self.backend.replay(shape.graph)
        return copy_tensors(shape.outputs)


def _copy_into(static: BatchTensors, batch: BatchTensors) -> None:
    """``batch`` (pinned host memory on CUDA) into a shape's static inputs, asynchronously."""
    for f in dataclasses.fields(BatchTensors):
        getattr(static, f.name).copy_(getattr(batch, f.name), non_blocking=True)


def copy_tensors(value: Any) -> Any:
    """``value`` with every tensor in it copied (dataclasses and dicts, their types kept: a step's outputs)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(
            value, **{f.name: copy_tensors(getattr(value, f.name)) for f in dataclasses.fields(value)}
        )
    if isinstance(value, dict):
        out = type(value)()
        out.update({k: copy_tensors(v) for k, v in value.items()})
        return out
    return value
