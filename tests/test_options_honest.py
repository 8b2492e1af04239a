"""The guard that keeps ORTTrainerOptions honest: no option is accepted and then silently ignored.

Every leaf of the option schema is accounted for here, once:
- in `REFUSED`: a non-default value this build cannot honour; the trainer raises NotImplementedError naming the
  option (`test_a_refused_value_raises_not_implemented_naming_the_option`); or
- by an effect probe (`@effect(leaf)`): a small function that builds a tiny trainer with the option at a non-default
  value, runs a step or two (or only constructs it, where the effect is at construction) and asserts what the option
  changes — weights, counters, graph nodes, files written, session options, or an error naming the option
  (`test_each_option_has_its_effect` runs it). Its `deeper` tests check the same effect in depth; they must exist.
A new option, or one with neither, fails `test_every_option_leaf_is_accounted_for`.

Runtimes. Without onnxruntime-training (the maintained onnxruntime, `has_training_build()` False) some options are
refused at construction (`trainer/config.py`, `check_runtime_supports`). They are listed in
`REFUSED_WITHOUT_TRAINING_BUILD` with the value to try and the option the error names; there, their probe is replaced
by that check. When one of them starts working on the maintained runtime, delete its line: its probe then runs on both
runtimes (a line left behind fails, since the refusal no longer comes). `NO_EFFECT_WITHOUT_TRAINING_BUILD` lists the
options the maintained runtime accepts and then ignores; their probes fail there and are marked as expected failures
(strict: the day one passes or raises another error, the lane says so); delete the line with the fix.

Cost: probes share what they can (`Context.shared`: the default trainer the options are compared with, one trainer
writing every `debug.graph_save_paths` file), and the options whose effect needs several processes share one run of
two ranks (`two_ranks`; those probes are marked `distributed`).
"""

from __future__ import annotations

import importlib
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from dist_worker import global_batches, shard
from helpers import (
    make_trainer,
    max_difference,
    needs_training_build,
    run_ranks,
    torch_weights,
    trainer_weights,
)
from models import MLP, TinyTransformer, mlp_batches, mlp_desc, transformer_desc, transformer_loss
from test_gradient_options import AMP_DESC
from test_graph_gradient_options import _amp_graph
from test_trainer_features import _log_softmax_nll_model

from orttrainer import ORTTrainer, ORTTrainerOptions, PropagateCastOpsStrategy, amp, optim
from orttrainer.schema.options import _ORTTRAINER_OPTIONS_SCHEMA
from orttrainer.trainer import config as config_module
from orttrainer.trainer import orttrainer as orttrainer_module
from orttrainer.trainer.gradient.torch_builder import RECOMPUTED_KEY
from orttrainer.trainer.graph.recompute import count_recompute_nodes
from orttrainer.trainer.runtime import has_training_build
from orttrainer.trainer.runtime import ort as ort_module
from orttrainer.trainer.runtime.data_parallel import DistributedContext, partition_parameters
from orttrainer.trainer.runtime.ort import Device, providers_for

CE = torch.nn.functional.cross_entropy
TRAINING_BUILD = has_training_build()


@dataclass(frozen=True)
class Refused:
    value: object


REFUSED = {
    "distributed.horizontal_parallel_size": Refused(2),
    "distributed.pipeline_parallel.pipeline_parallel_size": Refused(2),
    "distributed.pipeline_parallel.num_pipeline_micro_batches": Refused(2),
    "distributed.pipeline_parallel.pipeline_cut_info_string": Refused("a,b"),
    "distributed.pipeline_parallel.sliced_schema": Refused({"x": [1, 2]}),
    "distributed.pipeline_parallel.sliced_axes": Refused({"x": 0}),
    "distributed.pipeline_parallel.sliced_tensor_names": Refused(["x"]),
}


@dataclass(frozen=True)
class RefusedHere:
    """Without onnxruntime-training: `value` raises NotImplementedError at construction, naming `names` (the leaf
    itself when empty) and onnxruntime-training."""

    value: object
    names: str = ""


REFUSED_WITHOUT_TRAINING_BUILD = {
    "_internal_use.gradient_builder": RefusedHere("ort"),
}

NO_EFFECT_WITHOUT_TRAINING_BUILD = {
    "_internal_use.onnx_opset_version": "the torch builder exports opset 18 whatever this option says",
    "_internal_use.enable_onnx_contrib_ops": "only the TorchScript exporter reads it, which this runtime never runs",
}


def refused_here(leaf: str) -> bool:
    return not TRAINING_BUILD and leaf in REFUSED_WITHOUT_TRAINING_BUILD


# ---------------------------------------------------------------------------------------------------- the registry
@dataclass
class Context:
    """What a probe gets: the leaf it probes, monkeypatch, and the runs probes share."""

    leaf: str
    monkeypatch: pytest.MonkeyPatch
    request: pytest.FixtureRequest

    def shared(self, build: Callable[[], Any]) -> Any:
        """`build()`'s result, built once for this module (`build` must not depend on the probe)."""
        cache = self.request.getfixturevalue("shared_results")
        if build not in cache:
            cache[build] = build()
        return cache[build]

    def ranks(self) -> list[dict[str, dict]]:
        return self.request.getfixturevalue("two_ranks")


@dataclass(frozen=True)
class Effect:
    probe: Callable[[Context], None]
    deeper: tuple[str, ...]
    distributed: bool


EFFECTS: dict[str, Effect] = {}


def effect(*leaves: str, deeper: tuple[str, ...] = (), distributed: bool = False):
    """Register the decorated function as the effect probe of `leaves`."""

    def register(probe: Callable[[Context], None]) -> Callable[[Context], None]:
        for leaf in leaves:
            assert leaf not in EFFECTS, leaf
            EFFECTS[leaf] = Effect(probe, deeper, distributed)
        return probe

    return register


