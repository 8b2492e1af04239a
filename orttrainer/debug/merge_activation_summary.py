"""Merge two activation-statistics trees into one file per step, and compare them.

``python -m orttrainer.debug.merge_activation_summary --pt_dir A --ort_dir B --output_dir C [--overwrite]
[--rtol R] [--atol T] [--top N]``

Merge (legacy layout, ``docs/debugging.md`` §3): for every sub-directory ``D`` of each tree, write
``C/merge_pt/D_.txt`` (from A) and ``C/merge_ort/D_.txt`` (from B): the files named by the lines of
``A/step_0/order.txt``, in that order, each followed by one blank line; a missing file is skipped with a warning
``tensor <D>/<line> not exist``. Both trees use A's order, so ``diff merge_pt/step_3_.txt merge_ort/step_3_.txt``
lines up. ``C`` must not exist unless ``--overwrite``. Differences from legacy: sub-directories are processed in
natural order (``step_2`` before ``step_10``; legacy used file-system order); when ``A/step_0/order.txt`` is missing
(e.g. ``start_step > 0``) the lowest-numbered step with an order.txt gives the order; the order is read before
``C`` is created, so a failure leaves nothing behind.

Comparison (new; legacy left it to ``diff``): for each step directory present in both trees, every activation in
order is compared, A being the reference. ``min``/``max``/``mean``/``std`` must satisfy
``|b - a| <= atol + rtol * |a|`` (NaN equals NaN, infinities must match exactly); ``shape``, ``dtype`` and the
``nan``/``inf`` counts must be equal. neg/pos/zero counts and samples are not compared: they flip on values that
are equal within tolerance. The report names, per step, the first activation in order that differs beyond
tolerance and lists the largest relative differences ``|a - b| / max(|a|, |b|)``. It is printed to stdout; the
exit code is 0 whether or not runs diverge (non-zero only for usage or file errors).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .statistics import parse_statistics

logger = logging.getLogger(__name__)

ORDER_FILE = "order.txt"
TOLERANCE_FIELDS = ("min", "max", "mean", "std")
EXACT_FIELDS = ("shape", "dtype", "nan", "inf")


def merge_activation_summaries(
    pt_dir: str | os.PathLike, ort_dir: str | os.PathLike, output_dir: str | os.PathLike, overwrite: bool = False
) -> None:
    """Write ``output_dir/merge_pt/<D>_.txt`` and ``output_dir/merge_ort/<D>_.txt`` (see the module docstring)."""
    pt_dir, ort_dir, output_dir = Path(pt_dir), Path(ort_dir), Path(output_dir)
    if output_dir.exists():
        if not overwrite:
            raise FileExistsError(
                f"Output directory {output_dir} already exists. Enable --overwrite to allow overwriting it."
            )
        logger.warning(f"Output directory {output_dir} already exists, overwriting it.")
    order_path = find_order_file(pt_dir)
    order = read_order(order_path)
    if output_dir.exists():
        shutil.rmtree(output_dir)
    output_dir.mkdir(parents=True)
    for source, dest_name in ((pt_dir, "merge_pt"), (ort_dir, "merge_ort")):
        logger.warning(
            f"Start generating summary per step for [{source}] following typological order in [{order_path}]"
        )
        destination = output_dir / dest_name
        destination.mkdir()
        for step in step_dirs(source):
            _merge_step(step, order, destination / f"{step.name}_.txt")
        logger.warning(
            f"Finish generating summary per step for [{source}] following typological order in "
            f"[{order_path}], merged files are in [{destination}]"
        )


def _merge_step(step: Path, order: Sequence[str], target: Path) -> None:
    with open(target, "wb") as out:  # bytes in, bytes out: the merged file is the exact concatenation
        for line in order:
            path = step / line
            if path.is_file():
                out.write(path.read_bytes() + b"\n")
            else:
                logger.warning(f"tensor {path} not exist")


def find_order_file(root: Path) -> Path:
    """``root/step_0/order.txt``, else the lowest-numbered step's; ``FileNotFoundError`` naming step_0's."""
    preferred = root / "step_0" / ORDER_FILE
    if preferred.is_file():
        return preferred
    for step in step_dirs(root):
        if (step / ORDER_FILE).is_file():
            return step / ORDER_FILE
    raise FileNotFoundError(f"No such file or directory: '{preferred}' (and no other step has an {ORDER_FILE})")


def read_order(path: Path) -> list[str]:
    """The file names an order.txt lists, in order (blank lines skipped)."""
    return [line for line in path.read_text(encoding="utf-8").split("\n") if line]


def step_dirs(root: Path) -> list[Path]:
    """Sub-directories of ``root`` in natural order (``step_2`` before ``step_10``)."""

    def key(path: Path) -> list[Any]:
        return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", path.name)]

    return sorted((p for p in root.iterdir() if p.is_dir()), key=key) if root.is_dir() else []


# ------------------------------------------------------------------------------------------------------ comparison


@dataclasses.dataclass(frozen=True)
class Difference:
    """One compared field of one activation; ``beyond`` when it breaks the tolerance (or an exact field differs)."""

    activation: str
    field: str
    pt: Any
    ort: Any
    rel_diff: float
    beyond: bool


@dataclasses.dataclass
class StepComparison:
    """The comparison of one step directory: activations compared, the first and the largest differences, the files
    the ORT tree lacks, or ``only_in`` when one tree has no such step."""

    step: str
    compared: int = 0
    first_divergence: list[Difference] = dataclasses.field(default_factory=list)  # beyond-tolerance fields
    largest: list[Difference] = dataclasses.field(default_factory=list)
    missing_in_ort: list[str] = dataclasses.field(default_factory=list)
    only_in: str | None = None  # "pt" or "ort" when the step directory exists in one tree only


@dataclasses.dataclass
class ComparisonReport:
    """``compare_activation_summaries``'s result: the two trees, the tolerances and one entry per step."""

    pt_dir: str
    ort_dir: str
    rtol: float
    atol: float
    steps: list[StepComparison]

    @property
    def first_divergence(self) -> tuple[str, str] | None:
        """``(step, activation file)`` of the earliest divergence, or ``None``."""
        for step in self.steps:
            if step.first_divergence:
                return step.step, step.first_divergence[0].activation
        return None

    def format(self) -> str:
        """The report as the text the command line prints."""
        return _format_report(self)


