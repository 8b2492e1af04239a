"""The guard that keeps ORTTrainerOptions honest: no option is accepted and then silently ignored.

Every leaf of the option schema is listed in `HONESTY` with either
- `Effect(...)`: the tests (module::function) that show the option's observable effect — this file checks they
  exist, so renaming or deleting one fails here; or
- `Refused(value)`: a non-default value that this build cannot honour; this file checks that the trainer raises
  NotImplementedError naming the option for it.
A new option, or one dropped from this table, fails `test_every_option_leaf_is_accounted_for`.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass

import onnx
import pytest
import torch
from helpers import make_trainer, needs_training_build
from models import MLP, mlp_desc

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.schema.options import _ORTTRAINER_OPTIONS_SCHEMA
from orttrainer.trainer import config as config_module
from orttrainer.trainer.runtime.data_parallel import DistributedContext
from orttrainer.trainer.runtime.ort import Device

CE = torch.nn.functional.cross_entropy


@dataclass(frozen=True)
class Effect:
    tests: tuple[str, ...]

    def __init__(self, *tests: str) -> None:
        object.__setattr__(self, "tests", tests)


@dataclass(frozen=True)
class Refused:
    value: object


_GRAPH_SAVE = Effect("test_trainer_features::test_debug_graph_save_paths_write_the_four_stages")
_CAST_TRAINING = (
    "test_gradient_options::test_cast_propagation_reaches_the_graph_and_training_stays_within_the_float16_tolerance"
)
_CAST_GRAPH = "test_graph_gradient_options::test_each_cast_propagation_setting_changes_the_graph_as_documented"
_CAST_TORCH = (  # orttrainer's own pass on the torch builder's graphs, both runtimes
    "test_graph_cast_propagation::test_each_setting_moves_the_casts_as_onnx_runtime_does",
    "test_cast_propagation::test_every_setting_moves_the_casts_of_an_amp_onnx_model_and_trains_it_within_float16_"
    "tolerance",
    "test_cast_propagation::test_under_mixed_precision_every_strategy_trains_within_float16_tolerance",
)

HONESTY = {
    "batch.gradient_accumulation_steps": Effect(
        "test_trainer_features::test_accumulation_of_four_equals_one_step_on_the_concatenation"
    ),
    "device.id": Effect(
        "test_trainer_errors::test_cuda_asked_for_without_cuda_is_a_clear_error",
        "test_trainer_errors::test_a_malformed_device_id_is_rejected_in_the_constructor",
    ),
    "device.mem_limit": Effect("test_cpu_memory_limit::test_mem_limit_caps_the_cpu_arena_of_the_trainer_sessions"),
    "distributed.world_rank": Effect("test_distributed::test_two_ranks_equal_one_process_on_the_concatenated_batch"),
    "distributed.world_size": Effect("test_distributed::test_two_ranks_equal_one_process_on_the_concatenated_batch"),
    "distributed.local_rank": Effect("test_options_honest::test_local_rank_picks_the_cuda_device_of_a_rank"),
    "distributed.data_parallel_size": Effect("test_options_honest::test_data_parallel_size_must_be_the_world_size"),
    "distributed.horizontal_parallel_size": Refused(2),
    "distributed.pipeline_parallel.pipeline_parallel_size": Refused(2),
    "distributed.pipeline_parallel.num_pipeline_micro_batches": Refused(2),
    "distributed.pipeline_parallel.pipeline_cut_info_string": Refused("a,b"),
    "distributed.pipeline_parallel.sliced_schema": Refused({"x": [1, 2]}),
    "distributed.pipeline_parallel.sliced_axes": Refused({"x": 0}),
    "distributed.pipeline_parallel.sliced_tensor_names": Refused(["x"]),
    "distributed.allreduce_post_accumulation": Effect(
        "test_distributed::test_post_accumulation_reduces_once_per_optimizer_step"
    ),
    "distributed.deepspeed_zero_optimization.stage": Effect(
        "test_distributed::test_zero_stage_1_equals_data_parallel_and_partitions_the_optimizer_state"
    ),
    "distributed.enable_adasum": Effect("test_distributed::test_adasum_matches_the_reference_rule"),
    "lr_scheduler": Effect(
        "test_trainer_features::test_an_lr_scheduler_drives_the_learning_rate_per_optimization_step"
    ),
    "mixed_precision.enabled": Effect("test_mixed_precision::test_mixed_precision_tracks_fp32_on_the_transformer"),
    "mixed_precision.loss_scaler": Effect(
        "test_mixed_precision::test_the_scale_grows_after_each_window_of_finite_steps_up_to_the_cap",
        "test_mixed_precision::test_a_scaler_with_automatic_update_off_keeps_its_scale",
    ),
    "graph_transformer.attn_dropout_recompute": Effect(
        "test_recompute::test_attn_dropout_recompute_copies_each_attention_dropout_and_trains_identically"
    ),
    "graph_transformer.gelu_recompute": Effect(
        "test_recompute::test_gelu_recompute_copies_each_gelu_and_trains_identically"
    ),
    "graph_transformer.transformer_layer_recompute": Effect(
        "test_recompute::test_transformer_layer_recompute_copies_every_layer_but_the_last_and_trains_identically"
    ),
    "graph_transformer.number_recompute_layers": Effect(
        "test_recompute::test_number_recompute_layers_counts_from_the_first_layer",
        "test_recompute::test_number_recompute_layers_alone_is_an_error",
    ),
    "graph_transformer.propagate_cast_ops_config.strategy": Effect(_CAST_TRAINING, _CAST_GRAPH, *_CAST_TORCH),
    "graph_transformer.propagate_cast_ops_config.level": Effect(_CAST_TRAINING, _CAST_GRAPH, *_CAST_TORCH),
    "graph_transformer.propagate_cast_ops_config.allow": Effect(_CAST_TRAINING, _CAST_GRAPH, *_CAST_TORCH),
    "utils.frozen_weights": Effect(
        "test_trainer_features::test_frozen_weights_and_requires_grad_false_parameters_stay_unchanged"
    ),
    "utils.grad_norm_clip": Effect("test_trainer_parity::test_mlp_matches_pytorch"),
    "utils.memory_efficient_gradient": Effect(
        "test_gradient_options::test_memory_efficient_gradient_uses_the_invertible_layer_norm_gradient_and_trains_"
        "identically"
    ),
    "utils.run_symbolic_shape_infer": Effect(
        "test_trainer_features::test_run_symbolic_shape_infer_annotates_the_graph"
    ),
    "debug.deterministic_compute": Effect(
        "test_trainer_features::test_deterministic_compute_and_user_session_options_reach_onnxruntime"
    ),
    "debug.check_model_export": Effect(
        "test_trainer_features::test_check_model_export_passes_for_a_faithful_export_and_fails_for_a_changed_graph"
    ),
    "debug.graph_save_paths.model_after_graph_transforms_path": _GRAPH_SAVE,
    "debug.graph_save_paths.model_with_gradient_graph_path": _GRAPH_SAVE,
    "debug.graph_save_paths.model_with_training_graph_path": _GRAPH_SAVE,
    "debug.graph_save_paths.model_with_training_graph_after_optimization_path": _GRAPH_SAVE,
    "_internal_use.enable_internal_postprocess": Effect(
        "test_trainer_features::test_internal_postprocess_fuses_log_softmax_and_nll_so_the_model_trains"
    ),
    "_internal_use.extra_postprocess": Effect(
        "test_trainer_features::test_check_model_export_passes_for_a_faithful_export_and_fails_for_a_changed_graph",
        "test_legacy_api::test_onnx_model_extra_postprocess_in_place_and_loss_fn_warning",
        "test_extra_postprocess::test_an_edit_of_the_forward_graph_is_what_trains_and_evaluates",
    ),
    "_internal_use.onnx_opset_version": Effect("test_legacy_api::test_arguments_reach_the_new_trainer"),
    "_internal_use.gradient_builder": Effect(
        "test_trainer_torch_builder::test_auto_falls_back_to_torch_for_an_op_without_an_ort_gradient",
        "test_trainer_torch_builder::test_straight_through_estimator_trains_with_the_users_backward",
        "test_builders::test_builder_choice_rules",
    ),
    "_internal_use.enable_onnx_contrib_ops": Effect(
        "test_options_honest::test_enable_onnx_contrib_ops_exports_grid_sample_as_the_contrib_op"
    ),
    "provider_options": Effect(
        "test_trainer_features::test_provider_options_are_merged_into_the_provider_list_given_to_onnxruntime"
    ),
    "session_options": Effect(
        "test_trainer_features::test_deterministic_compute_and_user_session_options_reach_onnxruntime"
    ),
}


def _leaves(schema: dict, prefix: str = "") -> list[str]:
    found = []
    for key, rule in schema.items():
        if rule.get("type") == "dict" and "schema" in rule:
            found += _leaves(rule["schema"], f"{prefix}{key}.")
        else:
            found.append(f"{prefix}{key}")
    return found


def test_every_option_leaf_is_accounted_for():
    leaves = _leaves(_ORTTRAINER_OPTIONS_SCHEMA)
    assert len(leaves) == len(set(leaves)) == 44
    assert sorted(leaves) == sorted(HONESTY)


@pytest.mark.parametrize("leaf", [k for k, v in HONESTY.items() if isinstance(v, Effect)])
def test_the_tests_named_for_an_effect_exist(leaf):
    for reference in HONESTY[leaf].tests:
        module_name, function_name = reference.split("::")
        function = getattr(importlib.import_module(module_name), function_name, None)
        assert callable(function) and function_name.startswith("test_"), f"{leaf}: {reference} does not exist"


def _nested(path: str, value) -> dict:
    tree: dict = {"device": {"id": "cpu"}}
    node = tree
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return tree


@pytest.mark.parametrize("leaf", [k for k, v in HONESTY.items() if isinstance(v, Refused)])
def test_a_refused_value_raises_not_implemented_naming_the_option(leaf):
    value = HONESTY[leaf].value
    with pytest.raises(NotImplementedError, match=re.escape(f"options {leaf}={value!r} is not supported")):
        ORTTrainer(MLP(), mlp_desc(), optim.SGDConfig(), CE, options=ORTTrainerOptions(_nested(leaf, value)))


# ---------------------------------------------------------------- effect tests for options no other file covers
def test_local_rank_picks_the_cuda_device_of_a_rank(monkeypatch):
    """With device.id 'cuda', rank r of a multi-process run uses cuda:<local_rank> (no GPU needed to check)."""
    seen = {}

    def fake_context(options, device_type):
        seen["local_rank"] = options.distributed.local_rank
        return DistributedContext(1, 2, options.distributed.local_rank)

    monkeypatch.setattr(config_module, "resolve_context", fake_context)
    options = ORTTrainerOptions(
        {"device": {"id": "cuda"}, "distributed": {"world_rank": 1, "world_size": 2, "local_rank": 3}}
    )
    trainer = ORTTrainer(MLP(), mlp_desc(), optim.SGDConfig(), CE, options=options)
    assert seen == {"local_rank": 3} and trainer._config.device == Device("cuda", 3)


def test_data_parallel_size_must_be_the_world_size():
    with pytest.raises(ValueError, match=r"data_parallel_size=2 must equal the world size \(1\)"):
        make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), CE, {"distributed": {"data_parallel_size": 2}})


class Sampler(torch.nn.Module):
    """grid_sample has no ONNX op before opset 16; ONNX Runtime's contrib symbolics export it as com.microsoft's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 10)

    def forward(self, x, image, grid):
        sampled = torch.nn.functional.grid_sample(image, grid, align_corners=False).reshape(x.shape[0], 4)
        return self.fc(x + sampled)


