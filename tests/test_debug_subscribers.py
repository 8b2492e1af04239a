"""Subscribers on plain PyTorch models: names, layout and order (docs/debugging.md §1, §2, §4.1-4.3),
step counting and ranges, output_dir rules, re-subscribing, inspect_activation and the activation trace."""

from __future__ import annotations

import collections
import math
import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

from orttrainer.debug import (
    GlobalSubscriberManager,
    StatisticsSubscriber,
    SubscriberBase,
    SubscriberManager,
    inspect_activation,
    no_increase_global_step,
    order_for_step,
    parse_statistics,
    trace_activations,
)

INSPECT_LINE = {}  # line numbers of inspect_activation calls, filled in where they are made


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        y = inspect_activation("block_pre_act", y)
        return torch.relu(y)


class MLP(torch.nn.Module):  # the model of §4
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(3, 4)
        self.act = torch.nn.GELU()
        self.block = Block()
        self.fc2 = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.fc2(self.block(self.act(self.fc1(x))))


def run_sample(out, steps=3, **subscriber_kwargs):
    """The script of §4: seed 2, SGD lr 0.1, loss = output.sum()."""
    torch.manual_seed(2)
    model = MLP()
    subscriber = StatisticsSubscriber(out, override_output_dir=True, **subscriber_kwargs)
    GlobalSubscriberManager.subscribe(model, [subscriber])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 3)
    for _ in range(steps):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    return model


@pytest.fixture(autouse=True)
def _detach_global_manager():
    yield
    GlobalSubscriberManager.unsubscribe()


def tree(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files)


def order(out, step):
    return (out / f"step_{step}" / "order.txt").read_text(encoding="utf-8").splitlines()


SAMPLE_ORDER = """Linear_1_0th_output_forward GELU_2_0th_output_forward Linear_4_0th_output_forward
block_pre_act_forward Block_3_0th_output_forward Linear_5_0th_output_forward MLP_0_0th_output_forward
MLP_0_0th_output_backward Linear_5_0th_output_backward Block_3_0th_output_backward block_pre_act_backward
Linear_4_0th_output_backward GELU_2_0th_output_backward Linear_1_0th_output_backward""".split()  # §4.2


def test_sample_tree_order_and_file(tmp_path):
    out = tmp_path / "pt_out"
    run_sample(out)
    assert GlobalSubscriberManager.get_run_context().global_states.execution_step == 3
    expected = [f"step_{s}/{name}" for s in range(3) for name in sorted(SAMPLE_ORDER + ["order.txt"])]
    assert tree(out) == expected  # §4.1: 3 step folders of 15 files
    for step in range(3):
        assert order(out, step) == SAMPLE_ORDER  # §4.2
    # §4.3 (values to float32 rounding: the GELU kernel's last bit depends on the CPU's vector ISA).
    text = (out / "step_1" / "Linear_4_0th_output_forward").read_text(encoding="utf-8")
    lines = text.split("\n")
    assert lines[0] == (
        ">>>Linear_4_0th_output forward run shape: torch.Size([2, 4]) dtype: torch.float32 size: torch.Size([8]) "
    )
    assert lines[2:] == [
        "nan: 0, inf: 0",
        "samples(top 128): tensor([ 0.084963,  0.545676, -0.051005, -0.651725, "
        "-0.066703,  0.425806,  0.114026, -0.217961])",
        "neg: 4, pos: 4, zero: 0,",
        "=" * 16,
        "",
    ]
    parsed = parse_statistics(text)
    assert parsed["min"] == pytest.approx(-0.6517250537872314, abs=2e-7)
    assert parsed["max"] == pytest.approx(0.5456756353378296, abs=2e-7)
    assert parsed["mean"] == pytest.approx(0.022884562611579895, abs=2e-7)
    assert parsed["std"] == pytest.approx(0.3730965554714203, abs=2e-7)  # true std; legacy printed 0.4105221
    depths = {name: parse_statistics((out / "step_0" / name).read_text())["depth"] for name in SAMPLE_ORDER}
    assert depths["MLP_0_0th_output_forward"] == 1 and depths["Block_3_0th_output_backward"] == 2
    assert depths["Linear_4_0th_output_forward"] == 3 and depths["block_pre_act_forward"] == -1  # no '>' prefix