@pytest.fixture(scope="module")
def shared_results():
    return {}


# ------------------------------------------------------------------------------------ the MLP and its default run
BATCHES = mlp_batches(2)


def _mlp(extra: dict | None = None, steps: int = 1) -> ORTTrainer:
    """The MLP (seeded 0, Adam) with `extra` options, after `steps` steps on BATCHES."""
    torch.manual_seed(0)
    trainer = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(lr=1e-2), CE, extra)
    for x, y in BATCHES[:steps]:
        trainer.train_step(x, y)
    return trainer


def _initial() -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    return torch_weights(MLP())


def _default_run() -> dict:
    """The trainer with default options (on the CPU) the probes of the MLP compare with: its first step's outputs,
    its weights after one and after two steps."""
    trainer = _mlp(steps=0)
    outputs = trainer.train_step(*BATCHES[0])
    after_one = trainer_weights(trainer)
    trainer.train_step(*BATCHES[1])
    return {"trainer": trainer, "outputs": outputs, "after_one": after_one, "after_two": trainer_weights(trainer)}


def _session_options(trainer: ORTTrainer):
    return trainer._training_session.train_session.get_session_options()


def _config_entry(options, key: str) -> str | None:
    try:
        return options.get_session_config_entry(key)
    except RuntimeError:  # not set
        return None


# ----------------------------------------------------------------------------------------------------------- batch
@effect(
    "batch.gradient_accumulation_steps",
    deeper=("test_trainer_features::test_accumulation_of_four_equals_one_step_on_the_concatenation",),
)
def accumulation(ctx: Context) -> None:
    """k=2: the first micro-step leaves the weights alone; after the second they are the default trainer's after one
    step on the two micro-batches concatenated."""
    trainer = _mlp({"batch": {"gradient_accumulation_steps": 2}}, steps=0)
    x, y = BATCHES[0]
    trainer.train_step(x[:4], y[:4])
    assert max_difference(trainer_weights(trainer), _initial()) == 0.0
    assert trainer.optimization_step == 0
    trainer.train_step(x[4:], y[4:])
    assert trainer.optimization_step == 1
    assert max_difference(trainer_weights(trainer), ctx.shared(_default_run)["after_one"]) < 1e-5


# ---------------------------------------------------------------------------------------------------------- device
def _cuda_here() -> bool:
    return torch.cuda.is_available() and "CUDAExecutionProvider" in ort.get_available_providers()


@effect(
    "device.id",
    deeper=(
        "test_trainer_errors::test_cuda_asked_for_without_cuda_is_a_clear_error",
        "test_trainer_errors::test_a_malformed_device_id_is_rejected_in_the_constructor",
    ),
)
def device_id(ctx: Context) -> None:
    """'cpu' trains on ONNX Runtime's CPU provider; 'cuda:1' is CUDA device 1, which the provider list asks for, or
    is a clear error on a machine without CUDA."""
    assert ctx.shared(_default_run)["trainer"]._training_session.train_session.get_providers() == [
        "CPUExecutionProvider"
    ]
    options = ORTTrainerOptions({"device": {"id": "cuda:1"}})
    trainer = ORTTrainer(MLP(), mlp_desc(), optim.SGDConfig(), CE, options=options)
    assert trainer._config.device == Device("cuda", 1)
    if _cuda_here():
        assert providers_for(trainer._config.device, 0, {})[0] == ("CUDAExecutionProvider", {"device_id": 1})
        return
    with pytest.raises(RuntimeError, match=r"options device.id asks for CUDA \(cuda:1\) but CUDA is not available"):
        providers_for(trainer._config.device, 0, {})


@effect(
    "device.mem_limit", deeper=("test_cpu_memory_limit::test_mem_limit_caps_the_cpu_arena_of_the_trainer_sessions",)
)
def mem_limit(ctx: Context) -> None:
    """On the CPU: the sessions allocate from one process-wide arena capped at the limit. The allocator is recorded,
    not registered (it would cap every later session of this process; the deeper test runs in a fresh one)."""
    registered = []
    ctx.monkeypatch.setattr(ort, "create_and_register_allocator", lambda info, arena: registered.append(arena))
    ctx.monkeypatch.setattr(ort_module, "_registered_limit", None)
    trainer = _mlp({"device": {"mem_limit": 64 << 20}})
    assert [arena.max_mem for arena in registered] == [64 << 20]
    assert _config_entry(_session_options(trainer), "session.use_env_allocators") == "1"
    default = _session_options(ctx.shared(_default_run)["trainer"])
    assert _config_entry(default, "session.use_env_allocators") is None


# ------------------------------------------------------------------------------------------------------ distributed
# One run of two ranks (tests/dist_worker.py, Gloo) with three trainers per rank, each on global batches of 8 rows:
# SGD accumulating 2 micro-steps with allreduce_post_accumulation; Adam with ZeRO stage 1; SGD with Adasum.
RUNS = {
    "post": {"optimizer": "sgd", "accumulation": 2, "post": True, "steps": 2},
    "zero": {"optimizer": "adam", "zero": 1, "steps": 1},
    "adasum": {"optimizer": "sgd", "adasum": True, "steps": 1},
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict[str, dict]]:
    directory, runs = tmp_path_factory.mktemp("ranks"), list(RUNS.values())
    results = run_ranks(directory, 2, steps=1, global_batch=8, runs=runs)  # each run sets its own steps
    return [dict(zip(RUNS, result["runs"], strict=True)) for result in results]


