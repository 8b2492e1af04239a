"""Recurrent layers (nn.LSTM, nn.GRU, nn.RNN) as the torch builder traces them: layer by layer, with the dropout
between layers that eager PyTorch applies, and an LSTM layer's recurrence over time as one op whose backward is one op,
so that the trace does not grow with the sequence (the ONNX translation unrolls both ops: gradient/aten_onnx.py).

Rule: `lstm` and `single_state_rnn(op)` (the "autograd"-stage decompositions of `aten.lstm.input`, `aten.gru.input`,
`aten.rnn_tanh.input` and `aten.rnn_relu.input`, torch_private/decompositions.py) compute what the op computes: each
layer, both directions, then in training mode dropout at p on its output unless it is the last layer. A layer is
PyTorch's own decomposition of the op for one layer, except an LSTM layer where `recurrence_as_one_op` is on, which is:
for each direction gates_x = x·W_ihᵀ + b_ih + b_hh over all time steps at once, then the recurrence
`lstm_recurrence(gates_x, h0, c0, W_hh, reverse)`: for t in time order (reversed for the reverse direction)
gates = gates_x[t] + h·W_hhᵀ, i, f, o = σ(their parts), g = tanh(its part), c = f·c + i·g, h = o·tanh(c); it returns
every step's h, c and activated gates (i, f, g, o) at the step's own time index. The layer's output is the h's (both
directions concatenated), its final state the last step's h and c. The recurrence's backward is
`lstm_recurrence_backward`, the gates' gradient at every step, and W_hh's gradient then one product over all steps:
Σ_t d gates_tᵀ · h_{t-1}.

An LSTM layer is PyTorch's decomposition (the recurrence traced step by step) for projections (`proj_size`), tensors
other than float32, and the traces made for torch.onnx, which has no translation of these ops (a dynamic-shape
graph, or a graph the direct translation does not cover). Switch: `graph/passes.rewrite_enabled(
"lstm_recurrence_as_one_op")`.

Why: PyTorch's decomposition loops over the time steps in Python, and AOTAutograd traces every step's cell, forward
and backward, op by op, at about a millisecond per op: the benchmark LSTM (2 layers, 64 steps) was 9,000 traced nodes
and 8.7 s of a first step that now takes 2.3 s (docs/engine.md §22). And PyTorch's decomposition (torch 2.13's
`_rnn_helper`) applies the dropout between layers only when `num_layers < i - 1`, which never holds: a traced
`nn.LSTM(dropout=p)` (GRU, RNN) trained without it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

__all__ = ["lstm", "lstm_recurrence", "lstm_recurrence_backward", "recurrence_as_one_op", "single_state_rnn"]

_state = threading.local()


@contextlib.contextmanager
def recurrence_as_one_op(enabled: bool) -> Iterator[None]:
    """Within the block (this thread), `lstm` writes each recurrence as one op when `enabled`; outside, or when not,
    it is PyTorch's decomposition. The torch builder enables it for traces it translates directly."""
    previous = getattr(_state, "enabled", False)
    _state.enabled = enabled
    try:
        yield
    finally:
        _state.enabled = previous


