"""The recurrence ops of gradient/recurrent_layers.py, as PyTorch custom ops (`torch.library.custom_op`: an eager
kernel, a fake kernel for tracing, and an autograd formula): `orttrainer::lstm_recurrence` and
`orttrainer::gru_recurrence` run one LSTM or GRU layer's recurrence over all time steps in one direction,
feature-major ([features, T·B], column t·B + b holding sample b at step t), and their backward ops
`orttrainer::lstm_recurrence_backward` and `orttrainer::gru_recurrence_backward` give the gates' gradient at every step.
The torch builder traces them as single nodes, and its direct translation unrolls them (gradient/aten_onnx.py); the
eager kernels define what they compute (and are what the tests compare with nn.LSTM, nn.GRU and autograd).

Imported, and so registered, by `recurrent_layers.recurrent_ops()` when a trace first writes a recurrence as one op.
"""

from __future__ import annotations

import torch

__all__ = ["gru_recurrence", "gru_recurrence_backward", "lstm_recurrence", "lstm_recurrence_backward"]


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