def _rank_gradients(steps: int) -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]]]:
    """MLP seeded 0 as the worker builds it, and each rank's gradient: the mean over its micro-batches (its shard
    of the first `steps` global batches)."""
    torch.manual_seed(0)
    model = MLP()
    gradients = []
    for rank in range(2):
        model.zero_grad()
        for x, y in global_batches(steps, 8):
            (CE(model(shard(x, rank, 2)), shard(y, rank, 2)) / steps).backward()
        gradients.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return model, gradients


def _sgd_step(model: torch.nn.Module, combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], grads) -> dict:
    return {
        n: (p.detach().double() - 0.1 * combine(grads[0][n].double(), grads[1][n].double())).numpy()
        for n, p in model.named_parameters()
    }


@effect(
    "distributed.world_size",
    deeper=("test_distributed::test_two_ranks_equal_one_process_on_the_concatenated_batch",),
    distributed=True,
)
def world_size(ctx: Context) -> None:
    """world_size=2: each rank trains on its shard, and both get the update of the mean gradient over both shards."""
    model, grads = _rank_gradients(2)
    expected = _sgd_step(model, lambda a, b: (a + b) / 2, grads)
    ours, theirs = (rank["post"]["all_weights"] for rank in ctx.ranks())
    assert max_difference(_arrays(ours), _arrays(theirs)) == 0.0
    assert max_difference(_arrays(ours), expected) < 1e-6


def _arrays(tree: dict) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in tree.items()}


@effect(
    "distributed.world_rank",
    deeper=("test_distributed::test_zero_stage_1_equals_data_parallel_and_partitions_the_optimizer_state",),
    distributed=True,
)
def world_rank(ctx: Context) -> None:
    """The rank is this process's place in the group: under ZeRO, world_rank r holds the optimizer state of the
    parameters the partition gives rank r."""
    shapes = {n: tuple(p.shape) for n, p in MLP().named_parameters()}
    owners = partition_parameters(shapes, 2)
    assert set(owners.values()) == {0, 1}
    for rank, result in enumerate(ctx.ranks()):
        assert result["zero"]["partition_info"] == sorted(n for n, r in owners.items() if r == rank)


@effect(
    "distributed.allreduce_post_accumulation",
    deeper=("test_distributed::test_post_accumulation_reduces_once_per_optimizer_step",),
    distributed=True,
)
def allreduce_post_accumulation(ctx: Context) -> None:
    """One all-reduce per optimizer step (the default: one per micro-step): once for two micro-steps."""
    for result in ctx.ranks():
        assert result["post"]["counters"][:2] == [2, 1]
        assert result["post"]["calls"]["all_reduce"] == 1


@effect(
    "distributed.deepspeed_zero_optimization.stage",
    deeper=("test_distributed::test_zero_stage_1_equals_data_parallel_and_partitions_the_optimizer_state",),
    distributed=True,
)
def zero_stage(ctx: Context) -> None:
    """Stage 1: Adam's two moments are partitioned, each rank holding only its part."""
    total = 2 * sum(p.numel() for p in MLP().parameters())
    owned = [result["zero"]["moment_elements"] for result in ctx.ranks()]
    assert sum(owned) == total and max(owned) < total


@effect(
    "distributed.enable_adasum", deeper=("test_distributed::test_adasum_matches_the_reference_rule",), distributed=True
)
def adasum(ctx: Context) -> None:
    """The ranks' gradients are combined by the Adasum rule instead of averaged."""
    model, grads = _rank_gradients(1)

    def rule(g1: torch.Tensor, g2: torch.Tensor) -> torch.Tensor:
        dot = (g1 * g2).sum()
        return (1 - dot / (2 * (g1 * g1).sum())) * g1 + (1 - dot / (2 * (g2 * g2).sum())) * g2

    expected = _sgd_step(model, rule, grads)
    for result in ctx.ranks():
        assert max_difference(_arrays(result["adasum"]["all_weights"]), expected) < 1e-6
    assert max_difference(expected, _sgd_step(model, lambda a, b: (a + b) / 2, grads)) > 1e-4


@effect("distributed.local_rank")
def local_rank(ctx: Context) -> None:
    """With device.id 'cuda', rank r of a multi-process run uses cuda:<local_rank> (no GPU needed to check)."""
    seen = {}

    def fake_context(options, device_type):
        seen["local_rank"] = options.distributed.local_rank
        return DistributedContext(1, 2, options.distributed.local_rank)

    ctx.monkeypatch.setattr(config_module, "resolve_context", fake_context)
    options = ORTTrainerOptions(
        {"device": {"id": "cuda"}, "distributed": {"world_rank": 1, "world_size": 2, "local_rank": 3}}
    )
    trainer = ORTTrainer(MLP(), mlp_desc(), optim.SGDConfig(), CE, options=options)
    assert seen == {"local_rank": 3} and trainer._config.device == Device("cuda", 3)


@effect("distributed.data_parallel_size")
def data_parallel_size(ctx: Context) -> None:
    with pytest.raises(ValueError, match=r"data_parallel_size=2 must equal the world size \(1\)"):
        make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), CE, {"distributed": {"data_parallel_size": 2}})


# ---------------------------------------------------------------------------------------------------- lr_scheduler
@effect(
    "lr_scheduler",
    deeper=("test_trainer_features::test_an_lr_scheduler_drives_the_learning_rate_per_optimization_step",),
)
def lr_scheduler(ctx: Context) -> None:
    """A warm-up from 0 over 2 of 4 steps: the first step's rate is 0 (the weights stay), the second's half of lr."""
    scheduler = optim.lr_scheduler.ConstantWarmupLRScheduler(total_steps=4, warmup=0.5)
    trainer = _mlp({"lr_scheduler": scheduler})
    assert scheduler.get_last_lr() == [0.0]
    assert max_difference(trainer_weights(trainer), _initial()) == 0.0
    assert max_difference(ctx.shared(_default_run)["after_one"], _initial()) > 1e-3
    trainer.train_step(*BATCHES[1])
    assert scheduler.get_last_lr() == [0.005]
    assert max_difference(trainer_weights(trainer), _initial()) > 1e-3


