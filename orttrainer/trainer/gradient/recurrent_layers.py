"""Recurrent layers (nn.LSTM, nn.GRU, nn.RNN) as the torch builder traces them: layer by layer, with the dropout
between layers that eager PyTorch applies, and an LSTM's or GRU's layer's recurrence over time as one op whose backward
is one op, so that the trace does not grow with the sequence (the ONNX translation unrolls both ops:
gradient/aten_onnx.py).

Rule: `lstm` and `single_state_rnn(op)` (the "autograd"-stage decompositions of `aten.lstm.input`, `aten.gru.input`,
`aten.rnn_tanh.input` and `aten.rnn_relu.input`, torch_private/decompositions.py) compute what the op computes: each
layer, both directions, then in training mode dropout at p on its output unless it is the last layer. A layer is
PyTorch's own decomposition of the op for one layer, except an LSTM's or GRU's layers where `recurrence_as_one_op` is
on. Those run feature-major — a sequence is [features, T·B], column t·B + b holding sample b at step t — from the
first layer's input to the last layer's output: per layer and direction, gates_x = W_ih·x + b_ih (+ b_hh for an
LSTM) over all steps at once, then the recurrence in time order (reversed for the reverse direction):
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

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

__all__ = [
    "gru_recurrence",
    "gru_recurrence_backward",
    "lstm",
    "lstm_recurrence",
    "lstm_recurrence_backward",
    "recurrence_as_one_op",
    "single_state_rnn",
]

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
    return tuple(acts.chunk(4, 0))


def _step(values: torch.Tensor, t: int, batch: int) -> torch.Tensor:
    """Step `t`'s columns [·, B] of a feature-major [·, T·B] value."""
    return values[:, t * batch : (t + 1) * batch]


@torch.library.custom_op("orttrainer::lstm_recurrence", mutates_args=())
def lstm_recurrence(
    gates_x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, w_hh: torch.Tensor, reverse: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hs [H, T·B], cs [H, T·B], acts [4H, T·B]) of the recurrence over `gates_x` [4H, T·B] from `h0`, `c0` [B, H]
    with the recurrent weight `w_hh` [4H, H], feature-major (module docstring)."""
    batch = h0.shape[0]
    steps = gates_x.shape[1] // batch
    hs: list[torch.Tensor] = [h0.t()] * steps
    cs: list[torch.Tensor] = [c0.t()] * steps
    acts: list[torch.Tensor] = [gates_x[:, :batch]] * steps
    h, c = h0.t(), c0.t()
    for t in reversed(range(steps)) if reverse else range(steps):
        i, f, g, o = _gates(_step(gates_x, t, batch) + w_hh @ h)
        i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
        c = f * c + i * g
        h = o * c.tanh()
        hs[t], cs[t], acts[t] = h, c, torch.cat([i, f, g, o], 0)
    return torch.cat(hs, 1), torch.cat(cs, 1), torch.cat(acts, 1)


@lstm_recurrence.register_fake
def _lstm_recurrence_shapes(gates_x, h0, c0, w_hh, reverse):  # noqa: ANN001, ANN202 - torch.library's signature
    columns = gates_x.shape[1]
    return (
        gates_x.new_empty((h0.shape[1], columns)),
        gates_x.new_empty((c0.shape[1], columns)),
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
    """(d gates_x [4H, T·B], d h0 [B, H], d c0 [B, H]) of `lstm_recurrence` from the gradients of its hs and cs (None:
    nothing reads the cs) and what its forward returned; backward in time: d h = d hs[t] + W_hhᵀ·(the later step's
    d gates), d c = d cs[t] + f·(the later step's d c) + d h·o·(1 - tanh²(c)), and d gates = (d c·g, d c·c_prev,
    d c·i, d h·tanh(c)) times each activation's derivative (σ' = a·(1 - a), tanh' = 1 - a²)."""
    batch = c0.shape[0]
    steps = grad_hs.shape[1] // batch
    grad_gates: list[torch.Tensor] = [acts[:, :batch]] * steps
    grad_h = torch.zeros_like(c0.t())
    grad_c = torch.zeros_like(c0.t())
    for t in range(steps) if reverse else reversed(range(steps)):
        before = t + 1 if reverse else t - 1
        c_prev = _step(cs, before, batch) if 0 <= before < steps else c0.t()
        step_acts = _step(acts, t, batch)
        i, f, g, o = _gates(step_acts)
        tanh_c = _step(cs, t, batch).tanh()
        grad_h = _step(grad_hs, t, batch) + grad_h
        grad_c = grad_c if grad_cs is None else _step(grad_cs, t, batch) + grad_c
        grad_c = grad_c + grad_h * o * (1 - tanh_c * tanh_c)
        upstream = torch.cat([grad_c * g, grad_c * c_prev, grad_c * i, grad_h * tanh_c], 0)
        grad_gates[t] = upstream * torch.cat([i * (1 - i), f * (1 - f), 1 - g * g, o * (1 - o)], 0)
        grad_c = grad_c * f
        grad_h = w_hh.t() @ grad_gates[t]
    return torch.cat(grad_gates, 1), grad_h.t(), grad_c.t()