def _gates(acts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(acts.chunk(4, -1))


@torch.library.custom_op("orttrainer::lstm_recurrence", mutates_args=())
def lstm_recurrence(
    gates_x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, w_hh: torch.Tensor, reverse: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hs [T, B, H], cs [T, B, H], acts [T, B, 4H]) of the recurrence over `gates_x` [T, B, 4H] from `h0`, `c0`
    [B, H] with the recurrent weight `w_hh` [4H, H] (module docstring)."""
    steps = gates_x.shape[0]
    hs: list[torch.Tensor] = [h0] * steps
    cs: list[torch.Tensor] = [c0] * steps
    acts: list[torch.Tensor] = [gates_x[0]] * steps
    h, c = h0, c0
    for t in reversed(range(steps)) if reverse else range(steps):
        i, f, g, o = _gates(gates_x[t] + h @ w_hh.t())
        i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
        c = f * c + i * g
        h = o * c.tanh()
        hs[t], cs[t], acts[t] = h, c, torch.cat([i, f, g, o], -1)
    return torch.stack(hs), torch.stack(cs), torch.stack(acts)


@lstm_recurrence.register_fake
def _lstm_recurrence_shapes(gates_x, h0, c0, w_hh, reverse):  # noqa: ANN001, ANN202 - torch.library's signature
    steps = gates_x.shape[0]
    return (
        gates_x.new_empty((steps, *h0.shape)),
        gates_x.new_empty((steps, *c0.shape)),
        gates_x.new_empty(gates_x.shape),
    )


@torch.library.custom_op("orttrainer::lstm_recurrence_backward", mutates_args=())
def lstm_recurrence_backward(
    grad_hs: torch.Tensor,
    grad_cs: torch.Tensor | None,
    cs: torch.Tensor,
    acts: torch.Tensor,
    c0: torch.Tensor,
    w_hh: torch.Tensor,
    reverse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d gates_x [T, B, 4H], d h0, d c0) of `lstm_recurrence` from the gradients of its hs and cs (None: nothing
    reads the cs) and what its forward returned: backward in time, d h = d hs[t] + W_hhᵀ·(the later step's d gates), d c = d cs[t] + the later
    step's f·d c + d h·o·(1 - tanh²(c)), and d gates = (d c·g, d c·c_prev, d c·i, d h·tanh(c)) times each activation's
    derivative."""
    steps = grad_hs.shape[0]
    grad_gates: list[torch.Tensor] = [acts[0]] * steps
    grad_h = torch.zeros_like(grad_hs[0])
    grad_c = torch.zeros_like(c0)
    for t in range(steps) if reverse else reversed(range(steps)):
        before = t + 1 if reverse else t - 1
        c_prev = cs[before] if 0 <= before < steps else c0
        i, f, g, o = _gates(acts[t])
        tanh_c = cs[t].tanh()
        grad_h = grad_hs[t] + grad_h
        grad_c = grad_c if grad_cs is None else grad_cs[t] + grad_c
        grad_c = grad_c + grad_h * o * (1 - tanh_c * tanh_c)
        upstream = torch.cat([grad_c * g, grad_c * c_prev, grad_c * i, grad_h * tanh_c], -1)
        grad_gates[t] = upstream * _activation_derivative(acts[t])
        grad_c = grad_c * f
        grad_h = grad_gates[t] @ w_hh
    return torch.stack(grad_gates), grad_h, grad_c


def _activation_derivative(acts: torch.Tensor) -> torch.Tensor:
    """Each gate's derivative from its activation a: a·(1 - a) for the sigmoid gates, 1 - a² for the cell gate."""
    i, f, g, o = _gates(acts)
    return torch.cat([i * (1 - i), f * (1 - f), 1 - g * g, o * (1 - o)], -1)


@lstm_recurrence_backward.register_fake
def _lstm_recurrence_backward_shapes(grad_hs, grad_cs, cs, acts, c0, w_hh, reverse):  # noqa: ANN001, ANN202
    return acts.new_empty(acts.shape), grad_hs.new_empty(grad_hs.shape[1:]), c0.new_empty(c0.shape)


def _save(ctx, inputs, output) -> None:  # noqa: ANN001 - torch.library's signature
    _, h0, c0, w_hh, reverse = inputs
    hs, cs, acts = output
    ctx.save_for_backward(h0, c0, w_hh, hs, cs, acts)
    ctx.reverse = reverse
    ctx.set_materialize_grads(False)  # an unread output's gradient stays None: no zeros for the translation to add


def _backward(ctx, grad_hs, grad_cs, grad_acts):  # noqa: ANN001, ANN202 - torch.library's signature
    """The recurrence's backward (`lstm_recurrence_backward`) and W_hh's gradient as one product over all steps;
    `acts` is for the backward only (its gradient is not propagated: nothing else reads it)."""
    h0, c0, w_hh, hs, cs, acts = ctx.saved_tensors
    grad_hs = torch.zeros_like(hs) if grad_hs is None else grad_hs
    grad_gates, grad_h0, grad_c0 = lstm_recurrence_backward(grad_hs, grad_cs, cs, acts, c0, w_hh, ctx.reverse)
    before = [hs[1:], h0.unsqueeze(0)] if ctx.reverse else [h0.unsqueeze(0), hs[:-1]]
    h_prev = torch.cat(before, 0)
    hidden = h_prev.shape[-1]
    grad_w_hh = grad_gates.reshape(-1, 4 * hidden).t() @ h_prev.reshape(-1, hidden)
    return grad_gates, grad_h0, grad_c0, grad_w_hh, None


lstm_recurrence.register_autograd(_backward, setup_context=_save)


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
    one_op = _one_op(input, hx, params, num_layers * (2 if bidirectional else 1) * (4 if has_biases else 2))

    def layer(x: torch.Tensor, states: list[torch.Tensor], weights: Sequence[torch.Tensor]) -> tuple:
        if one_op:
            return _layer(x, states[0], states[1], weights, has_biases)
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
        def layer(x: torch.Tensor, states: list[torch.Tensor], weights: Sequence[torch.Tensor]) -> tuple:
            return _pytorch(op)(x, states[0], weights, has_biases, 1, 0.0, train, bidirectional, False)

        output, final = _layer_by_layer(
            layer, input, [hx], params, num_layers, dropout, train, bidirectional, batch_first
        )
        return output, final

    return decomposition


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


def _pytorch(op: torch._ops.OpOverload) -> Callable:
    from .torch_private import pytorch_decomposition

    return pytorch_decomposition(op)


def _layer(
    x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, params: Sequence[torch.Tensor], has_biases: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer over time-major `x` with its recurrences as one op each: (output, h_n, c_n), the states
    [directions, B, H]."""
    group = 4 if has_biases else 2
    outputs, h_n, c_n = [], [], []
    for direction in range(h0.shape[0]):
        w_ih, w_hh, *biases = params[direction * group : (direction + 1) * group]
        gates_x = torch.nn.functional.linear(x, w_ih, biases[0] if biases else None)
        if biases:
            gates_x = gates_x + biases[1]
        reverse = direction == 1
        hs, cs, _ = lstm_recurrence(gates_x, h0[direction], c0[direction], w_hh, reverse)
        final = 0 if reverse else -1  # the state after the last step taken
        outputs.append(hs)
        h_n.append(hs[final])
        c_n.append(cs[final])
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, -1)
    return output, torch.stack(h_n), torch.stack(c_n)


def _one_op(input: torch.Tensor, hx: Sequence[torch.Tensor], params: Sequence[torch.Tensor], count: int) -> bool:
    """Whether `lstm` writes the recurrence as one op: enabled, no projection, float32 throughout, 3-d input."""
    tensors = [input, *hx, *params]
    return (
        getattr(_state, "enabled", False)
        and input.dim() == 3
        and len(hx) == 2
        and hx[0].shape == hx[1].shape
        and len(params) == count
        and all(t.dtype == torch.float32 for t in tensors)
    )
