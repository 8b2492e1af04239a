"""Give every Dropout node its own random stream, positioned where the trainer left it.

ONNX Runtime's Dropout draws its mask from an engine seeded per computation. Without a `seed` attribute every Dropout
of every session in the process shares one global counter (`set_seed`), so two trainers change each other's masks
and a resumed run cannot continue the sequence. With `seed = s` a node owns its counter: its k-th computation
uses seed `s + k - 1` (docs/engine.md §9). The engine reduces
seeds modulo `SEED_MODULUS` (2**31 - 1) and treats 0 as 1.

Rule (`seed_dropouts`): the i-th Dropout node of the default domain (in node order) gets
`seed = 1 + (base + i * STREAM_STRIDE + position) mod (SEED_MODULUS - 1)`, so a session created after `position`
computations continues each node's stream exactly, and nodes' streams do not overlap for STREAM_STRIDE (about 16.7
million) computations when a graph has at most 128 Dropout nodes. The model is copied; other nodes are untouched.
"""

from __future__ import annotations

from functools import partial

import onnx
from onnx import helper

from .editor import copy_model
from .passes import FunctionPass, Problem, require

SEED_MODULUS = 2**31 - 1  # minstd_rand0's modulus: seeds s and s + SEED_MODULUS give the same engine
STREAM_STRIDE = (SEED_MODULUS - 1) // 128


def dropout_nodes(model: onnx.ModelProto) -> list[int]:
    """Indices of the Dropout nodes (default domain) in node order."""
    return [i for i, n in enumerate(model.graph.node) if n.op_type == "Dropout" and n.domain in ("", "ai.onnx")]


def dropout_seed(base: int, index: int, position: int) -> int:
    """The `seed` attribute of the `index`-th Dropout node for a session created after `position` computations."""
    if base < 0 or index < 0 or position < 0:
        raise ValueError(f"dropout seeds need non-negative base, index and position, got {(base, index, position)}")
    return 1 + (base + index * STREAM_STRIDE + position) % (SEED_MODULUS - 1)


def seed_dropouts(model: onnx.ModelProto, base: int, position: int) -> onnx.ModelProto:
    """Apply the rule above (a copy); a model without Dropout nodes is returned as is.

    Precondition: `base` and `position` are non-negative, and the graph has at most 128 Dropout nodes (beyond that
    their streams would overlap within STREAM_STRIDE computations)."""
    require("seed_dropouts", _seeds_problem(model, base, position))
    indices = dropout_nodes(model)
    if not indices:
        return model
    result = copy_model(model)
    for k, i in enumerate(indices):
        node = result.graph.node[i]
        kept = [a for a in node.attribute if a.name != "seed"]
        del node.attribute[:]
        node.attribute.extend([*kept, helper.make_attribute("seed", dropout_seed(base, k, position))])
    return result


def _seeds_problem(model: onnx.ModelProto, base: int, position: int) -> Problem:
    if base < 0 or position < 0:
        return f"the stream's base seed and position must be non-negative, got {base} and {position}"
    count = len(dropout_nodes(model))
    if count > (SEED_MODULUS - 1) // STREAM_STRIDE:
        return f"the graph has {count} Dropout nodes; per-node streams are laid out for at most 128"
    return None


def seed_dropouts_pass(base: int, position: int) -> FunctionPass:
    """`seed_dropouts` as a pass."""
    return FunctionPass(
        "seed_dropouts",
        partial(seed_dropouts, base=base, position=position),
        partial(_seeds_problem, base=base, position=position),
    )
