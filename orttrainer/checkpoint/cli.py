"""``python -m orttrainer.checkpoint``: look inside ORTTrainer checkpoints and convert them to PyTorch.

    info PATH                     what the checkpoint holds: model tensors, optimizer state per weight,
                                  trainer_options, train_step_info, partition_info and user_dict presence
    to-pytorch PATH [PATH...] OUT a plain torch.save'd {name: Tensor} of model/full_precision; several files of a
                                  partitioned (ZeRO/Megatron) run are aggregated first

Errors print one line to stderr and exit with status 2; the output file is never overwritten and appears only
when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import h5py
import numpy as np
import torch

from . import layout
from ._atomic import atomic_write, target_exists_error
from .aggregate import aggregate_checkpoints
from .storage import CHECKSUM_ATTRIBUTE, check_links, load, open_checkpoint, read_dataset
from .user_dict import ARRAYS_KEY, FORMAT_KEY, TREE_KEY

# The groups `describe` has a section for; any other top-level key is listed by name.
_KNOWN_KEYS = {
    layout.MODEL,
    layout.OPTIMIZER,
    layout.TRAINER_OPTIONS,
    layout.TRAIN_STEP_INFO,
    layout.PARTITION_INFO,
    layout.USER_DICT,
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, like every other error of this command
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m orttrainer.checkpoint",
        description="Inspect ORTTrainer HDF5 checkpoints (.ortcp) and convert them to PyTorch state_dicts.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    info = commands.add_parser("info", help="print what a checkpoint holds")
    info.add_argument("path", metavar="PATH", help="checkpoint file written by ORTTrainer.save_checkpoint")
    convert = commands.add_parser(
        "to-pytorch",
        help="write model/full_precision as a torch.save'd {name: Tensor}",
        description="Write the model weights as a plain PyTorch state_dict (torch.save of {name: Tensor}). "
        "Give every rank's file of a ZeRO/Megatron run to aggregate them. OUT must not exist.",
    )
    convert.add_argument("paths", nargs="+", metavar="PATH", help="checkpoint file(s)")
    convert.add_argument("output", metavar="OUT", help="PyTorch file to create (e.g. model.pt)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0, or 2 after printing one error line to stderr)."""
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "info":
            print(describe(args.path))
        else:
            print(to_pytorch(args.paths, args.output))
    except Exception as error:  # noqa: BLE001 - the user gets one readable line, not a traceback
        print(f"error: {_message(error)}", file=sys.stderr)
        return 2
    return 0


def _message(error: Exception) -> str:
    if isinstance(error, KeyError) and error.args:
        return str(error.args[0])  # str(KeyError) would add quotes
    if isinstance(error, OSError) and error.filename:
        return f"{error.strerror}: {error.filename}"
    return str(error)


# --- to-pytorch ---------------------------------------------------------------------------------------------------


def to_pytorch(paths: Sequence[str], output: str) -> str:
    """Write the model states of ``paths`` to ``output`` with ``torch.save``; returns a one-line summary.

    Rules: ``output`` must not exist. One file must be unpartitioned; several files are aggregated
    (``aggregate_checkpoints``), which requires one file per rank of a partitioned run.
    """
    if os.path.lexists(output):
        raise target_exists_error(output)
    weights = _read_weights(paths[0]) if len(paths) == 1 else aggregate_checkpoints(paths, pytorch_format=True)
    tensors = {name: torch.as_tensor(np.asarray(value)) for name, value in weights.items()}
    atomic_write(output, lambda handle: torch.save(tensors, handle))
    count = sum(t.numel() for t in tensors.values())
    return f"wrote {len(tensors)} tensors ({count:,} values) to {output}"


