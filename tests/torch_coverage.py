"""PyTorch's own test databases through the torch gradient builder: `module_db` (every torch.nn module, one training
step through ORTTrainer) and `op_db` (every differentiable op, its gradient through the builder and ONNX Runtime),
each compared with eager PyTorch. Shared by tests/test_torch_builder_module_db.py and
tests/test_torch_builder_op_db.py; run as a script it writes the coverage table docs/torch_builder_coverage.md:

    PYTHONPATH=. python tests/torch_coverage.py --run module_db --json module_db.json [--samples N]
    PYTHONPATH=. python tests/torch_coverage.py --run op_db --json op_db.json [--samples N]
    PYTHONPATH=. python tests/torch_coverage.py --table module_db.json op_db.json --known module_db.json op_db.json

The databases come from `torch.testing._internal` (needs the `expecttest` package, in the `test` extra).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.common_modules import module_db
from torch.utils import _pytree as pytree

from orttrainer import ORTTrainer, ORTTrainerOptions, optim

TORCH_BUILDER = {"device": {"id": "cpu"}, "_internal_use": {"gradient_builder": "torch"}}


def sampled(names: list[str], every: int, always: tuple[str, ...] = ()) -> list:
    """`names` as pytest parameters: one in `every` (chosen by a hash of the name, so the sample does not move when
    PyTorch adds entries) and every name in `always` run in the default test lanes; the others carry the `sweep`
    marker, which only `make coverage` runs (pyproject.toml)."""
    import zlib

    import pytest

    def marks(name: str) -> tuple:
        return () if name in always or zlib.crc32(name.encode()) % every == 0 else (pytest.mark.sweep,)

    return [pytest.param(name, marks=marks(name)) for name in names]


RTOL, ATOL = 1e-3, 1e-4


@dataclass
class Outcome:
    """One sample's result: "pass", or "error"/"mismatch" with `detail`; `mutated`: buffers the eager forward
    changes (compared with the trainer's after the step, as every other buffer is)."""

    status: str
    detail: str = ""
    mutated: list[str] = field(default_factory=list)


def _loss_of(out) -> torch.Tensor:
    """A scalar that depends on every floating output element with a distinct weight (complex outputs through
    their real and imaginary parts)."""
    loss = torch.zeros(())
    for j, o in enumerate(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)):
        if o.is_complex():
            o = torch.view_as_real(o.resolve_conj())
        if not o.is_floating_point():
            continue
        weight = torch.cos(torch.arange(o.numel(), dtype=o.dtype) * (0.7 + j)).reshape(o.shape)
        loss = loss + (o * weight).sum().to(loss.dtype)
    return loss


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    if got.shape != want.shape:
        return False
    scale = max(1.0, float(want[torch.isfinite(want)].abs().max()) if torch.isfinite(want).any() else 1.0)
    return bool(torch.allclose(got, want, rtol=RTOL, atol=ATOL * scale, equal_nan=True))


def error_key(outcome: Outcome) -> str:
    """The stable part of a failure, which the tests pin: "mismatch" for values that differ from eager's, else the
    op a translation failed on, the exception a trace failed with, or the error text's start."""
    if outcome.status == "mismatch":
        return "mismatch"
    detail = outcome.detail
    if "reads the value of a tensor in Python" in detail:
        return "reads a tensor's value in Python"
    for pattern in (
        r"([\w.]+ runs eagerly, which needs [\w ]+)",
        r"target=torch\.ops\.([\w.]+)\]",
        r"No ONNX function found for <OpOverload\(op='([\w.:]+)'",
        r"into a graph: (\w+)",
        r"^(\w+): \[ONNXRuntimeError\] : \d+ : (\w+)",
    ):
        found = re.search(pattern, detail)
        if found:
            return ":".join(found.groups())
    return detail[:60]


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:400] if text else ''}"