def test_module_indices_are_a_preorder_dfs_with_shared_modules_once():
    class Multi(torch.nn.Module):
        def forward(self, x):
            return x, x * 2

    class Shared(torch.nn.Module):  # the example of §1.3
        def __init__(self):
            super().__init__()
            self.lin, self.multi = torch.nn.Linear(2, 2), Multi()
            self.again = self.lin
            self.seq = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Tanh()))

        def forward(self, x):
            return self.seq(self.again(self.lin(x)))

    model = Shared()
    manager = SubscriberManager()
    manager.subscribe(model, [SubscriberBase(None, None)])
    states = manager.get_run_context().global_states
    names = {index: type(m).__name__ for m, index in states.module_to_module_index.items()}
    assert names == {0: "Shared", 1: "Linear", 2: "Multi", 3: "Sequential", 4: "ReLU", 5: "Sequential", 6: "Tanh"}
    assert states.module_index_to_depth == {0: 1, 1: 2, 2: 2, 3: 2, 4: 3, 5: 3, 6: 4}
    assert states.module_index_to_path == {0: "", 1: "lin", 2: "multi", 3: "seq", 4: "seq.0", 5: "seq.1", 6: "seq.1.0"}
    assert len(model.lin._forward_hooks) == 1  # reachable twice, hooked once
    manager.unsubscribe()


def test_hooks_do_not_change_training(tmp_path):
    class Net(torch.nn.Module):  # in-place activation right after a hooked output
        def __init__(self):
            super().__init__()
            self.seq = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(inplace=True), torch.nn.Linear(5, 1))

        def forward(self, x):
            return self.seq(x)

    def train(subscribe):
        torch.manual_seed(0)
        model = Net()
        if subscribe:
            GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(tmp_path / "o", override_output_dir=True)])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            (model(torch.ones(4, 3)) ** 2).mean().backward()
            opt.step()
        return model.state_dict()

    plain, hooked = train(False), train(True)
    assert all(torch.equal(plain[k], hooked[k]) for k in plain)
    assert (tmp_path / "o" / "step_2" / "ReLU_3_0th_output_backward").is_file()


def test_a_step_is_one_completed_root_forward(tmp_path):
    model = run_sample(tmp_path / "o", steps=1)
    model.eval()
    model(torch.randn(2, 3))  # eval, grad enabled, no backward
    with torch.no_grad():
        model(torch.randn(2, 3))
    assert GlobalSubscriberManager.get_run_context().global_states.execution_step == 3
    assert any(n.endswith("_backward") for n in order(tmp_path / "o", 0))
    for step in (1, 2):
        assert order(tmp_path / "o", step) == [n for n in SAMPLE_ORDER if n.endswith("_forward")]
    model.train()
    a, b = model(torch.randn(2, 3)), model(torch.randn(2, 3))  # steps 3 and 4, then one backward over both
    (a.sum() + b.sum()).backward()
    assert sorted(order(tmp_path / "o", 3)) == sorted(order(tmp_path / "o", 4)) == sorted(SAMPLE_ORDER)


def test_step_range_applies_to_modules_and_inspect_activation(tmp_path):
    run_sample(tmp_path / "o", start_step=1, end_step=2)
    assert sorted(os.listdir(tmp_path / "o")) == ["step_1"]
    assert order(tmp_path / "o", 1) == SAMPLE_ORDER  # block_pre_act included, and only in step 1
    sub = StatisticsSubscriber(tmp_path / "p")
    assert (sub.start_step, sub.end_step) == (0, sys.maxsize) and sub.in_range(0) and sub.in_range(10**9)
    sub = StatisticsSubscriber(tmp_path / "p", start_step=2, end_step=4)
    assert [sub.in_range(s) for s in range(5)] == [False, False, True, True, False]
    for bad in ({"start_step": -1}, {"end_step": 1.5}, {"start_step": 3, "end_step": 2}):
        with pytest.raises(ValueError):
            StatisticsSubscriber(tmp_path / "p", **bad)