@needs_training_build
@pytest.mark.parametrize("enabled", [True, False])
def test_enable_onnx_contrib_ops_exports_grid_sample_as_the_contrib_op(enabled, tmp_path):
    desc = {
        "inputs": [("x", ["b", 4]), ("image", ["b", 1, 3, 3]), ("grid", ["b", 2, 2, 2]), ("target", ["b"])],
        "outputs": [("loss", [], True)],
    }
    path = str(tmp_path / "forward.onnx")
    trainer = make_trainer(
        Sampler(),
        desc,
        optim.SGDConfig(),
        CE,
        {
            # the option acts on the TorchScript export, the 'ort' builder's ('auto' would switch to the torch
            # route when that export fails)
            "_internal_use": {"enable_onnx_contrib_ops": enabled, "gradient_builder": "ort"},
            "debug": {"graph_save_paths": {"model_after_graph_transforms_path": path}},
        },
    )
    batch = (torch.randn(2, 4), torch.randn(2, 1, 3, 3), torch.rand(2, 2, 2, 2) * 2 - 1, torch.tensor([1, 7]))
    if not enabled:
        with pytest.raises(RuntimeError, match="'aten::grid_sampler' to ONNX opset version 14 is not supported"):
            trainer.train_step(*batch)
        return
    trainer.train_step(*batch)
    assert ("com.microsoft", "GridSample") in {(n.domain, n.op_type) for n in onnx.load(path).graph.node}
