"""Recurrent layers (nn.LSTM, nn.GRU, nn.RNN) as the torch builder traces them: layer by layer, with the dropout
between layers that eager PyTorch applies, and an LSTM's or GRU's layer's recurrence over time as one op whose backward
is one op, so that the trace does not grow with the sequence (the ONNX translation unrolls both ops:
gradient/aten_onnx.py).

Rule: `lstm` and `single_state_rnn(op)` (the "autograd"-stage decompositions of `aten.lstm.input`, `aten.gru.input`,
`aten.rnn_tanh.input` and `aten.rnn_relu.input`, torch_private/decompositions.py) compute what the op computes: each
layer, both directions, then in training mode dropout at p on its output unless it is the last layer. A layer is
PyTorch's own decomposition of the op for one layer, except an LSTM's or GRU's layers in a trace for the direct
translation (`torch_trace.for_direct_translation`). Those run feature-major — a sequence is [features, T·B], column
t·B + b holding sample b at step t — from the first layer's input to the last layer's output: per layer and
direction, gates_x = W_ih·x + b_ih (+ b_hh for an LSTM) over all steps at once, then the recurrence in time order
(reversed for the reverse direction):
- `lstm_recurrence(gates_x, h0, c0, W_hh, reverse)`: gates = gates_x's step t + W_hh·hᵀ, i, f, o = σ(their parts),
  g = tanh(its part), c = f·c + i·g, h = o·tanh(c); it returns every step's h, c and activated gates (i, f, g, o);
- `gru_recurrence(gates_x, h0, W_hh, b_hh, reverse)`: gh = W_hh·hᵀ + b_hh, r, z = σ(gates_x's + gh's r, z parts),
  n = tanh(gates_x's n + r·gh's n), h = n + z·(h - n); it returns every step's h and r, z, n, gh's n.
The layer's output is the h's (both directions stacked), its final states the last step taken's. Each recurrence's
backward is one op too (`lstm_recurrence_backward`, `gru_recurrence_backward`: the gates' gradient at every step), and
W_hh's gradient one product over all steps, d gates·(the previous steps' h)ᵀ.

Feature-major because each step's product is then W_hh·hᵀ ([4H, H]·[H, B]), whose large operand ONNX Runtime reads
as it is; h·W_hhᵀ ([B, H]·[H, 4H]) packs W_hh's 1 MB on every call, twice as slow, and the layers would pass their
sequences transposed (docs/engine.md §23).

A layer is PyTorch's decomposition (the recurrence traced step by step) for an LSTM with projections (`proj_size`),
tensors other than float32, and the traces made for torch.onnx, which has no translation of these ops (a
dynamic-shape graph, or a graph the direct translation does not cover). Switch:
`graph/passes.rewrite_enabled("recurrences_as_one_op")`.

Why: PyTorch's decomposition loops over the time steps in Python, and AOTAutograd traces every step's cell, forward
and backward, op by op, at about a millisecond per op: the benchmark LSTM (2 layers, 64 steps) was 9,000 traced nodes
and most of an 8.3 s first step, 1.8 s now (docs/engine.md §23). And PyTorch's decomposition (torch 2.13's
`_rnn_helper`) applies the dropout between layers only when `num_layers < i - 1`, which never holds: a traced
`nn.LSTM(dropout=p)` (GRU, RNN) trained without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType

import torch

__all__ = ["lstm", "recurrent_ops", "single_state_rnn"]


def lstm(
    input: torch.Tensor,
    hx: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    batch_first: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`aten.lstm.input` layer by layer (module docstring)."""
    group = 4 if has_biases else 2
    if _one_op(input, list(hx), params, num_layers * (2 if bidirectional else 1) * group):

        def direction(x: torch.Tensor, k: int, reverse: bool) -> tuple[torch.Tensor, ...]:
            w_ih, w_hh, *biases = params[k * group : (k + 1) * group]
            gates_x = w_ih @ x if not biases else w_ih @ x + (biases[0] + biases[1]).unsqueeze(1)
            hs, cs, _ = recurrent_ops().lstm_recurrence(gates_x, hx[0][k], hx[1][k], w_hh, reverse)
            return hs, cs

        output, *final = _feature_major(direction, 2, input, num_layers, dropout, train, bidirectional, batch_first)
        return output, final[0], final[1]

    def layer(x: torch.Tensor, states: list[torch.Tensor], weights: Sequence[torch.Tensor]) -> tuple:
        return _pytorch(torch.ops.aten.lstm.input)(x, states, weights, has_biases, 1, 0.0, train, bidirectional, False)

    output, *final = _layer_by_layer(
        layer, input, list(hx), params, num_layers, dropout, train, bidirectional, batch_first
    )
    return output, final[0], final[1]