def test_output_dir_rules(tmp_path):
    out = tmp_path / "o"
    StatisticsSubscriber(out)  # missing: fine, and nothing is created before the first dump
    assert not out.exists()
    out.mkdir()
    StatisticsSubscriber(out)  # existing but empty: fine
    (out / "keep.txt").write_text("old")
    with pytest.raises(FileExistsError, match=f"Output directory {out} already exists and is not empty"):
        StatisticsSubscriber(out)
    assert (out / "keep.txt").read_text() == "old"  # nothing deleted
    with pytest.warns(UserWarning, match="overriding it"):
        sub = StatisticsSubscriber(out, override_output_dir=True)
    assert not out.exists() and sub.output_dir == out
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        StatisticsSubscriber(tmp_path / "file", override_output_dir=True)
    with pytest.raises(TypeError):
        StatisticsSubscriber(out, True)  # keyword-only: the legacy positional order differs


def test_subscribe_twice_replaces_the_hooks(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    first = StatisticsSubscriber(tmp_path / "first")
    GlobalSubscriberManager.subscribe(model, [first])
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(tmp_path / "second")])
    assert len(model.fc1._forward_hooks) == 1 and len(model._forward_hooks) == 3  # own + step end + exit
    for _ in range(2):
        model(torch.randn(2, 3)).sum().backward()
    assert GlobalSubscriberManager.get_run_context().global_states.execution_step == 2
    assert not (tmp_path / "first").exists()
    assert order(tmp_path / "second", 0) == order(tmp_path / "second", 1) == SAMPLE_ORDER  # no duplicates
    old = model.fc1  # (not `model`: its inspect_activation call would go to whatever the manager holds now)
    other = torch.nn.Sequential(torch.nn.Linear(3, 3))
    GlobalSubscriberManager.subscribe(other, [StatisticsSubscriber(tmp_path / "third")])
    assert len(old._forward_hooks) == 0 and len(model._forward_hooks) == 0
    old(torch.randn(2, 3))  # detached: no dump, no step
    other(torch.randn(1, 3))
    assert GlobalSubscriberManager.get_run_context().global_states.execution_step == 1
    assert order(tmp_path / "third", 0) == ["Linear_1_0th_output_forward", "Sequential_0_0th_output_forward"]
    GlobalSubscriberManager.unsubscribe()
    assert len(other._forward_hooks) == 0 and len(other[0]._forward_hooks) == 0


def test_subscribe_validates_before_resetting(tmp_path):
    model = MLP()
    sub = StatisticsSubscriber(tmp_path / "o")
    GlobalSubscriberManager.subscribe(model, [sub])
    with pytest.raises(ValueError, match="module must be a torch.nn.Module instance"):
        GlobalSubscriberManager.subscribe(object(), [sub])
    with pytest.raises(RuntimeError, match="No subscribers are registered."):
        GlobalSubscriberManager.subscribe(model, [])
    with pytest.raises(ValueError, match="subscriber must be a SubscriberBase instance"):
        GlobalSubscriberManager.subscribe(model, [object()])
    assert GlobalSubscriberManager.subscribers == (sub,) and GlobalSubscriberManager.module is model
    assert GlobalSubscriberManager.get_subscriber(StatisticsSubscriber) is sub


class Recorder(SubscriberBase):
    def __init__(self, tag, log):
        super().__init__(None, None)
        self.tag, self.log = tag, log

    def pre_forward_tensor_apply_impl(self, run_ctx, module, tensor_index, tensor):
        self.log.append((self.tag, "in", type(module).__name__, tensor_index))
        return tensor

    def post_forward_tensor_apply_impl(self, run_ctx, module, tensor_index, tensor):
        self.log.append((self.tag, "out", type(module).__name__, tensor_index))
        return tensor