# ------------------------------------------------------------------------------------------------- mixed_precision
@effect(
    "mixed_precision.enabled",
    deeper=("test_mixed_precision::test_mixed_precision_tracks_fp32_on_the_transformer",),
)
def mixed_precision(ctx: Context) -> None:
    """float16 compute: the logits come back in float16 (float32 by default), and a DynamicLossScaler is made."""
    trainer = _mlp({"mixed_precision": {"enabled": True}}, steps=0)
    loss, logits = trainer.train_step(*BATCHES[0])
    assert logits.dtype == torch.float16 and loss.dtype == torch.float32
    assert isinstance(trainer.options.mixed_precision.loss_scaler, amp.DynamicLossScaler)
    assert ctx.shared(_default_run)["outputs"][1].dtype == torch.float32


@effect(
    "mixed_precision.loss_scaler",
    deeper=(
        "test_mixed_precision::test_the_scale_grows_after_each_window_of_finite_steps_up_to_the_cap",
        "test_mixed_precision::test_a_scaler_with_automatic_update_off_keeps_its_scale",
    ),
)
def loss_scaler(ctx: Context) -> None:
    """The trainer drives the given scaler: a window of one finite step doubles its scale."""
    scaler = amp.DynamicLossScaler(loss_scale=1024.0, up_scale_window=1)
    _mlp({"mixed_precision": {"enabled": True, "loss_scaler": scaler}})
    assert scaler.loss_scale == 2048.0


# ----------------------------------------------------------------------------------------------- graph_transformer
def _transformer(graph_transformer: dict | None = None, utils: dict | None = None) -> ORTTrainer:
    """A 3-layer TinyTransformer (seeded 0) after one step."""
    torch.manual_seed(0)
    options = {"graph_transformer": graph_transformer or {}, "utils": utils or {}}
    trainer = make_trainer(TinyTransformer(layers=3), transformer_desc(), optim.SGDConfig(), transformer_loss, options)
    tokens = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    trainer.train_step(tokens, tokens)
    return trainer


def _default_transformer() -> ORTTrainer:
    return _transformer()


def _recomputed(trainer: ORTTrainer) -> dict[str, int]:
    """The 'ort' builder's recompute copies by op type (graph/recompute.py); the torch builder's count of
    recomputed nodes (gradient/torch_recompute.py) under "torch". Empty: nothing recomputed."""
    if trainer.gradient_builder == "torch":
        metadata = {p.key: p.value for p in trainer._built.compiled.training.model.metadata_props}
        count = int(metadata.get(RECOMPUTED_KEY, 0))
        return {"torch": count} if count else {}
    return count_recompute_nodes(trainer._built.compiled.training.model)


@effect(
    "graph_transformer.gelu_recompute",
    deeper=(
        "test_recompute::test_gelu_recompute_copies_each_gelu_and_trains_identically",
        "test_recompute_torch::test_each_option_recomputes_what_it_names_and_trains_bit_identically",
    ),
)
def gelu_recompute(ctx: Context) -> None:
    """The backward recomputes the MLP's GELU instead of keeping its output."""
    recomputed = _recomputed(_mlp({"graph_transformer": {"gelu_recompute": True}}))
    assert recomputed == ({"Gelu": 1} if TRAINING_BUILD else {"torch": 1})
    assert _recomputed(ctx.shared(_default_run)["trainer"]) == {}


@effect(
    "graph_transformer.attn_dropout_recompute",
    deeper=(
        "test_recompute::test_attn_dropout_recompute_copies_each_attention_dropout_and_trains_identically",
        "test_recompute_torch::test_each_option_recomputes_what_it_names_and_trains_bit_identically",
    ),
)
def attn_dropout_recompute(ctx: Context) -> None:
    """Each layer's attention dropout is recomputed from its mask."""
    recomputed = _recomputed(_transformer({"attn_dropout_recompute": True}))
    assert recomputed == {"DropoutGrad": 3} if TRAINING_BUILD else recomputed["torch"] > 0
    assert _recomputed(ctx.shared(_default_transformer)) == {}


def _transformer_layer_recompute() -> ORTTrainer:
    return _transformer({"transformer_layer_recompute": True})


def _layers_recomputed(trainer: ORTTrainer) -> int:
    """'ort': layers by their LayerNormalization copies (one per layer here); torch: recomputed nodes."""
    recomputed = _recomputed(trainer)
    return recomputed.get("LayerNormalization", 0) if TRAINING_BUILD else recomputed.get("torch", 0)


@effect(
    "graph_transformer.transformer_layer_recompute",
    deeper=(
        "test_recompute::test_transformer_layer_recompute_copies_every_layer_but_the_last_and_trains_identically",
        "test_recompute_torch::test_recomputing_layers_lowers_the_live_activations_of_a_step",
    ),
)
def transformer_layer_recompute(ctx: Context) -> None:
    """Every layer but the last is recomputed: here 2 of 3, each with its LayerNormalization."""
    layers = _layers_recomputed(ctx.shared(_transformer_layer_recompute))
    assert layers == 2 if TRAINING_BUILD else layers > 0
    assert _recomputed(ctx.shared(_default_transformer)) == {}