# module_db ----------------------------------------------------------------------------------------------------------
class ModuleHarness(nn.Module):
    """A module_db sample as a trainer model: the sample's tensors are data inputs `in0, in1, ...` (the other
    arguments are fixed), the loss weights every floating output. A module without trainable parameters gets one
    zero-valued parameter per floating input that requires grad, added to it, so that its input gradient is a
    parameter gradient."""

    MAX_INPUTS = 8

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.module = module
        leaves, self.spec = pytree.tree_flatten((args, kwargs))
        shift = not any(p.requires_grad for p in module.parameters())
        self.slots: list[tuple[str, object, str | None]] = []
        self.data: list[torch.Tensor] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                name = None
                if shift and leaf.requires_grad and leaf.is_floating_point():
                    name = f"shift{len(self.data)}"
                    self.register_parameter(name, nn.Parameter(torch.zeros_like(leaf)))
                self.slots.append(("data", len(self.data), name))
                self.data.append(leaf.detach().clone())
            else:
                self.slots.append(("const", leaf, None))
        if len(self.data) > self.MAX_INPUTS:
            raise ValueError(f"the harness takes at most {self.MAX_INPUTS} tensors, the sample has {len(self.data)}")

    def forward(self, in0=None, in1=None, in2=None, in3=None, in4=None, in5=None, in6=None, in7=None):
        given = [in0, in1, in2, in3, in4, in5, in6, in7]
        leaves = []
        for kind, value, name in self.slots:
            if kind == "const":
                leaves.append(value)
                continue
            x = given[value]  # type: ignore[index]
            leaves.append(x + getattr(self, name) if name else x)
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return _loss_of(self.module(*args, **kwargs))


def module_infos() -> list:
    """Every ModuleInfo with float32 training samples."""
    return [info for info in module_db if torch.float32 in info.dtypes]


def module_samples(info) -> list:
    """The float32 training samples a trainer can take: empty inputs are refused by design (README: a step needs
    at least one sample)."""
    torch.manual_seed(0)  # the samples' values come from the global generator: the same whatever ran before
    samples = info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=True, training=True)
    return [s for s in samples if all(t.numel() > 0 for t in _tensors(s.forward_input))]