@lstm_recurrence_backward.register_fake
def _lstm_recurrence_backward_shapes(grad_hs, grad_cs, cs, acts, c0, w_hh, reverse):  # noqa: ANN001, ANN202
    return acts.new_empty(acts.shape), c0.new_empty(c0.shape), c0.new_empty(c0.shape)


def _save(ctx, inputs, output) -> None:  # noqa: ANN001 - torch.library's signature
    _, h0, c0, w_hh, reverse = inputs
    hs, cs, acts = output
    ctx.save_for_backward(h0, c0, w_hh, hs, cs, acts)
    ctx.reverse = reverse
    ctx.set_materialize_grads(False)  # an unread output's gradient stays None: no zeros for the translation to add


def _backward(ctx, grad_hs, grad_cs, grad_acts):  # noqa: ANN001, ANN202 - torch.library's signature
    """The recurrence's backward (`lstm_recurrence_backward`) and W_hh's gradient as one product over all steps,
    d gates·(the previous steps' h)ᵀ; `acts` is for the backward only (nothing else reads it)."""
    h0, c0, w_hh, hs, cs, acts = ctx.saved_tensors
    grad_hs = torch.zeros_like(hs) if grad_hs is None else grad_hs
    grad_gates, grad_h0, grad_c0 = lstm_recurrence_backward(grad_hs, grad_cs, cs, acts, c0, w_hh, ctx.reverse)
    batch = h0.shape[0]
    before = [hs[:, batch:], h0.t()] if ctx.reverse else [h0.t(), hs[:, :-batch]]
    grad_w_hh = grad_gates @ torch.cat(before, 1).t()
    return grad_gates, grad_h0, grad_c0, grad_w_hh, None


lstm_recurrence.register_autograd(_backward, setup_context=_save)


@torch.library.custom_op("orttrainer::gru_recurrence", mutates_args=())
def gru_recurrence(
    gates_x: torch.Tensor, h0: torch.Tensor, w_hh: torch.Tensor, b_hh: torch.Tensor | None, reverse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hs [H, T·B], saved [4H, T·B]) of a GRU layer's recurrence over `gates_x` [3H, T·B] (W_ih·x + b_ih) from `h0`
    [B, H] with the recurrent weight `w_hh` [3H, H] and bias `b_hh` [3H] (None: none), feature-major (module
    docstring): per step gh = W_hh·hᵀ + b_hh, r, z = σ(gates_x's r, z + gh's), n = tanh(gates_x's n + r·gh's n),
    h = n + z·(h - n); `saved` holds each step's r, z, n and gh's n part, for the backward."""
    batch = h0.shape[0]
    steps = gates_x.shape[1] // batch
    hs: list[torch.Tensor] = [h0.t()] * steps
    saved: list[torch.Tensor] = [h0.t()] * steps
    h = h0.t()
    for t in reversed(range(steps)) if reverse else range(steps):
        gh = w_hh @ h if b_hh is None else w_hh @ h + b_hh.unsqueeze(1)
        gx_r, gx_z, gx_n = _step(gates_x, t, batch).chunk(3, 0)
        gh_r, gh_z, gh_n = gh.chunk(3, 0)
        r, z = (gx_r + gh_r).sigmoid(), (gx_z + gh_z).sigmoid()
        n = (gx_n + r * gh_n).tanh()
        h = n + z * (h - n)
        hs[t], saved[t] = h, torch.cat([r, z, n, gh_n], 0)
    return torch.cat(hs, 1), torch.cat(saved, 1)


@gru_recurrence.register_fake
def _gru_recurrence_shapes(gates_x, h0, w_hh, b_hh, reverse):  # noqa: ANN001, ANN202 - torch.library's signature
    columns, hidden = gates_x.shape[1], h0.shape[1]
    return gates_x.new_empty((hidden, columns)), gates_x.new_empty((4 * hidden, columns))


@torch.library.custom_op("orttrainer::gru_recurrence_backward", mutates_args=())
def gru_recurrence_backward(
    grad_hs: torch.Tensor, hs: torch.Tensor, saved: torch.Tensor, h0: torch.Tensor, w_hh: torch.Tensor, reverse: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d gates_x [3H, T·B], d gh [3H, T·B], d h0 [B, H]) of `gru_recurrence` from the gradient of its hs and what its
    forward returned; backward in time: d h = d hs[t] + z·(the later step's d h) + W_hhᵀ·(the later step's d gh),
    d n_pre = d h·(1 - z)·(1 - n²), d z_pre = d h·(h_prev - n)·z(1 - z), d r_pre = d n_pre·gh_n·r(1 - r); d gates_x =
    (d r_pre, d z_pre, d n_pre), d gh = (d r_pre, d z_pre, d n_pre·r)."""
    batch = h0.shape[0]
    steps = grad_hs.shape[1] // batch
    grad_gates: list[torch.Tensor] = [saved[:, :batch]] * steps
    grad_gh: list[torch.Tensor] = [saved[:, :batch]] * steps
    grad_h = torch.zeros_like(h0.t())
    for t in range(steps) if reverse else reversed(range(steps)):
        before = t + 1 if reverse else t - 1
        h_prev = _step(hs, before, batch) if 0 <= before < steps else h0.t()
        r, z, n, gh_n = _step(saved, t, batch).chunk(4, 0)
        grad_h = _step(grad_hs, t, batch) + grad_h
        grad_n = grad_h * (1 - z) * (1 - n * n)
        grad_z = grad_h * (h_prev - n) * z * (1 - z)
        grad_r = grad_n * gh_n * r * (1 - r)
        grad_gates[t] = torch.cat([grad_r, grad_z, grad_n], 0)
        grad_gh[t] = torch.cat([grad_r, grad_z, grad_n * r], 0)
        grad_h = grad_h * z + w_hh.t() @ grad_gh[t]
    return torch.cat(grad_gates, 1), torch.cat(grad_gh, 1), grad_h.t()


