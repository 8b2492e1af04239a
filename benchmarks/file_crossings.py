"""Which of orttrainer's source files a `train_step` runs code in: the first step (export, compile, session) and a
steady-state one, with default options, for each gradient builder this runtime has.

    python benchmarks/file_crossings.py [--builders auto torch] [--list]

A file counts when a Python frame of a function defined in it starts during the step (`sys.setprofile`), so
attribute reads of plain fields count nothing and a property or a called helper counts its file; each graph pass's
file counts once. "Moves" are the changes of file between consecutive calls; "moves up" are those into a file
that the previous one imports from a higher layer of the import order (approximated by the order in which the first
step entered the files: entering a file entered before is a move back up). Prints a table and writes
benchmarks/results/file_crossings.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from common import save_json  # noqa: E402

import orttrainer  # noqa: E402
from orttrainer import ORTTrainer, ORTTrainerOptions, optim  # noqa: E402

PACKAGE = os.path.dirname(os.path.abspath(orttrainer.__file__))


def _label(filename: str) -> str | None:
    if not filename.startswith(PACKAGE + os.sep):
        return None
    return os.path.relpath(filename, PACKAGE)


class FileRecorder:
    """Records the sequence of orttrainer files whose functions start while it is active."""

    def __init__(self) -> None:
        self.sequence: list[str] = []

    def __enter__(self) -> FileRecorder:
        def profile(frame, event, arg):  # noqa: ANN001 - sys.setprofile's signature
            if event == "call":
                label = _label(frame.f_code.co_filename)
                if label is not None and (not self.sequence or self.sequence[-1] != label):
                    self.sequence.append(label)

        sys.setprofile(profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)

    @property
    def files(self) -> list[str]:
        return sorted(set(self.sequence))

    def moves(self) -> tuple[int, int]:
        """(moves between files, moves back to a file entered earlier than the one left)."""
        first_seen: dict[str, int] = {}
        for label in self.sequence:
            first_seen.setdefault(label, len(first_seen))
        pairs = list(zip(self.sequence, self.sequence[1:], strict=False))
        return len(pairs), sum(first_seen[b] < first_seen[a] for a, b in pairs)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def measure(builder: str) -> dict[str, object]:
    torch.manual_seed(0)
    desc = {"inputs": [("x", ["batch", 8]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
    options = ORTTrainerOptions({"device": {"id": "cpu"}, "_internal_use": {"gradient_builder": builder}})
    loss_fn: Callable = torch.nn.functional.cross_entropy
    trainer = ORTTrainer(_Model(), desc, optim.AdamConfig(lr=1e-3), loss_fn=loss_fn, options=options)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    with FileRecorder() as first:
        trainer.train_step(x, y)
    trainer.train_step(x, y)
    with FileRecorder() as steady:
        trainer.train_step(x, y)
    first_moves, first_up = first.moves()
    return {
        "builder": builder,
        "made_by": trainer.gradient_builder,
        "first_step_files": first.files,
        "first_step_moves": first_moves,
        "first_step_moves_up": first_up,
        "steady_step_files": steady.files,
    }


def main() -> None:
    from orttrainer.trainer.runtime import has_training_build

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = ["auto", "torch"] if has_training_build() else ["torch"]
    parser.add_argument("--builders", nargs="+", default=default)
    parser.add_argument("--list", action="store_true", help="also list the files")
    args = parser.parse_args()
    rows = [measure(b) for b in args.builders]
    print("| builder (made by) | first step: files | moves | moves back up | steady step: files |")
    print("|---|---|---|---|---|")
    for r in rows:
        first, steady = r["first_step_files"], r["steady_step_files"]
        assert isinstance(first, list) and isinstance(steady, list)
        print(
            f"| {r['builder']} ({r['made_by']}) | {len(first)} | {r['first_step_moves']} | "
            f"{r['first_step_moves_up']} | {len(steady)} |"
        )
    if args.list:
        for r in rows:
            print(f"\n{r['builder']}: steady step: {r['steady_step_files']}\nfirst step: {r['first_step_files']}")
    save_json("file_crossings.json", {"rows": rows})


if __name__ == "__main__":
    main()