def test_subscribers_run_in_the_given_order_and_see_nested_outputs():
    Point = collections.namedtuple("Point", "a b")

    class Odd(torch.nn.Module):
        def forward(self, x, scale=None):
            return {"p": Point(x, "text"), "q": [x * 2, object()], "n": None}

    log = []
    tags = [f"s{i}" for i in range(6)]
    manager = SubscriberManager()
    model = Odd()
    manager.subscribe(model, [Recorder(tag, log) for tag in tags])
    result = model(torch.ones(1), scale=torch.ones(1))
    assert isinstance(result["p"], Point) and result["p"].b == "text" and result["n"] is None
    assert [e[0] for e in log[:6]] == tags  # registration order, not hash order
    assert [(e[1], e[3]) for e in log[::6]] == [("in", 0), ("in", 0), ("out", 0), ("out", 1)]  # args, kwargs
    manager.unsubscribe()


def test_bool_empty_and_shared_module_outputs(tmp_path):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.act = torch.nn.Tanh()

        def forward(self, x):
            return self.act(self.act(x)) > 0, x[:0]

    GlobalSubscriberManager.subscribe(Net(), [StatisticsSubscriber(tmp_path / "o")])
    GlobalSubscriberManager.module(torch.randn(3))
    assert order(tmp_path / "o", 0) == [
        "Tanh_1_0th_output_forward",
        "Tanh_1_0th_output_call2_forward",
        "Net_0_0th_output_forward",
        "Net_0_1th_output_forward",
    ]
    mask = parse_statistics((tmp_path / "o" / "step_0" / "Net_0_0th_output_forward").read_text())
    empty = parse_statistics((tmp_path / "o" / "step_0" / "Net_0_1th_output_forward").read_text())
    assert mask["dtype"] == "torch.bool" and empty["size"] == 0 and math.isnan(empty["min"])


def test_inspect_activation_forward_backward_and_pass_through(tmp_path):
    class Scale(torch.nn.Module):
        def forward(self, x):
            return inspect_activation("doubled", x * 2) * 3

    with pytest.raises(RuntimeError, match="StatisticsSubscriber is not registered, cannot inspect activation."):
        inspect_activation("x", torch.ones(1))
    model = Scale()
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(tmp_path / "o")])
    t = torch.ones(2, requires_grad=True)
    model(t).sum().backward()
    assert torch.equal(t.grad, torch.full((2,), 6.0))  # the gradient passes through unchanged
    assert order(tmp_path / "o", 0) == [
        "doubled_forward",
        "Scale_0_0th_output_forward",
        "Scale_0_0th_output_backward",
        "doubled_backward",
    ]
    backward = parse_statistics((tmp_path / "o" / "step_0" / "doubled_backward").read_text())
    assert (backward["min"], backward["max"], backward["depth"]) == (3.0, 3.0, -1)
    plain = torch.ones(2)
    assert inspect_activation("outside", plain) is plain  # no grad to observe: the object itself
    assert (tmp_path / "o" / "step_1" / "outside_forward").is_file()  # current step, outside any forward
    with pytest.raises(TypeError, match="expects a torch.Tensor"):
        inspect_activation("n", 5)


def test_duplicate_inspect_name_names_both_call_sites(tmp_path):
    class Twice(torch.nn.Module):
        def forward(self, x):
            x = inspect_activation("same", x)
            INSPECT_LINE["first"] = sys._getframe().f_lineno - 1
            x = inspect_activation("same", x + 1)
            return x

    GlobalSubscriberManager.subscribe(Twice(), [StatisticsSubscriber(tmp_path / "o", start_step=5)])
    with pytest.raises(ValueError) as error:
        GlobalSubscriberManager.module(torch.ones(1))  # raised although step 0 is outside the dump range
    first, second = INSPECT_LINE["first"], INSPECT_LINE["first"] + 2
    message = str(error.value)
    assert f"first at {__file__}:{first}, again at {__file__}:{second}" in message
    assert "'same' is used twice in step 0" in message
    assert GlobalSubscriberManager.get_run_context().global_states.execution_step == 0  # failed forward: no step
    assert not (tmp_path / "o").exists()