def _tensors(function_input) -> list[torch.Tensor]:
    leaves = pytree.tree_leaves((function_input.args, function_input.kwargs))
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def run_module_sample(info, sample) -> Outcome:
    """One SGD step (lr 1) of ORTTrainer with the torch builder on the sample, against eager PyTorch: the loss, each
    parameter's gradient (its change) and every buffer (those the forward updates, such as BatchNorm's running
    statistics, at their updated values)."""
    torch.manual_seed(0)
    module = info.module_cls(*sample.constructor_input.args, **sample.constructor_input.kwargs).to(torch.float32)
    module.train(True)
    args, kwargs = sample.forward_input.args, sample.forward_input.kwargs
    if info.is_lazy:  # materialise the parameters eagerly, as a user's first forward would
        with torch.no_grad():
            module(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    harness = ModuleHarness(module, args, kwargs)
    if not any(p.requires_grad for p in harness.parameters()):
        return Outcome("error", "nothing to train: no parameter and no input that requires grad")
    reference = copy.deepcopy(harness)
    before = {n: p.detach().clone() for n, p in harness.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in harness.named_buffers()}
    want_loss = reference(*reference.data)
    want_loss.backward()
    mutated = [n for n, b in reference.named_buffers() if not torch.equal(b, buffers[n])]
    desc = {"inputs": [(f"in{k}", list(t.shape)) for k, t in enumerate(harness.data)], "outputs": [("loss", [], True)]}
    try:
        trainer = ORTTrainer(harness, desc, optim.SGDConfig(lr=1.0), options=ORTTrainerOptions(TORCH_BUILDER))
        loss = trainer.train_step(*harness.data)
        state = trainer.state_dict(pytorch_format=True)
    except Exception as err:
        return Outcome("error", _short(err), mutated)
    problems = [] if _close(loss, want_loss.detach()) else [f"loss {float(loss):.6g}, eager {float(want_loss):.6g}"]
    for name, param in reference.named_parameters():
        want = param.grad if param.grad is not None else torch.zeros_like(param)
        got = before[name] - state[name]
        if not _close(got, want):
            problems.append(f"gradient of {name}: max difference {float((got - want).abs().max()):.3g}")
    for name, buffer in reference.named_buffers():
        if name in state and not _close(state[name].to(buffer.dtype), buffer):
            problems.append(f"buffer {name}: {'not updated' if name in mutated else 'changed'}")
    return Outcome("mismatch", "; ".join(problems), mutated) if problems else Outcome("pass", "", mutated)


def run_module_eval_sample(info, sample) -> tuple[Outcome, bool]:
    """`run_module_sample`'s trainer after its step, then one `eval_step` on the sample, against the module's eval-mode
    forward on the trainer's state (`state_dict(pytorch_format=True)`); and whether the eval graph was traced
    (build/torch_route.TorchEvalGraphs) rather than exported."""
    torch.manual_seed(0)
    module = info.module_cls(*sample.constructor_input.args, **sample.constructor_input.kwargs).to(torch.float32)
    module.train(True)
    args, kwargs = sample.forward_input.args, sample.forward_input.kwargs
    if info.is_lazy:
        with torch.no_grad():
            module(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    harness = ModuleHarness(module, args, kwargs)
    desc = {"inputs": [(f"in{k}", list(t.shape)) for k, t in enumerate(harness.data)], "outputs": [("loss", [], True)]}
    try:
        trainer = ORTTrainer(harness, desc, optim.SGDConfig(lr=1.0), options=ORTTrainerOptions(TORCH_BUILDER))
        trainer.train_step(*harness.data)
        got = trainer.eval_step(*harness.data)
        state = trainer.state_dict(pytorch_format=True)
    except Exception as err:
        return Outcome("error", _short(err)), False
    evals = trainer._training_session._evals._graph_for  # the trainer's TorchEvalGraphs
    traced = evals is not None and evals._first is None  # no eval-mode forward was exported
    reference = copy.deepcopy(harness)
    reference.load_state_dict(state, strict=False)
    reference.eval()
    with torch.no_grad():
        want = reference(*reference.data)
    if not _close(got, want):
        return Outcome("mismatch", f"eval loss {float(got):.6g}, eager {float(want):.6g}"), traced
    return Outcome("pass"), traced


# op_db ----------------------------------------------------------------------------------------------------------------
class OpHarness(nn.Module):
    """An OpInfo sample as a module: the sample's tensors that require grad and receive a gradient are parameters,
    its other tensors buffers; `forward(scale)` returns `scale * loss(op(sample))`."""

    def __init__(self, op, sample, differentiable: set[int]) -> None:
        super().__init__()
        self.op, self.process = op.op, sample.output_process_fn_grad
        leaves, self.spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
        self.slots: list[tuple[bool, object]] = []
        for j, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                if j in differentiable:
                    self.register_parameter(f"p{j}", nn.Parameter(leaf.detach().clone()))
                else:
                    self.register_buffer(f"c{j}", leaf.detach().clone())
                self.slots.append((True, f"p{j}" if j in differentiable else f"c{j}"))
            else:
                self.slots.append((False, leaf))

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        leaves = [getattr(self, str(v)) if is_tensor else v for is_tensor, v in self.slots]
        first, args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return _loss_of(self.process(self.op(first, *args, **kwargs))) * scale


def op_infos() -> list:
    """Every OpInfo that supports autograd in float32 (on the CPU)."""
    return [op for op in op_db if op.supports_autograd and torch.float32 in op.supported_backward_dtypes("cpu")]


def op_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def op_samples(op) -> list:
    torch.manual_seed(0)  # the samples' values come from the global generator: the same whatever ran before
    return list(op.sample_inputs("cpu", torch.float32, requires_grad=True))


def run_op_sample(op, sample, through_trainer: bool = False) -> Outcome:
    """The op's gradient for every input that requires grad, through the torch builder and ONNX Runtime (or,
    `through_trainer`, one SGD step of ORTTrainer), against `torch.autograd`."""
    leaves = pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
    if any(isinstance(t, torch.Tensor) and t.layout != torch.strided for t in leaves):
        return Outcome("error", "sparse tensors: the torch builder traces and exports dense (strided) tensors only")
    requiring = [j for j, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    scale = torch.tensor(1.0)
    try:
        probe = OpHarness(op, sample, set(requiring))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want_loss = probe(scale)
            params = list(probe.named_parameters())
            grads = torch.autograd.grad(want_loss, [p for _, p in params], allow_unused=True) if params else ()
    except Exception as err:  # the harness itself (eager PyTorch) cannot run the sample
        return Outcome("error", f"eager reference: {_short(err)}")
    reached = {int(n[1:]) for (n, _), g in zip(params, grads, strict=True) if g is not None}
    if not reached:
        return Outcome("error", "no input receives a gradient from autograd (nothing to compare)")
    want = {n: g for (n, _), g in zip(params, grads, strict=True) if g is not None}
    harness = OpHarness(op, sample, reached)
    try:
        got_loss, got = (_op_by_trainer if through_trainer else _op_by_builder)(harness, scale)
    except Exception as err:
        return Outcome("error", _short(err))
    problems = (
        [] if _close(got_loss, want_loss.detach()) else [f"loss {float(got_loss):.6g}, eager {float(want_loss):.6g}"]
    )
    if problems and (_RANDOM_NODES & set(_last_graph_ops) or _random_eager_op(_last_graph_ops)):
        return Outcome("error", "random: the graph draws random numbers (ONNX Runtime's generator, not torch's)")
    for name, grad in want.items():
        if not _close(got[name], grad):
            difference = (torch.as_tensor(got[name]) - grad).abs().max() if got[name].shape == grad.shape else "shape"
            problems.append(f"gradient of {name}: {difference}")
    return Outcome("mismatch", "; ".join(problems)) if problems else Outcome("pass")


_RANDOM_NODES = {
    "RandomNormal",
    "RandomNormalLike",
    "RandomUniform",
    "RandomUniformLike",
    "Bernoulli",
    "Multinomial",
    "Dropout",
}
_last_graph_ops: list[str] = []  # the op types of the graph `_op_by_builder` built last, and the ops it runs eagerly


def _random_eager_op(names: list[str]) -> bool:
    """Whether one of `names` is an aten op the graph runs eagerly (`aten.x.y`) that draws random numbers
    (torch's generator, but not in the order eager PyTorch drew them)."""
    for name in names:
        parts = name.split(".")
        if len(parts) == 3 and hasattr(torch.ops, parts[0]):
            op = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
            if torch.Tag.nondeterministic_seeded in op.tags:
                return True
    return False


def _op_by_builder(harness: OpHarness, scale: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    import onnxruntime as ort

    from orttrainer.trainer.gradient.torch_builder import build_torch_gradient_graph
    from orttrainer.trainer.runtime.eager_ops import eager_op_names, prepare_options

    trainable = [n for n, _ in harness.named_parameters()]
    graph = build_torch_gradient_graph(harness, None, ["scale"], [scale], ["loss"], trainable)
    _last_graph_ops[:] = [node.op_type for node in graph.model.graph.node] + eager_op_names(graph.model)
    state = {**dict(harness.named_parameters()), **dict(harness.named_buffers())}
    feeds = {"scale": scale.numpy()} | {n: state[n].detach().numpy().copy() for n in graph.state_names}
    options = ort.SessionOptions()
    prepare_options(graph.model, options)  # ops the builder runs eagerly in PyTorch
    session = ort.InferenceSession(graph.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in graph.model.graph.output]
    ort.set_seed(0)  # random ops draw from ONNX Runtime's global generator: the same draws whatever ran before
    out = dict(zip(names, session.run(None, feeds), strict=True))
    return torch.from_numpy(out["loss"]), {n: torch.from_numpy(out[f"{n}_grad"]) for n in trainable}


def _op_by_trainer(harness: OpHarness, scale: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    before = {n: p.detach().clone() for n, p in harness.named_parameters()}
    desc = {"inputs": [("scale", [])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(harness, desc, optim.SGDConfig(lr=1.0), options=ORTTrainerOptions(TORCH_BUILDER))
    loss = trainer.train_step(scale)
    state = trainer.state_dict(pytorch_format=True)
    return loss, {n: before[n] - state[n] for n in before}


# selection and the table -------------------------------------------------------------------------------------------
def spread(count: int, limit: int) -> list[int]:
    """Up to `limit` indices of `count` samples, evenly spread, the first always included."""
    if count <= limit:
        return list(range(count))
    return sorted({round(i * (count - 1) / (limit - 1)) for i in range(limit)}) if limit > 1 else [0]


def first_failure(run: Callable[[object], Outcome], samples: list, chosen: list[int]) -> tuple[Outcome, int]:
    """Run the chosen samples until one does not pass: (its outcome, its index), or the last pass. `mutated` is
    gathered over all the samples run."""
    mutated: set[str] = set()
    outcome = Outcome("error", "no sample")
    for i in chosen:
        outcome = run(samples[i])
        mutated.update(outcome.mutated)
        if outcome.status != "pass":
            return Outcome(outcome.status, outcome.detail, sorted(mutated)), i
    return Outcome(outcome.status, outcome.detail, sorted(mutated)), chosen[-1] if chosen else -1


def _table(rows: list[tuple[str, Outcome, str]], note: Callable[[str, Outcome], str]) -> list[str]:
    lines = ["| entry | result | samples | notes |", "|---|---|---|---|"]
    for name, outcome, samples in rows:
        text = "pass" if outcome.status == "pass" else f"{outcome.status} (`{error_key(outcome)}`): {outcome.detail}"
        lines.append(f"| `{name}` | {text.replace('|', '/')} | {samples} | {note(name, outcome)} |")
    return lines


METHOD = (
    "Each entry runs up to that many of its float32 samples, evenly spread, and shows the first that does not "
    "pass. `module_db`: one SGD step of ORTTrainer (torch builder) against eager PyTorch: loss, every "
    "parameter's gradient, and every buffer (those the forward updates at their updated values). `op_db`: the "
    "gradient of every input that requires grad, through the builder and ONNX Runtime, against `torch.autograd`. "
    "Tolerance: relative 1e-3, absolute 1e-4 times the largest value."
)


def run_database(database: str, samples: int, json_path: str, only: set[str] | None = None) -> None:
    """Run one database ("module_db" or "op_db"), up to `samples` samples per entry, and write its outcomes as
    JSON: entry -> [status, detail, mutated buffers, whether the first failing sample is the first sample,
    "k of n" samples run]. With `only`, just those entries, updating the outcomes already in `json_path`."""
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    started, records = time.time(), {}
    if only and os.path.exists(json_path):
        with open(json_path, encoding="utf-8") as f:
            records = json.load(f)[database]
    entries = (
        [(info.name, module_samples, lambda s, info=info: run_module_sample(info, s), info) for info in module_infos()]
        if database == "module_db"
        else [(op_name(op), op_samples, lambda s, op=op: run_op_sample(op, s), op) for op in op_infos()]
    )
    for name, samples_of, run, entry in entries:
        if only and name not in only:
            continue
        try:
            found = samples_of(entry)
        except Exception as err:  # a database entry that cannot make samples on this build
            records[name] = ["error", f"sample_inputs: {_short(err)}", [], True, "0", 0.0]
            continue
        chosen = spread(len(found), samples)
        outcome, at = first_failure(run, found, chosen)
        first = at == chosen[0] if chosen else True
        records[name] = [outcome.status, outcome.detail, outcome.mutated, first, f"{len(chosen)} of {len(found)}"]
        print(name, outcome.status, outcome.detail[:120], flush=True)
    import onnxruntime as ort

    meta = {"samples": samples, "seconds": round(time.time() - started), "torch": torch.__version__}
    meta["onnxruntime"] = ort.__version__
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump({"meta": meta, database: records}, f, indent=1)


def write_table(json_paths: list[str], path: str) -> None:
    """The markdown table of the databases' JSON outcomes (`run_database`)."""
    data: dict = {}
    metas = []
    for json_path in json_paths:
        with open(json_path, encoding="utf-8") as f:
            loaded = json.load(f)
        metas.append(loaded.pop("meta"))
        data.update(loaded)

    def rows(database: str) -> list[tuple[str, Outcome, str]]:
        return [(n, Outcome(r[0], r[1], r[2]), r[4]) for n, r in data.get(database, {}).items()]

    def module_note(name: str, outcome: Outcome) -> str:
        return "buffers updated: " + ", ".join(outcome.mutated) if outcome.mutated else ""

    module_rows, op_rows = rows("module_db"), rows("op_db")
    passed_m = sum(o.status == "pass" for _, o, _ in module_rows)
    passed_o = sum(o.status == "pass" for _, o, _ in op_rows)
    described = {
        f"{m['samples']} sample(s) per entry, torch {m['torch']}, onnxruntime {m['onnxruntime']}" for m in metas
    }
    runs = "; ".join(sorted(described))
    lines = [
        "# The torch gradient builder against PyTorch's test databases",
        "",
        "Generated by `PYTHONPATH=. python tests/torch_coverage.py` (`--run module_db`, `--run op_db`, then "
        f"`--table`; {runs}). " + METHOD,
        "",
        f"- module_db: {passed_m} of {len(module_rows)} entries pass",
        f"- op_db: {passed_o} of {len(op_rows)} entries pass",
        "",
        "## module_db",
        "",
        *_table(module_rows, module_note),
        "",
        "## op_db",
        "",
        *_table(op_rows, lambda name, outcome: ""),
        "",
    ]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    print(f"module_db {passed_m}/{len(module_rows)}, op_db {passed_o}/{len(op_rows)}: {path}")


def write_known(json_paths: list[str], out_path: str) -> None:
    """tests/torch_coverage_known.py from `--run` outcomes: the error key of each entry whose first sample (the
    one the tests run) does not pass."""
    records: dict = {}
    for json_path in json_paths:
        with open(json_path, encoding="utf-8") as f:
            records.update(json.load(f))
    lines = [
        '"""Generated by `PYTHONPATH=. python tests/torch_coverage.py --known ...` from its `--run` outcomes:',
        "the entries of PyTorch's test databases the torch builder does not handle, and the error key",
        '(`torch_coverage.error_key`) each gives. docs/torch_builder_coverage.md has the whole errors."""',
        "",
    ]
    for db, prefix in (("module_db", "MODULE_DB"), ("op_db", "OP_DB")):
        failing = {n: r for n, r in records.get(db, {}).items() if r[0] != "pass"}
        entries = []
        for n, r in sorted(failing.items()):
            if r[3]:
                line = f"    {json.dumps(n)}: {json.dumps(error_key(Outcome(r[0], r[1])))},"
                entries.append(line if len(line) <= 120 else line + "  # noqa: E501")
        head = f"{prefix}_UNSUPPORTED: dict[str, str] = {{"
        lines += [head, *entries, "}", ""] if entries else [head + "}", ""]
    with open(out_path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", choices=["module_db", "op_db"], help="run one database, writing --json")
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--only", help="comma-separated entries to run, updating --json")
    parser.add_argument("--json", help="the outcomes of --run")
    parser.add_argument("--table", nargs="+", help="write the markdown table (--out) from these outcomes")
    parser.add_argument("--known", nargs="+", help="write tests/torch_coverage_known.py from these outcomes")
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "torch_builder_coverage.md")
    )
    arguments = parser.parse_args()
    if arguments.run:
        only = set(arguments.only.split(",")) if arguments.only else None
        run_database(arguments.run, arguments.samples, arguments.json, only)
    if arguments.table:
        write_table(arguments.table, arguments.out)
    if arguments.known:
        write_known(arguments.known, os.path.join(os.path.dirname(__file__), "torch_coverage_known.py"))
