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
  in graph order (a valid ONNX graph is topologically sorted); the op table (the op-family files of this package)
  follows the ONNX spec per opset, from opset 7 to `NEWEST_OPSET`.
- Refusals, all at construction and all in one `GradientBuildError` that names each node, its op and its opset:
  an op outside the table, a node whose attributes the op does not implement (`base.CHECKS`), a default-domain
  opset outside [7, NEWEST_OPSET] or newer than the installed onnx knows, a node domain the model does not
  import; also a graph input that is neither a data input nor an initializer. Nothing surfaces later as a
  KeyError.
- Static values: a node whose inputs are all static and which has a numpy version (`STATIC_OPS`) is computed in
  numpy, unless its result has more than `STATIC_LIMIT` elements (then in torch: large constants would be baked
  into the traced graph). Intermediate values are released after their last use. A node that needs the numbers
  of a small trained or frozen initializer while tracing (a Dropout ratio, a Pad value) reads the model's value
  (`base.Call.numbers`).
- Subgraphs (If, Loop, Scan) are compiled with the graph; they read the enclosing graph's values by name.
- Running statistics: a training-mode BatchNormalization whose running mean and variance are buffers (frozen
  initializers) updates those buffers in place with the new statistics (`nn.batch_norm`), as PyTorch's BatchNorm
  updates its own: `statistics` maps each such buffer's initializer name to the node output that carries its new
  value, and the torch builder records the update as a mutated buffer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import torch
from onnx import helper

from ..errors import GradientBuildError
from . import (  # noqa: F401  (the op tables)
    cast,
    control,
    conv,
    elementwise,
    indexing,
    linalg,
    microsoft,
    nn,
    quantize,
    random,
    recurrent,
    reduce,
    resize,
    shape,
    signal,
    static,
)
from .base import (
    CHECKS,
    MICROSOFT,
    STATIC_OPS,
    TORCH_OPS,
    Call,
    NodeSpec,
    OnnxNodeError,
    OpResult,
    RunState,
    Value,
    tensor_value,
)

STATIC_LIMIT = 4096  # elements: larger results of static ops are computed in torch
GIVEN_LIMIT = 16  # elements: state tensors this small can be read as numbers while tracing (base.Call)
OLDEST_OPSET = 7  # the oldest default-domain opset whose specs the op table follows
NEWEST_OPSET = 22  # the newest (onnx 1.17's): a node whose op changed after it is refused
# ONNX Runtime's contrib ops in the default domain, which its optimizers write at any opset (before ONNX had them)
ORT_DEFAULT_DOMAIN = {"LayerNormalization", "SimplifiedLayerNormalization"}
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


