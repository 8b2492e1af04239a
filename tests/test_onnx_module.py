"""OnnxModule (orttrainer/trainer/gradient/onnx_module/) op by op: on a one-node graph (`onnx_op_cases.py`) its
outputs equal onnxruntime.InferenceSession's, and its PyTorch gradients equal ONNX Runtime's gradient builder's
(with the training build) and finite differences; plus naming, static shape arithmetic and its errors."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers import needs_training_build
from onnx import helper, numpy_helper
from onnx_op_cases import CASES, Case

from orttrainer.trainer.gradient.errors import GradientBuildError
from orttrainer.trainer.gradient.onnx_module import OnnxModule, module_name
from orttrainer.trainer.graph.passes import run_passes
from orttrainer.trainer.graph.pipeline import forward_passes

FLOATS = (np.float32, np.float64)


def one_node_model(c: Case, dtype=np.float32) -> onnx.ModelProto:
    """The node with its data inputs as graph inputs, its other inputs as initializers (floats as `dtype`)."""
    arrays = {n: (a.astype(dtype) if a.dtype in FLOATS else a) for n, a in c.inputs if a is not None}
    outputs = [f"out{k}" for k in range(c.outputs)]
    node = helper.make_node(c.op, [n for n, _ in c.inputs], outputs, domain=c.domain, **c.attrs)
    graph = helper.make_graph(
        [node],
        c.id,
        [helper.make_tensor_value_info(n, _elem(arrays[n]), arrays[n].shape) for n in c.data],
        [helper.make_empty_tensor_value_info(o) for o in outputs],
        [numpy_helper.from_array(a, n) for n, a in arrays.items() if n not in c.data],
    )
    opsets = [helper.make_opsetid("", c.opset)] + ([helper.make_opsetid(c.domain, 1)] if c.domain else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


def _elem(array: np.ndarray) -> int:
    return helper.np_dtype_to_tensor_dtype(array.dtype)


def trainable_of(model: onnx.ModelProto, c: Case) -> list[str]:
    """The case's floating-point initializers but the frozen ones and the loss weights R."""
    skipped = {*c.frozen, *(f"R{k}" for k in range(c.outputs))}
    return [i.name for i in model.graph.initializer if i.data_type in (1, 11) and i.name not in skipped]


def feeds(c: Case) -> dict[str, np.ndarray]:
    return {n: a for n, a in c.inputs if n in c.data}


def run_module(module: OnnxModule, c: Case) -> tuple[torch.Tensor, ...]:
    return module(*(torch.from_numpy(a.copy()) for a in feeds(c).values()))


def params(cases: list[Case]) -> list:
    """The cases as pytest parameters; ops of the training build only run with it."""
    return [pytest.param(c, id=c.id, marks=[needs_training_build] if c.training_build else []) for c in cases]


@pytest.mark.parametrize("c", params(CASES))
def test_forward_matches_onnxruntime(c):
    model = one_node_model(c)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(None, feeds(c))
    module = OnnxModule(model, list(c.data), [o.name for o in model.graph.output], trainable_of(model, c), c.frozen)
    got = run_module(module, c)
    for k, (g, e) in enumerate(zip(got, expected, strict=True)):
        if c.op == "Dropout" and k == 1 and e.dtype == np.bool_ and e.all():
            assert g.dtype == torch.bool and bool(g.all())
            continue
        assert g.dtype == torch.from_numpy(np.asarray(e)).dtype, (k, g.dtype, e.dtype)
        assert tuple(g.shape) == e.shape, (k, g.shape, e.shape)
        np.testing.assert_allclose(g.detach().numpy(), e, rtol=1e-5, atol=1e-6)


def loss_model(c: Case, dtype=np.float32) -> onnx.ModelProto:
    """The one-node model plus loss = sum_k ReduceSum(out_k * R_k) over the first `loss_outputs` outputs, the R_k
    fixed: a scalar for both gradient builders."""
    model = one_node_model(c, dtype)
    session = ort.InferenceSession(one_node_model(c).SerializeToString(), providers=["CPUExecutionProvider"])
    shapes = [a.shape for a in session.run(None, feeds(c))[: c.loss_outputs]]
    graph, rng = model.graph, np.random.default_rng(1)
    for k, shape in enumerate(shapes):
        graph.initializer.append(numpy_helper.from_array(rng.uniform(0.5, 1.5, shape).astype(dtype), f"R{k}"))
        graph.node.append(helper.make_node("Mul", [f"out{k}", f"R{k}"], [f"weighted{k}"]))
        graph.node.append(helper.make_node("ReduceSum", [f"weighted{k}"], [f"part{k}"], keepdims=0))
    total = "part0"
    for k in range(1, len(shapes)):  # Add: ONNX Runtime has no gradient for Sum
        graph.node.append(helper.make_node("Add", [total, f"part{k}"], [f"total{k}"]))
        total = f"total{k}"
    graph.node.append(helper.make_node("Identity", [total], ["loss"]))
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("loss", helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), []))
    return model