def _read_weights(path: str) -> dict[str, Any]:
    options = load(path, key=layout.TRAINER_OPTIONS) if _has_key(path, layout.TRAINER_OPTIONS) else {}
    if layout.is_partitioned(options):
        world_size = int(options.get(layout.WORLD_SIZE, 0))
        rank = int(options.get(layout.WORLD_RANK, 0))
        raise ValueError(
            f"{path} is rank {rank} of a partitioned run (ZeRO or Megatron) of {world_size} ranks: "
            f"pass all {world_size} rank files to aggregate them"
        )
    for precision in layout.PRECISION_KEYS:
        if _has_key(path, f"{layout.MODEL}/{precision}"):
            return load(path, key=f"{layout.MODEL}/{precision}")
    raise ValueError(f"{path} holds no model states ({layout.MODEL}/{layout.PRECISION_KEYS[0]})")


def _has_key(path: str, key: str) -> bool:
    with open_checkpoint(path) as (handle, _):
        return key in handle


# --- info ---------------------------------------------------------------------------------------------------------


def describe(path: str) -> str:
    """A readable report of a checkpoint's contents (shapes and dtypes; tensor data is not read)."""
    with open_checkpoint(path) as (handle, shown_as):
        check_links(handle, shown_as)  # no link out of the file or back into it (storage.py)
        size = os.path.getsize(shown_as) if os.path.isfile(shown_as) else None
        sections = [
            f"checkpoint: {shown_as}" + (f" (HDF5, {size:,} bytes)" if size is not None else ""),
            _model_section(handle),
            _optimizer_section(handle),
            _scalars_section(handle, layout.TRAINER_OPTIONS),
            _scalars_section(handle, layout.TRAIN_STEP_INFO),
            _partition_section(handle),
            _user_dict_section(handle),
            _checksums_section(handle),
        ]
        others = sorted(set(handle) - _KNOWN_KEYS)
        if others:
            sections.append("other keys: " + ", ".join(others))
    return "\n\n".join(sections)


def _model_section(handle: h5py.File) -> str:
    for precision in layout.PRECISION_KEYS:
        key = f"{layout.MODEL}/{precision}"
        if key in handle:
            group = handle[key]
            rows = [(name, _shape(ds), _dtype(ds)) for name, ds in _datasets(group)]
            count = sum(int(np.prod(ds.shape)) for _, ds in _datasets(group))
            title = f"{key}: {_plural(len(rows), 'tensor')}, {count:,} values"
            return "\n".join([title, *_table(("name", "shape", "dtype"), rows)])
    return f"{layout.MODEL}: absent"


def _optimizer_section(handle: h5py.File) -> str:
    if layout.OPTIMIZER not in handle:
        return f"{layout.OPTIMIZER}: absent"
    name_key = f"{layout.TRAINER_OPTIONS}/{layout.OPTIMIZER_NAME}"
    optimizer_name = _text(_read(handle[name_key])) if name_key in handle else "unknown optimizer"
    rows = []
    for weight, group in handle[layout.OPTIMIZER].items():
        if not isinstance(group, h5py.Group):
            rows.append((weight, "", _shape(group), _dtype(group), _small_value(group)))
            continue
        for state, ds in _datasets(group):
            rows.append((weight, state, _shape(ds), _dtype(ds), _small_value(ds)))
    weights = [name for name in handle[layout.OPTIMIZER] if name != layout.SHARED_OPTIMIZER_STATE]
    shared = " and shared state" if layout.SHARED_OPTIMIZER_STATE in handle[layout.OPTIMIZER] else ""
    title = f"{layout.OPTIMIZER}: {optimizer_name}, state for {_plural(len(weights), 'weight')}{shared}"
    if not rows:
        return f"{title} (no optimizer state)"
    return "\n".join([title, *_table(("weight", "state", "shape", "dtype", "value"), rows)])


def _scalars_section(handle: h5py.File, key: str) -> str:
    if key not in handle:
        return f"{key}: absent"
    rows = [(name, _text(_read(ds))) for name, ds in _datasets(handle[key])]
    return "\n".join([f"{key}:", *_table(("option", "value"), rows)])


