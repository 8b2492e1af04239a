"""merge_activation_summary: the legacy merged layout (docs/debugging.md §3, §4.4) and the new
comparison of two runs (first divergent activation per step, largest relative differences)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from orttrainer.debug import (
    GlobalSubscriberManager,
    StatisticsSubscriber,
    compare_activation_summaries,
    compute_statistics,
    inspect_activation,
    merge_activation_summaries,
    statistics_from_reductions,
    write_statistics,
)
from orttrainer.debug.merge_activation_summary import main

# §4.4 verbatim (merged/merge_pt/step_0_.txt of ORT 1.19.2), with the trailing space of header and min lines removed
# here (it is added back in _sample_lines) so that editors keep this file intact.
SAMPLE_44 = """\
>>Linear_1_0th_output forward run shape: torch.Size([2, 4]) dtype: torch.float32 size: torch.Size([8])
min: -0.4841911792755127 max: 0.7010738849639893, mean: 0.1834731101989746, std: 1.439122200012207
nan: 0, inf: 0
samples(top 128): tensor([ 0.175480,  0.424058,  0.701074,  0.396867,  0.002442,  0.597893, -0.345838, -0.484191])
neg: 2, pos: 6, zero: 0,
================

>>GELU_2_0th_output forward run shape: torch.Size([2, 4]) dtype: torch.float32 size: torch.Size([8])
min: -0.15209659934043884 max: 0.5316745042800903, mean: 0.16618208587169647, std: 1.2689214944839478
nan: 0, inf: 0
samples(top 128): tensor([ 0.099962,  0.281675,  0.531675,  0.259657,  0.001223,  0.433499, -0.126138, -0.152097])
neg: 2, pos: 6, zero: 0,
================

>>>Linear_4_0th_output forward run shape: torch.Size([2, 4]) dtype: torch.float32 size: torch.Size([8])
min: -0.6516914367675781 max: 0.34157347679138184, mean: -0.019395852461457253, std: 0.3453046977519989
nan: 0, inf: 0
samples(top 128): tensor([ 0.078403,  0.341573, -0.028494, -0.651691, -0.058825,  0.264809,  0.127258, -0.228200])
neg: 4, pos: 4, zero: 0,
================

block_pre_act forward run shape: torch.Size([2, 4]) dtype: torch.float32 size: torch.Size([8])
min: -0.6516914367675781 max: 0.34157347679138184, mean: -0.019395852461457253, std: 0.3453046977519989
nan: 0, inf: 0
samples(top 128): tensor([ 0.078403,  0.341573, -0.028494, -0.651691, -0.058825,  0.264809,  0.127258, -0.228200])
neg: 4, pos: 4, zero: 0,
================

>>Block_3_0th_output forward run shape: torch.Size([2, 4]) dtype: torch.float32 size: torch.Size([8])
min: 0.0 max: 0.34157347679138184, mean: 0.10150538384914398, std: 0.7714200019836426
nan: 0, inf: 0
samples(top 128): tensor([0.078403, 0.341573, 0.000000, 0.000000, 0.000000, 0.264809, 0.127258, 0.000000])
neg: 0, pos: 4, zero: 4,
================

>>Linear_5_0th_output forward run shape: torch.Size([2, 2]) dtype: torch.float32 size: torch.Size([4])
min: 0.03439533710479736 max: 0.14995437860488892, mean: 0.07756621390581131, std: 0.2735031545162201
nan: 0, inf: 0
samples(top 128): tensor([0.050985, 0.074930, 0.034395, 0.149954])
neg: 0, pos: 4, zero: 0,
================

>MLP_0_0th_output forward run shape: torch.Size([2, 2]) dtype: torch.float32 size: torch.Size([4])
min: 0.03439533710479736 max: 0.14995437860488892, mean: 0.07756621390581131, std: 0.2735031545162201
nan: 0, inf: 0
samples(top 128): tensor([0.050985, 0.074930, 0.034395, 0.149954])
neg: 0, pos: 4, zero: 0,
================

>MLP_0_0th_output backward run shape: torch.Size([2, 2]) dtype: torch.float32 size: torch.Size([4])
min: 1.0 max: 1.0, mean: 1.0, std: 3.464101552963257
nan: 0, inf: 0
samples(top 128): tensor([1., 1., 1., 1.])
neg: 0, pos: 4, zero: 0,
================

