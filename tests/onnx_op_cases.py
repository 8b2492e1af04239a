"""One-node ONNX graphs for OnnxModule's op tests (`tests/test_onnx_module.py`): the op, its inputs and attributes.

Each `Case` says which inputs are graph inputs (`data`; the rest are initializers, floating-point ones trained) and
how its gradient is checked: 'ort' (against ONNX Runtime's gradient builder, and by finite differences), 'fd'
(finite differences only: ONNX Runtime has no gradient for the op (docs/engine.md §1.5) or a wrong one
(docs/engine.md §11)) or None (not differentiable). `frozen` initializers are floats that are not trained
(a Dropout ratio, a padding value, class weights); the loss reads the first `loss_outputs` outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

RNG = np.random.default_rng(0)


def f(*shape: int, low: float = -1.0, high: float = 1.0) -> np.ndarray:
    return RNG.uniform(low, high, shape).astype(np.float32)


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


@dataclass(frozen=True)
class Case:
    op: str
    inputs: list[tuple[str, np.ndarray | None]]
    attrs: dict = field(default_factory=dict)
    opset: int = 17
    outputs: int = 1
    data: tuple[str, ...] = ()
    grad: str | None = "ort"
    frozen: tuple[str, ...] = ()
    loss_outputs: int = 1
    smooth: bool = True  # False: ties make finite differences meaningless
    domain: str = ""
    name: str = ""
    training_build: bool = False  # the op is in onnxruntime-training only (its forward check needs that build)

    @property
    def id(self) -> str:
        return self.name or f"{self.op}{self.opset}"


def case(op: str, *inputs: tuple[str, np.ndarray | None], **kwargs) -> Case:
    return Case(op, list(inputs), **kwargs)


X, Y = ("x", f(3, 4)), ("y", f(3, 4))
POSITIVE = ("x", f(3, 4, low=0.5, high=2.0))
IMAGE = ("x", f(2, 3, 5, 5))

ELEMENTWISE = [
    case("Add", X, ("y", f(4))),
    case("Sub", X, Y),
    case("Mul", X, ("y", f(3, 1))),
    case("Div", X, ("y", f(4, low=0.5, high=2.0))),
    case("Div", ("x", i64(7, -7, 6)), ("y", i64(2, 2, -4)), grad=None, name="Div_int"),
    case("Pow", POSITIVE, ("y", f(3, 4)), data=("y",)),
    case("Neg", X),
    case("Sqrt", POSITIVE),
    case("Exp", X),
    case("Log", POSITIVE),
    case("Abs", X),
    case("Erf", X),
    case("Tanh", X),
    case("Sigmoid", X),
    case("Relu", X),
    case("LeakyRelu", X, attrs={"alpha": 0.2}),
    case("Reciprocal", POSITIVE),
    case("Gelu", X, opset=20),
    case("Gelu", X, opset=20, attrs={"approximate": "tanh"}, grad="fd", name="Gelu_tanh"),
    case("Gelu", X, domain="com.microsoft", name="ms_Gelu"),
    case("FastGelu", X, ("b", f(4)), domain="com.microsoft", name="ms_FastGelu"),
    case("BiasGelu", X, ("b", f(4)), domain="com.microsoft", name="ms_BiasGelu"),
    case("Equal", ("x", i64(1, 2, 3)), ("y", i64(1, 0, 3)), grad=None),
    case("Less", X, Y, grad=None),
    case("Greater", X, Y, grad=None),
    case("Where", ("c", np.array([[True], [False], [True]])), X, Y, data=("c",)),
    case("Where", ("c", np.array([[True], [False], [True]])), X, ("y", f(4)), data=("c",), grad="fd", name="Where_b"),
    case("Sum", X, ("y", f(4)), ("z", f(3, 1)), grad="fd"),
    case("Mean", X, ("y", f(4)), grad="fd"),
    case("Max", X, Y),
    case("Min", X, Y),
    case("Clip", X, ("lo", np.array(-0.5, np.float32)), ("hi", np.array(0.5, np.float32)), grad="fd"),
    case("Clip", X, ("", None), ("hi", np.array(0.3, np.float32)), grad="fd", name="Clip_max_only"),
    case("Clip", X, attrs={"min": -0.4, "max": 0.6}, opset=7, grad="fd", name="Clip6"),
]

PRODUCTS_AND_SOFTMAX = [
    case("MatMul", ("x", f(2, 3, 4)), ("y", f(4, 5))),
    case("Gemm", ("a", f(3, 4)), ("b", f(4, 5)), ("c", f(5))),
    case(
        "Gemm",
        ("a", f(4, 3)),
        ("b", f(5, 4)),
        ("c", f(3, 1)),
        attrs={"alpha": 0.5, "beta": 2.0, "transA": 1, "transB": 1},
        name="Gemm_trans",
    ),
    case("Softmax", ("x", f(2, 3, 4))),
    case("Softmax", ("x", f(2, 3, 4)), opset=11, name="Softmax11_coerced"),
    case("LogSoftmax", ("x", f(2, 3, 4)), attrs={"axis": 1}),
    case("LogSoftmax", ("x", f(2, 3, 4)), opset=11, attrs={"axis": 2}),
    case("Einsum", ("x", f(2, 3, 4)), ("y", f(2, 4, 5)), attrs={"equation": "bij,bjk->bik"}, grad="fd"),
    case("CumSum", X, ("axis", i64(1)), grad="fd"),
    case("CumSum", X, ("axis", i64(0)), attrs={"exclusive": 1, "reverse": 1}, grad="fd", name="CumSum_excl_rev"),
]

REDUCTIONS = [
    case("ReduceMean", ("x", f(2, 3, 4)), attrs={"axes": [1], "keepdims": 0}),
    case("ReduceMean", ("x", f(2, 3, 4)), ("axes", i64(-1, 0)), opset=18, name="ReduceMean18"),
    case("ReduceSum", ("x", f(2, 3, 4)), attrs={"axes": [0, 2]}, opset=11),
    case("ReduceSum", ("x", f(2, 3, 4)), ("axes", i64(1)), attrs={"keepdims": 0}, opset=13),
    case("ReduceSum", ("x", f(2, 3, 4)), opset=13, name="ReduceSum_all"),
    case("ReduceSum", ("x", f(2, 3)), ("axes", i64()), attrs={"noop_with_empty_axes": 1}, opset=13, name="noop"),
    case("ReduceMax", ("x", f(2, 3, 4)), attrs={"axes": [1]}, grad="fd"),
    case("ReduceMin", ("x", f(2, 3, 4)), ("axes", i64(2)), attrs={"keepdims": 0}, opset=18, grad="fd"),
]

SHAPES = [
    case("Identity", X),
    case("Reshape", ("x", f(2, 3, 4)), ("s", i64(0, -1))),
    case("Reshape", ("x", f(2, 3, 4)), ("s", i64(0, 2, -1)), attrs={"allowzero": 0}, opset=14, name="Reshape_zero"),
    case("Transpose", ("x", f(2, 3, 4)), attrs={"perm": [1, 0, 2]}),
    case("Transpose", ("x", f(2, 3, 4)), grad="fd", name="Transpose_default"),
    case("Flatten", ("x", f(2, 3, 4)), attrs={"axis": 2}),
    case("Squeeze", ("x", f(2, 1, 3, 1)), ("axes", i64(1)), opset=13),
    case("Squeeze", ("x", f(2, 1, 3, 1)), opset=11, name="Squeeze_all"),
    case("Unsqueeze", ("x", f(2, 3)), ("axes", i64(0, -1)), opset=13),
    case("Unsqueeze", ("x", f(2, 3)), attrs={"axes": [1]}, opset=11),
    case("Concat", X, ("y", f(3, 2)), attrs={"axis": 1}),
    case("Split", ("x", f(2, 6)), ("split", i64(2, 4)), attrs={"axis": 1}, opset=13, outputs=2, loss_outputs=2),
    case("Split", ("x", f(6, 2)), opset=11, outputs=3, loss_outputs=3, name="Split_even"),
    case("Split", ("x", f(7, 2)), attrs={"num_outputs": 3}, opset=18, outputs=3, loss_outputs=3, name="Split18"),
    case("Slice", ("x", f(5, 6)), ("s", i64(1, 0)), ("e", i64(4, -1)), ("a", i64(0, 1)), ("st", i64(2, 1))),
    case(
        "Slice",
        ("x", f(5, 6)),
        ("s", i64(1, -1)),
        ("e", i64(4, -6)),
        ("a", i64(0, 1)),
        ("st", i64(2, -2)),
        grad="fd",
        name="Slice_negative_step",
    ),
    case("Slice", ("x", f(5, 6)), ("s", i64(-2)), ("e", i64(2**62)), ("a", i64(1)), name="Slice_to_end"),
    case("Slice", ("x", f(5, 6)), attrs={"starts": [1], "ends": [3], "axes": [1]}, opset=9, grad="fd"),
    case("Gather", ("x", f(5, 4)), ("i", i64(0, -1, 2)), attrs={"axis": 0}, data=("i",)),
    case("Gather", ("x", f(3, 5)), ("i", np.array([[1, 0], [4, -2]])), attrs={"axis": 1}, name="Gather_2d"),
    case("Cast", X, attrs={"to": 7}, grad=None),
    case("Cast", X, attrs={"to": 11}, grad=None, name="Cast_double"),
    case("ConstantOfShape", ("s", i64(2, 3)), grad=None),
    case("Shape", ("x", f(2, 3, 4)), grad=None),
    case("Shape", ("x", f(2, 3, 4)), attrs={"start": 1, "end": -1}, opset=15, grad=None, name="Shape15"),
    case("Expand", ("x", f(3, 1)), ("s", i64(2, 1, 4))),
    case("Tile", X, ("r", i64(2, 1))),
    case("Pad", X, ("p", i64(1, 0, 0, 2)), ("v", np.array(0.5, np.float32)), frozen=("v",)),
    case("Range", ("a", np.array(1, np.int64)), ("b", np.array(9, np.int64)), ("d", np.array(3, np.int64)), grad=None),
]

NN = [
    # ONNX Runtime scales the gradient of an inference-mode Dropout (docs/engine.md §1.4)
    case("Dropout", X, ("r", np.array(0.3, np.float32)), ("t", np.array(False)), outputs=2, frozen=("r",), grad="fd"),
    case("Dropout", X, ("r", np.zeros((), np.float32)), ("t", np.array(True)), outputs=2, frozen=("r",), name="Drop0"),
    case("LayerNormalization", ("x", f(2, 3, 4)), ("s", f(4)), ("b", f(4)), outputs=3),
    case("LayerNormalization", ("x", f(2, 3, 4)), ("s", f(3, 4)), attrs={"axis": 1, "epsilon": 1e-3}, grad="fd"),
    case(
        "BatchNormalization",
        IMAGE,
        ("s", f(3)),
        ("b", f(3)),
        ("m", f(3)),
        ("v", f(3, low=0.5, high=1.5)),
        opset=15,
        name="BN_inference",
    ),
    case(
        "BatchNormalization",
        IMAGE,
        ("s", f(3)),
        ("b", f(3)),
        ("m", f(3)),
        ("v", f(3, low=0.5, high=1.5)),
        attrs={"training_mode": 1, "momentum": 0.8},
        opset=15,
        outputs=3,
        frozen=("m", "v"),
        name="BN_training",
    ),
    case("Conv", IMAGE, ("w", f(4, 3, 3, 3)), ("b", f(4)), attrs={"pads": [1, 1, 1, 1]}),
    case(
        "Conv",
        ("x", f(2, 4, 7, 6)),
        ("w", f(4, 2, 3, 2)),
        attrs={"strides": [2, 1], "dilations": [1, 2], "group": 2, "pads": [0, 1, 2, 0]},
        name="Conv_group_asymmetric",
    ),
    case(
        "Conv",
        IMAGE,
        ("w", f(2, 3, 3, 3)),
        attrs={"auto_pad": "SAME_UPPER", "strides": [2, 2]},
        grad="fd",
        name="Conv_same",
    ),
    case("MaxPool", IMAGE, attrs={"kernel_shape": [2, 2], "strides": [2, 2]}),
    case("MaxPool", IMAGE, attrs={"kernel_shape": [3, 3], "pads": [1, 0, 0, 1]}, name="MaxPool_asym"),
    case("AveragePool", IMAGE, attrs={"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
    case(
        "AveragePool",
        IMAGE,
        attrs={"kernel_shape": [2, 3], "pads": [0, 1, 1, 0], "count_include_pad": 1},
        name="AveragePool_asym_include",
    ),
    case("AveragePool", IMAGE, attrs={"kernel_shape": [2, 2], "pads": [0, 0, 1, 1]}, name="AveragePool_asym"),
    case(
        "Conv", ("x", f(2, 3, 9)), ("w", f(4, 3, 3)), ("b", f(4)), attrs={"strides": [2], "pads": [1, 0]}, name="Conv1d"
    ),
    case("Conv", ("x", f(1, 2, 4, 4, 4)), ("w", f(2, 2, 2, 2, 2)), name="Conv3d"),
    case("MaxPool", IMAGE, attrs={"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, name="MaxPool_pad"),
    case("MaxPool", IMAGE, attrs={"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}, name="MaxPool_ceil"),
    case("MaxPool", IMAGE, attrs={"kernel_shape": [2, 2], "dilations": [2, 2]}, name="MaxPool_dilated"),
    # ties: the first maximum of a window (row-major) takes the gradient, as in ONNX Runtime
    case(
        "MaxPool",
        ("x", np.round(f(2, 3, 5, 5) * 2) / 2),
        attrs={"kernel_shape": [2, 2]},
        smooth=False,
        name="MaxPool_ties",
    ),
    case(
        "AveragePool",
        IMAGE,
        attrs={"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 0, 0], "ceil_mode": 1},
        name="AveragePool_ceil",
    ),
    case("AveragePool", ("x", f(2, 3, 7)), attrs={"kernel_shape": [3], "strides": [2]}, name="AveragePool1d"),
    case("GlobalAveragePool", IMAGE),
    case("GlobalMaxPool", IMAGE, grad="fd"),
    case("SoftmaxCrossEntropyLoss", ("x", f(4, 5)), ("t", i64(0, 4, 2, 2)), outputs=2, opset=13, data=("t",)),
    case(
        "SoftmaxCrossEntropyLoss",
        ("x", f(3, 5, 2)),
        ("t", np.array([[1, 3], [4, 0], [2, 2]])),
        ("w", f(5, low=0.5, high=1.5)),
        attrs={"ignore_index": 2, "reduction": "sum"},
        opset=13,
        frozen=("w",),
        name="SCE_weight_ignore",
    ),
    case(
        "NegativeLogLikelihoodLoss",
        ("x", f(4, 5)),
        ("t", i64(0, 4, 2, 1)),
        ("w", f(5, low=0.5, high=1.5)),
        attrs={"ignore_index": 1},
        opset=13,
        grad="fd",
        frozen=("w",),
    ),
    case("NegativeLogLikelihoodLoss", ("x", f(4, 5)), ("t", i64(0, 4, 2, 1)), attrs={"reduction": "none"}, grad="fd"),
]

SEQUENCE = ("x", f(3, 2, 3))  # (steps, batch, input)


def recurrent(op: str, gates: int, directions: int = 1, **kwargs) -> Case:
    """An RNN/GRU/LSTM node with hidden size 4 and every input given (LSTM: peepholes too)."""
    hidden, size = 4, 3
    inputs = [
        SEQUENCE,
        ("w", f(directions, gates * hidden, size)),
        ("r", f(directions, gates * hidden, hidden)),
        ("b", f(directions, 2 * gates * hidden)),
        ("lens", np.array([3, 2], np.int32)),
        ("h0", f(directions, 2, hidden)),
    ]
    if op == "LSTM":
        inputs += [("c0", f(directions, 2, hidden)), ("p", f(directions, 3 * hidden))]
    attrs = {"hidden_size": hidden, **kwargs.pop("attrs", {})}
    return case(op, *inputs, attrs=attrs, outputs=3 if op == "LSTM" else 2, loss_outputs=2, **kwargs)


# Ops added with the backend-test coverage (tests/test_onnx_conformance.py checks them against ONNX's test data);
# here each goes through the whole torch-builder route as well: trace, export, ONNX Runtime. ONNX Runtime 1.19's
# gradient builder has no gradient for most of them; where it has one it is compared ('ort'), except for a
# training-mode BatchNormalization-9 and ScatterND with reduction='add', where its gradients are wrong (finite
# differences agree with PyTorch's).
ACTIVATIONS = [
    case(op, X, grad="fd", opset=18 if op == "Mish" else 17)
    for op in ("Selu", "Celu", "Mish", "HardSwish", "Softplus", "Tan", "Atan", "Sinh", "Cosh", "Asinh")
] + [
    case("Sin", X, name="Sin17"),
    case("PRelu", X, ("slope", f(4)), grad="fd"),
    case("ThresholdedRelu", X, attrs={"alpha": 0.1}, grad="fd"),
    case("Shrink", X, attrs={"lambd": 0.3, "bias": 0.1}, grad="fd"),
    case("Asin", ("x", f(3, 4, low=-0.9, high=0.9)), grad="fd"),
    case("Acos", ("x", f(3, 4, low=-0.9, high=0.9)), grad="fd"),
    case("Atanh", ("x", f(3, 4, low=-0.9, high=0.9)), grad="fd"),
    case("Acosh", ("x", f(3, 4, low=1.5, high=3.0)), grad="fd"),
    case("Hardmax", ("x", f(2, 3, 4)), attrs={"axis": 1}, grad=None),
    case("ArgMax", ("x", f(2, 3, 4)), attrs={"axis": -1, "select_last_index": 1}, grad=None),
    case("TopK", ("x", f(3, 6)), ("k", i64(2)), outputs=2),
    case("Round", ("x", f(3, 4) * 3), grad=None),
]

LAYERS = [
    case(
        "ConvTranspose",
        IMAGE,
        ("w", f(3, 2, 3, 3)),
        ("b", f(2)),
        attrs={"strides": [2, 2], "pads": [1, 0, 0, 1]},
        grad="fd",
    ),
    case(
        "ConvTranspose",
        ("x", f(1, 4, 3, 3)),
        ("w", f(4, 1, 2, 2)),
        attrs={"group": 2, "strides": [2, 2], "output_padding": [1, 0], "dilations": [1, 2]},
        grad="fd",
        name="ConvTranspose_grouped",
    ),
    case("InstanceNormalization", IMAGE, ("s", f(3)), ("b", f(3)), grad="fd"),
    case(
        "GroupNormalization",
        ("x", f(2, 4, 3, 3)),
        ("s", f(4)),
        ("b", f(4)),
        attrs={"num_groups": 2},
        opset=21,
        grad="fd",
    ),
    case("LRN", IMAGE, attrs={"size": 3}, grad="fd"),
    case("MeanVarianceNormalization", IMAGE, grad="fd"),
    case("LpNormalization", X, grad="fd"),
    case("LpPool", IMAGE, attrs={"kernel_shape": [2, 2], "p": 3}, grad="fd"),
    case("GlobalLpPool", IMAGE, grad="fd"),
    case("MaxPool", IMAGE, attrs={"kernel_shape": [2, 2], "strides": [2, 2]}, outputs=2, name="MaxPool_indices"),
    case("DepthToSpace", ("x", f(1, 8, 2, 3)), attrs={"blocksize": 2, "mode": "CRD"}, grad="fd"),
    case("SpaceToDepth", ("x", f(1, 2, 4, 6)), attrs={"blocksize": 2}, grad="fd"),
    case(
        "BatchNormalization",
        IMAGE,
        ("s", f(3)),
        ("b", f(3)),
        ("m", f(3)),
        ("v", f(3, low=0.5, high=1.5)),
        opset=9,
        outputs=5,
        frozen=("m", "v"),
        grad="fd",
        name="BN9_training",
    ),
    recurrent("RNN", 1, grad="fd"),
    recurrent("GRU", 3, 2, attrs={"direction": "bidirectional", "linear_before_reset": 1}, grad="fd"),
    recurrent("LSTM", 4, attrs={"direction": "reverse", "clip": 2.0}, grad="fd"),
]

RESAMPLING = [
    case(
        "Resize",
        ("x", f(1, 2, 3, 4)),
        ("roi", np.zeros(0, np.float32)),
        ("scales", np.array([1, 1, 2, 1.5], np.float32)),
        attrs={"mode": "linear"},
        opset=19,
        frozen=("roi", "scales"),
        grad="fd",
        name="Resize_linear",
    ),
    case(
        "Resize",
        ("x", f(1, 2, 4, 4)),
        ("roi", np.zeros(0, np.float32)),
        ("scales", np.zeros(0, np.float32)),
        ("sizes", i64(1, 2, 3, 5)),
        attrs={"mode": "cubic", "coordinate_transformation_mode": "align_corners"},
        opset=13,
        frozen=("roi", "scales"),
        grad="fd",
        name="Resize_cubic_sizes",
    ),
    case(
        "Resize",
        ("x", f(1, 2, 3, 3)),
        ("roi", np.zeros(0, np.float32)),
        ("scales", np.array([1, 1, 2, 2], np.float32)),
        attrs={"mode": "nearest"},
        opset=13,
        frozen=("roi", "scales"),
        grad="fd",
        name="Resize_nearest",
    ),
    case(
        "Upsample",
        ("x", f(1, 1, 2, 3)),
        ("scales", np.array([1, 1, 2, 3], np.float32)),
        opset=9,
        frozen=("scales",),
        grad="fd",
    ),
    case(
        "GridSample",
        IMAGE,
        ("grid", f(2, 3, 4, 2, low=-1.1, high=1.1)),
        attrs={"align_corners": 1},
        opset=16,
        grad="fd",
    ),
    case(  # (bicubic's 16 taps make a graph that takes a minute to export; the conformance test checks it)
        "GridSample",
        IMAGE,
        ("grid", f(2, 3, 4, 2, low=-1.2, high=1.2)),
        attrs={"mode": "nearest", "padding_mode": "reflection"},
        opset=16,
        grad="fd",
        name="GridSample_nearest_reflection",
    ),
    case("AffineGrid", ("theta", f(2, 2, 3)), ("size", i64(2, 3, 4, 5)), opset=20, grad="fd"),
]

INDEXING = [
    case("GatherND", ("x", f(2, 3, 4)), ("i", np.array([[[1, 2]], [[0, -1]]])), attrs={"batch_dims": 1}),
    case(
        "ScatterElements", ("x", f(3, 4)), ("i", np.array([[1, 0], [2, 3], [0, 1]])), ("u", f(3, 2)), attrs={"axis": 1}
    ),
    case(
        "ScatterND",
        ("x", f(4, 3)),
        ("i", np.array([[1], [3]])),
        ("u", f(2, 3)),
        attrs={"reduction": "add"},
        opset=16,
        grad="fd",
        name="ScatterND_add",
    ),
    case(
        "OneHot", ("i", i64(0, 2, -1)), ("depth", i64(4)), ("v", np.array([0.5, 2.0], np.float32)), frozen=(), grad="fd"
    ),
    case("ReverseSequence", ("x", f(4, 2, 3)), ("lens", i64(3, 1)), attrs={"batch_axis": 1, "time_axis": 0}, grad="fd"),
    case("Trilu", ("x", f(2, 4, 4)), ("k", i64(1)), attrs={"upper": 0}),
    case("CumSum", ("x", f(3, 4)), ("axis", i64(-1)), attrs={"reverse": 1}, grad="fd", name="CumSum_negative_axis"),
    case("Pad", X, ("p", i64(2, 1, 1, 3)), attrs={"mode": "reflect"}, grad="fd", name="Pad_reflect"),
    case("Pad", X, ("p", i64(1, 3, 0, 2)), attrs={"mode": "wrap"}, opset=19, grad="fd", name="Pad_wrap"),
    case("Einsum", ("x", f(2, 3)), ("y", f(3, 4)), attrs={"equation": "ij,jk"}, grad="fd", name="Einsum_implicit"),
]

MICROSOFT = [
    case(
        "SkipLayerNormalization",
        ("x", f(2, 3, 4)),
        ("skip", f(2, 3, 4)),
        ("g", f(4)),
        ("beta", f(4)),
        ("bias", f(4)),
        attrs={"epsilon": 1e-5},
        domain="com.microsoft",
        grad="fd",
        name="ms_SkipLayerNormalization",
    ),
    case(
        "Attention",
        ("x", f(2, 3, 8)),
        ("w", f(8, 24)),
        ("b", f(24)),
        ("mask", np.array([3, 2], np.int32)),
        attrs={"num_heads": 2},
        domain="com.microsoft",
        grad="fd",
        name="ms_Attention",
    ),
    case(
        "FusedMatMul",
        ("a", f(2, 4, 3)),
        ("b", f(5, 4)),
        attrs={"transA": 1, "transB": 1, "alpha": 0.5},
        domain="com.microsoft",
        grad="fd",
        name="ms_FusedMatMul",
    ),
    case("QuickGelu", X, domain="com.microsoft", name="ms_QuickGelu"),
    case(
        "EmbedLayerNormalization",
        ("ids", np.array([[1, 4, 2], [0, 3, 3]], np.int32)),
        ("seg", np.array([[0, 0, 1], [0, 1, 1]], np.int32)),
        ("word", f(5, 4)),
        ("pos", f(6, 4)),
        ("segment", f(2, 4)),
        ("g", f(4)),
        ("beta", f(4)),
        ("mask", np.array([[1, 1, 1], [1, 1, 0]], np.int32)),
        attrs={"epsilon": 1e-5},
        domain="com.microsoft",
        outputs=2,
        grad="fd",
        name="ms_EmbedLayerNormalization",
    ),
]

MICROSOFT += [
    case(
        "MultiHeadAttention",
        ("q", f(2, 3, 8)),
        ("k", f(2, 4, 8)),
        ("v", f(2, 4, 8)),
        ("b", f(24)),
        attrs={"num_heads": 2},
        domain="com.microsoft",
        grad="fd",
        name="ms_MultiHeadAttention",
    ),
    case(
        "SkipSimplifiedLayerNormalization",
        ("x", f(2, 3, 4)),
        ("skip", f(2, 3, 4)),
        ("g", f(4)),
        attrs={"epsilon": 1e-5},
        domain="com.microsoft",
        grad="fd",
        name="ms_SkipSimplifiedLayerNormalization",
    ),
    case(
        "SimplifiedLayerNormalization", ("x", f(2, 3, 4)), ("s", f(4)), grad="fd", name="SimplifiedLayerNormalization"
    ),
    case(
        "FusedGemm",
        ("a", f(3, 4)),
        ("b", f(4, 5)),
        ("c", f(5)),
        attrs={"activation": "LeakyRelu", "activation_alpha": 0.2, "transB": 0},
        domain="com.microsoft",
        grad="fd",
        name="ms_FusedGemm",
    ),
    case(
        "SoftmaxCrossEntropyLossInternal",
        ("x", f(4, 5)),
        ("t", i64(0, 4, 2, 2)),
        ("w", f(5, low=0.5, high=1.5)),
        ("ignore", np.array(2, np.int64)),
        outputs=2,
        domain="com.microsoft",
        frozen=("w",),
        grad="fd",
        training_build=True,
        name="ms_SoftmaxCrossEntropyLossInternal",
    ),
    case(
        "SoftmaxCrossEntropy",
        ("x", f(4, 5)),
        ("p", np.full((4, 5), 0.2, np.float32)),
        outputs=2,
        domain="com.microsoft",
        grad="fd",
        training_build=True,
        name="ms_SoftmaxCrossEntropy",
    ),
    case(
        "TransposeMatMul",
        ("a", f(4, 3)),
        ("b", f(4, 5)),
        attrs={"transA": 1},
        domain="com.microsoft",
        grad="fd",
        training_build=True,
        name="ms_TransposeMatMul",
    ),
]

CASES = (
    ELEMENTWISE
    + PRODUCTS_AND_SOFTMAX
    + REDUCTIONS
    + SHAPES
    + NN
    + ACTIVATIONS
    + LAYERS
    + RESAMPLING
    + INDEXING
    + MICROSOFT
)
