"""ONNX model files from outside, files written, file names in options (docs/reliability.md §1, §3, §5): external
data whose location leads out of the model's directory, tensors that declare more than they hold, local functions
that recurse, graphs with a cycle; a symlink planted where save_as_onnx writes; debug paths no filesystem takes.

A recursive function crashed the training runtime (SIGSEGV) before the fix: that test runs the trainer in a
subprocess, so that this suite cannot crash. Checkpoints: test_reliability_hostile_checkpoints.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
import torch
from helpers import make_trainer, needs_training_build
from models import MLP, mlp_desc
from onnx import TensorProto, helper, numpy_helper

from orttrainer import optim
from orttrainer.trainer.build.external_data import ExternalDataError, load_model
from orttrainer.trainer.build.model_checks import InvalidModelError, check_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILDERS = [pytest.param("ort", marks=needs_training_build), "torch"]
DESC = {
    "inputs": [("x", ["batch", 4]), ("target", ["batch"])],
    "outputs": [("loss", [], True), ("logits", ["batch", 3])],
}
W = np.full((4, 3), 0.5, np.float32)


def _model(weight: TensorProto | None = None, nodes=None, functions=(), opsets=()) -> onnx.ModelProto:
    """logits = x @ W, loss = SoftmaxCrossEntropyLoss(logits, target); `nodes` replaces the MatMul."""
    weight = numpy_helper.from_array(W, "W") if weight is None else weight
    body = nodes or [helper.make_node("MatMul", ["x", "W"], ["logits"], name="matmul")]
    graph = helper.make_graph(
        [*body, helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "target"], ["loss"], name="loss")],
        "hostile",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("target", TensorProto.INT64, ["batch"]),
        ],
        [
            helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3]),
        ],
        [weight],
    )
    imports = [helper.make_opsetid("", 14), *opsets]
    return helper.make_model(graph, opset_imports=imports, ir_version=8, functions=list(functions))


def _trainer(model: onnx.ModelProto, builder: str):
    return make_trainer(model, DESC, optim.SGDConfig(lr=0.1), None, {"_internal_use": {"gradient_builder": builder}})


def _run_child(script: str, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """`script` in a fresh interpreter importing this checkout; its crash is a failed assertion, not ours."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.path.join(ROOT, "tests"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", textwrap.dedent(script), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, check=False)


# --- external data ------------------------------------------------------------------------------------------------


def _external_model(folder, *, link_to=None, location: str = "w.bin", length: int | None = None) -> str:
    """model.onnx in `folder` whose W lives in `location`: the real values (0.5) there, or a symlink to `link_to`."""
    os.makedirs(folder, exist_ok=True)
    data_path = os.path.join(folder, location)
    if link_to is None:
        if not os.path.exists(data_path):  # (through a symlinked folder it may be there already)
            with open(data_path, "wb") as f:
                f.write(W.tobytes())
    else:
        os.symlink(link_to, data_path)
    weight = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[4, 3], data_location=TensorProto.EXTERNAL)
    entries = {"location": location, "offset": "0", "length": str(W.nbytes if length is None else length)}
    for key, value in entries.items():
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    path = os.path.join(folder, "model.onnx")
    onnx.save(_model(weight), path)
    return path


def _secret(tmp_path) -> str:
    """A file outside the model's folder, with values that would train visibly (7 instead of 0.5)."""
    os.makedirs(tmp_path / "outside", exist_ok=True)
    path = tmp_path / "outside" / "secret.bin"
    path.write_bytes(np.full((4, 3), 7.0, np.float32).tobytes())
    return str(path)


def test_load_model_refuses_external_data_behind_a_symlink_out_of_the_folder(tmp_path):
    path = _external_model(tmp_path / "model", link_to=_secret(tmp_path))
    with pytest.raises(ExternalDataError, match=r"tensor 'W'.*'w\.bin'.*secret\.bin.*outside the model's directory"):
        load_model(path)


def test_load_model_refuses_a_symlinked_subfolder_leading_out(tmp_path):
    _secret(tmp_path)
    os.makedirs(tmp_path / "model")
    os.symlink(tmp_path / "outside", tmp_path / "model" / "sub")
    weight_file = tmp_path / "outside" / "w.bin"
    weight_file.write_bytes(W.tobytes())
    path = _external_model(tmp_path / "model", location="sub/w.bin")
    with pytest.raises(ExternalDataError, match="outside the model's directory"):
        load_model(path)


