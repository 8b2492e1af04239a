"""The optimizer update paths on hand-built graphs (graph/training.py `update`, update/torch_fused.py, update/path.py).

`"fused"` (ONNX Runtime's AdamOptimizer kernel in the graph) and `"torch"` (a gradient-only graph, then
`TorchOptimizer` in place on torch tensors) must compute what the plain-op graph computes: every case runs three
updates of the hand-built gradient model of test_graph_optimizer.py against its float64 reference — SGD, Adam in
both weight-decay modes with and without bias correction, LAMB with and without clamps, clipping, accumulation and
two parameter groups.
"""

from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort
import pytest
import torch
from helpers import needs_training_build
from onnx import TensorProto, helper
from test_graph_optimizer import (
    ATOL,
    LRS,
    RTOL,
    OrtRunner,
    Reference,
    adam_hyper,
    gradient_model,
    initial_params,
    lamb_hyper,
    random_data,
    sgd_hyper,
)

from orttrainer.trainer.compile.contract import OutsideUpdate, ParamGroup, TrainingGraph, moment_names, zero_state
from orttrainer.trainer.graph.training import build_training_graph
from orttrainer.trainer.runtime import has_training_build
from orttrainer.trainer.update.path import ENVIRONMENT_VARIABLE, choose_update_path
from orttrainer.trainer.update.torch_fused import TorchOptimizer, supports

# ONNX Runtime's kernel takes β2 as a float32 attribute and forms 1 - β2 in float32: 1 - float32(0.999) is
# 0.00099998713, 1.3e-5 below 0.001, and v carries that relative error (docs/engine.md §12). Without bias
# correction it reaches the weights through √v of a tiny v (lr 0.1-0.2 here): up to 2e-4 relative on this model.
FUSED_RTOL, FUSED_ATOL = 2e-4, 5e-6

CASES = {
    "sgd": ("SGDOptimizer", sgd_hyper()),
    "adam": ("AdamOptimizer", adam_hyper()),
    "adamw": ("AdamOptimizer", adam_hyper(**{"lambda": 0.05})),
    "adamw_no_bias_correction": ("AdamOptimizer", adam_hyper(**{"lambda": 0.05, "do_bias_correction": False})),
    "adam_mode1": ("AdamOptimizer", adam_hyper(**{"lambda": 0.05, "weight_decay_mode": 1})),
    "adam_mode1_no_bias_correction": (
        "AdamOptimizer",
        adam_hyper(**{"lambda": 0.05, "weight_decay_mode": 1, "do_bias_correction": False}),
    ),
    "lamb": ("LambOptimizer", lamb_hyper(**{"lambda": 0.01})),
    "lamb_clamped_bias_correction": (
        "LambOptimizer",
        lamb_hyper(**{"lambda": 0.01, "do_bias_correction": True, "ratio_min": 0.5, "ratio_max": 0.9}),
    ),
}


def compile_path(params, optimizer, groups, update, accumulation_steps=1, clip=False, loss_scale=None):
    model = gradient_model({p: v.shape for p, v in params.items()})
    if loss_scale:
        model.graph.input.append(helper.make_tensor_value_info(loss_scale, TensorProto.FLOAT, []))
    return build_training_graph(
        model,
        data_inputs=[f"x_{p}" for p in params],
        outputs=["loss"],
        trainable=list(params),
        optimizer_name=optimizer,
        groups=groups,
        accumulation_steps=accumulation_steps,
        clip_grad_norm=clip,
        loss_scale_input=loss_scale,
        update=update,
    )


class TorchRunner:
    """Runs a gradient-only graph as the session does: the gradient sums fetched, then `TorchOptimizer` in place."""

    def __init__(self, graph: TrainingGraph, params: dict[str, np.ndarray]) -> None:
        assert graph.outside_update is not None
        self.graph = graph
        self.session = ort.InferenceSession(graph.model.SerializeToString(), providers=["CPUExecutionProvider"])
        state = {**{p: v.copy() for p, v in params.items()}, **zero_state(graph.state_shapes)}
        self.state = {name: torch.from_numpy(value) for name, value in state.items()}
        self.optimizer = TorchOptimizer(graph.outside_update, lambda name: self.state[name])

    def _feeds(self, data: dict) -> dict:
        return {**{n: t.numpy() for n, t in self.state.items() if n in self._inputs()}, **data}

    def _inputs(self) -> set[str]:
        return {i.name for i in self.session.get_inputs()}

    def accumulate(self, data: dict, lr: float, count: int) -> tuple[float, dict]:
        fetched = self.session.run(["loss", *self.graph.accumulation.values()], self._feeds(data))
        sums = dict(zip(self.graph.accumulation, fetched[1:], strict=True))
        self.state.update({n: torch.from_numpy(v) for n, v in sums.items()})
        return float(fetched[0]), sums

    def update(self, data: dict, lr: float, count: int, loss_scale: float | None = None) -> tuple[float, dict]:
        names = list(self.graph.gradients)
        fetched = self.session.run(["loss", *self.graph.gradients.values()], self._feeds(data))
        grads = {p: torch.from_numpy(g) for p, g in zip(names, fetched[1:], strict=True)}
        self.finite = self.optimizer.step(grads, lr, count, loss_scale)
        for buffer in self.graph.accumulation:
            self.state[buffer].zero_()
        return float(fetched[0]), {n: t.numpy().copy() for n, t in self.state.items()}