@effect(
    "graph_transformer.number_recompute_layers",
    deeper=(
        "test_recompute::test_number_recompute_layers_counts_from_the_first_layer",
        "test_recompute::test_number_recompute_layers_alone_is_an_error",
        "test_recompute_torch::test_number_recompute_layers_counts_from_the_first_layer",
    ),
)
def number_recompute_layers(ctx: Context) -> None:
    """Alone it is an error; with transformer_layer_recompute it is how many layers, from the first (torch: 0
    recomputes two layers, at least twice the nodes of the first; measured 143 and 71)."""
    with pytest.raises(ValueError, match="number_recompute_layers=1 only takes effect with graph_transformer.transfor"):
        make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), CE, {"graph_transformer": {"number_recompute_layers": 1}})
    one = _layers_recomputed(_transformer({"transformer_layer_recompute": True, "number_recompute_layers": 1}))
    all_but_last = _layers_recomputed(ctx.shared(_transformer_layer_recompute))
    assert (one, all_but_last) == (1, 2) if TRAINING_BUILD else (one > 0 and all_but_last >= 2 * one)


def _forward_casts(cast_config: dict) -> int:
    """Casts in the forward part of the compiled training graph of `_amp_graph` (an ONNX model, built at
    construction) under this propagate_cast_ops_config (tests/test_graph_gradient_options.py documents them)."""
    options = {"graph_transformer": {"propagate_cast_ops_config": cast_config}}
    trainer = make_trainer(_amp_graph(), AMP_DESC, optim.AdamConfig(lr=1e-3), extra=options)
    return sum(
        n.op_type == "Cast" and "_Grad" not in n.name and not n.name.startswith("orttrainer/")
        for n in trainer._built.compiled.training.model.graph.node
    )


def _float16_nodes(cast_config: dict) -> int:
    """Nodes computing in float16 in the torch builder's training graph of `_amp_graph` (built at the first step)
    under this propagate_cast_ops_config (orttrainer's own pass, tests/test_cast_propagation.py documents it)."""
    from test_cast_propagation import _float16_nodes as float16_nodes
    from test_gradient_options import _batches as amp_batches

    options = {
        "graph_transformer": {"propagate_cast_ops_config": cast_config},
        "_internal_use": {"gradient_builder": "torch"},
    }
    trainer = make_trainer(_amp_graph(), AMP_DESC, optim.AdamConfig(lr=1e-3), extra=options)
    trainer.train_step(*amp_batches(1)[0])
    return float16_nodes(trainer._built.compiled.training.model)


_CAST_DEEPER = (
    "test_gradient_options::test_cast_propagation_reaches_the_graph_and_training_stays_within_the_float16_tolerance",
    "test_graph_gradient_options::test_each_cast_propagation_setting_changes_the_graph_as_documented",
    # orttrainer's own pass on the torch builder's graphs, both runtimes
    "test_graph_cast_propagation::test_each_setting_moves_the_casts_as_onnx_runtime_does",
    "test_cast_propagation::test_every_setting_moves_the_casts_of_an_amp_onnx_model_and_trains_it_within_float16_"
    "tolerance",
    "test_cast_propagation::test_under_mixed_precision_every_strategy_trains_within_float16_tolerance",
)


@effect("graph_transformer.propagate_cast_ops_config.strategy", deeper=_CAST_DEEPER)
def cast_strategy(ctx: Context) -> None:
    if TRAINING_BUILD:  # ONNX Runtime's PropagateCastOps on the 'ort' builder's graph
        assert _forward_casts({}) == 3  # FLOOD_FILL, ONNX Runtime's default
        assert _forward_casts({"strategy": PropagateCastOpsStrategy.INSERT_AND_REDUCE}) == 5
    assert _float16_nodes({}) < _float16_nodes({"strategy": PropagateCastOpsStrategy.INSERT_AND_REDUCE})


@effect("graph_transformer.propagate_cast_ops_config.level", deeper=_CAST_DEEPER)
def cast_level(ctx: Context) -> None:
    """Level 2 lets the casts move across the allowed Sigmoid."""
    if TRAINING_BUILD:
        assert _forward_casts({"allow": ["Sigmoid"]}) == 3
        assert _forward_casts({"level": 2, "allow": ["Sigmoid"]}) == 4
    assert _float16_nodes({"allow": ["Sigmoid"]}) < _float16_nodes({"level": 2, "allow": ["Sigmoid"]})


@effect("graph_transformer.propagate_cast_ops_config.allow", deeper=_CAST_DEEPER)
def cast_allow(ctx: Context) -> None:
    if TRAINING_BUILD:
        assert _forward_casts({"level": 2}) == 3
        assert _forward_casts({"level": 2, "allow": ["Sigmoid"]}) == 4
    assert _float16_nodes({"level": 2}) < _float16_nodes({"level": 2, "allow": ["Sigmoid"]})


# ----------------------------------------------------------------------------------------------------------- utils
@effect(
    "utils.frozen_weights",
    deeper=("test_trainer_features::test_frozen_weights_and_requires_grad_false_parameters_stay_unchanged",),
)
def frozen_weights(ctx: Context) -> None:
    trainer, initial = _mlp({"utils": {"frozen_weights": ["fc1.weight"]}}), _initial()
    weights, default = trainer_weights(trainer), ctx.shared(_default_run)["after_one"]
    assert "fc1.weight" not in weights and np.array_equal(_frozen(trainer, "fc1.weight"), initial["fc1.weight"])
    assert not np.array_equal(default["fc1.weight"], initial["fc1.weight"])
    assert not np.array_equal(weights["fc2.weight"], initial["fc2.weight"])


def _frozen(trainer: ORTTrainer, name: str) -> np.ndarray:
    return trainer.state_dict()["model"]["full_precision"][name]


