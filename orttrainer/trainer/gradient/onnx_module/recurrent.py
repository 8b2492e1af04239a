"""OnnxModule's recurrent layers: RNN, GRU and LSTM, written from the ONNX operator specification — the equations,
gate orders (LSTM: i, o, f, c; GRU: z, r, h), directions (forward, reverse, bidirectional), activation lists with
their alpha/beta, clip, sequence_lens, initial states, LSTM peepholes and input_forget, GRU linear_before_reset,
and layout (opset 14: batch first).

The time loop is unrolled (the sequence length is a shape, so it is known when the graph is traced); each step is
plain tensor arithmetic, differentiable in the inputs, weights and initial states. With sequence_lens, a batch
entry's steps past its length leave its state unchanged and output zeros; in reverse, its steps start at its last
valid element.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.nn import functional as F

from .base import Call, NodeSpec, Value, torch_op

Activation = Callable[[torch.Tensor], torch.Tensor]

# name -> (how many of activation_alpha / activation_beta it takes, the function of (x, alpha, beta))
_ACTIVATIONS: dict[str, tuple[int, int, Callable[[torch.Tensor, float, float], torch.Tensor]]] = {
    "relu": (0, 0, lambda x, a, b: torch.relu(x)),
    "tanh": (0, 0, lambda x, a, b: torch.tanh(x)),
    "sigmoid": (0, 0, lambda x, a, b: torch.sigmoid(x)),
    "affine": (1, 1, lambda x, a, b: a * x + b),
    "leakyrelu": (1, 0, lambda x, a, b: F.leaky_relu(x, a)),
    "thresholdedrelu": (1, 0, lambda x, a, b: torch.where(x > a, x, torch.zeros_like(x))),
    "scaledtanh": (1, 1, lambda x, a, b: a * torch.tanh(b * x)),
    "hardsigmoid": (1, 1, lambda x, a, b: torch.clamp(a * x + b, 0.0, 1.0)),
    "elu": (1, 0, lambda x, a, b: F.elu(x, a)),
    "softsign": (0, 0, lambda x, a, b: F.softsign(x)),
    "softplus": (0, 0, lambda x, a, b: F.softplus(x)),
}
# the default alpha and beta of the functions that take them
_DEFAULTS = {
    "affine": (1.0, 0.0),
    "leakyrelu": (0.01, 0.0),
    "thresholdedrelu": (1.0, 0.0),
    "scaledtanh": (1.0, 1.0),
    "hardsigmoid": (0.2, 0.5),
    "elu": (1.0, 0.0),
}
_GATES = {"RNN": ("Tanh",), "GRU": ("Sigmoid", "Tanh"), "LSTM": ("Sigmoid", "Tanh", "Tanh")}


def _check(node: NodeSpec) -> str | None:
    unknown = [a for a in node.attr("activations", []) if a.lower() not in _ACTIVATIONS]
    if unknown:
        return f"activations {unknown}"
    direction = node.attr("direction", "forward")
    return None if direction in ("forward", "reverse", "bidirectional") else f"direction {direction!r}"


def _activations(call: Call, directions: int) -> list[list[Activation]]:
    """Per direction, the node's activation functions (defaults per op), alphas and betas taken in order."""
    defaults = _GATES[call.node.op_type]
    names = list(call.attr("activations", [])) or list(defaults) * directions
    if len(names) == len(defaults) and directions == 2:
        names = names * 2
    alphas, betas = list(call.attr("activation_alpha", [])), list(call.attr("activation_beta", []))
    functions: list[Activation] = []
    for name in names:
        key = name.lower()
        takes_alpha, takes_beta, fn = _ACTIVATIONS[key]
        alpha, beta = _DEFAULTS.get(key, (0.0, 0.0))
        if takes_alpha and alphas:
            alpha = float(alphas.pop(0))
        if takes_beta and betas:
            beta = float(betas.pop(0))
        functions.append(_bound(fn, alpha, beta))
    per = len(defaults)
    return [functions[d * per : (d + 1) * per] for d in range(directions)]


def _bound(fn: Callable[[torch.Tensor, float, float], torch.Tensor], alpha: float, beta: float) -> Activation:
    def activation(x: torch.Tensor) -> torch.Tensor:
        return fn(x, alpha, beta)

    return activation


class _Inputs:
    """The optional inputs of a recurrent node, in time-major layout."""

    def __init__(self, call: Call, values: Sequence[Value | None], states: int) -> None:
        x, w, r = (call.tensor(v) for v in values[:3] if v is not None)
        self.batch_first = bool(call.attr("layout", 0))
        self.x = x.transpose(0, 1) if self.batch_first else x
        self.w, self.r = w, r
        self.directions = w.shape[0]
        self.hidden = int(call.attr("hidden_size", r.shape[-1]))
        steps, batch = self.x.shape[0], self.x.shape[1]
        gates = w.shape[1] // self.hidden
        extra = list(values[3:]) + [None] * 8
        self.bias = (
            call.tensor(extra[0])
            if extra[0] is not None
            else torch.zeros(self.directions, 2 * gates * self.hidden, dtype=x.dtype, device=x.device)
        )
        self.lengths = (
            call.tensor(extra[1]).to(torch.int64)
            if extra[1] is not None
            else torch.full((batch,), steps, dtype=torch.int64, device=x.device)
        )
        self.initial = [self._state(call, extra[2 + k], batch) for k in range(states)]
        self.peepholes = call.tensor(extra[4]) if states == 2 and extra[4] is not None else None

    def _state(self, call: Call, value: Value | None, batch: int) -> torch.Tensor:
        if value is None:
            return torch.zeros(self.directions, batch, self.hidden, dtype=self.x.dtype, device=self.x.device)
        state = call.tensor(value)
        return state.transpose(0, 1) if self.batch_first else state