@dataclass(frozen=True)
class Subgraph:
    """A compiled GraphProto attribute (If's branches, Loop's and Scan's bodies): `run(call, *inputs)` binds its
    formal inputs, reads other names from the enclosing graph's values (`call.scope`) and returns its outputs."""

    nodes: tuple[_Node, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    constants: Mapping[str, Value]

    def run(self, call: Call, *inputs: Value) -> list[Value]:
        env: dict[str, Value] = {**call.scope, **self.constants}
        env.update(zip(self.inputs, inputs, strict=True))
        _run_nodes(self.nodes, env, call.device, call.given, call.run)
        return [env[name] for name in self.outputs]


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
        self._static: dict[str, Value] = {}
        self._given: dict[str, np.ndarray] = {}  # small state tensors' values in the model (base.Call)
        _check_names(graph, self.input_names, self.output_names, [*trainable, *frozen])
        self._add_initializers(graph, set(trainable), set(frozen))
        opsets = {_DOMAINS.get(o.domain, o.domain): o.version for o in model.opset_import}
        self._nodes = _compile(graph, opsets, set(self.output_names), outer=set())
        self.statistics = _statistics(self._nodes, self._attributes, {n for n, _ in self.named_buffers()})

    def _add_initializers(self, graph: onnx.GraphProto, trainable: set[str], frozen: set[str]) -> None:
        taken: set[str] = set()
        for initializer in graph.initializer:
            value = _initializer_value(initializer)
            if initializer.name not in trainable and initializer.name not in frozen:
                self._static[initializer.name] = value
                continue
            name = module_name(initializer.name, taken, self)
            tensor = Call(_OUTPUT).tensor(value).clone()
            if initializer.name in trainable:
                self.register_parameter(name, torch.nn.Parameter(tensor))
            else:
                self.register_buffer(name, tensor)
            self.state_names[name] = initializer.name
            self._attributes[initializer.name] = name
            if isinstance(value, np.ndarray) and value.size <= GIVEN_LIMIT:
                self._given[initializer.name] = value

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(inputs) != len(self.input_names):
            raise TypeError(f"OnnxModule takes the inputs {self.input_names}, got {len(inputs)} tensors")
        device = next((t.device for t in inputs if isinstance(t, torch.Tensor)), None)
        if device is None:
            device = next((t.device for t in [*self.parameters(), *self.buffers()]), torch.device("cpu"))
        env: dict[str, Value] = dict(self._static)
        env.update({name: getattr(self, attribute) for name, attribute in self._attributes.items()})
        env.update(zip(self.input_names, inputs, strict=True))
        given = {id(env[name]): array for name, array in self._given.items()}
        run = RunState(frozenset(id(b) for b in self.buffers()))
        _run_nodes(self._nodes, env, device, given, run)
        outputs = tuple(Call(_OUTPUT, device).tensor(env[name]) for name in self.output_names)
        with torch.no_grad():
            for buffer, value in run.updates:
                buffer.copy_(value)
        return outputs


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


def running_statistics(model: onnx.ModelProto) -> list[str]:
    """The initializers that training-mode BatchNormalization nodes read as their running mean and variance: state
    the forward updates (`OnnxModule.statistics`) and never a trained weight (it gets no gradient). Frozen, they
    become the module's buffers, which the forward updates in place."""
    initializers = {i.name for i in model.graph.initializer}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    found: list[str] = []
    for node in model.graph.node:
        spec = NodeSpec(node.name, node.op_type, node.domain, opset, _attributes(node), tuple(node.output))
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx") and nn.batch_norm_training(spec):
            found += [n for n in node.input[3:5] if n in initializers and n not in found]
    return found


def _initializer_value(initializer: onnx.TensorProto) -> Value:
    if initializer.data_location == onnx.TensorProto.EXTERNAL and not initializer.HasField("raw_data"):
        location = next((e.value for e in initializer.external_data if e.key == "location"), "?")
        raise GradientBuildError(
            f"OnnxModule cannot hold the initializer {initializer.name!r}: its data is in the external file "
            f"{location!r}, which the model was loaded without; load it with onnx.load(path) (which reads external "
            "data) or onnx.external_data_helper.load_external_data_for_model(model, directory)"
        )
    try:
        return tensor_value(initializer)
    except ValueError as err:
        raise GradientBuildError(f"OnnxModule cannot hold the initializer {initializer.name!r}: {err}") from err


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


def _compile(graph: onnx.GraphProto, opsets: dict[str, int], kept: set[str], outer: set[str]) -> tuple[_Node, ...]:
    """The nodes with their specs and release lists; every refused node is named in one error. `kept`: values
    never released (the outputs); `outer`: names of the enclosing graphs a subgraph may read."""
    types = _element_types(graph)
    specs = [_spec(node, opsets, types) for node in graph.node]
    refusals = [(spec, _refusal(node, spec, opsets, types)) for node, spec in zip(graph.node, specs, strict=True)]
    refused = [(spec, reason) for spec, reason in refusals if reason]
    if refused:
        _raise_refusals(refused)
    last_use: dict[str, int] = {}
    for index, node in enumerate(graph.node):
        for name in [*node.input, *node.output, *_free_names(node)]:
            last_use[name] = index
    compiled = []
    for index, (node, spec) in enumerate(zip(graph.node, specs, strict=True)):
        attrs = dict(spec.attrs)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                attrs[attribute.name] = _subgraph(attribute.g, opsets, outer | _defined_before(graph, index))
        spec = NodeSpec(
            spec.name, spec.op_type, spec.domain, spec.opset, attrs, spec.outputs, spec.inputs, spec.input_types
        )
        release = tuple(n for n in node.output if last_use.get(n) == index and n not in kept)
        release += tuple(n for n in [*node.input, *_free_names(node)] if last_use.get(n) == index and n not in kept)
        compiled.append(_Node(spec, _key(node), tuple(node.input), tuple(dict.fromkeys(release))))
    return tuple(compiled)


def _subgraph(graph: onnx.GraphProto, opsets: dict[str, int], outer: set[str]) -> Subgraph:
    outputs = [o.name for o in graph.output]
    constants = {i.name: _initializer_value(i) for i in graph.initializer}
    nodes = _compile(graph, opsets, set(outputs), outer)
    return Subgraph(nodes, tuple(i.name for i in graph.input), tuple(outputs), constants)


def _defined_before(graph: onnx.GraphProto, index: int) -> set[str]:
    names = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    return names | {o for node in graph.node[:index] for o in node.output}


def _free_names(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs read from enclosing graphs (so they are not released before it runs)."""
    free: set[str] = set()
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            g = attribute.g
            defined = {i.name for i in g.input} | {i.name for i in g.initializer}
            for inner in g.node:
                free |= {n for n in [*inner.input, *_free_names(inner)] if n and n not in defined}
                defined |= set(inner.output)
            free |= {o.name for o in g.output if o.name not in defined}
    return free


def _spec(node: onnx.NodeProto, opsets: dict[str, int], types: Mapping[str, int]) -> NodeSpec:
    domain = _key(node)[0]
    return NodeSpec(
        node.name,
        node.op_type,
        domain,
        opsets.get(domain, 0),
        _attributes(node),
        tuple(node.output),
        tuple(node.input),
        tuple(types.get(name) for name in node.input),
    )


def _element_types(graph: onnx.GraphProto) -> dict[str, int]:
    """The ONNX element types the graph declares (inputs, outputs, value_info, initializers, Constant values):
    what an op needs when the torch dtype says less (INT4 held in int8)."""
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output, *graph.value_info]}
    types.update({i.name: i.data_type for i in graph.initializer})
    for node in graph.node:
        for attribute in node.attribute:
            if node.op_type == "Constant" and attribute.type == onnx.AttributeProto.TENSOR:
                types[node.output[0]] = attribute.t.data_type
    return {name: elem for name, elem in types.items() if elem}


def _refusal(node: onnx.NodeProto, spec: NodeSpec, opsets: dict[str, int], types: Mapping[str, int]) -> str | None:
    """Why OnnxModule cannot run `node`, or None."""
    key = _key(node)
    if key[0] not in opsets:
        return f"its domain {key[0]!r} is not imported by the model"
    if key not in TORCH_OPS and key not in STATIC_OPS:
        return f"no implementation of {node.op_type}"
    if any(types.get(name) == onnx.TensorProto.STRING for name in [*node.input, *node.output]):
        return "string tensors have no torch type"
    if key[0] == "":
        newest = onnx.defs.onnx_opset_version()
        if not OLDEST_OPSET <= spec.opset <= newest:
            return f"OnnxModule follows the ONNX specs of opsets {OLDEST_OPSET} to {min(newest, NEWEST_OPSET)}"
        try:
            since = onnx.defs.get_schema(node.op_type, spec.opset, "").since_version
        except onnx.defs.SchemaError:
            if node.op_type in ORT_DEFAULT_DOMAIN:
                return _check(key, spec)
            return f"{node.op_type} is not an operator of opset {spec.opset}"
        if since > NEWEST_OPSET:
            return f"{node.op_type}-{since} is newer than the specs OnnxModule follows (up to opset {NEWEST_OPSET})"
    return _check(key, spec)


def _check(key: tuple[str, str], spec: NodeSpec) -> str | None:
    check = CHECKS.get(key)
    return check(spec) if check is not None else None


def _raise_refusals(refused: list[tuple[NodeSpec, str]]) -> None:
    listed = sorted({f"{s.domain + '.' if s.domain else ''}{s.op_type}" for s, _ in refused})
    details = "; ".join(f"{spec.label}: {reason}" for spec, reason in refused[:5])
    more = f"; and {len(refused) - 5} more" if len(refused) > 5 else ""
    raise GradientBuildError(
        f"PyTorch cannot differentiate this ONNX model: OnnxModule cannot run {', '.join(listed)} — "
        f"{details}{more}. To train it, {INSTALL_HINT}.",
        op_type=refused[0][0].op_type,
    )


def _key(node: onnx.NodeProto) -> tuple[str, str]:
    return (_DOMAINS.get(node.domain, node.domain), node.op_type)


def _attributes(node: onnx.NodeProto) -> dict[str, object]:
    """Attribute values as Python: tensors as values (`base.tensor_value`), strings as str (lists alike); graphs
    as GraphProtos, which `_compile` replaces with their compiled `Subgraph`s."""
    values: dict[str, object] = {}
    for attribute in node.attribute:
        value = helper.get_attribute_value(attribute)
        if isinstance(value, onnx.TensorProto):
            value = _attribute_tensor(node, value)
        elif isinstance(value, bytes):
            value = value.decode()
        elif isinstance(value, list) and value and isinstance(value[0], bytes):
            value = [v.decode() for v in value]
        values[attribute.name] = value
    return values


def _attribute_tensor(node: onnx.NodeProto, proto: onnx.TensorProto) -> Value | str:
    try:
        return tensor_value(proto)
    except ValueError as err:
        return f"unreadable: {err}"  # the op's check refuses it (Constant of strings)


def _statistics(nodes: Sequence[_Node], attributes: Mapping[str, str], buffers: set[str]) -> dict[str, str]:
    """Running statistics a training-mode BatchNormalization updates in place: buffer initializer -> the node
    output that holds the new value ("" where the node does not output it: it is still computed and written)."""
    found: dict[str, str] = {}
    for node in nodes:
        if node.key != ("", "BatchNormalization") or not nn.batch_norm_training(node.spec):
            continue
        for input_index, output_index in ((3, 1), (4, 2)):
            name = node.inputs[input_index] if len(node.inputs) > input_index else ""
            if attributes.get(name) in buffers:
                outputs = node.spec.outputs
                found[name] = outputs[output_index] if len(outputs) > output_index else ""
    return found


def _run_nodes(
    nodes: Sequence[_Node],
    env: dict[str, Value],
    device: torch.device,
    given: Mapping[int, np.ndarray],
    run: RunState | None,
) -> None:
    for node in nodes:
        _run(node, Call(node.spec, device, given, env, run), env)
        for name in node.release:
            env.pop(name, None)


def _run(node: _Node, call: Call, env: dict[str, Value]) -> None:
    """Compute `node` from `env` and store its named outputs there."""
    values = [env[name] if name else None for name in node.inputs]
    numpy_version = STATIC_OPS.get(node.key)
    result: OpResult
    try:
        if numpy_version is not None and all(v is None or isinstance(v, np.ndarray) for v in values):
            result = numpy_version(call, *values)
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