def torch_gradients(model: onnx.ModelProto, c: Case, trainable: list[str]) -> dict[str, np.ndarray]:
    module = OnnxModule(model, list(c.data), ["loss"], trainable, c.frozen)
    (loss,) = run_module(module, c)
    loss.backward()
    params = dict(module.named_parameters())
    return {module.state_names[name]: p.grad.numpy() for name, p in params.items() if p.grad is not None}


def ort_gradients(model: onnx.ModelProto, c: Case, trainable: list[str]) -> dict[str, np.ndarray]:
    from orttrainer.trainer.gradient.ort_builder import build_ort_gradient_graph

    forward = run_passes(model, forward_passes(dropout_off=False))
    while True:
        try:
            graded = build_ort_gradient_graph(forward, "loss", trainable, trainable)
            break
        except GradientBuildError as err:  # statistics inputs that only feed unused outputs do not train
            if not err.unreachable:
                raise
            trainable = [t for t in trainable if t not in err.unreachable]
    session = ort.InferenceSession(graded.SerializeToString(), providers=["CPUExecutionProvider"])
    values = {n: a for n, a in c.inputs if n in trainable}
    results = session.run([f"{p}_grad" for p in trainable], {**feeds(c), **values})
    return dict(zip(trainable, results, strict=True))


DIFFERENTIABLE = [c for c in CASES if c.grad is not None]
WITH_ORT_GRADIENT = [c for c in CASES if c.grad == "ort"]


@needs_training_build
@pytest.mark.parametrize("c", WITH_ORT_GRADIENT, ids=[c.id for c in WITH_ORT_GRADIENT])
def test_gradients_match_onnxruntime_gradient_builder(c):
    model = loss_model(c)
    expected = ort_gradients(model, c, trainable_of(model, c))
    got = torch_gradients(model, c, trainable_of(model, c))
    assert set(got) == set(expected) and got
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-4, atol=1e-5, err_msg=name)


SMOOTH = [c for c in DIFFERENTIABLE if c.smooth]


@pytest.mark.parametrize("c", params(SMOOTH))
def test_gradients_match_finite_differences(c):
    """In float64: torch.autograd.gradcheck of the module's loss as a function of its trained initializers."""
    model = loss_model(c, np.float64)
    module = OnnxModule(model, list(c.data), ["loss"], trainable_of(model, c), c.frozen)
    params = dict(module.named_parameters())
    names = [n for n in module.state_names if n in params]
    inputs = [torch.from_numpy(a.copy()) for a in feeds(c).values()]

    def loss_of(*values):
        return torch.func.functional_call(module, dict(zip(names, values, strict=True)), tuple(inputs))[0]

    start = tuple(params[n].detach().clone().requires_grad_(True) for n in names)
    assert torch.autograd.gradcheck(loss_of, start, eps=1e-6, atol=1e-5, rtol=1e-4)
    assert all(
        torch.isfinite(g).all() for g in torch.autograd.grad(loss_of(*start), start, allow_unused=True) if g is not None
    )