def compare_activation_summaries(
    pt_dir: str | os.PathLike, ort_dir: str | os.PathLike, rtol: float = 1e-4, atol: float = 1e-6, top: int = 10
) -> ComparisonReport:
    """Compare two statistics trees step by step, ``pt_dir`` being the reference (rules in the module docstring)."""
    pt_dir, ort_dir = Path(pt_dir), Path(ort_dir)
    global_order = read_order(find_order_file(pt_dir))
    pt_steps = {p.name: p for p in step_dirs(pt_dir)}
    ort_steps = {p.name: p for p in step_dirs(ort_dir)}
    names = [p.name for p in step_dirs(pt_dir)] + [n for n in ort_steps if n not in pt_steps]
    steps = []
    for name in names:
        if name not in ort_steps or name not in pt_steps:
            steps.append(StepComparison(name, only_in="pt" if name in pt_steps else "ort"))
        else:
            steps.append(_compare_step(pt_steps[name], ort_steps[name], global_order, rtol, atol, top))
    return ComparisonReport(str(pt_dir), str(ort_dir), rtol, atol, steps)


def _compare_step(pt: Path, ort: Path, global_order: list[str], rtol: float, atol: float, top: int) -> StepComparison:
    # The merged files' order first, then anything this step dumped that step 0 did not.
    own = read_order(pt / ORDER_FILE) if (pt / ORDER_FILE).is_file() else []
    order = list(dict.fromkeys(global_order + own))
    result = StepComparison(pt.name)
    differences: list[Difference] = []
    for activation in order:
        if not (pt / activation).is_file():
            continue
        if not (ort / activation).is_file():
            result.missing_in_ort.append(activation)
            continue
        fields = _compare_files(activation, pt / activation, ort / activation, rtol, atol)
        result.compared += 1
        differences += fields
        if not result.first_divergence and any(d.beyond for d in fields):
            result.first_divergence = [d for d in fields if d.beyond]
    nonzero = [d for d in differences if d.rel_diff > 0]
    result.largest = sorted(nonzero, key=lambda d: -d.rel_diff)[:top]
    return result


