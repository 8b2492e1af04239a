"""PyTorch ops run eagerly inside ONNX Runtime: the kernel side of the torch builder's eager fallback.

An aten op of the torch builder's traced graph that torch.onnx cannot translate (most of `torch.linalg`, see
`gradient/eager_fallback.py`) becomes one node of onnxruntime-extensions' Python custom ops (PyOp) in the graph:

- domain `DOMAIN` (the one onnxruntime-extensions gives every Python op), op type `op_type(n_inputs, n_outputs)`;
- one string attribute, `CALL_ATTRIBUTE`: JSON of the aten overload ("aten.linalg_solve_ex.default"), its
  non-tensor arguments (tensors are `{"input": k}`) and the torch dtype of every input and output;
- every input and output crosses the boundary as float64 (Cast nodes around the node convert): ONNX Runtime fixes
  the element types of a custom op when the op is registered, and a Python op is registered once per process
  before the first session that uses it, so one op type per (input count, output count) takes any dtypes. A
  complex tensor crosses as its real view (a trailing dim of 2), as torch.onnx writes complex values.

`prepare_options(model, options)` registers the kernels and onnxruntime-extensions' library on the session options
of a model that has such nodes; every session orttrainer creates goes through it (`ort.create_session`,
`ort.optimized_model`). The kernel runs `torch.ops.<op>` on the inputs on the CPU and returns numpy arrays: a copy
of each input and output through host memory, and ONNX Runtime cannot optimise across the node.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np
import onnx
import torch

DOMAIN = "ai.onnx.contrib"  # onnxruntime-extensions' `default_opset_domain()`: every Python custom op lives there
OP_PREFIX = "OrtTrainerEagerAten"
CALL_ATTRIBUTE = "call"
MAX_INPUTS = 16
MAX_OUTPUTS = 8
PACKAGE = "onnxruntime-extensions"


def op_type(n_inputs: int, n_outputs: int) -> str:
    """The custom op type of an eager node with these many tensor inputs and outputs."""
    if n_inputs > MAX_INPUTS or not 1 <= n_outputs <= MAX_OUTPUTS:
        raise ValueError(
            f"an eagerly run op takes at most {MAX_INPUTS} tensors and returns 1 to {MAX_OUTPUTS}, "
            f"got {n_inputs} and {n_outputs}"
        )
    return f"{OP_PREFIX}_{n_inputs}_{n_outputs}"


def eager_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The eagerly run nodes of `model`'s main graph."""
    return [n for n in model.graph.node if n.domain == DOMAIN and n.op_type.startswith(OP_PREFIX)]


def eager_op_names(model: onnx.ModelProto) -> list[str]:
    """The aten overloads `model` runs eagerly, in graph order, once each."""
    names: dict[str, None] = {}
    for node in eager_nodes(model):
        for attribute in node.attribute:
            if attribute.name == CALL_ATTRIBUTE:
                names[json.loads(attribute.s.decode())["op"]] = None
    return list(names)


def prepare_options(model: onnx.ModelProto, options: Any) -> None:
    """Make a session created with `options` able to run `model`'s eager nodes (none: nothing to do).

    Raises ImportError naming the ops and the package when onnxruntime-extensions is not installed."""
    if not eager_nodes(model):
        return
    try:
        import onnxruntime_extensions
    except ImportError as err:
        raise ImportError(
            f"this graph runs {', '.join(eager_op_names(model))} eagerly in PyTorch (no ONNX translation exists), "
            f"which needs the {PACKAGE} package: pip install {PACKAGE} (README: Gradient builders)"
        ) from err
    _register_kernels()
    if not any(known is options for known in _options_with_library):
        # registering the library twice on one SessionOptions crashes ONNX Runtime (verified on 1.19.2 and 1.32.0)
        options.register_custom_ops_library(onnxruntime_extensions.get_library_path())
        _options_with_library.append(options)


# Every SessionOptions the library is registered on (kept alive, so that an id is never reused).
_options_with_library: list[Any] = []