@pytest.mark.parametrize(
    ("location", "message"),
    [("../outside/secret.bin", "without '..'"), ("/etc/hostname", "relative path")],
)
def test_load_model_refuses_parent_and_absolute_locations(tmp_path, location, message):
    _secret(tmp_path)
    model = onnx.load(_external_model(tmp_path / "model"), load_external_data=False)
    model.graph.initializer[0].external_data[0].value = location
    path = tmp_path / "model" / "bad.onnx"
    onnx.save(model, path)
    with pytest.raises(ExternalDataError, match=message):
        load_model(path)


def test_load_model_checks_the_length_against_the_declared_size(tmp_path):
    path = _external_model(tmp_path / "model", length=1 << 40)
    with pytest.raises(ExternalDataError, match=r"tensor 'W'.*declares 48 bytes but its length is 1099511627776"):
        load_model(path)


def test_load_model_refuses_a_file_shorter_than_declared(tmp_path):
    path = _external_model(tmp_path / "model")
    with open(tmp_path / "model" / "w.bin", "r+b") as f:
        f.truncate(20)
    with pytest.raises(ExternalDataError, match=r"declares 48 bytes but .*w\.bin holds 20 bytes"):
        load_model(path)


def test_load_model_refuses_a_fifo_without_blocking(tmp_path):
    os.makedirs(tmp_path / "model")
    os.mkfifo(tmp_path / "model" / "w.bin")
    model = onnx.load(_external_model(tmp_path / "other"), load_external_data=False)
    onnx.save(model, tmp_path / "model" / "model.onnx")
    with pytest.raises(ExternalDataError, match="not a regular file"):
        load_model(tmp_path / "model" / "model.onnx")


def test_load_model_reads_external_data_inside_the_folder(tmp_path):
    model = load_model(_external_model(tmp_path / "model"))
    assert np.array_equal(numpy_helper.to_array(model.graph.initializer[0]), W)
    assert model.graph.initializer[0].data_location == TensorProto.DEFAULT


@pytest.mark.parametrize("builder", BUILDERS)
def test_trainer_refuses_external_data_behind_a_symlink(tmp_path, monkeypatch, builder):
    """A ModelProto whose external data was not loaded has its locations resolved against the working directory
    (as onnx and ONNX Runtime would): the trainer reads them itself, confined there, on both builders."""
    path = _external_model(tmp_path / "model", link_to=_secret(tmp_path))
    model = onnx.load(path, load_external_data=False)
    monkeypatch.chdir(tmp_path / "model")
    with pytest.raises(ExternalDataError, match=r"tensor 'W'.*secret\.bin.*outside the model's directory"):
        _trainer(model, builder)


@pytest.mark.parametrize("builder", BUILDERS)
def test_trainer_reads_external_data_inside_the_working_directory(tmp_path, monkeypatch, builder):
    model = onnx.load(_external_model(tmp_path / "model"), load_external_data=False)
    monkeypatch.chdir(tmp_path / "model")
    trainer = _trainer(model, builder)
    _, logits = trainer.eval_step(torch.ones(2, 4), torch.tensor([0, 1]))
    assert torch.allclose(logits, torch.full((2, 3), 2.0))  # 4 x 0.5, not the outside file's values


# --- declared sizes, recursion and cycles in ONNX models ----------------------------------------------------------

_HUGE = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[10**6, 10**6])
_OVERFLOW = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[2**62, 2**62])
_SHORT = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[4, 3], raw_data=b"\0" * 8)


@pytest.mark.parametrize(
    ("weight", "message"),
    [
        (_HUGE, r"tensor 'W' \(initializer of the main graph\) declares dims \[1000000, 1000000\]"),
        (_OVERFLOW, r"tensor 'W' .*more than an int64 can count"),
        (_SHORT, r"tensor 'W' .*\(48 bytes\) but holds 8 bytes"),
    ],
    ids=["1e12-elements", "int64-overflow", "short-raw-data"],
)
@pytest.mark.parametrize("builder", BUILDERS)
def test_a_tensor_declaring_more_than_it_holds_is_refused_by_name(weight, message, builder):
    with pytest.raises(InvalidModelError, match=message) as error:
        _trainer(_model(weight), builder)
    assert "the ONNX model (graph 'hostile')" in str(error.value)


