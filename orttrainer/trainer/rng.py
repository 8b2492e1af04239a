"""Each trainer's own dropout random stream, and its position, so masks never depend on other trainers in the process
and a resumed run draws exactly the masks the uninterrupted run would have drawn.

Rule: the stream starts at `base = 1 + torch.initial_seed() mod 2**30` (so `torch.manual_seed` makes runs
repeatable, as before), taken when the trainer is built. Every training graph gets per-node Dropout seeds for the
position its stream has reached (`graph/dropout_seeds.py`, docs/engine.md §9): one position per graph key — one key
for a graph with dynamic shapes, one per input-shape signature for the torch builder's per-shape graphs, which run
separate sessions. A training run that completes moves its key's position by one (every Dropout computes once per
forward pass; recompute reuses the mask). The base and the positions are part of the state dict (`rng/...`); loading
them makes the sessions be created again at the loaded positions. A model without Dropout has no stream to save,
and its state dict keeps the legacy layout.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx
import torch

from .graph.dropout_seeds import STREAM_STRIDE, dropout_nodes, seed_dropouts_pass
from .graph.passes import run_passes
from .shapes import shape_signature

ALL_SHAPES = "all"  # the key of a graph that runs every input shape


def default_base_seed() -> int:
    """`1 + torch.initial_seed() mod 2**30`. Why the 1: seed 0 acts as seed 1 in ONNX Runtime's engine
    (docs/engine.md §9), so `torch.manual_seed(0)` would repeat its first mask."""
    return 1 + torch.initial_seed() % (1 << 30)


@dataclass
class DropoutStreams:
    """The trainer's dropout stream: `base` seed and the number of training runs per graph key."""

    base: int = field(default_factory=default_base_seed)
    positions: dict[str, int] = field(default_factory=dict)
    active: bool = False  # a training graph with Dropout nodes was seeded: the stream is part of the state

    def seeded(self, model: onnx.ModelProto, key: str) -> onnx.ModelProto:
        """`model` with its Dropout nodes seeded for `key`'s current position (graphs of other keys start at a
        different offset of the stream, so two shape signatures do not repeat each other's masks)."""
        if not dropout_nodes(model):
            return model
        self.active = True
        return run_passes(model, [seed_dropouts_pass(self.base + _key_offset(key), self.positions.get(key, 0))])

    def advance(self, key: str) -> None:
        """One completed training run of the graph for `key`."""
        self.positions[key] = self.positions.get(key, 0) + 1

    def state(self) -> dict[str, Any]:
        """The state dict entry: `{'seed': base, 'positions': {key: runs}}`."""
        return {"seed": self.base, "positions": dict(self.positions)}

    def load(self, saved: dict[str, Any]) -> bool:
        """Adopt a saved entry; returns whether anything changed (the sessions must then be created again)."""
        base = int(saved["seed"])
        positions = {_text(k): int(v) for k, v in dict(saved.get("positions", {})).items()}
        changed = (base, positions) != (self.base, self.positions)
        self.base, self.positions = base, positions
        return changed


def signature_key(signature: tuple[tuple[tuple[int, ...], str], ...] | None) -> str:
    """A readable key for a shape signature (an HDF5 name: no '/'); `ALL_SHAPES` for graphs with dynamic shapes."""
    if signature is None:
        return ALL_SHAPES
    return "|".join("x".join(str(d) for d in shape) + ":" + dtype.removeprefix("torch.") for shape, dtype in signature)


def stream_key(model: onnx.ModelProto, inputs: Sequence[torch.Tensor]) -> str:
    """The stream key of a training graph run on `inputs`: `ALL_SHAPES` when the graph has no data inputs to
    specialise on or any of its inputs has a dynamic dim (it serves many signatures, one stream), else the key of
    `inputs`' shape signature."""
    if not inputs or any(_has_dynamic_dim(i) for i in model.graph.input):
        return ALL_SHAPES
    return signature_key(shape_signature(inputs))


def _has_dynamic_dim(value: onnx.ValueInfoProto) -> bool:
    tensor = value.type.tensor_type
    return tensor.HasField("shape") and any(not d.HasField("dim_value") for d in tensor.shape.dim)


def _key_offset(key: str) -> int:
    return 0 if key == ALL_SHAPES else zlib.crc32(key.encode()) % STREAM_STRIDE


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
