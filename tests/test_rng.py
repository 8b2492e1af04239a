"""Each trainer owns its dropout random stream (trainer/state.py `DropoutStreams`, runtime/session.py `seeded`): masks
do not depend on other trainers in the process, and a resumed run draws exactly the masks the uninterrupted run
draws — in a fresh process, also in the middle of an accumulation window."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
import torch
from helpers import in_threads, make_trainer, needs_training_build, onnx_model
from onnx import TensorProto, helper, numpy_helper

from orttrainer import optim
from orttrainer.trainer.graph.dropout_seeds import SEED_MODULUS, dropout_seed, seed_dropouts
from orttrainer.trainer.graph.passes import PassPreconditionError
from orttrainer.trainer.runtime.session import signature_key
from orttrainer.trainer.state import DropoutStreams

HERE = os.path.dirname(__file__)


class DropoutMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


DESC = {"inputs": [("x", ["batch", 16]), ("y", ["batch"])], "outputs": [("loss", [], True), ("out", ["batch", 4])]}
CE = torch.nn.functional.cross_entropy


def _batches(n: int):
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def _trainer(accumulation: int = 1, builder: str = "auto"):
    torch.manual_seed(0)
    options = {"batch": {"gradient_accumulation_steps": accumulation}, "_internal_use": {"gradient_builder": builder}}
    return make_trainer(DropoutMLP(), DESC, optim.AdamConfig(lr=1e-2), CE, options)


def _losses(trainer, batches) -> list[float]:
    return [float(trainer.train_step(x, y)[0]) for x, y in batches]


# ------------------------------------------------------------------------------------------- the graph pass
def _dropout_graph(count: int = 1):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [256])
    outputs = [helper.make_tensor_value_info(f"y{k}", TensorProto.FLOAT, [256]) for k in range(count)]
    ratio = numpy_helper.from_array(np.array(0.5, np.float32), "ratio")
    mode = numpy_helper.from_array(np.array(True), "mode")
    nodes = [helper.make_node("Dropout", ["x", "ratio", "mode"], [f"y{k}"], name=f"d{k}") for k in range(count)]
    return onnx_model(nodes, [x], outputs, [ratio, mode], opset=17)


def _run(model, times: int) -> list[list[np.ndarray]]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [session.run(None, {"x": np.ones(256, np.float32)}) for _ in range(times)]


def test_seed_dropouts_gives_each_node_its_own_stream_and_a_position():
    model = _dropout_graph(2)
    seeded = seed_dropouts(model, base=5, position=0)
    assert [n.attribute[0].i for n in seeded.graph.node] == [dropout_seed(5, 0, 0), dropout_seed(5, 1, 0)]
    assert not any(a.name == "seed" for n in model.graph.node for a in n.attribute)  # the argument is not modified
    straight = _run(seeded, 4)
    assert not np.array_equal(straight[0][0], straight[0][1])  # two nodes, two streams
    resumed = _run(seed_dropouts(model, base=5, position=2), 2)  # a session created after two computations
    for a, b in zip(straight[2:], resumed, strict=True):
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])


def test_the_engine_facts_the_seeds_rely_on():
    """docs/engine.md §9: a node's k-th computation uses seed + k - 1, whatever set_seed says; seeds 0 and 1 agree."""
    model = _dropout_graph()
    from onnxruntime.capi import _pybind_state

    _pybind_state.set_seed(123)
    first = _run(seed_dropouts(model, base=0, position=0), 3)
    _pybind_state.set_seed(999)
    later = _run(seed_dropouts(model, base=0, position=1), 1)
    np.testing.assert_array_equal(first[1][0], later[0][0])
    assert dropout_seed(0, 0, 0) == 1 and dropout_seed(SEED_MODULUS - 2, 0, 0) == SEED_MODULUS - 1
    with pytest.raises(ValueError, match="non-negative"):
        dropout_seed(-1, 0, 0)
    with pytest.raises(PassPreconditionError, match="graph pass 'seed_dropouts': .* must be non-negative"):
        seed_dropouts(model, base=0, position=-1)
    with pytest.raises(PassPreconditionError, match="129 Dropout nodes"):
        seed_dropouts(_dropout_graph(129), base=0, position=0)


def test_streams_state_round_trip_and_keys():
    streams = DropoutStreams(base=7)
    streams.advance("all")
    streams.advance("all")
    copy = DropoutStreams(base=1)
    assert copy.load(streams.state()) is True and copy.state() == {"seed": 7, "positions": {"all": 2}}
    assert copy.load({"seed": np.int64(7), "positions": {b"all": np.int64(2)}}) is False  # as HDF5 gives it back
    assert signature_key((((8, 16), "torch.float32"), ((8,), "torch.int64"))) == "8x16:float32|8:int64"


# -------------------------------------------------------------------------------------------- in the trainer
@pytest.mark.parametrize("builder", [pytest.param("ort", marks=needs_training_build), "torch"])
def test_two_trainers_with_dropout_do_not_change_each_other(builder):
    batches = _batches(4)
    alone = _losses(_trainer(builder=builder), batches)
    first, second = _trainer(builder=builder), _trainer(builder=builder)
    interleaved = [(float(first.train_step(x, y)[0]), float(second.train_step(x, y)[0])) for x, y in batches]
    assert [a for a, _ in interleaved] == alone == [b for _, b in interleaved]  # bit-exact


def test_two_threads_each_training_a_trainer_match_training_alone():
    batches = _batches(4)
    alone = _losses(_trainer(), batches)
    trainers = [_trainer(), _trainer()]  # built from the same seed: the same stream
    results = in_threads(lambda trainer: _losses(trainer, batches), trainers)
    assert results[0] == alone == results[1]


_RESUME = """
import sys, json, torch
sys.path.insert(0, {tests!r})
from test_rng import _trainer, _batches
trainer = _trainer(accumulation=3)
trainer.load_checkpoint({path!r})
losses = [float(trainer.train_step(x, y)[0]) for x, y in _batches(8)[4:]]
weights = {{k: v.tolist() for k, v in trainer._training_session.get_state().items()}}
print(json.dumps({{"losses": losses, "weights": weights}}))
"""


def test_resume_with_dropout_mid_window_in_a_fresh_process_is_bit_exact(tmp_path):
    batches = _batches(8)
    straight = _trainer(accumulation=3)
    losses = _losses(straight, batches)
    first = _trainer(accumulation=3)
    _losses(first, batches[:4])  # stops inside the second accumulation window
    path = str(tmp_path / "half.ortcp")
    first.save_checkpoint(path)
    script = _RESUME.format(tests=HERE, path=path)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    resumed = json.loads(out.stdout.strip().splitlines()[-1])
    assert resumed["losses"] == losses[4:]
    for name, value in straight._training_session.get_state().items():
        assert np.array_equal(np.asarray(resumed["weights"][name], dtype=value.dtype), value), name