def _compare_files(activation: str, pt: Path, ort: Path, rtol: float, atol: float) -> list[Difference]:
    a = parse_statistics(pt.read_text(encoding="utf-8"))
    b = parse_statistics(ort.read_text(encoding="utf-8"))
    out = []
    for field in EXACT_FIELDS:
        if a[field] != b[field]:
            rel = _rel_diff(a[field], b[field]) if field in ("nan", "inf") else math.inf
            out.append(Difference(activation, field, a[field], b[field], rel, True))
    for field in TOLERANCE_FIELDS:
        x, y = a[field], b[field]
        out.append(Difference(activation, field, x, y, _rel_diff(x, y), not _close(x, y, rtol, atol)))
    return out


def _close(reference: float, value: float, rtol: float, atol: float) -> bool:
    if math.isnan(reference) or math.isnan(value):
        return math.isnan(reference) and math.isnan(value)
    if math.isinf(reference) or math.isinf(value):
        return reference == value
    return abs(value - reference) <= atol + rtol * abs(reference)


def _rel_diff(a: float, b: float) -> float:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b))


def _format_report(report: ComparisonReport) -> str:
    lines = [
        f"Comparing {report.ort_dir} against {report.pt_dir} (reference): rtol={report.rtol}, "
        f"atol={report.atol}; within tolerance: {', '.join(TOLERANCE_FIELDS)}; exact: {', '.join(EXACT_FIELDS)}"
    ]
    for step in report.steps:
        if step.only_in is not None:
            lines.append(f"{step.step}: only in {report.pt_dir if step.only_in == 'pt' else report.ort_dir}")
            continue
        if step.first_divergence:
            detail = "; ".join(
                f"{d.field}: pt={d.pt} ort={d.ort} (rel diff {d.rel_diff:.3g})" for d in step.first_divergence
            )
            lines.append(f"{step.step}: first divergence: {step.first_divergence[0].activation}  [{detail}]")
        else:
            lines.append(f"{step.step}: {step.compared} activations compared, no divergence beyond tolerance")
        if step.missing_in_ort:
            shown = ", ".join(step.missing_in_ort[:5]) + (", ..." if len(step.missing_in_ort) > 5 else "")
            lines.append(f"  {len(step.missing_in_ort)} activation(s) missing in {report.ort_dir}: {shown}")
        lines += _format_table(step.largest)
    return "\n".join(lines) + "\n"


def _format_table(rows: list[Difference]) -> list[str]:
    if not rows:
        return ["  largest relative differences: none (identical statistics)"]
    width = max(len("activation"), *(len(d.activation) for d in rows))
    lines = [
        "  largest relative differences (* = beyond tolerance):",
        f"    {'activation':<{width}}  {'field':<5}  {'pt':>24}  {'ort':>24}  rel diff",
    ]
    for d in rows:
        lines.append(
            f"    {d.activation:<{width}}  {d.field:<5}  {str(d.pt):>24}  {str(d.ort):>24}  "
            f"{d.rel_diff:.3e}{' *' if d.beyond else ''}"
        )
    return lines


# ------------------------------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """Merge, then compare, two statistics trees (``--help`` for the options); 1 after a one-line error."""
    parser = argparse.ArgumentParser(
        prog="python -m orttrainer.debug.merge_activation_summary", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--pt_dir", type=str, required=True, help="reference statistics directory")
    parser.add_argument("--ort_dir", type=str, required=True, help="statistics directory to compare")
    parser.add_argument("--output_dir", type=str, required=True, help="where merge_pt/ and merge_ort/ go")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output_dir")
    parser.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance (default 1e-4)")
    parser.add_argument("--atol", type=float, default=1e-6, help="absolute tolerance (default 1e-6)")
    parser.add_argument("--top", type=int, default=10, help="rows of the largest differences per step")
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(name)s [%(levelname)s] - %(message)s")
    try:
        merge_activation_summaries(args.pt_dir, args.ort_dir, args.output_dir, args.overwrite)
        report = compare_activation_summaries(args.pt_dir, args.ort_dir, args.rtol, args.atol, args.top)
    except (FileExistsError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    sys.stdout.write(report.format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