def train_path(update: str, optimizer: str, groups, params, *, accumulation_steps: int = 1, clip: bool = False):
    """Three updates on `update`'s path, weights and moments checked against the float64 reference after each."""
    graph = compile_path(params, optimizer, groups, update, accumulation_steps, clip)
    runner = TorchRunner(graph, params) if update == "torch" else OrtRunner(graph, params)
    ref, data = Reference(optimizer, groups, params), random_data()
    rtol, atol = (FUSED_RTOL, FUSED_ATOL) if update == "fused" else (RTOL, ATOL)
    for update_index in range(3):
        lr, running = LRS[update_index], {p: np.zeros_like(w) for p, w in ref.w.items()}
        for micro in range(accumulation_steps):
            feeds = data(update_index, micro, ref)
            running = {p: running[p] + g for p, g in ref.grad(feeds).items()}
            step = runner.accumulate if micro < accumulation_steps - 1 else runner.update
            loss, new = step(feeds, lr, update_index + 1)
            np.testing.assert_allclose(loss, ref.loss(feeds), rtol=rtol, atol=atol)
        ref.update(running, accumulation_steps, lr, clip)
        for p in params:
            np.testing.assert_allclose(new[p], ref.w[p], rtol=rtol, atol=atol, err_msg=f"{p} after {update_index}")
            if optimizer != "SGDOptimizer":
                m_name, v_name = moment_names(p)
                np.testing.assert_allclose(new[m_name], ref.m[p], rtol=rtol, atol=atol, err_msg=m_name)
                np.testing.assert_allclose(new[v_name], ref.v[p], rtol=rtol, atol=atol * 1e-3, err_msg=v_name)
    return graph, runner


