"""Shared pieces of the benchmarks: the benchmark models, batches, and running each measurement in its own process.

Each runner is measured in a fresh Python process: ONNX Runtime's thread pool spins after a run and steals cores
from whatever runs next in the same process (docs/engine.md §3.3), so interleaving would distort both numbers.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")


class BenchMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(784, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 10)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class BenchTransformer(nn.Module):
    """Embedding(1000, 256) + learned positions + 2 x TransformerEncoderLayer(256, 4 heads, ff 1024, GELU) + head."""

    def __init__(self, vocab: int = 1000, d_model: int = 256, seq: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, 4, 1024, dropout=0.0, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens) + self.pos[: tokens.shape[1]]))


class BenchResNet(nn.Module):
    """A ResNet-style CNN for 32x32 RGB images (CIFAR size): a 3x3 stem, three stages of two basic blocks (3x3
    convolutions, BatchNorm, ReLU, identity or strided 1x1 shortcuts) at 32/64/128 channels, global average pooling,
    a linear head over 10 classes. With `pooling`, torchvision's ResNet's stem and head for larger images: a 7x7
    stride-2 convolution and 3x3 stride-2 max pooling, `nn.AdaptiveAvgPool2d(1)` before the head."""

    class Block(nn.Module):
        def __init__(self, inputs: int, outputs: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(outputs)
            self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(outputs)
            self.shortcut = (
                nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))
                if stride != 1 or inputs != outputs
                else nn.Identity()
            )

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))

    def __init__(self, pooling: bool = False) -> None:
        super().__init__()
        if pooling:
            convolution, max_pool = nn.Conv2d(3, 32, 7, 2, 3, bias=False), nn.MaxPool2d(3, 2, 1)
            self.stem = nn.Sequential(convolution, nn.BatchNorm2d(32), nn.ReLU(), max_pool)
        else:
            self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1) if pooling else None
        blocks, channels = [], 32
        for width, stride in ((32, 1), (64, 2), (128, 2)):
            blocks += [self.Block(channels, width, stride), self.Block(width, width, 1)]
            channels = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(128, 10)

    def forward(self, images):
        features = self.blocks(self.stem(images))
        return self.head(self.pool(features).flatten(1) if self.pool is not None else features.mean(dim=(2, 3)))


class BenchLSTM(nn.Module):
    """An LSTM language model: Embedding(1000, 256), a 2-layer LSTM (hidden 256, batch first), a linear head; with
    `layer=nn.GRU`, the same model with a GRU."""

    def __init__(self, vocab: int = 1000, hidden: int = 256, layer: type[nn.RNNBase] = nn.LSTM) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = layer(hidden, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        return self.head(self.lstm(self.embed(tokens))[0])


def token_loss(logits, target):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


@dataclass(frozen=True)
class Workload:
    name: str
    make_model: object
    loss_fn: object
    model_desc: dict
    make_batch: object  # () -> (input, target)


WORKLOADS = {
    "mlp": Workload(
        "MLP 784-1024-1024-10, batch 64",
        BenchMLP,
        nn.functional.cross_entropy,
        {"inputs": [("x", ["batch", 784]), ("target", ["batch"])], "outputs": [("loss", [], True)]},
        lambda: (torch.randn(64, 784), torch.randint(0, 10, (64,))),
    ),
    "transformer": Workload(
        "Transformer 2x256, seq 128, batch 16",
        BenchTransformer,
        token_loss,
        {"inputs": [("tokens", ["batch", "seq"]), ("target", ["batch", "seq"])], "outputs": [("loss", [], True)]},
        lambda: (torch.randint(0, 1000, (16, 128)), torch.randint(0, 1000, (16, 128))),
    ),
    "cnn": Workload(
        "ResNet-style CNN (6 blocks, 32-128 channels, BatchNorm), 32x32x3, batch 32",
        BenchResNet,
        nn.functional.cross_entropy,
        {"inputs": [("images", ["batch", 3, 32, 32]), ("target", ["batch"])], "outputs": [("loss", [], True)]},
        lambda: (torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))),
    ),
    "pooled-cnn": Workload(
        "ResNet-style CNN with max and adaptive average pooling (torchvision's stem), 64x64x3, batch 16",
        lambda: BenchResNet(pooling=True),
        nn.functional.cross_entropy,
        {"inputs": [("images", ["batch", 3, 64, 64]), ("target", ["batch"])], "outputs": [("loss", [], True)]},
        lambda: (torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))),
    ),
    "lstm": Workload(
        "LSTM language model 2x256, seq 64, batch 16",
        BenchLSTM,
        token_loss,
        {"inputs": [("tokens", ["batch", "seq"]), ("target", ["batch", "seq"])], "outputs": [("loss", [], True)]},
        lambda: (torch.randint(0, 1000, (16, 64)), torch.randint(0, 1000, (16, 64))),
    ),
    "gru": Workload(
        "GRU language model 2x256, seq 64, batch 16",
        lambda: BenchLSTM(layer=nn.GRU),
        token_loss,
        {"inputs": [("tokens", ["batch", "seq"]), ("target", ["batch", "seq"])], "outputs": [("loss", [], True)]},
        lambda: (torch.randint(0, 1000, (16, 64)), torch.randint(0, 1000, (16, 64))),
    ),
}
# what runs unless named; the GRU and the pooled CNN measure builder rules
DEFAULT_WORKLOADS = ["mlp", "transformer", "cnn", "lstm"]


def run_worker(script: str, args: list[str], timeout: float = 900, env: dict[str, str] | None = None) -> dict:
    """Run `script --worker ...` in a fresh process (with `env` added to the environment); it prints one JSON line
    last."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    done = subprocess.run(
        [sys.executable, script, "--worker", *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    if done.returncode != 0:
        raise RuntimeError(f"worker {args} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


BYTECODE_DIR = os.path.join(RESULTS_DIR, "bytecode")

# What a first step imports (the torch builder's tracing and export included): their packages' bytecode is checked.
_FIRST_STEP_IMPORTS = (
    "numpy, onnx, onnxruntime, onnxscript, torch, torch._dynamo, torch._functorch.aot_autograd, torch.onnx, "
    "torch.optim, orttrainer"
)

# Run in the measured interpreter: the packages (top-level directories, or single files) of the loaded modules
# whose bytecode is missing where this interpreter looks for it (beside the source, or under PYTHONPYCACHEPREFIX).
_MISSING_BYTECODE = f"""
import json, os, sys
import {_FIRST_STEP_IMPORTS}
missing = set()
for name, module in list(sys.modules.items()):
    spec = getattr(module, "__spec__", None)
    if spec is None or not spec.cached or not (spec.origin or "").endswith(".py") or os.path.exists(spec.cached):
        continue
    top = sys.modules.get(name.partition(".")[0])
    paths = list(getattr(top, "__path__", None) or [getattr(top, "__file__", None) or spec.origin])
    missing.update(p for p in paths if p)
print(json.dumps(sorted(missing)))
"""

# Compile the packages and files named in argv[1] (a JSON list), with a worker per CPU.
_COMPILE = """
import compileall, json, os, sys
for path in json.loads(sys.argv[1]):
    if os.path.isdir(path):
        compileall.compile_dir(path, quiet=1, workers=0)
    else:
        compileall.compile_file(path, quiet=1)
"""


def compile_bytecode(pythons: list[str] | None = None) -> str:
    """Give the measured processes the bytecode that `pip install` leaves, so that a first step measures start-up
    and not the compilation of Python sources, which an installation without bytecode (`pip install
    --no-compile`, a read-only image; with `PYTHONDONTWRITEBYTECODE=1` nothing is ever written) repeats in every
    process: importing torch._dynamo alone takes 3.6-3.8 s from source against 1.0-1.1 s from bytecode on an AMD
    EPYC Zen 3. orttrainer's package is compiled in place, as before; where a dependency's bytecode is missing
    as well, every package that a first step imports is compiled into `BYTECODE_DIR` and the measured processes
    find it there (`PYTHONPYCACHEPREFIX`, set in this process's environment, which they inherit). Returns how the
    bytecode was found, for the results' JSON."""
    pythons = pythons or [sys.executable]
    code = "import compileall, os, orttrainer; compileall.compile_dir(os.path.dirname(orttrainer.__file__), quiet=1)"
    for python in pythons:
        subprocess.run([python, "-c", code], check=True)
    if not any(_missing_bytecode(python, os.environ) for python in pythons):
        return "installed" if "PYTHONPYCACHEPREFIX" not in os.environ else f"under {os.environ['PYTHONPYCACHEPREFIX']}"
    env = dict(os.environ, PYTHONPYCACHEPREFIX=BYTECODE_DIR)
    for python in pythons:
        missing = _missing_bytecode(python, env)
        subprocess.run([python, "-c", _COMPILE, json.dumps(missing)], env=env, check=True)
        left = _missing_bytecode(python, env)
        if left:
            raise RuntimeError(f"{python}: no bytecode for {left} after compiling it into {BYTECODE_DIR}")
    os.environ["PYTHONPYCACHEPREFIX"] = BYTECODE_DIR
    return f"compiled by the benchmark into {BYTECODE_DIR} (the installation has none)"


def _missing_bytecode(python: str, env: dict[str, str]) -> list[str]:
    done = subprocess.run([python, "-c", _MISSING_BYTECODE], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def environment() -> dict:
    """The interpreter, libraries and processor of a measurement, for its table and JSON."""
    import onnxruntime
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "isa": [f for f in ("avx2", "fma", "avx512f", "amx_tile") if f in flags],
        "machine": platform.machine(),
    }


def environment_line(env: dict) -> str:
    """The processor and library versions of `environment()`, as a table's caption begins."""
    processor = f"{env['cpu']} ({', '.join(env['isa'])}), {env['cpus']} CPUs"
    return f"{processor}; torch {env['torch']}, onnxruntime {env['onnxruntime']}"


def median_step_ms(step: Callable, batch: tuple, steps: int, warmup: int = 3) -> float:
    """The median time of `steps` calls of `step(*batch)`, after `warmup` untimed ones, in milliseconds."""
    for _ in range(warmup):
        step(*batch)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(*batch)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def save_json(name: str, payload: dict) -> str:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, name)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return path


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