@effect("utils.grad_norm_clip", deeper=("test_trainer_parity::test_mlp_matches_pytorch",))
def grad_norm_clip(ctx: Context) -> None:
    """Off, the gradients are not clipped to Adam's max_norm_clip (1): after two steps the weights differ."""
    unclipped = trainer_weights(_mlp({"utils": {"grad_norm_clip": False}}, steps=2))
    assert max_difference(unclipped, ctx.shared(_default_run)["after_two"]) > 1e-5


@effect(
    "utils.memory_efficient_gradient",
    deeper=(
        "test_gradient_options::test_memory_efficient_gradient_uses_the_invertible_layer_norm_gradient_and_trains_"
        "identically",
        "test_recompute_torch::test_memory_efficient_gradient_trains_as_without_it",
    ),
)
def memory_efficient_gradient(ctx: Context) -> None:
    """'ort': LayerNorm gradients from the outputs (InvertibleLayerNormalizationGrad), two per layer. torch
    (gradient/torch_memory.py): each output pinned where autograd computes it (`after` gates, Unsqueeze/Squeeze
    pairs) and no buffer-reuse plan."""
    efficient, default = _transformer(utils={"memory_efficient_gradient": True}), ctx.shared(_default_transformer)

    def count(trainer: ORTTrainer, op: str) -> int:
        return [n.op_type for n in trainer._built.compiled.training.model.graph.node].count(op)

    if TRAINING_BUILD:
        assert count(efficient, "InvertibleLayerNormalizationGrad") == 6
        assert count(default, "InvertibleLayerNormalizationGrad") == 0
    else:
        assert count(efficient, "Unsqueeze") > count(default, "Unsqueeze")
        assert not efficient._training_session.config.memory_reuse and default._training_session.config.memory_reuse


NLL_DESC = {"inputs": [("x", ["batch", 32]), ("target", ["batch"])], "outputs": [("loss", [], True)]}


@effect(
    "utils.run_symbolic_shape_infer",
    deeper=("test_trainer_features::test_run_symbolic_shape_infer_annotates_the_graph",),
)
def run_symbolic_shape_infer(ctx: Context) -> None:
    """The forward model gets ONNX Runtime's shape annotations (an ONNX model: at construction)."""

    def annotated(infer: bool) -> int:
        trainer = make_trainer(
            _log_softmax_nll_model(), NLL_DESC, optim.SGDConfig(), extra={"utils": {"run_symbolic_shape_infer": infer}}
        )
        return len(trainer._onnx_model.graph.value_info)

    assert annotated(False) == 0 and annotated(True) == 3


# ----------------------------------------------------------------------------------------------------------- debug
@effect(
    "debug.deterministic_compute",
    deeper=("test_trainer_features::test_deterministic_compute_and_user_session_options_reach_onnxruntime",),
)
def deterministic_compute(ctx: Context) -> None:
    assert _session_options(_mlp({"debug": {"deterministic_compute": True}})).use_deterministic_compute
    assert not _session_options(ctx.shared(_default_run)["trainer"]).use_deterministic_compute


@effect(
    "debug.check_model_export",
    deeper=(
        "test_trainer_features::test_check_model_export_passes_for_a_faithful_export_and_fails_for_a_changed_graph",
    ),
)
def check_model_export(ctx: Context) -> None:
    """The first step compares the exported graph's outputs with PyTorch's; made to differ here (PyTorch's moved by
    one), the step fails with the legacy message naming the option."""
    compared: list[list[str]] = []
    check = orttrainer_module.check_model_export

    def off_by_one(names, results, expected):
        compared.append(list(names))
        return check(names, results, [e + 1 for e in expected])

    ctx.monkeypatch.setattr(orttrainer_module, "check_model_export", off_by_one)
    with pytest.raises(AssertionError, match="the flag debug.check_model_export to False"):
        _mlp({"debug": {"check_model_export": True}})
    assert compared == [["loss", "logits"]]


GRAPH_SAVE_PATHS = [
    "model_after_graph_transforms_path",
    "model_with_gradient_graph_path",
    "model_with_training_graph_path",
    "model_with_training_graph_after_optimization_path",
]


@effect(
    *(f"debug.graph_save_paths.{name}" for name in GRAPH_SAVE_PATHS),
    deeper=("test_trainer_features::test_debug_graph_save_paths_write_the_four_stages",),
)
def graph_save_paths(ctx: Context) -> None:
    """One trainer writes the four stages; each leaf's file holds its stage."""
    saved = ctx.shared(_graph_save_files)
    weights, grads = sorted(_initial()), sorted(f"{n}_grad" for n in _initial())
    stage = ctx.leaf.rpartition(".")[2]
    model = saved[stage]
    outputs = {o.name for o in model.graph.output}
    contract = {p.key for p in model.metadata_props} == {"orttrainer.contract"}
    if stage == "model_after_graph_transforms_path":  # the weights (the forward model, with the ort builder)
        assert set(weights) <= {i.name for i in model.graph.initializer} and not contract
    elif stage == "model_with_gradient_graph_path":
        assert set(grads) <= outputs and not contract
    elif stage == "model_with_training_graph_path":  # the training graph carries its state contract
        assert set(grads) <= outputs and contract
    else:  # as ONNX Runtime optimised it
        training = saved["model_with_training_graph_path"]
        assert contract and [n.op_type for n in model.graph.node] != [n.op_type for n in training.graph.node]


def _graph_save_files() -> dict[str, onnx.ModelProto]:
    """The four files of one trainer that sets every debug.graph_save_paths leaf, loaded."""
    with tempfile.TemporaryDirectory(prefix="graph_save_paths_") as directory:
        paths = {name: os.path.join(directory, f"{name}.onnx") for name in GRAPH_SAVE_PATHS}
        _mlp({"debug": {"graph_save_paths": paths}})
        return {name: onnx.load(path) for name, path in paths.items()}