@functools.lru_cache(maxsize=1)
def _register_kernels() -> None:
    """One Python op per (input count, output count), all float64, registered once per process before the first
    library registration (a session's options see the Python ops registered when the library was; docs/engine.md
    §18)."""
    from onnxruntime_extensions import PyCustomOpDef, onnx_op

    for n_in in range(MAX_INPUTS + 1):
        for n_out in range(1, MAX_OUTPUTS + 1):
            onnx_op(
                op_type=op_type(n_in, n_out),
                inputs=[PyCustomOpDef.dt_double] * n_in,
                outputs=[PyCustomOpDef.dt_double] * n_out,
                attrs={CALL_ATTRIBUTE: PyCustomOpDef.dt_string},
            )(functools.partial(_kernel, n_out))


def encode_call(op: str, arguments: Any, input_dtypes: list[torch.dtype], output_dtypes: list[torch.dtype]) -> str:
    """The `CALL_ATTRIBUTE` string. `arguments` is (args, kwargs) with `{"input": k}` for the k-th tensor input;
    the other leaves are None, bool, int, float, complex, str, or torch dtypes, devices, layouts and memory formats."""
    return json.dumps(
        {
            "op": op,
            "arguments": _encode(arguments),
            "inputs": [str(d).removeprefix("torch.") for d in input_dtypes],
            "outputs": [str(d).removeprefix("torch.") for d in output_dtypes],
        }
    )


_TORCH_VALUE_TYPES = (torch.dtype, torch.device, torch.layout, torch.memory_format)


def _encode(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict) and set(value) == {"input"}:
        return value
    if isinstance(value, dict):  # keyword arguments
        return {"dict": {str(k): _encode(v) for k, v in value.items()}}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, complex):
        return {"complex": [value.real, value.imag]}
    if isinstance(value, _TORCH_VALUE_TYPES):
        return {type(value).__name__: str(value).removeprefix("torch.")}
    raise TypeError(f"an argument of type {type(value).__name__} ({value!r}) cannot be written into an eager node")


def _decode(value: Any, inputs: list[torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, inputs) for v in value]
    if not isinstance(value, dict):
        return value
    (kind, content), *_ = value.items()
    if kind == "input":
        return inputs[content]
    if kind == "dict":
        return {k: _decode(v, inputs) for k, v in content.items()}
    if kind == "complex":
        return complex(*content)
    if kind == "device":
        return torch.device(content)
    return getattr(torch, content)  # dtype, layout, memory_format: torch.float32, torch.strided, ...


@functools.lru_cache(maxsize=256)
def _parsed(call: str) -> tuple[Any, Any, list[torch.dtype], list[torch.dtype]]:
    record = json.loads(call)
    namespace, name, overload = record["op"].split(".")
    op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    dtypes = [[getattr(torch, d) for d in record[k]] for k in ("inputs", "outputs")]
    return op, record["arguments"], dtypes[0], dtypes[1]


def _kernel(n_outputs: int, *arrays: np.ndarray, **attributes: str) -> tuple[np.ndarray, ...] | np.ndarray:
    """Run the node's op on `arrays` (float64, see the module docstring) and return its outputs as float64."""
    op, arguments, input_dtypes, output_dtypes = _parsed(attributes[CALL_ATTRIBUTE])
    inputs = [_from_transport(a, d) for a, d in zip(arrays, input_dtypes, strict=True)]
    args, kwargs = _decode(arguments, inputs)
    with torch.no_grad():
        result = op(*args, **kwargs)
    outputs = list(result) if isinstance(result, (tuple, list)) else [result]
    if len(outputs) != n_outputs or len(outputs) != len(output_dtypes):
        raise RuntimeError(f"{attributes[CALL_ATTRIBUTE]}: returned {len(outputs)} tensors, expected {n_outputs}")
    converted = tuple(_to_transport(t) for t in outputs)
    return converted if n_outputs > 1 else converted[0]


def _from_transport(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    tensor = torch.from_numpy(np.array(array, dtype=np.float64, copy=True))
    if dtype.is_complex:
        return torch.view_as_complex(tensor.to(dtype.to_real()).contiguous())
    return tensor.to(dtype)


def _to_transport(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().resolve_conj().resolve_neg()
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    return tensor.to(torch.float64).contiguous().numpy().copy()  # not np.ascontiguousarray: it makes 0-d 1-d
