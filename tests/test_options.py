"""ORTTrainerOptions against the legacy 1.13.1 behaviour (docs/legacy_api.md §5)."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
import types

import pytest
from helpers import needs_training_build

from orttrainer import ORTTrainerOptions, PropagateCastOpsStrategy, amp, optim, orttrainer_options
from orttrainer.schema import options as options_module
from orttrainer.schema.options import _ORTTrainerOptionsInternal

# The complete normalised tree of §5.2, written out by hand so that a changed default shows up here.
DEFAULTS = {
    "batch": {"gradient_accumulation_steps": 1},
    "device": {"id": "cuda", "mem_limit": 0},
    "distributed": {
        "world_rank": 0,
        "world_size": 1,
        "local_rank": 0,
        "data_parallel_size": 1,
        "horizontal_parallel_size": 1,
        "pipeline_parallel": {
            "pipeline_parallel_size": 1,
            "num_pipeline_micro_batches": 1,
            "pipeline_cut_info_string": "",
            "sliced_schema": {},
            "sliced_axes": {},
            "sliced_tensor_names": [],
        },
        "allreduce_post_accumulation": False,
        "deepspeed_zero_optimization": {"stage": 0},
        "enable_adasum": False,
    },
    "lr_scheduler": None,
    "mixed_precision": {"enabled": False, "loss_scaler": None},
    "graph_transformer": {
        "attn_dropout_recompute": False,
        "gelu_recompute": False,
        "transformer_layer_recompute": False,
        "number_recompute_layers": 0,
        "propagate_cast_ops_config": {"strategy": PropagateCastOpsStrategy.FLOOD_FILL, "level": 1, "allow": []},
    },
    "utils": {
        "frozen_weights": [],
        "grad_norm_clip": True,
        "memory_efficient_gradient": False,
        "run_symbolic_shape_infer": False,
    },
    "debug": {
        "deterministic_compute": False,
        "check_model_export": False,
        "graph_save_paths": {
            "model_after_graph_transforms_path": "",
            "model_with_gradient_graph_path": "",
            "model_with_training_graph_path": "",
            "model_with_training_graph_after_optimization_path": "",
        },
    },
    "_internal_use": {
        "enable_internal_postprocess": True,
        "extra_postprocess": None,
        "onnx_opset_version": 14,
        "enable_onnx_contrib_ops": True,
        "gradient_builder": "auto",  # orttrainer's own key: the legacy keys and defaults above are unchanged
    },
    "provider_options": {},
    "session_options": None,
}


def _with(path: str, value: object) -> dict:
    """DEFAULTS with the dotted ``path`` set to ``value``."""
    expected = copy.deepcopy(DEFAULTS)
    *parents, leaf = path.split(".")
    node = expected
    for key in parents:
        node = node[key]
    node[leaf] = value
    return expected


def test_empty_options_give_the_full_default_tree():
    assert ORTTrainerOptions({})._validated_opts == DEFAULTS
    assert ORTTrainerOptions()._validated_opts == DEFAULTS


@pytest.mark.parametrize(
    "partial",
    [
        {"batch": {}},
        {"distributed": {}},
        {"distributed": {"pipeline_parallel": {}, "deepspeed_zero_optimization": {}}},
        {"graph_transformer": {"propagate_cast_ops_config": {}}},
        {"debug": {"graph_save_paths": {}}},
        {key: {} for key, value in DEFAULTS.items() if isinstance(value, dict)},
    ],
)
def test_partially_filled_dicts_normalise_like_empty(partial):
    assert ORTTrainerOptions(partial)._validated_opts == DEFAULTS


@pytest.mark.parametrize(
    "path, value",
    [
        ("batch.gradient_accumulation_steps", 4),
        ("device.id", "cpu"),
        ("device.mem_limit", 2 * 1024**3),
        ("distributed.world_size", 2),
        ("distributed.pipeline_parallel.pipeline_parallel_size", 2),
        ("distributed.pipeline_parallel.sliced_schema", {"x": [1, 2]}),
        ("distributed.pipeline_parallel.sliced_axes", {"x": 0}),
        ("distributed.pipeline_parallel.sliced_tensor_names", ["x"]),
        ("distributed.deepspeed_zero_optimization.stage", 1),
        ("graph_transformer.propagate_cast_ops_config.strategy", PropagateCastOpsStrategy.INSERT_AND_REDUCE),
        ("graph_transformer.propagate_cast_ops_config.strategy", None),
        ("graph_transformer.propagate_cast_ops_config.level", -1),
        ("graph_transformer.propagate_cast_ops_config.allow", ["MatMul"]),
        ("utils.frozen_weights", ["fc1.weight"]),
        ("utils.memory_efficient_gradient", True),
        ("debug.graph_save_paths.model_with_training_graph_path", "train.onnx"),
        ("_internal_use.onnx_opset_version", 12),
        ("_internal_use.gradient_builder", "torch"),
        ("_internal_use.gradient_builder", "ort"),
        ("provider_options", {"EP1": {"key1": "val1"}}),
    ],
)
def test_one_value_set_keeps_every_other_default(path, value):
    *parents, leaf = path.split(".")
    options: dict = {}
    node = options
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    assert ORTTrainerOptions(options)._validated_opts == _with(path, value)


def test_attribute_access_wraps_every_dict():
    opts = ORTTrainerOptions(
        {
            "mixed_precision": {"enabled": True},
            "distributed": {"pipeline_parallel": {"pipeline_parallel_size": 2}},
            "provider_options": {"EP1": {"key1": "val1"}},
        }
    )
    assert opts.mixed_precision.enabled is True
    assert opts.distributed.pipeline_parallel.pipeline_parallel_size == 2
    assert opts.distributed.pipeline_parallel.num_pipeline_micro_batches == 1
    assert opts.graph_transformer.propagate_cast_ops_config.strategy is PropagateCastOpsStrategy.FLOOD_FILL
    # Dict-valued leaves become wrappers too (legacy behaviour); the dict itself stays in _validated_opts.
    assert isinstance(opts.provider_options, _ORTTrainerOptionsInternal)
    assert opts.provider_options.EP1.key1 == "val1"
    assert opts.provider_options._validated_opts == {"EP1": {"key1": "val1"}}
    assert opts._validated_opts["provider_options"]["EP1"]["key1"] == "val1"
    assert isinstance(opts.distributed.pipeline_parallel.sliced_schema, _ORTTrainerOptionsInternal)
    assert opts.utils.frozen_weights == []


def test_attribute_writes_are_allowed_but_not_reflected_in_validated_opts():
    opts = ORTTrainerOptions({})
    opts.utils.run_symbolic_shape_infer = True
    opts.batch = 3
    assert opts.utils.run_symbolic_shape_infer is True
    assert opts.batch == 3
    assert opts._validated_opts == DEFAULTS


def test_repr_lists_attributes_like_a_dict():
    opts = ORTTrainerOptions({"batch": {"gradient_accumulation_steps": 2}})
    assert repr(opts.batch) == "{'gradient_accumulation_steps': 2}"
    assert repr(opts.device) == "{'id': 'cuda', 'mem_limit': 0}"
    assert repr(opts.mixed_precision) == "{'enabled': False, 'loss_scaler': None}"
    assert repr(opts) == repr(opts._validated_opts)
    assert "_original_opts" not in repr(opts) and "_main_class_name" not in repr(opts)
    opts.device.id = "cpu"  # repr follows the attributes, not _validated_opts
    assert repr(opts.device) == "{'id': 'cpu', 'mem_limit': 0}"


# Every row of docs/legacy_api.md §5.3, verbatim.
ERROR_TABLE = [
    (
        {"mixed_precision": {"enabled": 1}},
        "Invalid options: {'mixed_precision': [{'enabled': ['must be of boolean type']}]}",
    ),
    (
        {"batch": {"gradient_accumulation_steps": 0}},
        "Invalid options: {'batch': [{'gradient_accumulation_steps': ['min value is 1']}]}",
    ),
    ({"device": {"id": 1}}, "Invalid options: {'device': [{'id': ['must be of string type']}]}"),
    ({"device": {"mem_limit": -1}}, "Invalid options: {'device': [{'mem_limit': ['min value is 0']}]}"),
    ({"foo": 1}, "Invalid options: {'foo': ['unknown field']}"),
    (
        {"distributed": {"deepspeed_zero_optimization": {"stage": 2}}},
        "Invalid options: {'distributed': [{'deepspeed_zero_optimization': [{'stage': ['max value is 1']}]}]}",
    ),
    (
        {"_internal_use": {"onnx_opset_version": 11}},
        "Invalid options: {'_internal_use': [{'onnx_opset_version': ['min value is 12']}]}",
    ),
    (
        {"_internal_use": {"extra_postprocess": 3}},
        "Invalid options: {'_internal_use': [{'extra_postprocess': ['Must be callable or None']}]}",
    ),
    ({"lr_scheduler": 3}, "Invalid options: {'lr_scheduler': ['must be of lr_scheduler type']}"),
    (
        {"mixed_precision": {"loss_scaler": 3}},
        "Invalid options: {'mixed_precision': [{'loss_scaler': ['must be of loss_scaler type']}]}",
    ),
    ({"session_options": 3}, "Invalid options: {'session_options': ['must be of session_options type']}"),
    ({"utils": {"frozen_weights": "a"}}, "Invalid options: {'utils': [{'frozen_weights': ['must be of list type']}]}"),
    (
        {"distributed": {"world_size": 0, "world_rank": -1}},
        "Invalid options: {'distributed': [{'world_rank': ['min value is 0'], 'world_size': ['min value is 1']}]}",
    ),
    ({"batch": 1}, "Invalid options: {'batch': ['must be of dict type']}"),
]

# Further errors of the 1.13.1 schema (§5.2 constraints), in the same cerberus format.
MORE_ERRORS = [
    (
        {"_internal_use": {"onnx_opset_version": 15}},
        "Invalid options: {'_internal_use': [{'onnx_opset_version': ['max value is 14']}]}",
    ),
    (
        {"graph_transformer": {"propagate_cast_ops_config": {"level": -2}}},
        "Invalid options: {'graph_transformer': [{'propagate_cast_ops_config': [{'level': ['min value is -1']}]}]}",
    ),
    (
        {"graph_transformer": {"propagate_cast_ops_config": {"strategy": 2}}},
        "Invalid options: {'graph_transformer': [{'propagate_cast_ops_config': "
        "[{'strategy': ['must be of propagate_cast_ops_strategy type']}]}]}",
    ),
    (
        {"graph_transformer": {"propagate_cast_ops_config": {"allow": ["MatMul", 1]}}},
        "Invalid options: {'graph_transformer': [{'propagate_cast_ops_config': "
        "[{'allow': [{1: ['must be of string type']}]}]}]}",
    ),
    (
        {"graph_transformer": {"propagate_cast_ops_config": {"propagate_cast_ops_level": 1}}},
        "Invalid options: {'graph_transformer': [{'propagate_cast_ops_config': "
        "[{'propagate_cast_ops_level': ['unknown field']}]}]}",
    ),
    (
        {"distributed": {"pipeline_parallel": {"sliced_axes": {"x": "0"}}}},
        "Invalid options: {'distributed': [{'pipeline_parallel': "
        "[{'sliced_axes': [{'x': ['must be of integer type']}]}]}]}",
    ),
    (
        {"utils": {"invertible_layer_norm_gradient": True}},
        "Invalid options: {'utils': [{'invertible_layer_norm_gradient': ['unknown field']}]}",
    ),
    ({"provider_options": []}, "Invalid options: {'provider_options': ['must be of dict type']}"),
    (
        {"_internal_use": {"gradient_builder": "jax"}},
        "Invalid options: {'_internal_use': [{'gradient_builder': ['unallowed value jax']}]}",
    ),
]


@pytest.mark.parametrize("options, message", ERROR_TABLE + MORE_ERRORS)
def test_invalid_options_raise_value_error_with_cerberus_errors(options, message):
    with pytest.raises(ValueError) as excinfo:
        ORTTrainerOptions(options)
    assert str(excinfo.value) == message


def test_custom_types_accept_their_classes():
    scheduler = optim.LinearWarmupLRScheduler(total_steps=10)
    scaler = amp.loss_scaler.DynamicLossScaler()

    def postprocess(model):
        return model

    opts = ORTTrainerOptions(
        {
            "lr_scheduler": scheduler,
            "mixed_precision": {"enabled": True, "loss_scaler": scaler},
            "_internal_use": {"extra_postprocess": postprocess},
        }
    )
    assert opts.lr_scheduler is scheduler
    assert opts.mixed_precision.loss_scaler is scaler
    assert opts._internal_use.extra_postprocess is postprocess


class _FakeSessionOptions:
    pass


def test_session_options_type_is_checked_through_sys_modules(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", types.SimpleNamespace(SessionOptions=_FakeSessionOptions))
    value = _FakeSessionOptions()
    assert ORTTrainerOptions({"session_options": value}).session_options is value
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # onnxruntime not importable: nothing can match
    with pytest.raises(ValueError, match=r"must be of session_options type"):
        ORTTrainerOptions({"session_options": value})


def test_session_options_accepts_the_real_onnxruntime_class():
    ort = pytest.importorskip("onnxruntime")
    session_options = ort.SessionOptions()
    assert ORTTrainerOptions({"session_options": session_options}).session_options is session_options


def _fake_ort_strategy(name: str) -> object:
    # Stands in for the pybind11 enum value: same type name, an onnxruntime module, a `.name`.
    cls = type("PropagateCastOpsStrategy", (), {"__module__": "onnxruntime.capi.onnxruntime_pybind11_state"})
    value = cls()
    value.name = name
    return value


@pytest.mark.parametrize("name", ["NONE", "INSERT_AND_REDUCE", "FLOOD_FILL"])
def test_onnxruntime_strategy_enum_is_normalised_by_name(name):
    opts = ORTTrainerOptions(
        {"graph_transformer": {"propagate_cast_ops_config": {"strategy": _fake_ort_strategy(name)}}}
    )
    strategy = opts._validated_opts["graph_transformer"]["propagate_cast_ops_config"]["strategy"]
    assert strategy is PropagateCastOpsStrategy[name]
    assert opts.graph_transformer.propagate_cast_ops_config.strategy is PropagateCastOpsStrategy[name]


@needs_training_build
def test_real_onnxruntime_strategy_enum_is_normalised():
    import onnxruntime.training as training

    value = training.PropagateCastOpsStrategy.INSERT_AND_REDUCE
    opts = ORTTrainerOptions({"graph_transformer": {"propagate_cast_ops_config": {"strategy": value}}})
    assert opts.graph_transformer.propagate_cast_ops_config.strategy is PropagateCastOpsStrategy.INSERT_AND_REDUCE


def test_lookalike_strategy_from_another_module_is_rejected():
    cls = type("PropagateCastOpsStrategy", (), {"__module__": "somewhere_else"})
    value = cls()
    value.name = "FLOOD_FILL"
    with pytest.raises(ValueError, match=r"'strategy': \['must be of propagate_cast_ops_strategy type'\]"):
        ORTTrainerOptions({"graph_transformer": {"propagate_cast_ops_config": {"strategy": value}}})


def test_strategy_enum_values_match_onnxruntime():
    assert [(m.name, int(m)) for m in PropagateCastOpsStrategy] == [
        ("NONE", 0),
        ("INSERT_AND_REDUCE", 1),
        ("FLOOD_FILL", 2),
    ]


def test_each_instance_gets_fresh_default_containers():
    first, second = ORTTrainerOptions({}), ORTTrainerOptions({})
    first._validated_opts["utils"]["frozen_weights"].append("w")
    first._validated_opts["provider_options"]["EP"] = {}
    assert second._validated_opts["utils"]["frozen_weights"] == []
    assert ORTTrainerOptions({})._validated_opts == DEFAULTS


def test_user_dict_is_not_modified():
    user = {"batch": {}, "utils": {"frozen_weights": ["a"]}}
    opts = ORTTrainerOptions(user)
    assert user == {"batch": {}, "utils": {"frozen_weights": ["a"]}}
    assert opts._original_opts == user


def test_legacy_module_path_reexports_the_same_objects():
    assert orttrainer_options.ORTTrainerOptions is ORTTrainerOptions
    assert orttrainer_options._ORTTRAINER_OPTIONS_SCHEMA is options_module._ORTTRAINER_OPTIONS_SCHEMA
    assert orttrainer_options.ORTTrainerOptionsValidator is options_module.ORTTrainerOptionsValidator
    assert orttrainer_options._ORTTrainerOptionsInternal is _ORTTrainerOptionsInternal


def test_schema_imports_without_onnxruntime():
    # sys.modules[name] = None makes any `import onnxruntime` raise ImportError in that process.
    script = textwrap.dedent(
        """
        import sys
        sys.modules["onnxruntime"] = None
        import orttrainer.schema as schema
        from orttrainer import orttrainer_options, model_desc_validation
        opts = schema.ORTTrainerOptions({"batch": {"gradient_accumulation_steps": 2}})
        desc = schema._ORTTrainerModelDesc({"inputs": [("x", ["batch"])], "outputs": [("loss", [], True)]})
        assert opts.batch.gradient_accumulation_steps == 2 and desc.outputs[0].is_loss
        try:
            schema.ORTTrainerOptions({"session_options": object()})
        except ValueError as error:
            print(error)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "Invalid options: {'session_options': ['must be of session_options type']}"


def test_gradient_builder_is_an_added_key_that_leaves_the_legacy_ones_alone():
    internal = ORTTrainerOptions({})._validated_opts["_internal_use"]
    assert internal["gradient_builder"] == "auto"
    assert set(internal) - {"gradient_builder"} == {
        "enable_internal_postprocess",
        "extra_postprocess",
        "onnx_opset_version",
        "enable_onnx_contrib_ops",
    }
    for value in ("ort", "torch", "auto"):
        assert ORTTrainerOptions({"_internal_use": {"gradient_builder": value}})._internal_use.gradient_builder == value