@pytest.mark.parametrize("update", [pytest.param("fused", marks=needs_training_build), "torch"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("accumulation", "clip"), [(1, False), (3, True)])
def test_every_optimizer_matches_the_reference(update, case, accumulation, clip):
    optimizer, hyper = CASES[case]
    params = initial_params(w=(4, 3), b=(3,))
    train_path(update, optimizer, [ParamGroup(hyper, ["w", "b"])], params, accumulation_steps=accumulation, clip=clip)


@pytest.mark.parametrize("update", [pytest.param("fused", marks=needs_training_build), "torch"])
def test_parameter_groups_keep_their_own_hyper_parameters(update):
    params = initial_params(w=(4, 3), b=(3,), c=(2, 2))
    groups = [
        ParamGroup(adam_hyper(**{"lambda": 0.1, "max_norm_clip": 0.5}), ["w", "c"]),
        ParamGroup(adam_hyper(**{"weight_decay_mode": 1, "alpha": 0.8, "lambda": 0.02}), ["b"]),
    ]
    train_path(update, "AdamOptimizer", groups, params, accumulation_steps=2, clip=True)


@needs_training_build
def test_fused_adam_is_one_kernel_per_tensor_each_with_its_own_step():
    """docs/engine.md §12: the kernel writes its step output into its step input, so every node reads a distinct
    copy of the update count (a shared one advanced once per node: the second tensor saw step 2)."""
    params = initial_params(w=(4, 3), b=(3,), c=(2,))
    graph, _ = train_path("fused", "AdamOptimizer", [ParamGroup(adam_hyper(), list(params))], params)
    nodes = [n for n in graph.model.graph.node if n.op_type == "AdamOptimizer"]
    assert len(nodes) == 3 and all(n.domain == "com.microsoft" for n in nodes)
    assert len({n.input[1] for n in nodes}) == 3
    assert not [n for n in graph.model.graph.node if n.op_type == "Sqrt"]  # no plain-op Adam left


def test_fused_adam_leaves_mode_1_groups_to_plain_ops():
    params = initial_params(w=(4, 3))
    graph = compile_path(params, "AdamOptimizer", [ParamGroup(adam_hyper(weight_decay_mode=1), ["w"])], "fused")
    assert not [n for n in graph.model.graph.node if n.op_type == "AdamOptimizer"]


def test_the_gradient_only_graph_contract():
    params = initial_params(w=(4, 3), b=(3,))
    graph = compile_path(params, "LambOptimizer", [ParamGroup(lamb_hyper(), ["w", "b"])], "torch", 2, clip=True)
    assert {n.op_type for n in graph.model.graph.node} <= {"Mul", "ReduceSum", "ReduceSumSquare", "Add", "Sum"}
    assert set(graph.gradients.values()) == set(graph.accumulation.values())  # G is the running sum's new value
    assert graph.weight_updates == {"w": "w", "b": "b"}  # updated in place: state.py reads these names
    assert graph.optimizer_state == {m: m for p in ("w", "b") for m in moment_names(p)}
    assert graph.state_shapes["Moment_1_w"] == (4, 3)
    outputs = {o.name for o in graph.model.graph.output}
    assert set(graph.gradients.values()) <= outputs and graph.lr_input not in {i.name for i in graph.model.graph.input}
    assert graph.outside_update == OutsideUpdate(
        "LambOptimizer", [ParamGroup(lamb_hyper(), ["w", "b"])], 2, True, False, ["w", "b"]
    )


def test_without_accumulation_the_gradients_are_the_builder_outputs():
    params = initial_params(w=(4, 3))
    graph = compile_path(params, "SGDOptimizer", [ParamGroup(sgd_hyper(), ["w"])], "torch")
    assert graph.gradients == {"w": "w_grad"} and graph.state_shapes == {} and graph.accumulation == {}


def test_a_non_finite_gradient_skips_the_torch_update_and_changes_nothing():
    params = initial_params(w=(4, 3), b=(3,))
    graph = compile_path(params, "AdamOptimizer", [ParamGroup(adam_hyper(), ["w", "b"])], "torch", loss_scale="s")
    assert graph.outside_update is not None and graph.outside_update.check_finite
    state = {
        **{p: torch.from_numpy(v.copy()) for p, v in params.items()},
        **{n: torch.from_numpy(v) for n, v in zero_state(graph.state_shapes).items()},
    }
    before = {n: t.clone() for n, t in state.items()}
    optimizer = TorchOptimizer(graph.outside_update, lambda n: state[n])
    grads = {"w": torch.full((4, 3), math.inf), "b": torch.ones(3)}
    assert optimizer.step(grads, 0.1, 1, 1024.0) is False
    assert all(torch.equal(before[n], state[n]) for n in state)
    assert optimizer.step({"w": torch.ones(4, 3) * 1024, "b": torch.ones(3)}, 0.1, 1, 1024.0) is True
    assert not torch.equal(before["w"], state["w"])


def test_the_loss_scale_divides_the_gradients():
    """With a loss scale s, gradients of the scaled loss `s·G` update like `G` (the scale reaches the fused kernel as
    grad_scale)."""
    hyper = adam_hyper(**{"lambda": 0.05})
    update = OutsideUpdate("AdamOptimizer", [ParamGroup(hyper, ["w"])], 2, True, True, ["w"])
    results = []
    for scale in (1.0, 512.0):
        state = {"w": torch.ones(5), "Moment_1_w": torch.zeros(5), "Moment_2_w": torch.zeros(5)}
        assert TorchOptimizer(update, lambda n, s=state: s[n]).step({"w": torch.arange(5.0) * scale}, 0.1, 1, scale)
        results.append(state["w"])
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-7)


def test_supports_and_the_environment_switch(monkeypatch):
    groups = [ParamGroup(adam_hyper(do_bias_correction=False, beta=1.0), ["w"])]
    assert not supports("AdamOptimizer", groups) and supports("LambOptimizer", groups)
    assert supports("AdamOptimizer", [ParamGroup(adam_hyper(beta=1.0), ["w"])])  # bias correction on: exact
    monkeypatch.delenv(ENVIRONMENT_VARIABLE, raising=False)
    assert choose_update_path("AdamOptimizer", [ParamGroup(adam_hyper(), ["w"])]) == "torch"
    assert choose_update_path("AdamOptimizer", groups) == "graph"  # auto: the one case torch does not cover
    for value in ("graph", "fused"):
        monkeypatch.setenv(ENVIRONMENT_VARIABLE, value)
        if (
            value == "fused" and not has_training_build()
        ):  # no training kernels here: test_fused_needs_the_training_build
            with pytest.raises(ValueError, match="needs onnxruntime-training"):
                choose_update_path("LambOptimizer", groups)
            continue
        assert choose_update_path("LambOptimizer", groups) == value
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, "torch")
    with pytest.raises(ValueError, match="cannot drop the bias correction"):
        choose_update_path("AdamOptimizer", groups)
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, "eager")
    with pytest.raises(ValueError, match="expected one of"):
        choose_update_path("AdamOptimizer", groups)


def test_fused_needs_the_training_build(monkeypatch):
    import orttrainer.trainer.update.path as update_path

    monkeypatch.setenv(ENVIRONMENT_VARIABLE, "fused")
    monkeypatch.setattr(update_path.ort_private, "has_training_build", lambda: False)
    with pytest.raises(ValueError, match="needs onnxruntime-training"):
        choose_update_path("AdamOptimizer", [ParamGroup(adam_hyper(), ["w"])])