# --------------------------------------------------------------------------------------------------- _internal_use
@effect(
    "_internal_use.enable_internal_postprocess",
    deeper=("test_trainer_features::test_internal_postprocess_fuses_log_softmax_and_nll_so_the_model_trains",),
)
def enable_internal_postprocess(ctx: Context) -> None:
    """The post-processing fuses LogSoftmax -> NegativeLogLikelihoodLoss into SoftmaxCrossEntropyLoss (an ONNX
    model, the torch builder on both runtimes: at construction)."""

    def forward_ops(enabled: bool) -> list[str]:
        options = {"_internal_use": {"enable_internal_postprocess": enabled, "gradient_builder": "torch"}}
        trainer = make_trainer(_log_softmax_nll_model(), NLL_DESC, optim.SGDConfig(), extra=options)
        return [n.op_type for n in trainer._onnx_model.graph.node]

    assert forward_ops(True) == ["MatMul", "SoftmaxCrossEntropyLoss"]
    assert forward_ops(False) == ["MatMul", "LogSoftmax", "NegativeLogLikelihoodLoss"]


@effect(
    "_internal_use.extra_postprocess",
    deeper=(
        "test_trainer_features::test_check_model_export_passes_for_a_faithful_export_and_fails_for_a_changed_graph",
        "test_legacy_api::test_onnx_model_extra_postprocess_in_place_and_loss_fn_warning",
        "test_extra_postprocess::test_an_edit_of_the_forward_graph_is_what_trains_and_evaluates",
    ),
)
def extra_postprocess(ctx: Context) -> None:
    """The user's function gets the exported model and returns the one that is trained."""
    seen = []

    def mark(model: onnx.ModelProto) -> onnx.ModelProto:
        seen.append(sorted(i.name for i in model.graph.initializer))
        onnx.helper.set_model_props(model, {"marked": "yes"})
        return model

    trainer = _mlp({"_internal_use": {"extra_postprocess": mark}})
    if not TRAINING_BUILD:  # the torch builder: torch.export's forward, built at the first step
        trainer.train_step(*BATCHES[0])
    assert len(seen) == 1 and set(_initial()) <= set(seen[0])  # torch.export's forward also holds its constants
    assert {p.key: p.value for p in trainer._onnx_model.metadata_props} == {"marked": "yes"}


@effect("_internal_use.onnx_opset_version", deeper=("test_legacy_api::test_arguments_reach_the_new_trainer",))
def onnx_opset_version(ctx: Context) -> None:
    """The PyTorch model is exported at this opset (14 by default)."""

    def opset(trainer: ORTTrainer) -> int:
        trainer.eval_step(*BATCHES[0])  # the forward model exists (the torch builder exports it when first needed)
        return next(o.version for o in trainer._onnx_model.opset_import if o.domain in ("", "ai.onnx"))

    assert opset(_mlp({"_internal_use": {"onnx_opset_version": 12}})) == 12
    assert opset(ctx.shared(_default_run)["trainer"]) == 14


