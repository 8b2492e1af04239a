"""Mixed precision for an ONNX model on the torch builder: the forward graph the `OnnxModule` runs, in float16.

A PyTorch module trains in mixed precision on the torch builder by being traced computing in float16 (build/export.py);
an ONNX model has no PyTorch code to trace that way, and its float32 constants would meet float16 activations. So
its graph is converted as the 'ort' builder converts it (graph/mixed_precision.py, `to_float16`), and the
`OnnxModule` of the converted graph is traced like any module, with the loss scale (gradient/torch_trace.JointWrapper):

Rule (`float16_forward`): the trainer's state (trainable and frozen initializers) stays float32 — it is the master
weights — and is read through a `Cast` to float16 where a float16 op consumes it; the data inputs and the loss stay
float32 at the graph's boundary; every other float tensor (activations, the graph's own constants) becomes float16,
except the inputs and outputs of the loss-sensitive ops of `graph.mixed_precision.FLOAT32_OPS` (softmax
cross-entropy, NLL, log-softmax, layer norm, reductions, powers) and of `Gather` (an embedding lookup: its
backward is a scatter-add into the table, which ONNX Runtime's CPU ScatterND does not implement for float16 —
"MLFloat16 data type is not supported with ScatterND opset 16 when reduction is 'add'", verified on 1.19.2 and
1.32.0 — and which loses precision in float16), which compute in float32 between casts. The state's gradients then
come back through the casts' backward in float32. The other outputs keep the converter's float16.

The loss is not rounded to float16 on its way out: where the converter casts a float32-computing op's output to
float16 and back to float32 for the graph's output (`Cast(to=float16)` then `Cast(to=float32)`), the loss is the
first cast's input cast to float32 (`_unrounded_loss`); a rounded loss would scale a 1e-3 relative error into the
gradients through the loss scale's seed and differ from a PyTorch model's loss, which the trace keeps float32.
"""

from __future__ import annotations

import onnx

from ..graph.editor import copy_model
from ..graph.mixed_precision import to_float16
from ..graph.state_inputs import move_initializers_to_inputs


def float16_forward(model: onnx.ModelProto, state: list[str], data_inputs: list[str], loss: str) -> onnx.ModelProto:
    """`model` (not modified) converted by the rule above; `state` stays float32 initializers."""
    moved = move_initializers_to_inputs(model, state)
    converted = to_float16(moved, [*data_inputs, *state, loss], block=("Gather",))
    result = copy_model(converted)
    wanted = set(state)
    values = {i.name: i for i in model.graph.initializer if i.name in wanted}
    kept = [i for i in result.graph.input if i.name not in wanted]
    del result.graph.input[:]
    result.graph.input.extend(kept)
    result.graph.initializer.extend(values[name] for name in state if name in values)
    _unrounded_loss(result, loss)
    return result


def _unrounded_loss(model: onnx.ModelProto, loss: str) -> None:
    """In place: `loss = Cast(to=float)(Cast(to=float16)(x))` becomes `loss = Cast(to=float)(x)` (module
    docstring); any other producer of `loss` is left as it is."""
    producers = {out: node for node in model.graph.node for out in node.output}
    last = producers.get(loss)
    if last is None or _cast_to(last) != onnx.TensorProto.FLOAT:
        return
    rounding = producers.get(last.input[0])
    if rounding is None or _cast_to(rounding) != onnx.TensorProto.FLOAT16:
        return
    last.input[0] = rounding.input[0]
    read = {name for node in model.graph.node for name in node.input} | {o.name for o in model.graph.output}
    if rounding.output[0] not in read:
        model.graph.node.remove(rounding)


def _cast_to(node: onnx.NodeProto) -> int | None:
    if node.op_type != "Cast" or node.domain not in ("", "ai.onnx"):
        return None
    return next((a.i for a in node.attribute if a.name == "to"), None)
