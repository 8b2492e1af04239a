"""Optimizer update subgraphs (update/in_graph.py): SGD, Adam (both decay modes, bias correction on/off) and LAMB.

Every test compiles a hand-built gradient model with `build_training_graph`, runs three consecutive updates with
onnxruntime and compares weights and moments with a float64 numpy reference of the documented formula. The harness
here is shared with test_graph_training.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from orttrainer.trainer.compile.contract import ParamGroup, TrainingGraph, moment_names, zero_state
from orttrainer.trainer.graph.editor import GraphEditor
from orttrainer.trainer.graph.training import build_training_graph
from orttrainer.trainer.update.in_graph import StepScalars, append_adam

LRS = (0.1, 0.05, 0.2)  # a different learning rate per update, so the lr input is really read
RTOL, ATOL = 2e-6, 1e-7


def adam_hyper(**overrides) -> dict:
    return {
        "alpha": 0.9,
        "beta": 0.999,
        "lambda": 0.0,
        "epsilon": 1e-8,
        "max_norm_clip": 1.0,
        "do_bias_correction": True,
        "weight_decay_mode": 0,
        **overrides,
    }


def lamb_hyper(**overrides) -> dict:
    return {
        "alpha": 0.9,
        "beta": 0.999,
        "lambda": 0.0,
        "ratio_min": -math.inf,
        "ratio_max": math.inf,
        "epsilon": 1e-6,
        "max_norm_clip": 1.0,
        "do_bias_correction": False,
        **overrides,
    }


def sgd_hyper(**overrides) -> dict:
    return {"max_norm_clip": 1.0, **overrides}  # SGD reads no hyper-parameter but the learning rate input


# ---------------------------------------------------------------------------------------------------------- harness
def gradient_model(shapes: dict[str, tuple[int, ...]]) -> onnx.ModelProto:
    """A gradient model built by hand: for each parameter p with data input x_p of the same shape,
    `loss = Σ_p [Σ(x_p·p) + ½·Σ p²]`, so `p_grad = x_p + p` (computed by an Add node)."""
    nodes, inputs, terms, grads = [], [], [], []
    for p, shape in shapes.items():
        inputs += [
            helper.make_tensor_value_info(f"x_{p}", TensorProto.FLOAT, list(shape)),
            helper.make_tensor_value_info(p, TensorProto.FLOAT, list(shape)),
        ]
        nodes += [
            helper.make_node("Mul", [f"x_{p}", p], [f"{p}_xp"]),
            helper.make_node("ReduceSum", [f"{p}_xp"], [f"{p}_linear"], keepdims=0),
            helper.make_node("ReduceSumSquare", [p], [f"{p}_sq"], keepdims=0),
            helper.make_node("Mul", [f"{p}_sq", "half"], [f"{p}_quadratic"]),
            helper.make_node("Add", [f"x_{p}", p], [f"{p}_grad"]),
        ]
        terms += [f"{p}_linear", f"{p}_quadratic"]
        grads.append(helper.make_tensor_value_info(f"{p}_grad", TensorProto.FLOAT, list(shape)))
    nodes.append(helper.make_node("Sum", terms, ["loss"]))
    outputs = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []), *grads]
    half = numpy_helper.from_array(np.array(0.5, np.float32), "half")
    graph = helper.make_graph(nodes, "gradient_model", inputs, outputs, [half])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


def compile_graph(
    params: dict[str, np.ndarray],
    optimizer: str,
    groups: list[ParamGroup],
    *,
    accumulation_steps: int = 1,
    clip: bool = False,
) -> TrainingGraph:
    return build_training_graph(
        gradient_model({p: v.shape for p, v in params.items()}),
        data_inputs=[f"x_{p}" for p in params],
        outputs=["loss"],
        trainable=list(params),
        optimizer_name=optimizer,
        groups=groups,
        accumulation_steps=accumulation_steps,
        clip_grad_norm=clip,
    )


class OrtRunner:
    """Runs a TrainingGraph the way the training session does: state fed back, only the fetched path executed."""

    def __init__(self, graph: TrainingGraph, params: dict[str, np.ndarray]) -> None:
        self.graph = graph
        self.session = ort.InferenceSession(graph.model.SerializeToString(), providers=["CPUExecutionProvider"])
        self.state = {**{p: v.copy() for p, v in params.items()}, **zero_state(graph.state_shapes)}
        self.options = ort.RunOptions()
        self.options.only_execute_path_to_fetches = True

    def _run(self, data: dict, lr: float, count: int, state_outputs: dict[str, str]) -> tuple[float, dict]:
        feeds = {
            **self.state,
            **data,
            self.graph.lr_input: np.array(lr, np.float32),
            self.graph.update_count_input: np.array(count, np.int64),
        }
        fetched = self.session.run(["loss", *state_outputs.values()], feeds, self.options)
        new_state = dict(zip(state_outputs, fetched[1:], strict=True))
        self.state.update(new_state)
        return float(fetched[0]), new_state

    def accumulate(self, data: dict, lr: float, count: int) -> tuple[float, dict]:
        return self._run(data, lr, count, self.graph.accumulation)

    def update(self, data: dict, lr: float, count: int) -> tuple[float, dict]:
        result = self._run(data, lr, count, {**self.graph.weight_updates, **self.graph.optimizer_state})
        self.state.update(zero_state({b: self.state[b].shape for b in self.graph.accumulation}))
        return result


class Reference:
    """The documented update rules in float64 numpy, for parameters whose gradient is `x_p + p`."""

    def __init__(self, optimizer: str, groups: list[ParamGroup], params: dict[str, np.ndarray]) -> None:
        self.optimizer, self.groups = optimizer, groups
        self.w = {p: v.astype(np.float64) for p, v in params.items()}
        self.m = {p: np.zeros_like(v) for p, v in self.w.items()}
        self.v = {p: np.zeros_like(v) for p, v in self.w.items()}
        self.t = 0
        self.clip_factors: list[float] = []
        self.ratios: dict[str, list[float]] = {p: [] for p in params}

    def loss(self, data: dict) -> float:
        return sum(float((data[f"x_{p}"] * w).sum() + 0.5 * (w * w).sum()) for p, w in self.w.items())

    def grad(self, data: dict) -> dict[str, np.ndarray]:
        return {p: data[f"x_{p}"].astype(np.float64) + w for p, w in self.w.items()}

    def update(self, grad_sum: dict[str, np.ndarray], k: int, lr: float, clip: bool) -> None:
        self.t += 1
        g = {p: s / k for p, s in grad_sum.items()}  # the update uses the mean of the micro-batch gradients
        norm = math.sqrt(sum(float((x * x).sum()) for x in g.values()))
        for group in self.groups:
            factor = 1.0
            if clip and self.optimizer != "SGDOptimizer":  # torch.nn.utils.clip_grad_norm_
                factor = min(1.0, group.hyper["max_norm_clip"] / (norm + 1e-6))
                self.clip_factors.append(factor)
            for p in group.params:
                getattr(self, self.optimizer)(p, g[p] * factor, lr, group.hyper)

    def _moments(self, p: str, g: np.ndarray, h: dict) -> tuple[float, float]:
        b1, b2 = h["alpha"], h["beta"]
        self.m[p] = b1 * self.m[p] + (1 - b1) * g
        self.v[p] = b2 * self.v[p] + (1 - b2) * g * g
        if not h["do_bias_correction"]:
            return 1.0, 1.0
        return 1 - b1**self.t, 1 - b2**self.t

    def SGDOptimizer(self, p: str, g: np.ndarray, lr: float, h: dict) -> None:
        self.w[p] = self.w[p] - lr * g

    def AdamOptimizer(self, p: str, g: np.ndarray, lr: float, h: dict) -> None:
        bc1, bc2 = self._moments(p, g, h)
        lam, eps, m, v = h["lambda"], h["epsilon"], self.m[p], self.v[p]
        if h["weight_decay_mode"] == 0:  # torch.optim.AdamW
            self.w[p] = self.w[p] * (1 - lr * lam) - lr * (m / bc1) / (np.sqrt(v / bc2) + eps)
        else:  # decay after the update, bias correction in the step size, epsilon not corrected
            self.w[p] = (self.w[p] - lr * math.sqrt(bc2) / bc1 * m / (np.sqrt(v) + eps)) * (1 - lr * lam)

    def LambOptimizer(self, p: str, g: np.ndarray, lr: float, h: dict) -> None:
        bc1, bc2 = self._moments(p, g, h)
        w = self.w[p]
        r = (self.m[p] / bc1) / (np.sqrt(self.v[p] / bc2) + h["epsilon"]) + h["lambda"] * w
        w_norm, r_norm = np.linalg.norm(w), np.linalg.norm(r)
        ratio = float(np.clip(w_norm / r_norm, h["ratio_min"], h["ratio_max"])) if w_norm > 0 and r_norm > 0 else 1.0
        self.ratios[p].append(ratio)
        self.w[p] = w - lr * ratio * r


DataFn = Callable[[int, int, Reference], dict[str, np.ndarray]]


def random_data(seed: int = 0) -> DataFn:
    rng = np.random.default_rng(seed)
    return lambda update, micro, ref: {
        f"x_{p}": rng.standard_normal(w.shape).astype(np.float32) for p, w in ref.w.items()
    }


def train_and_compare(
    params: dict[str, np.ndarray],
    optimizer: str,
    groups: list[ParamGroup],
    *,
    accumulation_steps: int = 1,
    clip: bool = False,
    data: DataFn | None = None,
    updates: int = 3,
) -> tuple[TrainingGraph, Reference]:
    """Compile, then run `updates` optimizer steps of `accumulation_steps` micro-steps each, checking the loss, the
    running gradient sums of the micro-steps and the weights and moments after each update against `Reference`."""
    graph = compile_graph(params, optimizer, groups, accumulation_steps=accumulation_steps, clip=clip)
    runner, ref = OrtRunner(graph, params), Reference(optimizer, groups, params)
    data = data or random_data()
    for update in range(updates):
        lr, running = LRS[update], {p: np.zeros_like(w) for p, w in ref.w.items()}
        for micro in range(accumulation_steps):
            feeds = data(update, micro, ref)
            running = {p: running[p] + g for p, g in ref.grad(feeds).items()}
            if micro < accumulation_steps - 1:
                loss, sums = runner.accumulate(feeds, lr, update + 1)
                for p in params:
                    np.testing.assert_allclose(sums[graph_buffer(graph, p)], running[p], rtol=RTOL, atol=ATOL)
            else:
                loss, new = runner.update(feeds, lr, update + 1)
            np.testing.assert_allclose(loss, ref.loss(feeds), rtol=RTOL, atol=ATOL)
        ref.update(running, accumulation_steps, lr, clip)
        for p in params:
            np.testing.assert_allclose(new[p], ref.w[p], rtol=RTOL, atol=ATOL, err_msg=f"{p} after update {update}")
            assert new[p].shape == params[p].shape and new[p].dtype == np.float32
            if optimizer != "SGDOptimizer":
                m_name, v_name = moment_names(p)
                np.testing.assert_allclose(new[m_name], ref.m[p], rtol=RTOL, atol=ATOL, err_msg=m_name)
                np.testing.assert_allclose(new[v_name], ref.v[p], rtol=RTOL, atol=ATOL * 1e-3, err_msg=v_name)
    return graph, ref


def graph_buffer(graph: TrainingGraph, param: str) -> str:
    (buffer,) = [b for b in graph.accumulation if b.startswith(f"{param}_grad")]
    return buffer


def initial_params(seed: int = 1, **shapes: tuple[int, ...]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {p: rng.standard_normal(shape).astype(np.float32) for p, shape in shapes.items()}


def op_count(graph: TrainingGraph, op_type: str) -> int:
    return sum(n.op_type == op_type for n in graph.model.graph.node)


# -------------------------------------------------------------------------------------------------------------- SGD
def test_sgd():
    params = initial_params(w=(3, 2), b=(2,))
    graph, _ = train_and_compare(params, "SGDOptimizer", [ParamGroup(sgd_hyper(), ["w", "b"])])
    assert graph.optimizer_state == {} and graph.state_shapes == {}


# ------------------------------------------------------------------------------------------------------------- Adam
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.3])
def test_adam(mode, bias_correction, weight_decay):
    params = initial_params(w=(3, 2), b=(2,))
    hyper = adam_hyper(
        weight_decay_mode=mode,
        do_bias_correction=bias_correction,
        **{"lambda": weight_decay},
        alpha=0.8,
        beta=0.95,
        epsilon=1e-3,
    )
    graph, _ = train_and_compare(params, "AdamOptimizer", [ParamGroup(hyper, ["w", "b"])])
    # the bias corrections are computed once per group, in double; nothing at all when they are off
    assert op_count(graph, "Pow") == (2 if bias_correction else 0)
    assert op_count(graph, "Sqrt") == 2 + (1 if bias_correction else 0)  # √v per tensor, √bc2 per group


def test_adam_modes_differ_with_weight_decay_and_bias_correction():
    params = initial_params(w=(3, 2))
    _, mode0 = train_and_compare(params, "AdamOptimizer", [ParamGroup(adam_hyper(**{"lambda": 0.3}), ["w"])])
    _, mode1 = train_and_compare(
        params, "AdamOptimizer", [ParamGroup(adam_hyper(weight_decay_mode=1, **{"lambda": 0.3}), ["w"])]
    )
    assert np.abs(mode0.w["w"] - mode1.w["w"]).max() > 1e-3


def test_adam_update_count_drives_the_bias_correction():
    # Feeding update number 5 instead of 1 on the first update changes bc1/bc2: the step size follows the input.
    params = initial_params(w=(3, 2))
    graph = compile_graph(params, "AdamOptimizer", [ParamGroup(adam_hyper(), ["w"])])
    runner = OrtRunner(graph, params)
    data = {"x_w": np.ones((3, 2), np.float32)}
    _, new = runner.update(data, 0.1, 5)
    g = data["x_w"] + params["w"].astype(np.float64)
    m, v = 0.1 * g, 0.001 * g * g
    expected = params["w"] - 0.1 * (m / (1 - 0.9**5)) / (np.sqrt(v / (1 - 0.999**5)) + 1e-8)
    np.testing.assert_allclose(new["w"], expected, rtol=RTOL, atol=ATOL)


def test_adam_with_a_tensor_coefficient():
    # append_adam folds a 0-d coefficient tensor (here a graph input) into the moment updates.
    graph = helper.make_graph(
        [],
        "g",
        [
            helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
            for n, s in [("w", [2]), ("G", [2]), ("coef", []), ("lr", []), ("Moment_1_w", [2]), ("Moment_2_w", [2])]
        ]
        + [helper.make_tensor_value_info("count", TensorProto.DOUBLE, [])],
        [],
    )
    ed = GraphEditor(graph, "t")
    (update,) = append_adam(ed, ["w"], ["G"], "coef", StepScalars("lr", "count"), adam_hyper())
    for name in (update.new_weight, *(out for _, out in update.moments)):
        ed.add_output(name, TensorProto.FLOAT, [2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    w, G, m, v = (np.array(a, np.float32) for a in ([1.0, -2.0], [3.0, 0.5], [0.1, 0.2], [0.01, 0.02]))
    feeds = {
        "w": w,
        "G": G,
        "coef": np.array(0.25, np.float32),
        "lr": np.array(0.1, np.float32),
        "Moment_1_w": m,
        "Moment_2_w": v,
        "count": np.array(2.0),
    }
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    g = 0.25 * G.astype(np.float64)
    m_new, v_new = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
    w_new = w - 0.1 * (m_new / (1 - 0.81)) / (np.sqrt(v_new / (1 - 0.999**2)) + 1e-8)
    for value, want in zip(got, (w_new, m_new, v_new), strict=True):
        np.testing.assert_allclose(value, want, rtol=RTOL, atol=1e-8)


# ------------------------------------------------------------------------------------------------------------- LAMB
@pytest.mark.parametrize("bias_correction", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_lamb(bias_correction, weight_decay):
    params = initial_params(w=(3, 2), b=(2,))
    hyper = lamb_hyper(do_bias_correction=bias_correction, **{"lambda": weight_decay})
    _, ref = train_and_compare(params, "LambOptimizer", [ParamGroup(hyper, ["w", "b"])])
    assert all(r != 1.0 for r in ref.ratios["w"])  # the trust ratio really scales the update


def test_lamb_trust_ratio_is_clamped():
    params = initial_params(w=(3, 2), b=(2,))
    groups = [ParamGroup(lamb_hyper(ratio_max=0.2), ["w"]), ParamGroup(lamb_hyper(ratio_min=2.5), ["b"])]
    _, ref = train_and_compare(params, "LambOptimizer", groups)
    assert ref.ratios == {"w": [0.2] * 3, "b": [2.5] * 3}


def test_lamb_zero_norms_give_ratio_one():
    # w starts at zero (‖w‖ = 0); u gets a zero gradient on the first update (m = 0 so ‖r‖ = 0).
    params = {"w": np.zeros((3, 2), np.float32), "u": initial_params(u=(2,))["u"]}
    random = random_data(3)

    def data(update: int, micro: int, ref: Reference) -> dict[str, np.ndarray]:
        feeds = random(update, micro, ref)
        if update == 0:
            feeds["x_u"] = -params["u"]
        return feeds

    hyper = lamb_hyper(ratio_min=0.5, ratio_max=0.6)  # a clamped ratio could never be 1
    _, ref = train_and_compare(params, "LambOptimizer", [ParamGroup(hyper, ["w", "u"])], data=data)
    assert ref.ratios["w"][0] == 1.0 and ref.ratios["u"][0] == 1.0
    assert all(0.5 <= r <= 0.6 for r in ref.ratios["w"][1:] + ref.ratios["u"][1:])
    assert np.any(ref.w["w"] != 0)


# -------------------------------------------------------------------------------------------- 0-d (scalar) weights
@pytest.mark.parametrize(
    ("optimizer", "hyper"),
    [("SGDOptimizer", sgd_hyper()), ("AdamOptimizer", adam_hyper()), ("LambOptimizer", lamb_hyper(**{"lambda": 0.1}))],
)
def test_scalar_parameter_keeps_its_shape(optimizer, hyper):
    params = initial_params(w=(3, 2), s=())
    graph, _ = train_and_compare(params, optimizer, [ParamGroup(hyper, ["w", "s"])], clip=True)
    outputs = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in graph.model.graph.output}
    assert outputs[graph.weight_updates["s"]] == []
    if optimizer != "SGDOptimizer":
        assert graph.state_shapes[moment_names("s")[0]] == () and graph.state_shapes[moment_names("s")[1]] == ()