class Sampler(torch.nn.Module):
    """grid_sample has no ONNX op before opset 16; ONNX Runtime's contrib symbolics export it as com.microsoft's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 10)

    def forward(self, x, image, grid):
        sampled = torch.nn.functional.grid_sample(image, grid, align_corners=False).reshape(x.shape[0], 4)
        return self.fc(x + sampled)


SAMPLER_DESC = {
    "inputs": [("x", ["b", 4]), ("image", ["b", 1, 3, 3]), ("grid", ["b", 2, 2, 2]), ("target", ["b"])],
    "outputs": [("loss", [], True)],
}


def _sampler_batch() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    grid = torch.rand(2, 2, 2, 2, generator=g) * 2 - 1
    return torch.randn(2, 4, generator=g), torch.randn(2, 1, 3, 3, generator=g), grid, torch.tensor([1, 7])


@effect(
    "_internal_use.enable_onnx_contrib_ops",
    deeper=("test_options_honest::test_enable_onnx_contrib_ops_exports_grid_sample_as_the_contrib_op",),
)
def enable_onnx_contrib_ops(ctx: Context) -> None:
    """On (the default), grid_sample exports as com.microsoft's GridSample and the 'ort' builder trains it; off, the
    TorchScript export fails and 'auto' trains with the torch builder, saying why."""

    def trained(enabled: bool) -> ORTTrainer:
        torch.manual_seed(0)
        options = {"_internal_use": {"enable_onnx_contrib_ops": enabled}}
        trainer = make_trainer(Sampler(), SAMPLER_DESC, optim.SGDConfig(), CE, options)
        trainer.train_step(*_sampler_batch())
        return trainer

    on = trained(True)
    assert on.gradient_builder == "ort"
    assert ("com.microsoft", "GridSample") in {(n.domain, n.op_type) for n in on._onnx_model.graph.node}
    off = trained(False)
    assert off.gradient_builder == "torch" and "the TorchScript exporter failed" in off._built.builder.reason


@effect(
    "_internal_use.gradient_builder",
    deeper=(
        "test_trainer_torch_builder::test_auto_falls_back_to_torch_for_an_op_without_an_ort_gradient",
        "test_trainer_torch_builder::test_straight_through_estimator_trains_with_the_users_backward",
        "test_builders::test_builder_choice_rules",
    ),
)
def gradient_builder(ctx: Context) -> None:
    """'torch': PyTorch's autograd builds the backward ('auto' picks ONNX Runtime's here)."""
    assert _mlp({"_internal_use": {"gradient_builder": "torch"}}).gradient_builder == "torch"
    assert ctx.shared(_default_run)["trainer"].gradient_builder == "ort"


# ------------------------------------------------------------------------------------ provider and session options
@effect(
    "provider_options",
    deeper=(
        "test_trainer_features::test_provider_options_are_merged_into_the_provider_list_given_to_onnxruntime",
        "test_trainer_features::test_provider_options_that_onnxruntime_would_drop_are_refused_at_construction",
    ),
)
def provider_options(ctx: Context) -> None:
    """A provider's options go into the provider list the sessions get (with CUDA: for real; without, the list is
    built as if this build had it); a provider this build lacks, or options for the CPU one, are refused."""
    options = {"CUDAExecutionProvider": {"arena_extend_strategy": "kSameAsRequested"}}
    device = Device("cuda") if _cuda_here() else Device("cpu")
    if not _cuda_here():
        available = ["CUDAExecutionProvider", "CPUExecutionProvider"]
        ctx.monkeypatch.setattr(ort, "get_available_providers", lambda: available)
    trainer = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), CE, {"provider_options": options})
    given = dict(providers_for(device, 0, trainer._config.options._validated_opts["provider_options"]))
    assert given["CUDAExecutionProvider"]["arena_extend_strategy"] == "kSameAsRequested"
    ctx.monkeypatch.undo()
    for refused, message in [
        ({"NoSuchExecutionProvider": {}}, "provider_options names 'NoSuchExecutionProvider', which this onnxruntime"),
        ({"CPUExecutionProvider": {"a": 1}}, "CPU provider takes no options from Python"),
    ]:
        with pytest.raises(ValueError, match=message):
            make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), CE, {"provider_options": refused})


@effect(
    "session_options",
    deeper=("test_trainer_features::test_deterministic_compute_and_user_session_options_reach_onnxruntime",),
)
def session_options(ctx: Context) -> None:
    """The user's SessionOptions are the sessions' (one intra-op thread here; ONNX Runtime's choice by default), and
    keep ONNX Runtime's spinning; orttrainer's own do not spin between runs (docs/engine.md §3.3)."""
    user = ort.SessionOptions()
    user.intra_op_num_threads = 1
    given = _session_options(_mlp({"session_options": user}))
    assert given.intra_op_num_threads == 1
    assert _config_entry(given, "session.intra_op.allow_spinning") is None
    default = _session_options(ctx.shared(_default_run)["trainer"])
    assert default.intra_op_num_threads == 0
    assert _config_entry(default, "session.intra_op.allow_spinning") == "0"


# ------------------------------------------------------------------------------------------------------- the tests
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
    assert not set(EFFECTS) & set(REFUSED)
    assert sorted(leaves) == sorted([*EFFECTS, *REFUSED])
    assert set(REFUSED_WITHOUT_TRAINING_BUILD) | set(NO_EFFECT_WITHOUT_TRAINING_BUILD) <= set(EFFECTS)
    assert not set(REFUSED_WITHOUT_TRAINING_BUILD) & set(NO_EFFECT_WITHOUT_TRAINING_BUILD)


def _effect_params():
    for leaf, found in EFFECTS.items():
        marks = [pytest.mark.distributed] if found.distributed and not refused_here(leaf) else []
        if not TRAINING_BUILD and leaf in NO_EFFECT_WITHOUT_TRAINING_BUILD:
            reason = f"accepted and ignored without onnxruntime-training: {NO_EFFECT_WITHOUT_TRAINING_BUILD[leaf]}"
            marks.append(pytest.mark.xfail(reason=reason, raises=AssertionError, strict=True))
        yield pytest.param(leaf, marks=marks, id=leaf)


@pytest.mark.parametrize("leaf", list(_effect_params()))
def test_each_option_has_its_effect(leaf, monkeypatch, request):
    found = EFFECTS[leaf]
    for reference in found.deeper:
        module_name, function_name = reference.split("::")
        assert callable(getattr(importlib.import_module(module_name), function_name, None)), reference
    if refused_here(leaf):
        refused = REFUSED_WITHOUT_TRAINING_BUILD[leaf]
        named = re.escape(refused.names or leaf)
        with pytest.raises(NotImplementedError, match=f"options .*{named}.*onnxruntime-training"):
            ORTTrainer(
                MLP(), mlp_desc(), optim.SGDConfig(), CE, options=ORTTrainerOptions(_nested(leaf, refused.value))
            )
        return
    found.probe(Context(leaf, monkeypatch, request))


def _nested(path: str, value) -> dict:
    tree: dict = {"device": {"id": "cpu"}}
    node = tree
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return tree


@pytest.mark.parametrize("leaf", list(REFUSED))
def test_a_refused_value_raises_not_implemented_naming_the_option(leaf):
    value = REFUSED[leaf].value
    with pytest.raises(NotImplementedError, match=re.escape(f"options {leaf}={value!r} is not supported")):
        ORTTrainer(MLP(), mlp_desc(), optim.SGDConfig(), CE, options=ORTTrainerOptions(_nested(leaf, value)))


# ---------------------------------------------------------------------------------------- deeper tests of this file
@needs_training_build
@pytest.mark.parametrize("enabled", [True, False])
def test_enable_onnx_contrib_ops_exports_grid_sample_as_the_contrib_op(enabled, tmp_path):
    path = str(tmp_path / "forward.onnx")
    trainer = make_trainer(
        Sampler(),
        SAMPLER_DESC,
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
        with pytest.raises(
            RuntimeError, match="no translation of 'aten::grid_sampler' at opset 14; it has one from opset 16"
        ):
            trainer.train_step(*batch)
        return
    trainer.train_step(*batch)
    assert ("com.microsoft", "GridSample") in {(n.domain, n.op_type) for n in onnx.load(path).graph.node}
