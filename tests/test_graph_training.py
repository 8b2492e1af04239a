"""The training-graph assembly (training.py): graph contract, gradient accumulation, clipping and parameter groups.

Uses the hand-built gradient model and the float64 reference of test_graph_optimizer.py (`p_grad = x_p + p`), and
checks clipping and accumulation once more against torch itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import value_names
from onnx import TensorProto, helper
from test_graph_optimizer import (
    OrtRunner,
    adam_hyper,
    compile_graph,
    gradient_model,
    initial_params,
    lamb_hyper,
    op_count,
    sgd_hyper,
    train_and_compare,
)

from orttrainer.trainer.compile.contract import (
    LEARNING_RATE_INPUT,
    UPDATE_COUNT_INPUT,
    ParamGroup,
    accumulation_buffer_name,
    zero_state,
)
from orttrainer.trainer.graph.training import build_training_graph


def _clip_norm_nodes(graph) -> int:
    return sum(
        n.op_type == "ReduceSumSquare" and n.name.startswith("orttrainer/train/grad_sq") for n in graph.model.graph.node
    )


# --------------------------------------------------------------------------------------------------- graph contract
def test_graph_contract_without_accumulation():
    params = initial_params(w=(3, 2), b=(2,))
    source = gradient_model({p: v.shape for p, v in params.items()})
    before = source.SerializeToString()
    graph = build_training_graph(
        source,
        data_inputs=["x_w", "x_b"],
        outputs=["loss"],
        trainable=["w", "b"],
        optimizer_name="AdamOptimizer",
        groups=[ParamGroup(adam_hyper(), ["w", "b"])],
        accumulation_steps=1,
        clip_grad_norm=True,
    )
    assert source.SerializeToString() == before  # the gradient model is not modified
    assert (graph.data_inputs, graph.outputs) == (["x_w", "x_b"], ["loss"])
    assert (graph.lr_input, graph.update_count_input) == (LEARNING_RATE_INPUT, UPDATE_COUNT_INPUT)
    assert graph.accumulation == {}
    assert graph.weight_updates == {"w": "orttrainer/train/w.new", "b": "orttrainer/train/b.new"}
    assert graph.optimizer_state == {
        "Moment_1_w": "orttrainer/train/Moment_1_w.new",
        "Moment_2_w": "orttrainer/train/Moment_2_w.new",
        "Moment_1_b": "orttrainer/train/Moment_1_b.new",
        "Moment_2_b": "orttrainer/train/Moment_2_b.new",
    }
    assert graph.state_shapes == {"Moment_1_w": (3, 2), "Moment_2_w": (3, 2), "Moment_1_b": (2,), "Moment_2_b": (2,)}
    model = graph.model.graph
    assert value_names(model.input) == [
        "x_w",
        "w",
        "x_b",
        "b",
        "__learning_rate",
        "__update_count",
        "Moment_1_w",
        "Moment_2_w",
        "Moment_1_b",
        "Moment_2_b",
    ]
    inputs = {i.name: i.type.tensor_type for i in model.input}
    assert inputs["__learning_rate"].elem_type == TensorProto.FLOAT and not inputs["__learning_rate"].shape.dim
    assert inputs["__update_count"].elem_type == TensorProto.INT64 and not inputs["__update_count"].shape.dim
    # the gradients are consumed inside the graph: no `<p>_grad` output is left
    assert value_names(model.output) == ["loss", *graph.weight_updates.values(), *graph.optimizer_state.values()]
    node_names = [n.name for n in model.node if n.name]
    assert len(node_names) == len(set(node_names))
    assert all(n.name.startswith("orttrainer/train/") for n in model.node[len(source.graph.node) :])


def test_graph_contract_with_accumulation():
    params = initial_params(w=(3, 2), s=())
    graph = compile_graph(params, "SGDOptimizer", [ParamGroup(sgd_hyper(), ["w", "s"])], accumulation_steps=4)
    assert graph.accumulation == {
        "w_grad_accumulation_buffer": "orttrainer/train/w_grad_accumulation_buffer.new",
        "s_grad_accumulation_buffer": "orttrainer/train/s_grad_accumulation_buffer.new",
    }
    assert accumulation_buffer_name("w") == "w_grad_accumulation_buffer"
    assert graph.state_shapes == {"w_grad_accumulation_buffer": (3, 2), "s_grad_accumulation_buffer": ()}
    assert value_names(graph.model.graph.input)[4:] == [
        "w_grad_accumulation_buffer",
        "s_grad_accumulation_buffer",
        "__learning_rate",
        "__update_count",
    ]
    assert value_names(graph.model.graph.output) == [
        "loss",
        *graph.accumulation.values(),
        *graph.weight_updates.values(),
    ]
    zeros = zero_state(graph.state_shapes)
    assert {k: (v.shape, v.dtype, float(np.abs(v).sum())) for k, v in zeros.items()} == {
        "w_grad_accumulation_buffer": ((3, 2), np.float32, 0.0),
        "s_grad_accumulation_buffer": ((), np.float32, 0.0),
    }


def test_unknown_optimizer_is_rejected():
    params = initial_params(w=(3, 2))
    with pytest.raises(
        ValueError,
        match=r"unknown optimizer 'AdagradOptimizer'; expected one of \['AdamOptimizer', "
        r"'LambOptimizer', 'SGDOptimizer'\]",
    ):
        compile_graph(params, "AdagradOptimizer", [ParamGroup(sgd_hyper(), ["w"])])


def test_dynamic_parameter_shape_is_rejected():
    model = gradient_model({"w": (3, 2)})
    model.graph.input[1].type.tensor_type.shape.dim[0].dim_param = "batch"
    with pytest.raises(ValueError, match="trainable tensor 'w' has a dynamic shape"):
        build_training_graph(
            model,
            data_inputs=["x_w"],
            outputs=["loss"],
            trainable=["w"],
            optimizer_name="SGDOptimizer",
            groups=[ParamGroup(sgd_hyper(), ["w"])],
            accumulation_steps=1,
            clip_grad_norm=False,
        )


def test_reserved_input_names_cannot_be_reused():
    model = gradient_model({"w": (3, 2)})
    model.graph.input.append(helper.make_tensor_value_info(LEARNING_RATE_INPUT, TensorProto.FLOAT, []))
    with pytest.raises(ValueError, match="'__learning_rate' is already used"):
        build_training_graph(
            model,
            data_inputs=["x_w"],
            outputs=["loss"],
            trainable=["w"],
            optimizer_name="SGDOptimizer",
            groups=[ParamGroup(sgd_hyper(), ["w"])],
            accumulation_steps=1,
            clip_grad_norm=False,
        )


# ----------------------------------------------------------------------------------------------------- accumulation
@pytest.mark.parametrize(
    ("optimizer", "hyper"),
    [
        ("SGDOptimizer", sgd_hyper()),
        ("AdamOptimizer", adam_hyper(**{"lambda": 0.1})),
        ("LambOptimizer", lamb_hyper(do_bias_correction=True)),
    ],
)
@pytest.mark.parametrize("steps", [1, 3])
def test_accumulation_sums_micro_steps_and_updates_with_the_mean(optimizer, hyper, steps):
    params = initial_params(w=(3, 2), s=())
    graph, _ = train_and_compare(params, optimizer, [ParamGroup(hyper, ["w", "s"])], accumulation_steps=steps)
    assert len(graph.accumulation) == (2 if steps > 1 else 0)


def test_micro_steps_do_not_update_weights():
    params = initial_params(w=(3, 2))
    graph = compile_graph(params, "AdamOptimizer", [ParamGroup(adam_hyper(), ["w"])], accumulation_steps=2)
    runner = OrtRunner(graph, params)
    data = {"x_w": np.ones((3, 2), np.float32)}
    runner.accumulate(data, 0.1, 1)
    assert set(runner.state) == {"w", "Moment_1_w", "Moment_2_w", "w_grad_accumulation_buffer"}
    np.testing.assert_array_equal(runner.state["w"], params["w"])
    np.testing.assert_array_equal(runner.state["Moment_1_w"], 0.0)
    np.testing.assert_allclose(runner.state["w_grad_accumulation_buffer"], 1.0 + params["w"], rtol=1e-7)
    runner.update(data, 0.1, 1)
    np.testing.assert_array_equal(runner.state["w_grad_accumulation_buffer"], 0.0)
    assert np.abs(runner.state["w"] - params["w"]).min() > 0.09  # Adam's first step moves every element by ~lr


# --------------------------------------------------------------------------------------------------------- clipping
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("optimizer", ["AdamOptimizer", "LambOptimizer"])
def test_clipping_scales_by_the_global_norm(optimizer, steps):
    params = initial_params(w=(3, 2), b=(2,))
    hyper = (adam_hyper if optimizer == "AdamOptimizer" else lamb_hyper)(max_norm_clip=0.5)
    graph, ref = train_and_compare(
        params, optimizer, [ParamGroup(hyper, ["w", "b"])], accumulation_steps=steps, clip=True
    )
    assert all(f < 0.5 for f in ref.clip_factors) and len(ref.clip_factors) == 3  # clipping was active
    assert _clip_norm_nodes(graph) == 2  # one squared norm per gradient


def test_clipping_is_a_no_op_below_max_norm():
    params = initial_params(w=(3, 2), b=(2,))
    hyper = adam_hyper(max_norm_clip=100.0)
    _, clipped = train_and_compare(params, "AdamOptimizer", [ParamGroup(hyper, ["w", "b"])], clip=True)
    _, plain = train_and_compare(params, "AdamOptimizer", [ParamGroup(hyper, ["w", "b"])], clip=False)
    assert clipped.clip_factors == [1.0] * 3
    for p in params:
        np.testing.assert_allclose(clipped.w[p], plain.w[p], rtol=0, atol=0)


def test_clipping_off_adds_no_norm():
    params = initial_params(w=(3, 2))
    graph = compile_graph(params, "AdamOptimizer", [ParamGroup(adam_hyper(max_norm_clip=1e-3), ["w"])], clip=False)
    assert _clip_norm_nodes(graph) == 0


def test_sgd_is_never_clipped():
    # As the legacy SGDOptimizer, which took no gradient-norm input: clip_grad_norm has no effect on SGD.
    params = initial_params(w=(3, 2))
    graph, ref = train_and_compare(
        params, "SGDOptimizer", [ParamGroup(sgd_hyper(max_norm_clip=1e-3), ["w"])], clip=True
    )
    assert _clip_norm_nodes(graph) == 0 and ref.clip_factors == []


def test_per_group_max_norm_with_one_global_norm():
    params = initial_params(w=(3, 2), b=(2,))
    groups = [ParamGroup(adam_hyper(max_norm_clip=0.4), ["w"]), ParamGroup(adam_hyper(max_norm_clip=100.0), ["b"])]
    _, ref = train_and_compare(params, "AdamOptimizer", groups, clip=True, accumulation_steps=3)
    w_factors, b_factors = ref.clip_factors[0::2], ref.clip_factors[1::2]
    assert all(f < 0.4 for f in w_factors) and b_factors == [1.0] * 3


# ---------------------------------------------------------------------------------------------------- param groups
def test_two_groups_with_different_hyper_parameters():
    params = initial_params(w=(3, 2), b=(2,), s=())
    groups = [
        ParamGroup(adam_hyper(alpha=0.5, beta=0.9, epsilon=1e-4, **{"lambda": 0.2}), ["w", "s"]),
        ParamGroup(adam_hyper(weight_decay_mode=1, do_bias_correction=False, **{"lambda": 0.05}), ["b"]),
    ]
    graph, _ = train_and_compare(params, "AdamOptimizer", groups, clip=True)
    assert op_count(graph, "Pow") == 2  # bias corrections: once for the first group, none for the second
    assert list(graph.weight_updates) == ["w", "s", "b"]


def test_two_lamb_groups():
    params = initial_params(w=(3, 2), b=(2,))
    groups = [
        ParamGroup(lamb_hyper(alpha=0.7, **{"lambda": 0.3}), ["b"]),
        ParamGroup(lamb_hyper(beta=0.99, do_bias_correction=True, ratio_max=0.2, max_norm_clip=0.5), ["w"]),
    ]
    train_and_compare(params, "LambOptimizer", groups, clip=True, accumulation_steps=3)


# ------------------------------------------------------------------------------------------------ torch as reference
def test_matches_torch_adamw_with_clip_grad_norm_and_accumulation():
    params = initial_params(w=(3, 2), b=(2,))
    hyper = adam_hyper(alpha=0.8, beta=0.95, **{"lambda": 0.1}, max_norm_clip=0.7)
    graph = compile_graph(params, "AdamOptimizer", [ParamGroup(hyper, ["w", "b"])], accumulation_steps=2, clip=True)
    runner = OrtRunner(graph, params)
    torch_params = {p: torch.tensor(v, dtype=torch.float64, requires_grad=True) for p, v in params.items()}
    adamw = torch.optim.AdamW(torch_params.values(), lr=0.1, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1)
    rng = np.random.default_rng(5)
    for update, lr in enumerate((0.1, 0.05, 0.2), start=1):
        for group in adamw.param_groups:
            group["lr"] = lr
        for micro in range(2):
            data = {f"x_{p}": (3 * rng.standard_normal(v.shape)).astype(np.float32) for p, v in params.items()}
            loss = sum(
                (torch.tensor(data[f"x_{p}"], dtype=torch.float64) * w).sum() + 0.5 * (w * w).sum()
                for p, w in torch_params.items()
            )
            (loss / 2).backward()  # the mean of the micro-batch gradients
            (runner.accumulate if micro == 0 else runner.update)(data, lr, update)
        torch.nn.utils.clip_grad_norm_(list(torch_params.values()), 0.7)
        adamw.step()
        adamw.zero_grad()
        for p, w in torch_params.items():
            np.testing.assert_allclose(runner.state[p], w.detach().numpy(), rtol=2e-6, atol=1e-7)