def test_activation_checkpointing_recompute_is_not_dumped_again(tmp_path):
    class Checkpointed(MLP):
        def forward(self, x):
            h = torch.utils.checkpoint.checkpoint(self.block, self.act(self.fc1(x)), use_reentrant=False)
            return self.fc2(h)

    model = Checkpointed()
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(tmp_path / "o")])
    for _ in range(2):  # the recompute inside backward would repeat block_pre_act: no duplicate-name error
        model(torch.randn(2, 3)).sum().backward()
    expected = [name.replace("MLP_0", "Checkpointed_0") for name in SAMPLE_ORDER]
    assert order(tmp_path / "o", 0) == order(tmp_path / "o", 1) == expected


def test_no_increase_global_step_suspends_everything(tmp_path):
    model = MLP()
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(tmp_path / "o")])
    with no_increase_global_step():
        model(torch.randn(2, 3)).sum().backward()
    assert GlobalSubscriberManager.get_run_context().global_states.execution_step == 0
    assert not (tmp_path / "o").exists()


def test_two_statistics_subscribers_write_both(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    GlobalSubscriberManager.subscribe(
        model, [StatisticsSubscriber(tmp_path / "a"), StatisticsSubscriber(tmp_path / "b", start_step=1)]
    )
    for _ in range(2):
        model(torch.randn(2, 3)).sum().backward()
    assert order(tmp_path / "a", 0) == order(tmp_path / "a", 1) == order(tmp_path / "b", 1) == SAMPLE_ORDER
    assert sorted(os.listdir(tmp_path / "b")) == ["step_1"]
    assert tree(tmp_path / "a" / "step_1") == tree(tmp_path / "b" / "step_1")


def test_trace_activations_matches_a_real_run_without_side_effects(tmp_path):
    class WithNorm(MLP):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.BatchNorm1d(2)

        def forward(self, x):
            return self.norm(super().forward(x))

    torch.manual_seed(0)
    model = WithNorm()
    sub = StatisticsSubscriber(tmp_path / "o", start_step=0, end_step=1)
    GlobalSubscriberManager.subscribe(model, [sub])
    x = torch.randn(4, 3)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    records = trace_activations(model, (x,))
    assert GlobalSubscriberManager.get_run_context().global_states.execution_step == 0 and not (tmp_path / "o").exists()
    assert all(torch.equal(buffers[k], v) for k, v in model.named_buffers())
    assert all(p.grad is None for p in model.parameters())
    model(x).sum().backward()
    assert order_for_step(records, sub, 0) == order(tmp_path / "o", 0)
    assert order_for_step(records, sub, 1) == []
    lin = next(r for r in records if r.name == "Linear_4_0th_output")
    assert (lin.module_path, lin.module_class, lin.depth, lin.tensor_index, lin.shape) == (
        "block.lin",
        "Linear",
        3,
        0,
        (4, 4),
    )
    inspected = next(r for r in records if r.name == "block_pre_act")
    assert inspected.module_index is None and inspected.depth == -1
    forward_only = trace_activations(model, (x,), backward=False)
    assert [r.file_name for r in forward_only] == [n for n in order(tmp_path / "o", 0) if n.endswith("_forward")]


def _rank_worker(rank, init_file, out):
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model = torch.nn.Linear(2, 2)
        GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(out, override_output_dir=True)])
        model(torch.ones(1, 2))
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.distributed
def test_per_rank_output_directories(tmp_path):
    mp.spawn(_rank_worker, args=(str(tmp_path / "init"), str(tmp_path / "o")), nprocs=2)
    assert tree(tmp_path / "o") == [
        f"rank_{r}/step_0/{f}" for r in range(2) for f in ("Linear_0_0th_output_forward", "order.txt")
    ]
