"""A long run holds its memory: after warming up, hundreds more steps (with accumulation, eval steps and a state dict
now and then) leave the process's resident memory where it was, with each gradient builder this runtime has. Run in
a fresh process, so that nothing else the suite did moves the numbers. Linux only (/proc/self/status)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from orttrainer.trainer.runtime import has_training_build

_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[2])
from models import MLP, mlp_desc
from helpers import make_trainer
from orttrainer import optim

def rss_mib():
    with open("/proc/self/status") as status:
        line = next(l for l in status if l.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024

torch.set_num_threads(1)
torch.manual_seed(0)
options = {"batch": {"gradient_accumulation_steps": 2}, "_internal_use": {"gradient_builder": sys.argv[1]}}
trainer = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(lr=1e-3), torch.nn.functional.cross_entropy, options)
g = torch.Generator().manual_seed(0)
batches = [(torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(4)]
def run(steps):
    for i in range(steps):
        trainer.train_step(*batches[i % 4])
        if i % 50 == 0:
            trainer.eval_step(*batches[0])
            trainer.state_dict()
run(100)
before = rss_mib()
run(600)
print(json.dumps({"before": before, "after": rss_mib(), "builder": trainer.gradient_builder}))
"""

BUILDERS = ["torch", "ort"] if has_training_build() else ["torch"]
ALLOWED_GROWTH_MIB = 16  # allocator noise; a leak of one tensor of this model per step would be ~60 MB over 600


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the resident set size from /proc (Linux)")
@pytest.mark.parametrize("builder", BUILDERS)
def test_six_hundred_more_steps_leave_the_resident_memory_where_it_was(builder):
    tests = os.path.dirname(__file__)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, builder, tests], capture_output=True, text=True, env=env, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    assert numbers["builder"] == builder
    assert numbers["after"] - numbers["before"] < ALLOWED_GROWTH_MIB, numbers