@pytest.mark.parametrize("c", params(DIFFERENTIABLE))
def test_the_torch_builder_exports_gradients_that_onnxruntime_runs_like_pytorch(c):
    """The whole route: trace the module, export forward + backward as ONNX, run it with InferenceSession."""
    from orttrainer.trainer.gradient.torch_graphs import TorchSource

    model = loss_model(c)
    trainable = trainable_of(model, c)
    module = OnnxModule(model, list(c.data), ["loss"], trainable, c.frozen)
    source = TorchSource(module, None, list(c.data), 18, True, state_names=module.state_names)
    batch = [torch.from_numpy(a.copy()) for a in feeds(c).values()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graded = _exported_or_frozen(source, batch, trainable, [*trainable, *c.frozen])
    session = ort.InferenceSession(graded.SerializeToString(), providers=["CPUExecutionProvider"])
    state = {n: a for n, a in c.inputs if n in trainable or n in c.frozen}
    results = dict(zip([o.name for o in graded.graph.output], session.run(None, {**feeds(c), **state}), strict=True))
    expected = torch_gradients(model, c, trainable)
    assert {n[: -len("_grad")] for n in results if n.endswith("_grad")} == set(expected)
    for name, gradient in expected.items():
        np.testing.assert_allclose(results[f"{name}_grad"], gradient, rtol=1e-5, atol=1e-6, err_msg=name)


def _exported_or_frozen(source, batch, trainable, state) -> onnx.ModelProto:
    """The gradient model; initializers without a gradient are frozen first, as the trainer does."""
    from orttrainer.trainer.gradient.torch_graphs import torch_gradient_model

    while True:
        try:
            return torch_gradient_model(source, batch, ["loss"], trainable, state).model
        except GradientBuildError as err:
            if not err.unreachable:
                raise
            trainable = [t for t in trainable if t not in err.unreachable]


def test_dropout_in_training_mode_drops_with_the_mask_it_outputs():
    c = Case(
        "Dropout",
        [("x", np.ones((200, 50), np.float32)), ("r", np.array(0.25, np.float32)), ("t", np.array(True))],
        outputs=2,
    )
    model = one_node_model(c)
    module = OnnxModule(model, [], ["out0", "out1"], ["x"])
    out, mask = module()
    assert mask.dtype == torch.bool and 0.2 < 1 - mask.float().mean().item() < 0.3
    torch.testing.assert_close(out, mask.float() / 0.75)
    out.sum().backward()
    torch.testing.assert_close(dict(module.named_parameters())["x"].grad, mask.float() / 0.75)


def _graph_model(nodes, inputs, outputs, initializers, opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _linear_chain(names: list[str]) -> onnx.ModelProto:
    """y = x @ W0 @ W1 ..., one initializer per name; loss = ReduceMean(y)."""
    rng = np.random.default_rng(2)
    nodes, current = [], "x"
    for k, name in enumerate(names):
        nodes.append(helper.make_node("MatMul", [current, name], [f"h{k}"]))
        current = f"h{k}"
    nodes.append(helper.make_node("ReduceMean", [current], ["loss"], keepdims=0))
    return _graph_model(
        nodes,
        [helper.make_tensor_value_info("x", 1, ["batch", 3])],
        [helper.make_tensor_value_info("loss", 1, [])],
        [numpy_helper.from_array(rng.standard_normal((3, 3)).astype(np.float32), n) for n in names],
    )


def test_state_tensors_get_module_names_that_map_back_to_the_initializer_names():
    names = ["fc1.weight", "/layer/W:0", "0bias", "training", "a.b", "a_b", "forward"]
    module = OnnxModule(_linear_chain(names), ["x"], ["loss"], names[:-1], names[-1:])
    assert sorted(module.state_names.values()) == sorted(names)
    assert module.state_names["fc1_weight"] == "fc1.weight" and module.state_names["_layer_W_0"] == "/layer/W:0"
    assert module.state_names["_0bias"] == "0bias"
    assert {module.state_names[n] for n in ("training_1", "a_b", "a_b_1", "forward_1")} == {
        "training",
        "a.b",
        "a_b",
        "forward",
    }
    assert [module.state_names[n] for n, _ in module.named_parameters()] == names[:-1]
    assert [module.state_names[n] for n, _ in module.named_buffers()] == ["forward"]
    assert module.training is True and callable(module.forward)  # the attributes it avoided still work
    assert module_name("x.y", {"x_y"}, module) == "x_y_1"


def test_an_op_outside_the_table_is_named_with_its_node_and_opset_and_what_to_do():
    model = _linear_chain(["W"])
    model.graph.node.insert(1, helper.make_node("TfIdfVectorizer", ["h0"], ["counts"], name="the_tfidf"))
    with pytest.raises(
        GradientBuildError,
        match=r"node 'the_tfidf' \(TfIdfVectorizer, opset 17\): no implementation of TfIdfVectorizer",
    ) as err:
        OnnxModule(model, ["x"], ["loss"], ["W"])
    assert "pip install 'orttrainer[ort-training]'" in str(err.value) and "PyTorch module" in str(err.value)
    assert err.value.op_type == "TfIdfVectorizer"


def test_every_refused_node_is_named_at_construction_with_its_reason():
    """An attribute value an op does not implement, an opset outside the specs followed, a domain the model does
    not import: one error at construction, each node with its op, opset and reason."""
    model = _linear_chain(["W"])
    model.graph.node.insert(1, helper.make_node("Resize", ["h0", "", "scales"], ["r"], name="bad_mode", mode="area"))
    model.graph.node.insert(2, helper.make_node("Gelu", ["h0"], ["g"], name="ms_gelu", domain="com.example"))
    with pytest.raises(GradientBuildError) as err:
        OnnxModule(model, ["x"], ["loss"], ["W"])
    message = str(err.value)
    assert "node 'bad_mode' (Resize, opset 17): mode 'area'" in message
    assert "node 'ms_gelu' (com.example.Gelu, opset 0): its domain 'com.example' is not imported" in message
    old = _linear_chain(["W"])
    old.opset_import[0].version = 6
    with pytest.raises(GradientBuildError, match=r"\(MatMul, opset 6\): OnnxModule follows the ONNX specs of opsets 7"):
        OnnxModule(old, ["x"], ["loss"], ["W"])


def test_a_graph_input_that_is_neither_data_nor_initializer_is_refused():
    model = _linear_chain(["W"])
    model.graph.input.append(helper.make_tensor_value_info("extra", 1, [1]))
    with pytest.raises(GradientBuildError, match=r"graph inputs \['extra'\] are neither data inputs nor"):
        OnnxModule(model, ["x"], ["loss"], ["W"])


def _reshape_by_computed_shape(shape_from_data: bool) -> onnx.ModelProto:
    """loss = ReduceMean(Reshape(x, [Shape(x)[0], -1]) @ W): the target shape is computed in the graph from
    Shape, or (shape_from_data) read from the int64 data input `s`."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
        helper.make_node("Unsqueeze", ["batch", "zero_axis"], ["batch1"]),
        helper.make_node("Concat", ["batch1", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "s" if shape_from_data else "target"], ["flat"]),
        helper.make_node("MatMul", ["flat", "W"], ["y"]),
        helper.make_node("ReduceMean", ["y"], ["loss"], keepdims=0),
    ]
    inputs = [helper.make_tensor_value_info("x", 1, ["batch", 2, 3])]
    inputs += [helper.make_tensor_value_info("s", 7, [2])] if shape_from_data else []
    initializers = [
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array([0], np.int64), "zero_axis"),
        numpy_helper.from_array(np.array([-1], np.int64), "minus_one"),
        numpy_helper.from_array(np.random.default_rng(3).standard_normal((6, 4)).astype(np.float32), "W"),
    ]
    return _graph_model(nodes, inputs, [helper.make_tensor_value_info("loss", 1, [])], initializers)


def _trace(model: onnx.ModelProto, inputs: list[str], batch: list[torch.Tensor]) -> onnx.ModelProto:
    from orttrainer.trainer.gradient.torch_graphs import TorchSource, torch_gradient_model

    module = OnnxModule(model, inputs, ["loss"], ["W"])
    source = TorchSource(module, None, inputs, 17, True, state_names=module.state_names)
    return torch_gradient_model(source, batch, ["loss"], ["W"], ["W"]).model


def test_shapes_computed_in_the_graph_are_numbers_when_the_torch_builder_traces():
    model = _reshape_by_computed_shape(shape_from_data=False)
    x = torch.randn(5, 2, 3)
    graded = _trace(model, ["x"], [x])
    weight = numpy_helper.to_array(model.graph.initializer[3])
    session = ort.InferenceSession(graded.SerializeToString(), providers=["CPUExecutionProvider"])
    loss, grad = session.run(["loss", "W_grad"], {"x": x.numpy(), "W": weight})
    w = torch.from_numpy(weight.copy()).requires_grad_(True)
    expected = (x.reshape(5, -1) @ w).mean()
    expected.backward()
    np.testing.assert_allclose(loss, expected.item(), rtol=1e-6)
    np.testing.assert_allclose(grad, w.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_a_shape_read_from_data_cannot_be_traced_and_the_error_names_the_node():
    model = _reshape_by_computed_shape(shape_from_data=True)
    with pytest.raises(
        GradientBuildError, match=r"\(Reshape, opset 17\): input shape must be known when the graph is traced"
    ):
        _trace(model, ["x", "s"], [torch.randn(5, 2, 3), torch.tensor([5, 6])])
    module = OnnxModule(model, ["x", "s"], ["loss"], ["W"])  # run eagerly, the values are there
    assert module(torch.randn(5, 2, 3), torch.tensor([5, 6]))[0].shape == ()


def _run_one(c: Case) -> tuple[torch.Tensor, ...]:
    model = one_node_model(c)
    return run_module(OnnxModule(model, list(c.data), [o.name for o in model.graph.output], []), c)


def test_contrib_ops_without_a_cpu_kernel_compute_their_documented_formula():
    """BiasAdd, GemmFastGelu and BiasSoftmax (CUDA-only in ONNX Runtime) and SparseSoftmaxCrossEntropy (a training
    op of older ONNX Runtime builds, unregistered in 1.19): no InferenceSession to compare with, so their
    formulas."""
    x, bias, skip, w = (torch.randn(*s, generator=torch.Generator().manual_seed(k)) for k, s in
                        enumerate([(2, 3, 4), (4,), (2, 3, 4), (4, 5)]))  # fmt: skip
    ms = {"domain": "com.microsoft", "data": ("x",)}
    (got,) = _run_one(Case("BiasAdd", [("x", x.numpy()), ("b", bias.numpy()), ("s", skip.numpy())], **ms))
    torch.testing.assert_close(got, x + bias + skip)
    (got,) = _run_one(Case("GemmFastGelu", [("x", x.numpy()), ("w", w.numpy()), ("b", bias[:1].numpy())], **ms))
    torch.testing.assert_close(got, torch.nn.functional.gelu(x @ w + bias[:1], approximate="tanh"))
    scores, mask = torch.randn(2, 3, 4, 5), torch.randn(2, 4, 5)  # the mask repeats along dimension 1
    softmax = Case(
        "BiasSoftmax", [("x", scores.numpy()), ("b", mask.numpy())], {"axis": 2, "is_inner_broadcast": 1}, **ms
    )
    torch.testing.assert_close(_run_one(softmax)[0], torch.softmax(scores + mask[:, None], dim=2))
    labels = np.array([[0, 3, 1], [2, 2, 0]], np.int64)
    weights = np.array([[1.0, 0.5, 2.0], [0.0, 1.0, 1.5]], np.float32)
    sce = Case("SparseSoftmaxCrossEntropy", [("x", x.numpy()), ("t", labels), ("w", weights)], outputs=2, **ms)
    loss, log_prob = _run_one(sce)
    expected = torch.nn.functional.log_softmax(x, dim=-1)
    picked = -expected.gather(-1, torch.from_numpy(labels).unsqueeze(-1)).squeeze(-1) * torch.from_numpy(weights)
    torch.testing.assert_close(log_prob, expected)
    torch.testing.assert_close(loss, picked.sum() / weights.sum())


def test_scan_8_runs_each_batch_entry_for_its_sequence_length_like_onnxruntime():
    """Scan-8 (opset 8): batch first, sequence_lens per entry, a reversed scan input; the body accumulates a sum
    and outputs it per step."""
    body = helper.make_graph(
        [helper.make_node("Add", ["s_in", "x_in"], ["s_out"]), helper.make_node("Identity", ["s_out"], ["y_out"])],
        "body",
        [helper.make_tensor_value_info("s_in", 1, [2]), helper.make_tensor_value_info("x_in", 1, [2])],
        [helper.make_tensor_value_info("s_out", 1, [2]), helper.make_tensor_value_info("y_out", 1, [2])],
    )
    node = helper.make_node(
        "Scan", ["lens", "init", "x"], ["final", "ys"], body=body, num_scan_inputs=1, directions=[1]
    )
    graph = helper.make_graph(
        [node],
        "scan8",
        [
            helper.make_tensor_value_info("lens", 7, [2]),
            helper.make_tensor_value_info("init", 1, [2, 2]),
            helper.make_tensor_value_info("x", 1, [2, 3, 2]),
        ],
        [helper.make_tensor_value_info("final", 1, [2, 2]), helper.make_tensor_value_info("ys", 1, [2, 3, 2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)])
    model.ir_version = 8
    feeds = {
        "lens": np.array([3, 1], np.int64),
        "init": np.array([[0, 1], [2, 3]], np.float32),
        "x": np.arange(12, dtype=np.float32).reshape(2, 3, 2),
    }
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    module = OnnxModule(model, list(feeds), ["final", "ys"], [])
    got = module(*(torch.from_numpy(v) for v in feeds.values()))
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g.numpy(), e)