def _outputs(call: Call, inputs: _Inputs, ys: list[torch.Tensor], finals: list[list[torch.Tensor]]):
    """Y (steps, directions, batch, hidden), then the final states (directions, batch, hidden); batch first with
    layout=1."""
    y = torch.stack(ys, dim=1)
    states = [torch.stack(f) for f in finals]
    if inputs.batch_first:
        return [y.permute(2, 0, 1, 3), *(s.transpose(0, 1) for s in states)]
    return [y, *states]


def _run(
    call: Call,
    inputs: _Inputs,
    step: Callable[[int, torch.Tensor, list[torch.Tensor]], list[torch.Tensor]],
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Each direction over time; `step(direction, x_t, states)` gives the new states (hidden first)."""
    reverse = str(call.attr("direction", "forward")) == "reverse"
    steps = inputs.x.shape[0]
    ys: list[torch.Tensor] = []
    finals: list[list[torch.Tensor]] = [[] for _ in inputs.initial]
    for d in range(inputs.directions):
        states = [s[d] for s in inputs.initial]
        order = range(steps - 1, -1, -1) if reverse or d == 1 else range(steps)
        outputs: list[torch.Tensor | None] = [None] * steps
        for t in order:
            valid = (t < inputs.lengths).unsqueeze(-1)
            new = step(d, inputs.x[t], states)
            states = [torch.where(valid, n, s) for n, s in zip(new, states, strict=True)]
            outputs[t] = torch.where(valid, new[0], torch.zeros_like(new[0]))
        ys.append(torch.stack([o for o in outputs if o is not None]))
        for k, s in enumerate(states):
            finals[k].append(s)
    return ys, finals


def _clip(call: Call, t: torch.Tensor) -> torch.Tensor:
    bound = call.attr("clip")
    return t if bound is None else torch.clamp(t, -float(bound), float(bound))


@torch_op("RNN", check=_check)
def rnn(call: Call, *values: Value | None) -> list[torch.Tensor]:
    """H_t = f(X_t W^T + H_{t-1} R^T + Wb + Rb)."""
    inputs = _Inputs(call, values, 1)
    f = _activations(call, inputs.directions)
    h = inputs.hidden

    def step(d: int, x: torch.Tensor, states: list[torch.Tensor]) -> list[torch.Tensor]:
        bias = inputs.bias[d, :h] + inputs.bias[d, h:]
        return [f[d][0](_clip(call, x @ inputs.w[d].T + states[0] @ inputs.r[d].T + bias))]

    return _outputs(call, inputs, *_run(call, inputs, step))


@torch_op("GRU", check=_check)
def gru(call: Call, *values: Value | None) -> list[torch.Tensor]:
    """z, r = f(X W^T + H R^T + b); h~ = g(X Wh^T + (r * H) Rh^T + Rbh + Wbh), or with linear_before_reset
    g(X Wh^T + r * (H Rh^T + Rbh) + Wbh); H_t = (1 - z) * h~ + z * H_{t-1}."""
    inputs = _Inputs(call, values, 1)
    f = _activations(call, inputs.directions)
    h = inputs.hidden
    before_reset = bool(call.attr("linear_before_reset", 0))

    def step(d: int, x: torch.Tensor, states: list[torch.Tensor]) -> list[torch.Tensor]:
        previous = states[0]
        wz, wr, wh = inputs.w[d].split(h)
        rz, rr, rh = inputs.r[d].split(h)
        wbz, wbr, wbh, rbz, rbr, rbh = inputs.bias[d].split(h)
        z = f[d][0](_clip(call, x @ wz.T + previous @ rz.T + wbz + rbz))
        r = f[d][0](_clip(call, x @ wr.T + previous @ rr.T + wbr + rbr))
        if before_reset:
            candidate = x @ wh.T + r * (previous @ rh.T + rbh) + wbh
        else:
            candidate = x @ wh.T + (r * previous) @ rh.T + rbh + wbh
        new = f[d][1](_clip(call, candidate))
        return [(1 - z) * new + z * previous]

    return _outputs(call, inputs, *_run(call, inputs, step))


@torch_op("LSTM", check=_check)
def lstm(call: Call, *values: Value | None) -> list[torch.Tensor]:
    """i, f = f(X W^T + H R^T + P (.) C_{t-1} + b); c~ = g(X Wc^T + H Rc^T + b); C_t = f * C_{t-1} + i * c~;
    o = f(X Wo^T + H Ro^T + Po (.) C_t + b); H_t = o * h(C_t). input_forget couples f = 1 - i."""
    inputs = _Inputs(call, values, 2)
    act = _activations(call, inputs.directions)
    h = inputs.hidden
    coupled = bool(call.attr("input_forget", 0))

    def step(d: int, x: torch.Tensor, states: list[torch.Tensor]) -> list[torch.Tensor]:
        previous, cell = states
        gates = x @ inputs.w[d].T + previous @ inputs.r[d].T + inputs.bias[d, : 4 * h] + inputs.bias[d, 4 * h :]
        gi, go, gf, gc = gates.split(h, dim=-1)
        if inputs.peepholes is not None:
            pi, po, pf = inputs.peepholes[d].split(h)
            gi, gf = gi + pi * cell, gf + pf * cell
        else:
            po = None
        i = act[d][0](_clip(call, gi))
        forget = 1 - i if coupled else act[d][0](_clip(call, gf))
        new_cell = forget * cell + i * act[d][1](_clip(call, gc))
        if po is not None:
            go = go + po * new_cell
        o = act[d][0](_clip(call, go))
        return [o * act[d][2](new_cell), new_cell]

    return _outputs(call, inputs, *_run(call, inputs, step))