>>Linear_5_0th_output backward run shape: torch.Size([2, 2]) dtype: torch.float32 size: torch.Size([4])
min: 1.0 max: 1.0, mean: 1.0, std: 3.464101552963257
nan: 0, inf: 0
samples(top 128): tensor([1., 1., 1., 1.])
neg: 0, pos: 4, zero: 0,
================

>>Block_3_0th_output backward run shape: torch.Size([2, 4]) dtype: torch.float32 size: torch.Size([8])
min: -0.6552361845970154 max: 0.10258549451828003, mean: -0.14239898324012756, std: 1.1139914989471436
nan: 0, inf: 0
samples(top 128): tensor([ 0.062741, -0.655236,  0.102585, -0.079686,  0.062741, -0.655236,  0.102585, -0.079686])
neg: 4, pos: 4, zero: 0,
================

block_pre_act backward run shape: torch.Size([2, 4]) dtype: torch.float32 size: torch.Size([8])
min: -0.6552361845970154 max: 0.10258549451828003, mean: -0.14314329624176025, std: 1.1174774169921875
nan: 0, inf: 0
samples(top 128): tensor([ 0.062741, -0.655236,  0.000000,  0.000000,  0.000000, -0.655236,  0.102585,  0.000000])
neg: 2, pos: 2, zero: 4,
================

>>>Linear_4_0th_output backward run shape: torch.Size([2, 4]) dtype: torch.float32 size: torch.Size([8])
min: -0.6552361845970154 max: 0.10258549451828003, mean: -0.14314329624176025, std: 1.1174774169921875
nan: 0, inf: 0
samples(top 128): tensor([ 0.062741, -0.655236,  0.000000,  0.000000,  0.000000, -0.655236,  0.102585,  0.000000])
neg: 2, pos: 2, zero: 4,
================

>>GELU_2_0th_output backward run shape: torch.Size([2, 4]) dtype: torch.float32 size: torch.Size([8])
min: -0.2611038088798523 max: 0.33417025208473206, mean: 0.03297238051891327, std: 0.3251630663871765
nan: 0, inf: 0
samples(top 128): tensor([ 0.334170,  0.003745,  0.013904, -0.202213,  0.316018,  0.035758,  0.023501, -0.261104])
neg: 2, pos: 6, zero: 0,
================

>>Linear_1_0th_output backward run shape: torch.Size([2, 4]) dtype: torch.float32 size: torch.Size([8])
min: -0.16189275681972504 max: 0.21339622139930725, mean: 0.02852436527609825, std: 0.242618128657341
nan: 0, inf: 0
samples(top 128): tensor([ 0.213396,  0.003067,  0.013586, -0.161893,  0.158625,  0.033059,  0.005517, -0.037162])
neg: 2, pos: 6, zero: 0,
================

"""


def _sample_lines():
    return [
        line + " " if " run shape: " in line or line.startswith("min: ") else line for line in SAMPLE_44.split("\n")
    ]


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(inspect_activation("block_pre_act", self.lin(x)))


class MLP(torch.nn.Module):  # the model of §4
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(3, 4)
        self.act = torch.nn.GELU()
        self.block = Block()
        self.fc2 = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.fc2(self.block(self.act(self.fc1(x))))


def run_sample(out, perturb=0.0):
    """§4's script; ``perturb`` is added to one weight of block.lin before training."""
    torch.manual_seed(2)
    model = MLP()
    with torch.no_grad():
        model.block.lin.weight[0, 0] += perturb
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(out, override_output_dir=True)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 3)
    try:
        for _ in range(3):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    finally:
        GlobalSubscriberManager.unsubscribe()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {
        "pt": run_sample(root / "pt_out"),
        "ort": run_sample(root / "ort_out"),
        "perturbed": run_sample(root / "perturbed", perturb=0.05),
    }


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_merged_files_have_the_legacy_layout(runs, tmp_path):
    merge_activation_summaries(runs["pt"], runs["ort"], tmp_path / "merged")
    assert _tree(tmp_path / "merged") == [
        "merge_ort",
        *[f"merge_ort/step_{s}_.txt" for s in range(3)],
        "merge_pt",
        *[f"merge_pt/step_{s}_.txt" for s in range(3)],
    ]
    order = (runs["pt"] / "step_0" / "order.txt").read_text().splitlines()
    for step in range(3):
        merged = (tmp_path / "merged" / "merge_pt" / f"step_{step}_.txt").read_bytes()
        # Byte for byte: each file in step_0's order, followed by one blank line.
        assert merged == b"".join((runs["pt"] / f"step_{step}" / name).read_bytes() + b"\n" for name in order)
        assert merged == (tmp_path / "merged" / "merge_ort" / f"step_{step}_.txt").read_bytes()  # identical runs
    got = (tmp_path / "merged" / "merge_pt" / "step_0_.txt").read_text(encoding="utf-8").split("\n")
    want = _sample_lines()
    assert len(got) == len(want) == 99 and got[-2:] == ["", ""]  # 98 lines, ending in "================\n\n"
    for mine, legacy in zip(got, want, strict=False):
        if not legacy.startswith("min: "):
            assert mine == legacy  # headers, depth prefixes, order, samples, counts, separators
            continue
        assert mine.endswith(" ")
        ours, theirs = parse_statistics_line(mine), parse_statistics_line(legacy)
        for field in ("min", "max", "mean"):  # last float32 bit depends on the CPU's vector ISA (GELU)
            assert ours[field] == pytest.approx(theirs[field], abs=2e-7)
    # std is the true std: the all-ones gradient of the root output has std 0 (legacy printed 3.464101552963257).
    assert (
        got[
            got.index(
                ">MLP_0_0th_output backward run shape: torch.Size([2, 2]) dtype: torch.float32 size: torch.Size([4]) "
            )
            + 1
        ]
        == "min: 1.0 max: 1.0, mean: 1.0, std: 0.0 "
    )


