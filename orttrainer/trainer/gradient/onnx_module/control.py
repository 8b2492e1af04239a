"""OnnxModule's control-flow ops: If, Loop and Scan, written from the ONNX operator specification. Their subgraphs
are compiled with the graph (module.py: `Subgraph`) and read the enclosing graph's values by name.

Rules: If runs the branch its condition chooses; a condition computed from data while tracing (no value to read)
runs both branches and selects element-wise (`torch.where`), which needs outputs of equal shapes — otherwise an
error naming the node. Loop needs its trip count and its condition as numbers (static, or run eagerly): the loop
is unrolled; scan outputs are stacked along a new first axis. Scan (opset >= 9) slices its scan inputs along
scan_input_axes (reversed where scan_input_directions says so), runs the body per slice with the carried states,
and stacks the scan outputs along scan_output_axes (reversed alike). Scan-8 (opsets 8 and before 9) is batched:
every input and output has the batch first, the scan axis second, an optional first input sequence_lens gives
each batch entry's number of steps (`directions` reverses scan inputs), and scan outputs past an entry's length
are zeros.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Call, NodeSpec, Value, axis_of, torch_op


def _body(call: Call, name: str) -> Any:
    return call.attr(name)


def _if_check(node: NodeSpec) -> str | None:
    return None if "then_branch" in node.attrs and "else_branch" in node.attrs else "a branch is missing"


@torch_op("If", check=_if_check)
def if_(call: Call, condition: Value) -> list[Value]:
    then_branch, else_branch = _body(call, "then_branch"), _body(call, "else_branch")
    try:
        chosen = bool(call.numbers(condition, "cond")[0])
    except Exception:  # a traced condition: no value to read
        chosen = None
    if chosen is not None:
        return (then_branch if chosen else else_branch).run(call)
    selector = call.tensor(condition).reshape(())
    taken, other = then_branch.run(call), else_branch.run(call)
    results: list[Value] = []
    for a, b in zip(taken, other, strict=True):
        x, y = call.tensors(a, b)
        if x.shape != y.shape:
            raise call.fail(
                f"the condition is computed from data and the branches' outputs differ in shape ({tuple(x.shape)} "
                f"and {tuple(y.shape)})"
            )
        results.append(torch.where(selector, x, y))
    return results


@torch_op("Loop", check=lambda n: None if "body" in n.attrs else "the body is missing")
def loop(call: Call, trip_count: Value | None, condition: Value | None, *carried: Value) -> list[Value]:
    """Iterations i = 0, 1, ... while i < M (when given) and cond (when given); the body takes (i, cond,
    carried...) and returns (cond, carried..., scan outputs...)."""
    body = _body(call, "body")
    limit = None if trip_count is None else call.ints(trip_count, "M")[0]
    going = True if condition is None else bool(call.numbers(condition, "cond")[0])
    state = list(carried)
    scans: list[list[torch.Tensor]] = []
    i = 0
    while going and (limit is None or i < limit):
        cond_in = torch.tensor(going, device=call.device)
        outputs = body.run(call, torch.tensor(i, dtype=torch.int64, device=call.device), cond_in, *state)
        going = bool(call.numbers(outputs[0], "the body's condition")[0])
        state = list(outputs[1 : 1 + len(carried)])
        for k, value in enumerate(outputs[1 + len(carried) :]):
            if len(scans) <= k:
                scans.append([])
            scans[k].append(call.tensor(value))
        i += 1
    scan_count = len(body.outputs) - 1 - len(carried)
    stacked = [torch.stack(values) if values else torch.zeros(0, device=call.device) for values in scans]
    stacked += [torch.zeros(0, device=call.device) for _ in range(scan_count - len(stacked))]
    return [*state, *stacked]


@torch_op("Scan", check=lambda n: None if "body" in n.attrs else "the body is missing")
def scan(call: Call, *values: Value | None) -> list[torch.Tensor]:
    if call.opset < 9:
        return _scan_8(call, *values)
    body = _body(call, "body")
    scan_inputs = int(call.attr("num_scan_inputs"))
    states = [call.tensor(v) for v in values[: len(values) - scan_inputs] if v is not None]
    sequences = [call.tensor(v) for v in values[len(values) - scan_inputs :] if v is not None]
    input_axes = [
        axis_of(a, s.dim()) for a, s in zip(call.attr("scan_input_axes", [0] * scan_inputs), sequences, strict=True)
    ]
    input_reversed = list(call.attr("scan_input_directions", [0] * scan_inputs))
    steps = sequences[0].shape[input_axes[0]] if sequences else 0
    per_step: list[list[torch.Tensor]] = []
    for t in range(steps):
        slices = [
            s.select(axis, steps - 1 - t if back else t)
            for s, axis, back in zip(sequences, input_axes, input_reversed, strict=True)
        ]
        outputs = [call.tensor(v) for v in body.run(call, *states, *slices)]
        states = outputs[: len(states)]
        per_step.append(outputs[len(states) :])
    scan_outputs = len(body.outputs) - len(states)
    output_axes = list(call.attr("scan_output_axes", [0] * scan_outputs))
    output_reversed = list(call.attr("scan_output_directions", [0] * scan_outputs))
    stacked = []
    for k in range(scan_outputs):
        pieces = [step[k] for step in per_step]
        if output_reversed[k]:
            pieces.reverse()
        stacked.append(torch.stack(pieces, dim=axis_of(output_axes[k], pieces[0].dim() + 1)))
    return [*states, *stacked]


def _scan_8(call: Call, lengths: Value | None, *values: Value | None) -> list[torch.Tensor]:
    """Scan-8: the opset-9 scan of each batch entry, its first sequence_lens steps only; outputs stacked on the
    batch axis, scan outputs zero-padded to the longest sequence."""
    body = _body(call, "body")
    scan_inputs = int(call.attr("num_scan_inputs"))
    tensors = [call.tensor(v) for v in values if v is not None]
    states, sequences = tensors[: len(tensors) - scan_inputs], tensors[len(tensors) - scan_inputs :]
    steps = sequences[0].shape[1]
    counts = [steps] * sequences[0].shape[0] if lengths is None else call.ints(lengths, "sequence_lens")
    backwards = list(call.attr("directions", [0] * scan_inputs))
    finals: list[list[torch.Tensor]] = []
    outputs: list[list[torch.Tensor]] = []
    for b, count in enumerate(counts):
        state = [s[b] for s in states]
        per_step: list[list[torch.Tensor]] = []
        for t in range(count):
            slices = [seq[b, count - 1 - t if back else t] for seq, back in zip(sequences, backwards, strict=True)]
            results = [call.tensor(v) for v in body.run(call, *state, *slices)]
            state, per_step = results[: len(state)], [*per_step, results[len(state) :]]
        finals.append(state)
        stacked = []
        for k in range(len(body.outputs) - len(states)):
            pieces = [step[k] for step in per_step]
            like = pieces[0] if pieces else torch.zeros(0)
            pieces += [torch.zeros_like(like)] * (steps - count)
            stacked.append(torch.stack(pieces))
        outputs.append(stacked)
    return [torch.stack([f[k] for f in finals]) for k in range(len(states))] + [
        torch.stack([o[k] for o in outputs]) for k in range(len(outputs[0]) if outputs else 0)
    ]