def single_state_rnn(op: torch._ops.OpOverload):  # noqa: ANN201 - a decomposition of `op`'s signature
    """The decomposition of `op` (`aten.gru.input`, `aten.rnn_tanh.input`, `aten.rnn_relu.input`: one state tensor)
    layer by layer (module docstring)."""

    def decomposition(
        input: torch.Tensor,
        hx: torch.Tensor,
        params: Sequence[torch.Tensor],
        has_biases: bool,
        num_layers: int,
        dropout: float,
        train: bool,
        bidirectional: bool,
        batch_first: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        group = 4 if has_biases else 2
        if op == torch.ops.aten.gru.input and _one_op(
            input, [hx], params, num_layers * (2 if bidirectional else 1) * group
        ):

            def direction(x: torch.Tensor, k: int, reverse: bool) -> tuple[torch.Tensor, ...]:
                w_ih, w_hh, *biases = params[k * group : (k + 1) * group]
                gates_x = w_ih @ x if not biases else w_ih @ x + biases[0].unsqueeze(1)
                hs, _ = recurrent_ops().gru_recurrence(gates_x, hx[k], w_hh, biases[1] if biases else None, reverse)
                return (hs,)

            output, final = _feature_major(direction, 1, input, num_layers, dropout, train, bidirectional, batch_first)
            return output, final

        def layer(x: torch.Tensor, states: list[torch.Tensor], weights: Sequence[torch.Tensor]) -> tuple:
            return _pytorch(op)(x, states[0], weights, has_biases, 1, 0.0, train, bidirectional, False)

        output, final = _layer_by_layer(
            layer, input, [hx], params, num_layers, dropout, train, bidirectional, batch_first
        )
        return output, final

    return decomposition


def _feature_major(
    direction: Callable[[torch.Tensor, int, bool], tuple[torch.Tensor, ...]],
    states: int,
    input: torch.Tensor,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    batch_first: bool,
) -> tuple[torch.Tensor, ...]:
    """(output, each of the `states` final states [layers · directions, B, H]) of the layers with their
    recurrences as one op each, feature-major from the first layer's input to the last layer's output ([features,
    T·B], column t·B + b), so that neither the layers' inputs nor their gates are transposed between layers;
    `direction(x, k, reverse)` runs direction k (layer · directions + direction) over feature-major x and returns
    its feature-major per-step states (h first)."""
    steps, batch = (input.shape[1], input.shape[0]) if batch_first else (input.shape[0], input.shape[1])
    # to [F, T·B] by a swap of the leading dims (rows move whole) and a 2-d transpose: ONNX Runtime's Transpose
    # reverses [B, T, F] in one go 6x slower (docs/engine.md §23)
    x = (input.transpose(0, 1) if batch_first else input).reshape(steps * batch, input.shape[2]).t()
    directions = 2 if bidirectional else 1
    finals: list[list[torch.Tensor]] = [[] for _ in range(states)]
    for layer in range(num_layers):
        outputs = []
        for d in range(directions):
            reverse = d == 1
            per_step = direction(x, layer * directions + d, reverse)
            last = slice(0, batch) if reverse else slice((steps - 1) * batch, steps * batch)  # the last step taken
            outputs.append(per_step[0])
            for kept, values in zip(finals, per_step, strict=True):
                kept.append(values[:, last].t())
        x = outputs[0] if directions == 1 else torch.cat(outputs, 0)
        if dropout and train and layer < num_layers - 1:
            x = torch.dropout(x, dropout, train=True)
    output = x.t().reshape(steps, batch, x.shape[0])
    output = output.transpose(0, 1) if batch_first else output
    return output, *(torch.stack(kept) for kept in finals)


def _layer_by_layer(
    layer: Callable[[torch.Tensor, list[torch.Tensor], Sequence[torch.Tensor]], tuple],
    input: torch.Tensor,
    states: list[torch.Tensor],
    params: Sequence[torch.Tensor],
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    batch_first: bool,
) -> tuple[torch.Tensor, ...]:
    """(output, each final state [layers · directions, B, ·]) of `num_layers` layers over `input`, each
    `layer(time-major x, its slices of `states`, its weights) -> (output, final states...)`, with dropout between
    layers in training mode."""
    directions = 2 if bidirectional else 1
    per_layer = len(params) // num_layers
    x = input.transpose(0, 1) if batch_first else input
    finals: list[list[torch.Tensor]] = [[] for _ in states]
    for index in range(num_layers):
        first, last = index * directions, (index + 1) * directions
        x, *final = layer(x, [s[first:last] for s in states], params[index * per_layer : (index + 1) * per_layer])
        for kept, value in zip(finals, final, strict=True):
            kept.append(value)
        if dropout and train and index < num_layers - 1:
            x = torch.dropout(x, dropout, train=True)
    output = x.transpose(0, 1) if batch_first else x
    return output, *(torch.cat(kept) for kept in finals)


def recurrent_ops() -> ModuleType:
    """gradient/recurrent_ops.py, imported (its ops registered) on first use: a trace that writes a recurrence as one
    op; not at orttrainer's import or in a process whose graphs come from the compile cache (4 registrations,
    ~20 ms)."""
    from . import recurrent_ops as ops

    return ops


def _direct_translation() -> bool:
    """Whether the trace running in this thread is for the direct translation (which unrolls the recurrence ops) and
    the switch `recurrences_as_one_op` is on."""
    from ..graph.passes import rewrite_enabled
    from .torch_trace import for_direct_translation

    return for_direct_translation() and rewrite_enabled("recurrences_as_one_op")


def _pytorch(op: torch._ops.OpOverload) -> Callable:
    from .torch_private import pytorch_decomposition

    return pytorch_decomposition(op)


def _one_op(input: torch.Tensor, hx: list[torch.Tensor], params: Sequence[torch.Tensor], count: int) -> bool:
    """Whether a layer's recurrence is one op: enabled, no projection (an LSTM's h and c alike; `count` weights),
    float32 throughout, 3-d input."""
    tensors = [input, *hx, *params]
    return (
        _direct_translation()
        and input.dim() == 3
        and all(h.shape == hx[0].shape for h in hx)
        and len(params) == count
        and all(t.dtype == torch.float32 for t in tensors)
    )