def parse_statistics_line(line):
    parts = line.replace(",", "").split()
    return {parts[i].rstrip(":"): float(parts[i + 1]) for i in range(0, 8, 2)}


def test_merge_rules(runs, tmp_path):
    out = tmp_path / "merged"
    out.mkdir()
    with pytest.raises(FileExistsError, match=f"Output directory {out} already exists. Enable --overwrite"):
        merge_activation_summaries(runs["pt"], runs["ort"], out)
    (out / "stale").write_text("x")
    merge_activation_summaries(runs["pt"], runs["ort"], out, overwrite=True)
    assert not (out / "stale").exists()
    with pytest.raises(FileNotFoundError, match="step_0/order.txt"):
        merge_activation_summaries(tmp_path / "nothing", runs["ort"], tmp_path / "never")
    assert not (tmp_path / "never").exists()  # the order is read before anything is created


def test_merge_orders_steps_naturally_and_skips_missing_files(tmp_path, caplog):
    stats = compute_statistics(torch.ones(2))
    for step in (2, 10):  # no step_0: the lowest step's order.txt is used
        write_statistics(tmp_path / "a", step, "x", "forward", stats)
        write_statistics(tmp_path / "a", step, "y", "forward", stats)
    write_statistics(tmp_path / "b", 2, "x", "forward", stats)
    merge_activation_summaries(tmp_path / "a", tmp_path / "b", tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m" / "merge_pt").iterdir()) == ["step_10_.txt", "step_2_.txt"]
    assert (tmp_path / "m" / "merge_ort" / "step_2_.txt").read_text() == (
        tmp_path / "b" / "step_2" / "x_forward"
    ).read_text() + "\n"
    assert f"tensor {tmp_path / 'b' / 'step_2' / 'y_forward'} not exist" in caplog.text
    report = compare_activation_summaries(tmp_path / "a", tmp_path / "b")
    assert [s.step for s in report.steps] == ["step_2", "step_10"]
    assert report.steps[0].missing_in_ort == ["y_forward"] and report.steps[1].only_in == "pt"
    assert report.first_divergence is None


def test_identical_runs_show_no_divergence(runs):
    report = compare_activation_summaries(runs["pt"], runs["ort"])
    assert report.first_divergence is None
    assert [(s.step, s.compared, s.largest) for s in report.steps] == [(f"step_{i}", 14, []) for i in range(3)]
    text = report.format()
    assert "step_0: 14 activations compared, no divergence beyond tolerance" in text
    assert "none (identical statistics)" in text


def test_a_perturbed_weight_is_found_at_its_first_activation(runs):
    report = compare_activation_summaries(runs["pt"], runs["perturbed"], rtol=1e-4, atol=1e-6, top=5)
    assert report.first_divergence == ("step_0", "Linear_4_0th_output_forward")  # fc1 and GELU are unchanged
    step0 = report.steps[0]
    assert all(d.activation == "Linear_4_0th_output_forward" and d.beyond for d in step0.first_divergence)
    assert len(step0.largest) == 5 and step0.largest[0].rel_diff >= step0.largest[-1].rel_diff > 0
    assert {d.activation for d in step0.largest} <= set((runs["pt"] / "step_0" / "order.txt").read_text().split())
    # In later steps the update has spread the change to fc1 (through the gradient), so it diverges first.
    assert report.steps[1].first_divergence[0].activation == "Linear_1_0th_output_forward"
    text = report.format()
    assert "step_0: first divergence: Linear_4_0th_output_forward  [" in text
    assert "largest relative differences (* = beyond tolerance):" in text
    loose = compare_activation_summaries(runs["pt"], runs["perturbed"], rtol=10.0, atol=10.0)
    assert loose.first_divergence is None  # all differences are within a huge tolerance


def _write(root, name, **overrides):
    values = dict(
        shape=(4,),
        dtype="float32",
        min=-1.0,
        max=2.0,
        mean=0.5,
        std=1.0,
        nan=0,
        inf=0,
        neg=1,
        pos=3,
        zero=0,
        samples=[-1.0, 2.0, 0.5, 0.5],
    )
    values.update(overrides)
    write_statistics(root, 0, name, "forward", statistics_from_reductions(**values))


@pytest.mark.parametrize(
    ("override", "diverges"),
    [
        ({"mean": 0.5 + 4e-5}, False),
        ({"mean": 0.5 + 2e-4}, True),
        ({"std": 1.00009}, False),
        ({"max": 2.001}, True),
        ({"nan": 1}, True),
        ({"shape": (2, 2)}, True),
        ({"dtype": "float16"}, True),
        ({"neg": 2, "pos": 2}, False),
    ],
)
def test_tolerance_rules(tmp_path, override, diverges):
    _write(tmp_path / "a", "first")
    _write(tmp_path / "a", "second")
    _write(tmp_path / "b", "first")
    _write(tmp_path / "b", "second", **override)
    report = compare_activation_summaries(tmp_path / "a", tmp_path / "b", rtol=1e-4, atol=1e-6)
    assert report.first_divergence == (("step_0", "second_forward") if diverges else None)


def test_nan_equals_nan(tmp_path):
    _write(tmp_path / "a", "n", mean=float("nan"), std=float("nan"))
    _write(tmp_path / "b", "n", mean=float("nan"), std=float("nan"))
    assert compare_activation_summaries(tmp_path / "a", tmp_path / "b").first_divergence is None
    _write(tmp_path / "c", "n", std=float("nan"))
    assert compare_activation_summaries(tmp_path / "a", tmp_path / "c").first_divergence == ("step_0", "n_forward")


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "orttrainer.debug.merge_activation_summary", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_command_line(runs, tmp_path):
    same = _cli("--pt_dir", runs["pt"], "--ort_dir", runs["ort"], "--output_dir", tmp_path / "m1")
    assert same.returncode == 0, same.stderr
    assert "step_2: 14 activations compared, no divergence beyond tolerance" in same.stdout
    assert f"[WARNING] - Start generating summary per step for [{runs['pt']}]" in same.stderr
    assert "RuntimeWarning" not in same.stderr
    assert (tmp_path / "m1" / "merge_ort" / "step_1_.txt").is_file()


def test_main(runs, tmp_path, capsys):
    code = main(
        [
            "--pt_dir",
            str(runs["pt"]),
            "--ort_dir",
            str(runs["perturbed"]),
            "--output_dir",
            str(tmp_path / "m"),
            "--rtol",
            "1e-3",
            "--atol",
            "1e-5",
            "--top",
            "3",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0  # diverging is a finding, not a failure
    assert "rtol=0.001, atol=1e-05" in out
    assert "step_0: first divergence: Linear_4_0th_output_forward" in out
    assert main(["--pt_dir", str(runs["pt"]), "--ort_dir", str(runs["ort"]), "--output_dir", str(tmp_path / "m")]) == 1
    assert "already exists. Enable --overwrite" in capsys.readouterr().err
    assert (
        main(
            [
                "--pt_dir",
                str(runs["pt"]),
                "--ort_dir",
                str(runs["ort"]),
                "--output_dir",
                str(tmp_path / "m"),
                "--overwrite",
            ]
        )
        == 0
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["--pt_dir", str(runs["pt"])])
    assert exit_info.value.code == 2
    assert "the following arguments are required: --ort_dir, --output_dir" in capsys.readouterr().err
