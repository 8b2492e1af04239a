"""The peak of a training graph's live intermediate tensors under ONNX Runtime's own execution order: a
deterministic measure of activation memory for the tests (benchmarks/memory.py measures the process's memory).

How: the graph runs once in a fresh `InferenceSession` with profiling on; the profile lists the nodes in the order
ONNX Runtime ran them, with each output's shape and type. Walking that order, a node's outputs become live when it
runs and die after their last reader (graph outputs stay live to the end, graph inputs are not counted); the peak
of the live bytes is what a step needs for its intermediate tensors when each buffer is freed as its tensor dies
(the trainer's memory options turn ONNX Runtime's buffer-reuse plan off for exactly that, docs/engine.md §16).
Buffers an op shares with its input (Reshape) count as their own, so the measure is an upper bound of that plan.
On onnxruntime-training 1.19 the profile also lists a few Casts the saved optimized model lacks; they are left out.
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np
import onnx

_BYTES = {"float": 4, "double": 8, "int64_t": 8, "int32_t": 4, "bool": 1, "uint8_t": 1, "int8_t": 1, "MLFloat16": 2}


def activation_peak_mib(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> float:
    """MiB at the peak of live intermediate tensors of one run of `model` on `feeds` (module docstring); inputs
    `feeds` lacks are zeros of their declared shape."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as directory:
        options = ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(directory, "profile")
        options.optimized_model_filepath = os.path.join(directory, "optimized.onnx")
        options.intra_op_num_threads = 1
        options.log_severity_level = 3
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        session.run(None, {i.name: _feed(i, feeds) for i in session.get_inputs()})
        with open(session.end_profiling()) as f:
            events = [e for e in json.load(f) if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
        optimized = onnx.load(options.optimized_model_filepath)
    nodes = {n.name: n for n in optimized.graph.node}
    order, sizes = [], {}
    for event in events:
        node = nodes.get(event["name"].removesuffix("_kernel_time"))
        if node is None:  # a node ONNX Runtime 1.19 adds after writing the optimized model (a Cast): not counted
            continue
        order.append(node)
        for name, typed in zip(node.output, event["args"].get("output_type_shape", []), strict=False):
            ((kind, shape),) = typed.items()
            sizes[name] = int(np.prod(shape)) * _BYTES.get(kind, 4)
    outputs = {o.name for o in optimized.graph.output}
    last = {name: i for i, node in enumerate(order) for name in node.input}
    live, peak, alive = 0, 0, {}
    for i, node in enumerate(order):
        for name in node.output:
            if name and name not in alive:
                alive[name] = sizes.get(name, 0)
                live += alive[name]
        peak = max(peak, live)
        for name in [*set(node.input), *node.output]:
            if name in alive and last.get(name, -1) <= i and name not in outputs:
                live -= alive.pop(name)
    return peak / 2**20


def _feed(value, feeds: dict[str, np.ndarray]) -> np.ndarray:
    if value.name in feeds:
        return feeds[value.name]
    dtype = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(float16)": np.float16}[value.type]
    return np.zeros([d if isinstance(d, int) else 1 for d in value.shape], dtype=dtype)


def trainer_activation_peak_mib(trainer, inputs: dict[str, np.ndarray]) -> float:
    """`activation_peak_mib` of a built trainer's training graph on its current state and the data `inputs`."""
    model = trainer._built.compiled.step_graph.model
    return activation_peak_mib(model, {**trainer._training_session.get_state(), **inputs})
