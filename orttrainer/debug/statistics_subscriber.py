"""``StatisticsSubscriber``: one statistics file per activation, forward and backward, per step.

Layout (legacy, ``docs/debugging.md`` §2.3): ``<dir>/step_<N>/<name>_forward``,
``<dir>/step_<N>/<name>_backward`` and ``<dir>/step_<N>/order.txt``, which gets one line (the file name) appended
per dump, so it lists dumps in execution order: forward in post-hook order (children before parents), backward in
autograd order. Module outputs are named ``{ClassName}_{module_index}_{k}th_output`` (``0th``, ``1th``, ... as
legacy). A backward file goes to the step of the forward that produced the tensor.

Decisions (differences from legacy ORT 1.19.2):

* ``output_dir``: if it exists and is not empty, ``override_output_dir=False`` raises ``FileExistsError`` naming
  it and deletes nothing; ``True`` deletes its contents at construction (legacy: any existing directory, even an
  empty one, was an error). A path that is a file is always an error.
* Per-rank directories: when ``torch.distributed`` is initialized with ``world_size > 1`` at construction, files
  go to ``<output_dir>/rank_<r>`` and each rank checks and clears only its own ``rank_<r>`` (no cross-rank race).
  Construct the subscriber after ``init_process_group``.
* ``inspect_activation`` honours ``[start_step, end_step)`` like module outputs (legacy dumped it in every step).
* Statistics: correct std on every path, bool/empty tensors supported (see ``statistics.py``).
* Every keyword after ``output_dir`` is keyword-only (the legacy positional order was different, so a positional
  call would silently mean something else). ``bucket_size=None`` means the legacy default.
* No NVTX ranges: the legacy decorator crashed on CPU-only torch builds.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import torch

from ._tap import tap
from .statistics import TensorStatistics, _check_direction, compute_statistics, format_statistics
from .subscriber import RuntimeStates, SubscriberBase

ORDER_FILE = "order.txt"


def module_activation_name(class_name: str, module_index: int, tensor_index: int, call: int = 1) -> str:
    """Name of a module's ``tensor_index``-th output tensor; calls after the first in a step get ``_call<c>``."""
    name = f"{class_name}_{module_index}_{tensor_index}th_output"
    return name if call <= 1 else f"{name}_call{call}"


def activation_file_name(name: str, direction: str) -> str:
    """``<name>_forward`` or ``<name>_backward``: the file name and the line written to order.txt."""
    _check_direction(direction)
    return f"{name}_{direction}"


def step_dir(output_dir: str | os.PathLike, step: int) -> Path:
    """``<output_dir>/step_<step>``: where one step's files and order.txt go."""
    return Path(output_dir) / f"step_{step}"


def write_statistics(
    output_dir: str | os.PathLike, step: int, name: str, direction: str, stats: TensorStatistics, depth: int = -1
) -> Path:
    """Write ``<output_dir>/step_<step>/<name>_<direction>`` and append its file name to that step's order.txt.

    This is the single writer of both collection paths; ``output_dir`` is used as given (already per rank).
    The step directory is created when missing; an existing file of the same name is replaced.
    """
    folder = step_dir(output_dir, step)
    folder.mkdir(parents=True, exist_ok=True)
    file_name = activation_file_name(name, direction)
    text = format_statistics(name, direction, stats, depth)
    with open(folder / ORDER_FILE, "a", encoding="utf-8", newline="\n") as order:
        order.write(f"{file_name}\n")
    path = folder / file_name
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    return path


def rank_output_dir(output_dir: str | os.PathLike) -> Path:
    """``output_dir``, or ``output_dir/rank_<r>`` when torch.distributed runs with more than one process."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return Path(output_dir) / f"rank_{dist.get_rank()}"
    return Path(output_dir)


def prepare_output_dir(path: Path, override: bool) -> None:
    """Apply the ``override_output_dir`` rule to ``path`` (see the module docstring)."""
    if not path.exists():
        return
    if not path.is_dir():
        raise NotADirectoryError(f"Output directory {path} exists and is not a directory.")
    if not any(path.iterdir()):
        return
    if not override:
        raise FileExistsError(
            f"Output directory {path} already exists and is not empty. Set override_output_dir=True for "
            "StatisticsSubscriber to replace its contents, or choose another directory."
        )
    warnings.warn(f"Output directory {path} already exists, overriding it.", stacklevel=3)
    shutil.rmtree(path)


class StatisticsSubscriber(SubscriberBase):
    """Dump statistics of every module output and ``inspect_activation`` tensor, and of their gradients.

    Args:
        output_dir: where ``step_<N>/`` folders are written (per rank in a multi-process run).
        override_output_dir: replace the contents of a non-empty ``output_dir`` instead of raising.
        start_step, end_step: dump only steps in ``[start_step, end_step)``; ``None`` means unbounded.
        run_on_cpu: copy each tensor to CPU before reducing (a last resort when dumping runs out of device memory).
        bucket_size: elements reduced at once; ``None`` means the legacy default (536870912).
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        *,
        override_output_dir: bool = False,
        start_step: int | None = None,
        end_step: int | None = None,
        run_on_cpu: bool = False,
        bucket_size: int | None = None,
    ) -> None:
        super().__init__(start_step, end_step)
        if bucket_size is not None and (
            isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size <= 0
        ):
            raise ValueError(f"bucket_size must be a positive int or None, got {bucket_size!r}")
        self._output_dir = rank_output_dir(output_dir)
        self._run_on_cpu = run_on_cpu
        self._bucket_size = bucket_size
        prepare_output_dir(self._output_dir, override_output_dir)

    @property
    def output_dir(self) -> Path:
        """The directory files go to (``rank_<r>`` included)."""
        return self._output_dir

    def compute(self, tensor: torch.Tensor) -> TensorStatistics:
        """Statistics of ``tensor`` with this subscriber's ``run_on_cpu``/``bucket_size``."""
        return compute_statistics(tensor, bucket_size=self._bucket_size, run_on_cpu=self._run_on_cpu)

    def dump(self, step: int, name: str, direction: str, stats: TensorStatistics, depth: int = -1) -> Path:
        """Write one statistics file into this subscriber's directory (no range check: the caller decides)."""
        return write_statistics(self._output_dir, step, name, direction, stats, depth)

    def post_forward_tensor_apply_impl(
        self, run_ctx: RuntimeStates, module: torch.nn.Module, tensor_index: int, tensor: torch.Tensor
    ) -> torch.Tensor:
        """Dump the output tensor's statistics now and its gradient's in backward (the module's depth as prefix)."""
        states = run_ctx.global_states
        index = states.module_to_module_index[module]
        call = states.module_call_count.get(index, 1)
        name = module_activation_name(type(module).__name__, index, tensor_index, call)
        return self._tap(name, states.module_index_to_depth[index], states.execution_step, tensor)

    def inspect_activation_apply_impl(self, run_ctx: RuntimeStates, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Dump an ``inspect_activation`` tensor (and later its gradient) under ``name``, depth -1."""
        return self._tap(name, -1, run_ctx.global_states.execution_step, tensor)

    def _tap(self, name: str, depth: int, step: int, tensor: torch.Tensor) -> torch.Tensor:
        # The step is bound now: the gradient arrives after the counter has moved on and belongs to this forward.
        return tap(
            tensor,
            lambda value: self.dump(step, name, "forward", self.compute(value), depth),
            lambda grad: self.dump(step, name, "backward", self.compute(grad), depth),
        )
