"""Small helpers shared by the tests: trainers on the CPU and their weights, hand-built ONNX graphs and running them
with ONNX Runtime, the legacy-style export."""

from __future__ import annotations

import copy
import io
import json
import os
import socket
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from orttrainer import ORTTrainer, ORTTrainerOptions
from orttrainer.trainer.runtime import has_training_build

# The one reason a test skips in the maintained-runtime lane (`make test-maintained`): it exercises what only
# onnxruntime-training has (README: Installation).
needs_training_build = pytest.mark.skipif(
    not has_training_build(),
    reason="needs onnxruntime-training (the 'ort' gradient builder / ONNX Runtime training ops)",
)


def cpu_options(extra: dict | None = None) -> ORTTrainerOptions:
    """Options on the CPU with `extra` merged in (one level deep per group)."""
    opts: dict = {"device": {"id": "cpu"}}
    for key, value in (extra or {}).items():
        if isinstance(value, dict):
            opts.setdefault(key, {}).update(value)
        else:
            opts[key] = value
    return ORTTrainerOptions(opts)


def make_trainer(model, desc, config, loss_fn=None, extra: dict | None = None) -> ORTTrainer:
    return ORTTrainer(model, desc, config, loss_fn=loss_fn, options=cpu_options(extra))


def adam_weights(make_model, batches, lr: float) -> dict[str, np.ndarray]:
    """The weights of `make_model()` (seeded as the trainers' models are) after torch.optim.Adam on `batches`, the
    model returning its loss."""
    torch.manual_seed(0)
    reference = make_model()
    adam = torch.optim.Adam(reference.parameters(), lr=lr)
    for batch in batches:
        adam.zero_grad()
        reference(*batch).backward()
        adam.step()
    return {n: p.detach().numpy() for n, p in reference.named_parameters()}


def steps_like_pytorch(trainer: ORTTrainer, reference: torch.nn.Module, optimizer, batches) -> None:
    """Train `trainer` and `reference` (a copy of its model, which returns its loss, under the torch `optimizer`)
    on `batches`, asserting that each step's loss is PyTorch's."""
    for batch in batches:
        loss = trainer.train_step(*batch)
        optimizer.zero_grad()
        expected = reference(*batch)
        expected.backward()
        optimizer.step()
        torch.testing.assert_close(torch.as_tensor(loss), expected.detach())


def trainer_weights(trainer: ORTTrainer) -> dict[str, np.ndarray]:
    return trainer._training_session.get_state(list(trainer._built.compiled.trainable))


def torch_weights(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def state_and_counters(trainer: ORTTrainer) -> dict[str, np.ndarray]:
    """Everything a step may change: the session's state, and the step counters as "counters"."""
    state = trainer._training_session.get_state()
    info = trainer._train_step_info
    state["counters"] = np.array([info.step, info.optimization_step, trainer._state.counters.optimizer_updates])
    return state


def max_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def clone(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def run_ranks(directory, world_size: int, steps: int, global_batch: int, **scenario) -> list[dict]:
    """Run tests/dist_worker.py in `world_size` processes (Gloo on the CPU) and return each rank's result: `steps`
    global batches of `global_batch` rows, each rank training on its shard; `scenario` is the rest of the worker's
    config (optimizer, accumulation, options, "runs", ...)."""
    worker = os.path.join(os.path.dirname(__file__), "dist_worker.py")
    port, procs, outs = _free_port(), [], []
    for rank in range(world_size):
        out = os.path.join(directory, f"rank{rank}_{len(os.listdir(directory))}.json")
        config = {"rank": rank, "world_size": world_size, "steps": steps, "global_batch": global_batch, "out": out}
        config.update(scenario)
        if "save" in scenario:
            config["save"] = scenario["save"].format(rank=rank)
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(
            subprocess.Popen(
                [sys.executable, worker, json.dumps(config)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
        outs.append(out)
    for proc in procs:
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output[-3000:]
    results = []
    for out in outs:
        with open(out) as f:
            results.append(json.load(f))
    return results


def in_threads(work: Callable[[Any], Any], items: Sequence) -> list:
    """`work(item)` for each of `items`, each in its own thread, all started before any is joined; the results in
    order. A thread's exception, which would otherwise vanish, fails the caller's test."""
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            results[k] = work(items[k])
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(items))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    return [results[k] for k in range(len(items))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export_training_onnx(
    module: torch.nn.Module,
    args: tuple,
    input_names: list[str],
    output_names: list[str],
    dynamic_axes: dict[str, dict[int, str]],
    opset_version: int = 14,
) -> onnx.ModelProto:
    """`module` (returning the loss first) as an ONNX model the way legacy users made theirs: the TorchScript
    exporter in training mode, no constant folding."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter's, chosen on purpose
        torch.onnx.export(
            module,
            args,
            buffer,
            input_names=input_names,
            output_names=output_names,
            dynamic_axes=dynamic_axes,
            opset_version=opset_version,
            do_constant_folding=False,
            training=torch.onnx.TrainingMode.TRAINING,
            dynamo=False,
        )
    return onnx.load_from_string(buffer.getvalue())


# hand-built ONNX graphs ---------------------------------------------------------------------------------------------


def value_info(name: str, shape: Sequence | None = None, elem_type: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    """A graph input or output; `shape` None: unknown rank."""
    return helper.make_tensor_value_info(name, elem_type, shape)


def initializer(name: str, value, dtype=np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def onnx_model(
    nodes: Iterable[onnx.NodeProto],
    inputs: Iterable[onnx.ValueInfoProto],
    outputs: Iterable[onnx.ValueInfoProto],
    initializers: Iterable[onnx.TensorProto] = (),
    opset: int = 14,
    ms: bool = False,
    domains: Iterable[tuple[str, int]] = (),
    ir_version: int = 8,
) -> onnx.ModelProto:
    """A model of one graph named "g": the ONNX domain at `opset`, then com.microsoft 1 when `ms` (ONNX Runtime's
    contrib and training ops), then any other (domain, version) in `domains`. IR version 8, which every ONNX Runtime
    the tests run on loads."""
    graph = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), list(initializers))
    opsets = [("", opset), *([("com.microsoft", 1)] if ms else []), *domains]
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = ir_version
    return model


def run_onnx(model: onnx.ModelProto, feeds: dict, outputs: list[str] | None = None) -> list[np.ndarray]:
    """One run of `model` by ONNX Runtime on the CPU: the `outputs` asked for, or all of them in graph order."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(outputs, feeds)


def run_onnx_by_name(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    """`run_onnx`'s results keyed by the graph's output names."""
    return dict(zip([o.name for o in model.graph.output], run_onnx(model, feeds), strict=True))


def value_names(values: Iterable) -> list[str]:
    """The names of graph inputs, outputs or initializers, in order."""
    return [v.name for v in values]
