"""Data parallelism with real processes (Gloo on the CPU): equivalence with single-process training on the
concatenated batch, both all-reduce modes, ZeRO stage 1, checkpoint aggregation and Adasum."""

from __future__ import annotations

import functools
import os

import helpers
import numpy as np
import pytest
import torch
from helpers import needs_training_build

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.trainer.runtime.data_parallel import adasum_pair, partition_parameters

pytestmark = pytest.mark.distributed
STEPS, PER_RANK = 10, 4


# the scenario of every run here: STEPS global batches of PER_RANK rows per rank
run_ranks = functools.partial(helpers.run_ranks, steps=STEPS, global_batch=2 * PER_RANK)


def _flat(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _max_difference(a: dict, b: dict) -> float:
    a, b = _flat(a), _flat(b)
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(float(np.abs(np.asarray(a[k]) - np.asarray(b[k])).max()) for k in a)


@pytest.mark.parametrize(
    ("optimizer", "accumulation", "post"),
    [
        ("adam", 1, False),
        ("lamb", 1, False),
        ("adam", 2, True),
        ("adam", 2, False),
        ("lamb", 2, True),
        ("lamb", 2, False),
    ],
)
def test_two_ranks_equal_one_process_on_the_concatenated_batch(tmp_path, optimizer, accumulation, post):
    single = run_ranks(tmp_path, 1, optimizer=optimizer, accumulation=accumulation)[0]
    ranks = run_ranks(tmp_path, 2, optimizer=optimizer, accumulation=accumulation, post=post)
    for result in ranks:
        assert _max_difference(result["all_weights"], single["all_weights"]) < 1e-5
        assert result["counters"] == single["counters"]
    assert _max_difference(ranks[0]["optimizer"], ranks[1]["optimizer"]) == 0.0  # replicated without ZeRO


def test_two_ranks_with_the_torch_gradient_builder_equal_one_process(tmp_path):
    """The torch builder's gradient-step graph (accumulating in the graph) under data parallelism, with two batch
    sizes: the first batch's static graph, then the dynamic graph for the other size; the single-process reference
    uses the default builder ('ort' with onnxruntime-training, so the two builders are compared; 'torch' without
    it)."""
    cfg = {"accumulation": 2, "halve_odd_steps": True}
    single = run_ranks(tmp_path, 1, builder="auto", **cfg)[0]
    ranks = run_ranks(tmp_path, 2, builder="torch", post=True, **cfg)
    for result in ranks:
        assert result["gradient_builder"] == "torch" and result["graphs"] == 2
        assert _max_difference(result["all_weights"], single["all_weights"]) < 1e-5
        assert result["counters"] == single["counters"]


def test_post_accumulation_reduces_once_per_optimizer_step(tmp_path):
    per_micro = run_ranks(tmp_path, 2, accumulation=2, post=False)[0]["calls"]
    per_update = run_ranks(tmp_path, 2, accumulation=2, post=True)[0]["calls"]
    assert per_micro["all_reduce"] == STEPS and per_update["all_reduce"] == STEPS // 2


@pytest.mark.parametrize("optimizer", ["adam", "lamb"])
def test_zero_stage_1_equals_data_parallel_and_partitions_the_optimizer_state(tmp_path, optimizer):
    plain = run_ranks(tmp_path, 2, optimizer=optimizer, accumulation=2, post=True)
    zero = run_ranks(tmp_path, 2, optimizer=optimizer, accumulation=2, post=True, zero=1)
    for ours, theirs in zip(zero, plain, strict=True):
        assert _max_difference(ours["all_weights"], theirs["all_weights"]) < 1e-6
    total = plain[0]["moment_elements"]
    owned = [r["moment_elements"] for r in zero]
    assert sum(owned) == total and max(owned) < total  # each rank holds only its partition
    assert sorted(zero[0]["partition_info"] + zero[1]["partition_info"]) == sorted(plain[0]["all_weights"])
    assert not set(zero[0]["optimizer"]) & set(zero[1]["optimizer"]) - {"shared_optimizer_state"}


def test_zero_checkpoints_aggregate_into_one_process_and_reload_onto_two_ranks(tmp_path):
    straight = run_ranks(tmp_path, 2, optimizer="lamb", zero=1, accumulation=2, post=True)
    half = str(tmp_path / "zero_{rank}.ortcp")
    run_ranks(tmp_path, 2, optimizer="lamb", zero=1, accumulation=2, post=True, stop=4, save=half)
    files = [half.format(rank=r) for r in range(2)]
    resumed = run_ranks(tmp_path, 2, optimizer="lamb", zero=1, accumulation=2, post=True, start=4, load=files)
    for ours, theirs in zip(resumed, straight, strict=True):
        assert _max_difference(ours["all_weights"], theirs["all_weights"]) <= 1e-6
        assert _max_difference(ours["optimizer"], theirs["optimizer"]) <= 1e-6
        assert ours["counters"] == theirs["counters"]
    single = run_ranks(tmp_path, 1, optimizer="lamb", accumulation=2, start=4, load=files)[0]
    assert _max_difference(single["all_weights"], straight[0]["all_weights"]) < 1e-5
    assert single["counters"] == straight[0]["counters"]


def test_a_checkpoint_mid_accumulation_window_is_refused_with_data_parallelism(tmp_path):
    path = str(tmp_path / "mid_{rank}.ortcp")
    for result in run_ranks(tmp_path, 2, accumulation=2, post=True, stop=3, save=path):
        assert "middle of a gradient-accumulation window" in result["save_error"]
    assert not list(tmp_path.glob("mid_*.ortcp"))


@needs_training_build  # mixed precision on the 'ort' builder
def test_mixed_precision_with_zero_matches_plain_data_parallel(tmp_path):
    plain = run_ranks(tmp_path, 2, mixed_precision=True, accumulation=2, post=True)
    zero = run_ranks(tmp_path, 2, mixed_precision=True, accumulation=2, post=True, zero=1)
    assert _max_difference(zero[0]["all_weights"], plain[0]["all_weights"]) < 1e-6
    assert sorted(zero[0]["weights"]) == zero[0]["partition_info"]  # master weights sharded per rank


def test_adasum_matches_the_reference_rule(tmp_path):
    ranks = run_ranks(tmp_path, 2, optimizer="sgd", adasum=True, steps=1)
    from dist_worker import MLP, global_batches, shard

    torch.manual_seed(0)
    model = MLP()
    x, y = global_batches(STEPS, 2 * PER_RANK)[0]
    grads = []
    for rank in range(2):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(shard(x, rank, 2)), shard(y, rank, 2)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    expected = {}
    for name, param in model.named_parameters():
        g1, g2 = grads[0][name].double(), grads[1][name].double()
        dot = (g1 * g2).sum()
        combined = (1 - dot / (2 * (g1 * g1).sum())) * g1 + (1 - dot / (2 * (g2 * g2).sum())) * g2
        expected[name] = (param.detach().double() - 0.1 * combined).tolist()
    for result in ranks:
        assert _max_difference(result["all_weights"], expected) < 1e-6


def test_adasum_pair_properties():
    g = torch.randn(10)
    torch.testing.assert_close(adasum_pair(g, g), g)  # identical gradients: their average
    orthogonal = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    torch.testing.assert_close(adasum_pair(*orthogonal), torch.tensor([1.0, 2.0]))  # orthogonal: their sum
    torch.testing.assert_close(adasum_pair(torch.zeros(3), g[:3]), g[:3])


def test_partition_balances_elements():
    shapes = {"a": (100,), "b": (60,), "c": (50,), "d": (10,)}
    owners = partition_parameters(shapes, 2)
    loads = [sum(np.prod(shapes[n]) for n, r in owners.items() if r == rank) for rank in range(2)]
    assert sorted(loads) == [110, 110] and set(owners) == set(shapes)


def test_inconsistent_distributed_options_are_clear_errors():
    from models import MLP, mlp_desc

    def trainer(distributed: dict):
        return ORTTrainer(
            MLP(),
            mlp_desc(),
            optim.SGDConfig(),
            torch.nn.functional.cross_entropy,
            options=ORTTrainerOptions({"device": {"id": "cpu"}, "distributed": distributed}),
        )

    with pytest.raises(ValueError, match="world_rank=1 needs distributed.world_size > 1"):
        trainer({"world_rank": 1})
    with pytest.raises(RuntimeError, match="MASTER_PORT is not set"):
        os.environ.pop("MASTER_PORT", None)
        trainer({"world_rank": 0, "world_size": 2})
    with pytest.raises(NotImplementedError, match="options distributed.horizontal_parallel_size=2"):
        trainer({"horizontal_parallel_size": 2})
    with pytest.raises(NotImplementedError, match="options distributed.pipeline_parallel.pipeline_parallel_size=2"):
        trainer({"pipeline_parallel": {"pipeline_parallel_size": 2}})


def test_ranks_built_from_different_seeds_start_from_rank_0s_weights(tmp_path):
    """As DistributedDataParallel does: without it, ranks seeded differently trained different models (rc 0)."""
    same = run_ranks(tmp_path, 2, steps=3)
    seeded = run_ranks(tmp_path, 2, steps=3, seed_per_rank=True)
    for result in seeded:  # rank 0 was seeded with 0, as in `same`: both ranks follow it
        assert _max_difference(result["all_weights"], same[0]["all_weights"]) == 0.0


def test_ranks_with_different_parameter_shapes_get_a_clear_error_on_every_rank(tmp_path):
    """Before: Gloo aborted the processes (SIGABRT, "Received data size doesn't match expected size")."""
    for result in run_ranks(tmp_path, 2, steps=1, hidden_per_rank=True, expect_error=True):
        assert (
            "rank 1's model differs from rank 0's: 'fc1.weight' is [16, 32] float32 on rank 0 but [24, 32]"
            in (result["error"])
        )
