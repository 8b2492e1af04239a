"""Interleaved measurement: every runner in its own process, all alive at once, stepping in turn.

Why: the development machine is shared, and other jobs change the speed of everything by up to 3x within minutes.
Each runner keeps its own process (ONNX Runtime's and PyTorch's thread pools and allocators do not disturb each
other, and each process's peak memory is its own), but the driver makes them take turns: round after round, each
runner runs a few steps while the others wait on a pipe (using no CPU). A burst of load from elsewhere then hits
neighbouring turns of every runner alike, so the per-round ratio of two runners' step times is far steadier than
any absolute time; the report gives the median ratio over rounds and its spread.

Protocol (one JSON object per line): the worker builds its runner, runs and times the first step, and prints
`{"ready": ...}`; then for each `{"steps": n}` on stdin it runs n steps and prints their times; on `{"done": true}`
it prints its summary (peak RSS, last loss) and exits.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

StepFn = Callable[[], Any]  # runs one step, returns the loss


def serve(first: Callable[[], dict], step: StepFn, summary: Callable[[], dict]) -> None:
    """The worker side: `first()` builds the runner and times step 1; then answer the driver's requests."""
    print(json.dumps({"ready": first()}), flush=True)
    import time

    for line in sys.stdin:
        request = json.loads(line)
        if request.get("done"):
            break
        times = []
        for _ in range(int(request["steps"])):
            start = time.perf_counter()
            step()
            times.append(1000.0 * (time.perf_counter() - start))
        print(json.dumps({"times_ms": times}), flush=True)
    print(json.dumps({"summary": summary()}), flush=True)


class Worker:
    """The driver side of one runner's process."""

    def __init__(
        self, script: str, args: list[str], env: dict[str, str] | None = None, python: str = sys.executable
    ) -> None:
        environment = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.args = args
        self.proc = subprocess.Popen(
            [python, script, "--worker", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environment,
        )
        self.ready = self._read("ready")

    def steps(self, n: int) -> list[float]:
        return self._request({"steps": n}, "times_ms")

    def finish(self) -> dict:
        summary = self._request({"done": True}, "summary")
        self.proc.wait(timeout=60)
        return summary

    def _request(self, request: dict, key: str) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read(key)

    def _read(self, key: str) -> Any:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                message = json.loads(line)
                if key in message:
                    return message[key]
        self.proc.wait(timeout=60)
        error = self.proc.stderr.read() if self.proc.stderr is not None else ""
        raise RuntimeError(f"worker {self.args} exited ({self.proc.returncode}):\n{error[-4000:]}")


def interleave(workers: dict[str, Worker], rounds: int, steps: int, warmup: int, seed: int = 0) -> dict[str, list]:
    """`warmup` steps each, then `rounds` rounds of `steps` steps per runner, in a shuffled order each round; returns
    runner -> one list of step times (ms) per round."""
    order = list(workers)
    for name in order:
        workers[name].steps(warmup)
    shuffle = random.Random(seed)
    per_round: dict[str, list] = {name: [] for name in order}
    for _ in range(rounds):
        shuffle.shuffle(order)
        for name in order:
            per_round[name].append(workers[name].steps(steps))
    return per_round


def ratio_statistics(mine: list[list[float]], base: list[list[float]]) -> dict[str, float]:
    """Per round, the ratio of the medians of the step times; their median, quartiles and extremes."""
    ratios = sorted(statistics.median(a) / statistics.median(b) for a, b in zip(mine, base, strict=True))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {
        "median": statistics.median(ratios),
        "q1": quartiles[0],
        "q3": quartiles[2],
        "min": ratios[0],
        "max": ratios[-1],
    }


def time_statistics(per_round: list[list[float]]) -> dict[str, float]:
    """Median step time over all rounds and the spread of the per-round medians (min, max)."""
    medians = [statistics.median(r) for r in per_round]
    return {"median": statistics.median([t for r in per_round for t in r]), "min": min(medians), "max": max(medians)}