def test_declared_sizes_are_checked_in_attributes_sparse_tensors_and_functions():
    constant = helper.make_node("Constant", [], ["c"], name="const", value=_HUGE)
    with pytest.raises(InvalidModelError, match="attribute 'value' of node 'const'"):
        check_model(_model(nodes=[constant, helper.make_node("MatMul", ["x", "W"], ["logits"])]))
    sparse = onnx.SparseTensorProto(dims=[10**6, 10**6])
    sparse.values.CopyFrom(numpy_helper.from_array(np.zeros(0, np.float32), "S"))
    sparse.indices.CopyFrom(numpy_helper.from_array(np.zeros(0, np.int64), "S_indices"))
    model = _model()
    model.graph.sparse_initializer.append(sparse)
    with pytest.raises(InvalidModelError, match=r"sparse tensor 'S' .*would make it dense"):
        check_model(model)
    function = helper.make_function(
        "local",
        "F",
        ["a"],
        ["b"],
        [helper.make_node("Constant", [], ["b"], value=_SHORT)],
        [helper.make_opsetid("", 14)],
    )
    with pytest.raises(InvalidModelError, match=r"function local\.F"):
        check_model(_model(functions=[function]))


def _calls(*names: str) -> list[onnx.FunctionProto]:
    """Local functions F -> G -> ... each calling the next name in `names` (the last one calls the first)."""
    imports = [helper.make_opsetid("", 14), helper.make_opsetid("local", 1)]
    callees = [*names[1:], names[0]]
    return [
        helper.make_function(
            "local", name, ["a"], ["b"], [helper.make_node(callee, ["a"], ["b"], domain="local")], imports
        )
        for name, callee in zip(names, callees, strict=True)
    ]


def _calling_model(functions: list[onnx.FunctionProto]) -> onnx.ModelProto:
    nodes = [
        helper.make_node("F", ["x"], ["x2"], domain="local", name="call"),
        helper.make_node("MatMul", ["x2", "W"], ["logits"], name="matmul"),
    ]
    return _model(nodes=nodes, functions=functions, opsets=[helper.make_opsetid("local", 1)])


@pytest.mark.parametrize(
    ("names", "cycle"), [(("F",), "local.F -> local.F"), (("F", "G"), "local.F -> local.G -> local.F")]
)
def test_recursive_local_functions_are_refused(names, cycle):
    with pytest.raises(InvalidModelError, match=f"calls itself \\({cycle}\\)"):
        check_model(_calling_model(_calls(*names)))


def test_functions_that_call_each_other_without_a_cycle_pass():
    imports = [helper.make_opsetid("", 14), helper.make_opsetid("local", 1)]
    g = helper.make_function("local", "G", ["a"], ["b"], [helper.make_node("Relu", ["a"], ["b"])], imports)
    f = helper.make_function(
        "local",
        "F",
        ["a"],
        ["b"],
        [helper.make_node("G", ["a"], ["m"], domain="local"), helper.make_node("G", ["m"], ["b"], domain="local")],
        imports,
    )
    check_model(_calling_model([f, g]))


_RECURSIVE_CHILD = """
    import sys, torch
    from test_reliability_hostile_files import _calling_model, _calls, _trainer
    try:
        trainer = _trainer(_calling_model(_calls(*sys.argv[2:])), sys.argv[1])
        trainer.train_step(torch.ones(2, 4), torch.tensor([0, 1]))
        print("TRAINED")
    except Exception as error:
        print(f"{type(error).__name__}: {error}")
"""


