"""`OnnxModule`: an ONNX graph run node by node with torch ops, so that the `torch` gradient builder can trace it and
PyTorch's autograd can differentiate an ONNX model on any ONNX Runtime build (the maintained `onnxruntime` has no
gradient builder of its own).

Rules:
- Construction takes the (post-processed) forward model, the data input names (model_desc order), the outputs to
  return (model_desc order, loss first) and the trainer's trainable and frozen initializer names
  (`parameters.split_parameters`). Trainable initializers become `nn.Parameter`s, frozen ones buffers; every other
  initializer is a static value (a constant of the traced graph, readable as numbers by shape ops).
- Names: `register_parameter` refuses names with dots, and the torch builder names graph inputs after the module's
  parameters, so each state tensor gets a module name made from its initializer name (`module_name`);
  `state_names` maps module names back to initializer names, and `graph/state_names.rename_state_pass` renames the
  gradient model's inputs `<module name>` and outputs `<module name>_grad` to the initializer names the trainer's
  session, optimizer and checkpoints use.
- `forward(*inputs)` takes the data inputs positionally and returns the outputs as a tuple of tensors. Nodes run
  in graph order (a valid ONNX graph is topologically sorted); the op table (`onnx_ops_*.py`) follows the ONNX
  spec per opset. An op outside the table, a node domain the model does not import, a graph input that is
  neither a data input nor an initializer: `GradientBuildError` at construction.
- Static values: a node whose inputs are all static and which has a numpy version (`STATIC_OPS`) is computed in
  numpy, unless its result has more than `STATIC_LIMIT` elements (then in torch: large constants would be baked
  into the traced graph). Intermediate values are released after their last use. A node that needs the numbers
  of a small trained or frozen initializer while tracing (a Dropout ratio, a Pad value) reads the model's value
  (`onnx_ops_base.Call.numbers`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from . import conv, elementwise, nn, shape, static  # noqa: F401  (tables)
from ..errors import GradientBuildError
from .base import MICROSOFT, STATIC_OPS, TORCH_OPS, Call, NodeSpec, OnnxNodeError, OpResult, Value

STATIC_LIMIT = 4096  # elements: larger results of static ops are computed in torch
GIVEN_LIMIT = 16  # elements: state tensors this small can be read as numbers while tracing (onnx_ops_base.Call)
_DOMAINS = {"": "", "ai.onnx": "", MICROSOFT: MICROSOFT}
INSTALL_HINT = (
    "install ONNX Runtime's training build, whose gradient builder differentiates ONNX graphs itself "
    "(pip install 'orttrainer[ort-training]', Python 3.11), or express the model as a PyTorch module"
)


@dataclass(frozen=True)
class _Node:
    spec: NodeSpec
    key: tuple[str, str]
    inputs: tuple[str, ...]
    release: tuple[str, ...]  # values whose last use is this node


class OnnxModule(torch.nn.Module):
    """An ONNX graph as a torch module (see the module docstring for the rules)."""

    def __init__(
        self,
        model: onnx.ModelProto,
        input_names: Sequence[str],
        output_names: Sequence[str],
        trainable: Sequence[str],
        frozen: Sequence[str] = (),
    ) -> None:
        super().__init__()
        graph = model.graph
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.state_names: dict[str, str] = {}  # module name -> initializer name
        self._attributes: dict[str, str] = {}  # initializer name -> module name
        self._static: dict[str, np.ndarray] = {}
        self._given: dict[str, np.ndarray] = {}  # small state tensors' values in the model (onnx_ops_base.Call)
        _check_names(graph, self.input_names, self.output_names, [*trainable, *frozen])
        self._add_initializers(graph, set(trainable), set(frozen))
        opsets = {_DOMAINS.get(o.domain, o.domain): o.version for o in model.opset_import}
        self._nodes = _compile(graph, opsets, self.output_names)

    def _add_initializers(self, graph: onnx.GraphProto, trainable: set[str], frozen: set[str]) -> None:
        taken: set[str] = set()
        for initializer in graph.initializer:
            array = numpy_helper.to_array(initializer)
            if initializer.name not in trainable and initializer.name not in frozen:
                self._static[initializer.name] = array
                continue
            name = module_name(initializer.name, taken, self)
            tensor = torch.from_numpy(np.array(array, copy=True))
            if initializer.name in trainable:
                self.register_parameter(name, torch.nn.Parameter(tensor))
            else:
                self.register_buffer(name, tensor)
            self.state_names[name] = initializer.name
            self._attributes[initializer.name] = name
            if array.size <= GIVEN_LIMIT:
                self._given[initializer.name] = array

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(inputs) != len(self.input_names):
            raise TypeError(f"OnnxModule takes the inputs {self.input_names}, got {len(inputs)} tensors")
        device = next((t.device for t in inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
        env: dict[str, Value] = dict(self._static)
        env.update({name: getattr(self, attribute) for name, attribute in self._attributes.items()})
        env.update(zip(self.input_names, inputs, strict=True))
        given = {id(env[name]): array for name, array in self._given.items()}
        for node in self._nodes:
            _run(node, env, device, given)
            for name in node.release:
                env.pop(name, None)
        return tuple(Call(_OUTPUT, device).tensor(env[name]) for name in self.output_names)


_OUTPUT = NodeSpec("", "output", "", 0, {}, ())


def module_name(initializer: str, taken: set[str], module: torch.nn.Module) -> str:
    """A name `register_parameter` accepts, made from an initializer name: characters other than ASCII letters,
    digits and `_` become `_`, a leading digit gets a `_` in front, and a name already taken (by another tensor
    or an attribute of `module`) gets the first free suffix `_1`, `_2`, ... The name is added to `taken`."""
    base = re.sub(r"\W", "_", initializer, flags=re.ASCII) or "_"
    base = f"_{base}" if base[0].isdigit() else base
    name, k = base, 1
    while name in taken or hasattr(module, name):
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


def _check_names(graph: onnx.GraphProto, inputs: list[str], outputs: list[str], state: list[str]) -> None:
    initializers = {i.name for i in graph.initializer}
    graph_inputs = [i.name for i in graph.input]
    produced = initializers | set(inputs) | {o for n in graph.node for o in n.output}
    problems = {
        "data inputs {} are not graph inputs": [n for n in inputs if n not in graph_inputs],
        "graph inputs {} are neither data inputs nor initializers": [
            n for n in graph_inputs if n not in initializers and n not in inputs
        ],
        "outputs {} are not computed by the graph": [n for n in outputs if n not in produced],
        "state tensors {} are not initializers": [n for n in state if n not in initializers],
    }
    for message, names in problems.items():
        if names:
            raise GradientBuildError(f"OnnxModule cannot run the ONNX model: {message.format(names)}")


def _compile(graph: onnx.GraphProto, opsets: dict[str, int], outputs: list[str]) -> list[_Node]:
    """The nodes with their specs and release lists; every unsupported op is named in one error."""
    unsupported = [n for n in graph.node if _key(n) not in TORCH_OPS and _key(n) not in STATIC_OPS]
    if unsupported:
        listed = ", ".join(sorted({f"{n.domain + '.' if n.domain else ''}{n.op_type}" for n in unsupported}))
        nodes = ", ".join(repr(n.name or n.output[0]) for n in unsupported[:5])
        raise GradientBuildError(
            f"PyTorch cannot differentiate this ONNX model: orttrainer's OnnxModule has no implementation of "
            f"{listed} (node{'s' if len(unsupported) > 1 else ''} {nodes}{', ...' if len(unsupported) > 5 else ''})"
            f". To train it, {INSTALL_HINT}.",
            op_type=unsupported[0].op_type,
        )
    last_use: dict[str, int] = {}
    for index, node in enumerate(graph.node):
        for name in [*node.input, *node.output]:
            last_use[name] = index
    kept = set(outputs)
    compiled = []
    for index, node in enumerate(graph.node):
        domain = _key(node)[0]
        if domain not in opsets:
            raise GradientBuildError(f"node {node.name!r} ({node.op_type}) uses domain {domain!r}, not imported")
        spec = NodeSpec(node.name, node.op_type, domain, opsets[domain], _attributes(node), tuple(node.output))
        release = tuple(n for n in node.output if last_use.get(n) == index and n not in kept)
        release += tuple(n for n in node.input if last_use.get(n) == index and n not in kept)
        compiled.append(_Node(spec, _key(node), tuple(node.input), release))
    return compiled


def _key(node: onnx.NodeProto) -> tuple[str, str]:
    return (_DOMAINS.get(node.domain, node.domain), node.op_type)


def _attributes(node: onnx.NodeProto) -> dict[str, object]:
    """Attribute values as Python: tensors as numpy arrays, strings as str (lists alike)."""
    values: dict[str, object] = {}
    for attribute in node.attribute:
        value = helper.get_attribute_value(attribute)
        if isinstance(value, onnx.TensorProto):
            value = numpy_helper.to_array(value)
        elif isinstance(value, bytes):
            value = value.decode()
        elif isinstance(value, list) and value and isinstance(value[0], bytes):
            value = [v.decode() for v in value]
        values[attribute.name] = value
    return values


def _run(node: _Node, env: dict[str, Value], device: torch.device, given: dict[int, np.ndarray]) -> None:
    """Compute `node` from `env` and store its named outputs there."""
    call = Call(node.spec, device, given)
    values = [env[name] if name else None for name in node.inputs]
    static = STATIC_OPS.get(node.key)
    result: OpResult
    try:
        if static is not None and all(v is None or isinstance(v, np.ndarray) for v in values):
            result = static(call, *values)
            if node.key in TORCH_OPS and not _small(result):
                result = TORCH_OPS[node.key](call, *values)
        else:
            result = TORCH_OPS[node.key](call, *values)
    except OnnxNodeError:
        raise
    except Exception as err:
        raise call.fail(f"{type(err).__name__}: {err}") from err
    outputs = _outputs(result)
    for index, name in enumerate(node.spec.outputs):
        if not name:
            continue
        value = outputs[index] if index < len(outputs) else None
        if value is None:
            raise call.fail(f"output {index} ({name!r}) is not computed")
        env[name] = value


def _outputs(result: OpResult) -> list[Value | None]:
    """An op's result as a list; numpy scalars (numpy returns np.int64 for some 0-d results) become arrays."""
    values = [result] if isinstance(result, (torch.Tensor, np.ndarray, np.generic)) else list(result)
    return [np.asarray(v) if isinstance(v, np.generic) else v for v in values]


def _small(result: OpResult) -> bool:
    return all(v.size <= STATIC_LIMIT for v in _outputs(result) if isinstance(v, np.ndarray))