@gru_recurrence_backward.register_fake
def _gru_recurrence_backward_shapes(grad_hs, hs, saved, h0, w_hh, reverse):  # noqa: ANN001, ANN202
    shape = (w_hh.shape[0], grad_hs.shape[1])
    return grad_hs.new_empty(shape), grad_hs.new_empty(shape), h0.new_empty(h0.shape)


def _save_gru(ctx, inputs, output) -> None:  # noqa: ANN001 - torch.library's signature
    _, h0, w_hh, b_hh, reverse = inputs
    hs, saved = output
    ctx.save_for_backward(h0, w_hh, hs, saved)
    ctx.reverse, ctx.has_bias = reverse, b_hh is not None


def _backward_gru(ctx, grad_hs, grad_saved):  # noqa: ANN001, ANN202 - torch.library's signature
    """The recurrence's backward (`gru_recurrence_backward`), and W_hh's and b_hh's gradients over all steps: d gh·(the
    previous steps' h)ᵀ and d gh summed over the columns."""
    h0, w_hh, hs, saved = ctx.saved_tensors
    grad_gates, grad_gh, grad_h0 = gru_recurrence_backward(grad_hs, hs, saved, h0, w_hh, ctx.reverse)
    batch = h0.shape[0]
    before = [hs[:, batch:], h0.t()] if ctx.reverse else [h0.t(), hs[:, :-batch]]
    grad_w_hh = grad_gh @ torch.cat(before, 1).t()
    grad_b_hh = grad_gh.sum(1) if ctx.has_bias else None
    return grad_gates, grad_h0, grad_w_hh, grad_b_hh, None


gru_recurrence.register_autograd(_backward_gru, setup_context=_save_gru)


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
            hs, cs, _ = lstm_recurrence(gates_x, hx[0][k], hx[1][k], w_hh, reverse)
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
                hs, _ = gru_recurrence(gates_x, hx[k], w_hh, biases[1] if biases else None, reverse)
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


def _pytorch(op: torch._ops.OpOverload) -> Callable:
    from .torch_private import pytorch_decomposition

    return pytorch_decomposition(op)


def _one_op(input: torch.Tensor, hx: list[torch.Tensor], params: Sequence[torch.Tensor], count: int) -> bool:
    """Whether a layer's recurrence is one op: enabled, no projection (an LSTM's h and c alike; `count` weights),
    float32 throughout, 3-d input."""
    tensors = [input, *hx, *params]
    return (
        getattr(_state, "enabled", False)
        and input.dim() == 3
        and all(h.shape == hx[0].shape for h in hx)
        and len(params) == count
        and all(t.dtype == torch.float32 for t in tensors)
    )