@pytest.mark.parametrize("names", [("F",), ("F", "G")], ids=["recursive", "mutually-recursive"])
@pytest.mark.parametrize("builder", BUILDERS)
def test_trainer_refuses_recursive_functions_before_onnxruntime_sees_them(builder, names):
    """Before the fix the training runtime crashed (SIGSEGV): the trainer runs in a subprocess."""
    result = _run_child(_RECURSIVE_CHILD, builder, *names)
    assert result.returncode == 0, f"the trainer's process died ({result.returncode}): {result.stderr[-2000:]}"
    assert result.stdout.startswith("InvalidModelError: the ONNX model (graph 'hostile'): local function local.F"), (
        result.stdout
    )


@pytest.mark.parametrize("builder", BUILDERS)
def test_a_graph_with_a_cycle_is_refused_as_such(builder):
    nodes = [
        helper.make_node("Add", ["x", "z"], ["y"], name="add"),
        helper.make_node("Relu", ["y"], ["z"], name="relu"),
        helper.make_node("MatMul", ["y", "W"], ["logits"], name="matmul"),
    ]
    with pytest.raises(InvalidModelError, match=r"the main graph has a cycle: (y -> z -> y|z -> y -> z) \(nodes"):
        _trainer(_model(nodes=nodes), builder)


def test_a_cycle_through_a_subgraph_is_found():
    """The If reads `z` from its branch; `z` is computed from the If's output: a cycle through the subgraph."""
    branch = helper.make_graph(
        [helper.make_node("Identity", ["z"], ["out"])], "branch", [], [helper.make_tensor_value_info("out", 1, None)]
    )
    nodes = [
        helper.make_node("If", ["cond"], ["y"], name="if", then_branch=branch, else_branch=branch),
        helper.make_node("Relu", ["y"], ["z"], name="relu"),
        helper.make_node("MatMul", ["x", "W"], ["logits"], name="matmul"),
    ]
    model = _model(nodes=nodes)
    model.graph.input.append(helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
    with pytest.raises(InvalidModelError, match="has a cycle"):
        check_model(model)


def test_a_graph_out_of_order_but_acyclic_is_not_a_cycle():
    nodes = [helper.make_node("MatMul", ["y", "W"], ["logits"]), helper.make_node("Relu", ["x"], ["y"])]
    check_model(_model(nodes=nodes))


# --- files written ------------------------------------------------------------------------------------------------


def _trained_mlp():
    torch.manual_seed(0)
    trainer = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(lr=0.1), torch.nn.functional.cross_entropy)
    trainer.train_step(torch.randn(4, 32), torch.tensor([0, 1, 2, 3]))
    return trainer


def test_save_as_onnx_follows_no_planted_symlink(tmp_path):
    """A link at the old predictable temporary name and one at the target itself: neither victim changes, and the
    target becomes the model (the link there is replaced, as a rename replaces any name)."""
    trainer = _trained_mlp()
    victims = [tmp_path / "victim_a", tmp_path / "victim_b"]
    for victim in victims:
        victim.write_bytes(b"precious")
    target = tmp_path / "model.onnx"
    os.symlink(victims[0], f"{target}.tmp-{os.getpid()}")
    os.symlink(victims[1], target)
    trainer.save_as_onnx(str(target))
    assert [v.read_bytes() for v in victims] == [b"precious", b"precious"]
    assert not os.path.islink(target)
    assert {i.name for i in onnx.load(str(target)).graph.initializer} >= {"fc1.weight", "fc2.weight"}
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["model.onnx", "victim_a", "victim_b", f"model.onnx.tmp-{os.getpid()}"]
    )


# --- file names in options ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/tmp/a\0b.onnx", "contains a NUL character"),
        ("/tmp/" + "n" * 300 + ".onnx", "bytes long; this filesystem allows"),
        ("/tmp/" + "/".join(["d" * 200] * 25) + "/m.onnx", "bytes long; this system allows"),
    ],
    ids=["nul", "long-name", "long-path"],
)
@pytest.mark.parametrize("key", ["model_with_training_graph_path", "model_with_training_graph_after_optimization_path"])
def test_graph_save_paths_the_system_cannot_take_are_refused_at_construction(path, message, key):
    options = {"debug": {"graph_save_paths": {key: path}}}
    with pytest.raises(ValueError, match=f"options debug.graph_save_paths.{key}.*{message}"):
        make_trainer(MLP(), mlp_desc(), optim.SGDConfig(lr=0.1), torch.nn.functional.cross_entropy, options)
