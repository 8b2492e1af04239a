"""device.mem_limit on the CPU caps ONNX Runtime's CPU arena (trainer/runtime/ort.py). The cap is per process, so the
test runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch
    from helpers import make_trainer
    from models import MLP, mlp_desc
    from orttrainer import optim

    def trainer(limit):
        torch.manual_seed(0)
        return make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), torch.nn.functional.cross_entropy,
                            {"device": {"mem_limit": limit}})

    small = (torch.randn(8, 32), torch.randint(0, 10, (8,)))
    big = (torch.randn(65536, 32), torch.randint(0, 10, (65536,)))
    capped = trainer(4 << 20)
    capped.train_step(*small)
    print("small batch under the cap: ok")
    try:
        capped.train_step(*big)  # the hidden layer alone is 65536 x 64 floats = 16 MiB
    except Exception as error:  # onnxruntime's RuntimeException
        print("big batch over the cap:", "is smaller than requested bytes" in str(error))
    trainer(0).train_step(*big)
    print("big batch without a cap: ok")
    try:
        trainer(8 << 20).train_step(*small)
    except ValueError as error:
        print("another cap:", str(error))
""")


def test_mem_limit_caps_the_cpu_arena_of_the_trainer_sessions():
    tests = os.path.dirname(__file__)
    path = os.pathsep.join([tests, os.path.dirname(tests), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[:3] == ["small batch under the cap: ok", "big batch over the cap: True", "big batch without a cap: ok"]
    assert lines[3] == (
        "another cap: options device.mem_limit=8388608: this process already caps ONNX Runtime's "
        "shared CPU arena at 4194304 bytes, and the cap cannot change (one per process)"
    )