def _partition_section(handle: h5py.File) -> str:
    if layout.PARTITION_INFO not in handle:
        return f"{layout.PARTITION_INFO}: absent (not a partitioned checkpoint)"
    rows = []
    for weight, group in handle[layout.PARTITION_INFO].items():
        values = {name: _text(_read(ds)) for name, ds in _datasets(group)} if isinstance(group, h5py.Group) else {}
        rows.append((weight, values.get(layout.ORIGINAL_DIM, ""), values.get(layout.MEGATRON_ROW_PARTITION, "")))
    title = f"{layout.PARTITION_INFO}: present for {_plural(len(rows), 'weight')}"
    return "\n".join([title, *_table(("weight", layout.ORIGINAL_DIM, layout.MEGATRON_ROW_PARTITION), rows)])


def _user_dict_section(handle: h5py.File) -> str:
    if layout.USER_DICT not in handle:
        return f"{layout.USER_DICT}: absent"
    node = handle[layout.USER_DICT]
    if not isinstance(node, h5py.Group):
        value = _read(node)
        size = len(value) // 2 if isinstance(value, (bytes, str)) else 0
        return f"{layout.USER_DICT}: present ({size:,} bytes pickled, the original's format; not unpickled here)"
    # JSON is data, not code: reading the tree is safe; the pickled values in it are only counted.
    text = _text(_read(node[TREE_KEY])) if TREE_KEY in node else "null"
    tree = json.loads(text)
    keys = [key for key, _ in tree.get("dict", [])] if isinstance(tree, dict) else []
    arrays = len(node[ARRAYS_KEY]) if ARRAYS_KEY in node else 0
    pickled = text.count('{"pickle":')  # quotes inside JSON strings are escaped: this is only the tag
    shown = ", ".join(repr(key) for key in keys[:10]) + (", ..." if len(keys) > 10 else "")
    return (
        f"{layout.USER_DICT}: present ({_text(_read(node[FORMAT_KEY])) if FORMAT_KEY in node else 'unknown format'}, "
        f"keys {shown or 'none'}; {_plural(arrays, 'array')}, {_plural(pickled, 'pickled value')}, not unpickled here)"
    )


def _checksums_section(handle: h5py.File) -> str:
    datasets: list[h5py.Dataset] = []
    handle.visititems(lambda _, item: datasets.append(item) if isinstance(item, h5py.Dataset) else None)
    filtered = sum(1 for ds in datasets if ds.fletcher32)
    hashed = sum(1 for ds in datasets if CHECKSUM_ATTRIBUTE in ds.attrs)
    missing = len(datasets) - filtered - hashed
    text = f"checksums: fletcher32 on {_plural(filtered, 'array')}, CRC-32 on {_plural(hashed, 'other dataset')}"
    return text + (f"; {missing} without (saved before checksums, not verified)" if missing else "")


# --- formatting ---------------------------------------------------------------------------------------------------


def _read(ds: h5py.Dataset) -> Any:
    # Values shown are verified like loaded ones: a corrupt counter is an error here too, not a wrong number.
    return read_dataset(ds, ds.file.filename)


def _datasets(group: h5py.Group) -> list[tuple[str, h5py.Dataset]]:
    return [(name, item) for name, item in group.items() if isinstance(item, h5py.Dataset)]


def _shape(ds: h5py.Dataset) -> str:
    return "scalar" if ds.shape == () else str(tuple(ds.shape))


def _dtype(ds: h5py.Dataset) -> str:
    return "str" if h5py.check_string_dtype(ds.dtype) else str(ds.dtype)


def _small_value(ds: h5py.Dataset) -> str:
    # Step and Update_Count are one-element counters worth showing; moments are not.
    return _text(_read(ds)) if int(np.prod(ds.shape)) <= 1 else ""


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, np.ndarray):
        return str(value.tolist())
    if isinstance(value, np.generic):
        return str(value.item())
    return str(value)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  " + "  ".join(str(cell).ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()

    return [line(headers), *(line(row) for row in rows)]
