"""benchmarks/gpu_suite.py, the suite a GPU window runs: its --smoke run on the CPU (the same code paths as on a GPU,
tiny sizes) must measure every section, so that the suite cannot rot between GPU windows; its time limits, its
batch search and its package check are tested on their own."""

import importlib.util
import json
import re
import signal
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from helpers import REPO
from robust_lightning.training.lightning_module import ImageClassifier

SUITE = REPO / "benchmarks" / "gpu_suite.py"


@pytest.fixture(scope="module")
def suite():
    spec = importlib.util.spec_from_file_location("gpu_suite_under_test", SUITE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_suite(*args: str, limit: float) -> subprocess.CompletedProcess:
    """The suite as a user starts it, under a hard limit: at the limit it gets SIGTERM (its sections' process groups
    are killed on its way out), then SIGKILL, and the test fails."""
    process = subprocess.Popen(
        [sys.executable, str(SUITE), *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        try:
            process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
        pytest.fail(f"the suite ran past {limit} s")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu-suite") / "gpu_suite.json"
    # a budget above the default 170 s: the other tests run beside this one (the default is for a quiet machine,
    # where the smoke run takes about 2 minutes)
    result = run_suite("--smoke", "--budget", "400", "--out", str(out), limit=480)
    log = out.with_suffix(".log")
    assert result.returncode == 0, result.stdout + result.stderr + (log.read_text()[-6000:] if log.exists() else "")
    return {"report": json.loads(out.read_text()), "stdout": result.stdout}


def test_the_smoke_run_passes_every_section_within_its_budget(smoke):
    report = smoke["report"]
    assert list(report["sections"]) == ["steps", "fit", "autoattack", "max_batch", "compile"]
    assert {name: section["status"] for name, section in report["sections"].items()} == dict.fromkeys(
        report["sections"], "ok"
    )
    assert report["smoke"] is True and report["seconds"] <= report["budget_s"] == 400
    assert re.fullmatch(r"python\S* \S*gpu_suite.py --smoke --budget 400 --out \S+gpu_suite.json", report["command"])
    # the table is what the run prints last, before the file names
    lines = smoke["stdout"].strip().splitlines()
    assert lines[-1].startswith("figures: ") and ".log" in lines[-1]
    header = next(i for i, line in enumerate(lines) if line.startswith("section "))
    assert all(re.match(r"(steps|fit|autoattack|compile|max_batch) ", line) for line in lines[header + 1 : -1])


def test_the_steps_count_more_work_for_the_adversarial_step(smoke):
    steps = smoke["report"]["sections"]["steps"]
    assert steps["device"] == "cpu" and steps["bf16_ceiling_tflops"] > 0
    for arch in ("convnext_atto_convstem", "test_vit"):
        figures = steps[arch]
        assert figures["batch"] == 4 and figures["resolution"] == 32
        # the forward's FLOPs, counted here on a model of the same architecture and batch
        module = ImageClassifier(arch=arch, num_classes=1000, image_size=32)
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            module(torch.rand(4, 3, 32, 32))
        assert figures["forward_gflop"] == round(counter.get_total_flops() / 1e9, 2)
        # on the CPU, models without BatchNorm reuse the attack's last forward: 7 passes, not 8
        assert (figures["clean_passes"], figures["at_passes"]) == (3, 7)
        assert figures["at_step_s"] > 0 and figures["clean_step_s"] > 0
        # the figure is rounded to 0.1 image/s: on a slow CPU (4 images/s) that is more than 1%
        assert figures["at_images_per_s"] == pytest.approx(4 / figures["at_step_s"], rel=0.01, abs=0.06)
    assert "at_cudnn_benchmark_over_at" in steps["convnext_atto_convstem"]  # ConvNeXt only
    assert "at_cudnn_benchmark_over_at" not in steps["test_vit"]


def test_the_fit_runs_the_recipe_from_the_suites_shards_with_the_probe(smoke):
    fit = smoke["report"]["sections"]["fit"]
    assert "configs/recipes/convnext_tiny_convstem.yaml" in fit["command"]
    # 3 optimiser steps of 16 images, one logging window each: the first window (start-up) is left out
    assert fit["throughput"]["steps"] == 2 and fit["throughput"]["images_per_device"] == 32
    assert fit["throughput"]["images_per_s"] > 0 and 0 <= fit["throughput"]["data_wait_share"] <= 1
    assert fit["step_synchronisations"] == []  # the probe ran (a CPU records none); None if it had not


def test_autoattack_runs_both_engines_on_the_same_points(smoke, suite, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # measured_hours reads autoattack_cost.py's pass counts
    autoattack = smoke["report"]["sections"]["autoattack"]
    runs = {name: autoattack[name] for name in ("reference_fp32", "fast_fp32", "fast_tf32")}
    assert len({run["clean_accuracy"] for run in runs.values()}) == 1  # one model, the same points
    for name, run in runs.items():
        assert 0 <= run["robust_accuracy"] <= run["clean_accuracy"] <= 1
        # the reference AutoAttack's checks are part of every run (robust_lightning.attacks.checks)
        assert set(run["seconds_per_attack"]) == {"clean", "checks", "apgd-ce", "apgd-t", "fab-t", "square"}
        assert list(run["robust_after"]) == ["apgd-ce", "apgd-t", "fab-t", "square"]
        if name != "reference_fp32":
            assert 0 <= run["agreement"] <= 1 and run["speedup"] > 0
    assert autoattack["attack_synchronisations"] == {"apgd-ce": [], "apgd-t": [], "fab-t": [], "square": []}
    costs = autoattack["pass_costs_ms_per_image"]
    assert costs.pop("model") == "test_convnext" and set(costs) == {"fp32", "tf32"}
    # the hours follow from the printed per-pass costs (rounded to 4 decimals of a ms) and the pass counts
    seconds = {p: {k: v / 1000 for k, v in c.items()} for p, c in costs.items()}
    expected = suite.measured_hours(seconds)
    assert autoattack["hours_per_checkpoint"] == pytest.approx(expected, rel=1e-3, abs=0.01)


def test_compile_and_max_batch_report_their_figures(smoke):
    compiled = smoke["report"]["sections"]["compile"]["test_vit"]
    assert len(compiled["at_compiled_warmup_calls_s"]) >= 3 and compiled["at_compiled_images_per_s"] > 0
    assert isinstance(compiled["at_compiled_compile_s"], float) and compiled["at_compiled_over_at"] > 0
    max_batch = smoke["report"]["sections"]["max_batch"]
    for arch in ("convnext_atto_convstem", "test_vit"):
        # nothing runs out of memory on the CPU: doubling from 4 stops at the smoke limit of 16
        assert max_batch[arch]["tried"] == {"4": "fits", "8": "fits", "16": "fits"}
        assert (max_batch[arch]["largest"], max_batch[arch]["smallest_failing"]) == (16, None)


@pytest.mark.parametrize("threshold", [1, 7, 8, 100, 173, 174, 175, 400, 1000, 1391, 4095, 4096, 5000])
def test_the_batch_search_brackets_the_largest_batch_that_fits(suite, threshold):
    tried = []

    def fits(batch):
        tried.append(batch)
        return batch <= threshold

    fitting, failing = suite.largest_batch(fits, start=174, limit=4096, granularity=8)
    if threshold >= 2784:  # 174 x 16 fits, 174 x 32 is past the limit: never tried
        assert (fitting, failing) == (2784, None)
        return
    assert fitting <= threshold < failing and failing - fitting <= 8
    assert len(tried) == len(set(tried)) <= 2 * 12  # doubling, then halving: logarithmic


@pytest.mark.parametrize("threshold", [1, 300, 1900, 1983, 1984, 2000, 2087, 2200, 4096, 5000])
def test_the_batch_search_from_a_predicted_batch_brackets_it_in_few_tries(suite, threshold):
    tried = []

    def fits(batch):
        tried.append(batch)
        return batch <= threshold

    fitting, failing = suite.largest_batch(fits, start=1984, limit=4096, granularity=8, growth=1.05)
    if threshold >= 4096:  # 5 % steps up to the limit: the last one fits
        assert failing is None and fitting <= 4096 < max(int(fitting * 1.05), fitting + 8)
        return
    assert fitting <= threshold < failing and failing - fitting <= 8
    if 1900 <= threshold <= 2087:  # within 5 % of the prediction: a step of 5 %, then a few halvings
        assert len(tried) <= 7, tried


def test_the_predicted_batch_follows_the_line_through_the_two_largest_measured_peaks(suite):
    # the ConvNeXt-T + ConvStem AT step on an H200 (benchmarks/RESULTS.md): 2000 fitted, 2088 did not
    peaks = {174: 11.91, 348: 23.8}
    per_image = (23.8 - 11.91) / 174
    expected = int(348 + (0.97 * 139.8 - 23.8) / per_image)
    assert suite.predicted_largest_batch(peaks, 139.8) == expected
    assert 1950 < expected < 2088
    # what ran out of memory, or a CPU's "fits", is no measured point
    assert suite.predicted_largest_batch({174: 11.91, 348: "out of memory", 96: 6.6}, 139.8) == int(
        174 + (0.97 * 139.8 - 11.91) / ((11.91 - 6.6) / 78)
    )
    assert suite.predicted_largest_batch({4: "fits", 8: "fits"}, 139.8) is None
    assert suite.predicted_largest_batch({174: 11.91}, 139.8) is None


def test_each_section_gets_its_share_and_what_earlier_ones_left(suite, tmp_path, monkeypatch, capsys):
    """compile and max_batch share 20 s as 50 : 15 (their --smoke seconds); a section that ends early leaves its
    time to the next, one that runs to its limit leaves the next less than 5 s: it is skipped."""
    clock = [0.0]
    monkeypatch.setattr(suite.time, "monotonic", lambda: clock[0])
    for compile_uses_its_limit, expected in ((False, [20 * 50 / 65, 20.0]), (True, [20 * 50 / 65])):
        limits = []

        def section(command, limit, log, uses_limit=compile_uses_its_limit, limits=limits):
            limits.append(limit)
            clock[0] += limit if uses_limit else 0.5
            return f"stopped at its limit of {limit:.0f} s" if uses_limit else "ok"

        monkeypatch.setattr(suite, "run_child", section)
        out = tmp_path / f"{compile_uses_its_limit}.json"
        monkeypatch.setattr(sys, "argv", ["gpu_suite.py", "--smoke", "--sections", "compile", "max_batch"])
        monkeypatch.setattr(sys, "argv", [*sys.argv, "--budget", "20", "--out", str(out)])
        code = suite.main()
        assert limits == pytest.approx([x - 0.5 * i for i, x in enumerate(expected)], abs=1e-9)
        sections = json.loads(out.read_text())["sections"]
        if compile_uses_its_limit:
            assert code == 1 and sections["compile"]["status"] == "stopped at its limit of 15 s"
            assert sections["max_batch"] == {"status": "skipped: no time left in the budget"}
        else:
            assert code == 0 and [s["status"] for s in sections.values()] == ["ok", "ok"]
    assert "skipped: no time left in the budget" in capsys.readouterr().out


def test_a_section_past_its_limit_is_killed_with_every_process_it_started(suite, tmp_path):
    pid_file = tmp_path / "grandchild"
    # the grandchild's pid and start time (a pid alone may be another process's by the time it is looked up)
    code = (
        "import subprocess, time; child = subprocess.Popen(['sleep', '120']); "
        f"start = open(f'/proc/{{child.pid}}/stat').read().rsplit(')', 1)[1].split()[19]; "
        f"open({str(pid_file)!r}, 'w').write(f'{{child.pid}} {{start}}'); time.sleep(120)"
    )
    started = time.monotonic()
    with open(tmp_path / "log", "w") as log:
        assert suite.run_child([sys.executable, "-c", code], 3, log) == "stopped at its limit of 3 s"
    assert time.monotonic() - started < 15
    pid, start = pid_file.read_text().split()

    def grandchild_alive() -> bool:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            return False
        return fields[19] == start and fields[0] not in "ZX"  # not dead awaiting its reaper

    # SIGKILL is delivered when the process is next scheduled, which on a loaded machine takes a moment
    deadline = time.monotonic() + 10
    while grandchild_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not grandchild_alive()
    with open(tmp_path / "log", "w") as log:
        assert suite.run_child([sys.executable, "-c", "raise SystemExit(3)"], 10, log) == "failed (exit 3; see the log)"
        assert suite.run_child([sys.executable, "-c", "pass"], 10, log) == "ok"


def test_missing_packages_are_named_with_the_way_to_bring_them(suite, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(suite, "REQUIRED", (*suite.REQUIRED, "no_such_package_here"))
    monkeypatch.setattr(sys, "argv", ["gpu_suite.py", "--out", str(tmp_path / "x.json")])
    assert suite.main() == 2
    error = capsys.readouterr().err
    assert "missing packages: no_such_package_here." in error and "benchmarks/gpu_packages.sh" in error
    assert not (tmp_path / "x.json").exists()


def test_the_packages_carried_to_the_gpu_are_the_environments_versions():
    script = (REPO / "benchmarks" / "gpu_packages.sh").read_text()
    pins = dict(re.findall(r"([A-Za-z_]+)==([0-9.]+)", script))
    for name in ("jsonargparse", "docstring_parser", "typeshed_client", "kornia", "kornia_rs", "webdataset"):
        assert pins[name] == version(name), name
    for name in ("braceexpand", "timm", "pyautoattack"):
        assert pins[name] == version(name), name


def test_synchronisations_are_grouped_by_place(suite):
    places = ["robust_lightning/a.py:3 in f", "robust_lightning/a.py:3 in f", "lightning/b.py:9 in g"]
    assert suite.grouped(places) == "robust_lightning/a.py:3 in f x 2, lightning/b.py:9 in g x 1"
    assert suite.grouped([]) == ""
