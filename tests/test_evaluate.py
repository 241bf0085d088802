"""robust_lightning.evaluate: the evaluation callbacks on any nn.Module, from Python. Results are checked against
direct computations (AutoAttack called on the same points, accuracy counted by hand)."""

import json
import re
from pathlib import Path

import pytest
import timm
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import robust_lightning
from helpers import REPO, WNIDS, synthetic_points, train_small_cnn, write_image
from robust_lightning.attacks import AutoAttack
from robust_lightning.cli import main
from robust_lightning.errors import UserError
from robust_lightning.evaluation.autoattack import AutoAttackEvaluation
from robust_lightning.job_signals import JobSignals, JobStopped
from robust_lightning.training import interruption

LINF = [{"norm": "Linf", "eps": 10 / 255}]
QUICK = {"version": "apgd-ce", "options": {"autoattack": {"n_iter": 5}}}


@pytest.fixture(scope="module")
def points():
    return synthetic_points(24, seed=3)


def test_any_module_on_tensors_matches_autoattack_called_directly(trained, points, tmp_path, caplog):
    x, y = points
    result = robust_lightning.evaluate(trained, (x, y), threat_models=LINF, out_dir=tmp_path, batch_size=24, **QUICK)
    section = result["autoattack"]["threat_models"]["Linf-10_255"]
    direct = AutoAttack(trained, norm="Linf", eps=10 / 255, version="apgd-ce", n_iter=5).evaluate(x, y, bs=24)
    assert section["num_points"] == 24
    assert section["clean_accuracy"] == pytest.approx(direct.clean_accuracy)
    assert section["robust_accuracy"] == pytest.approx(direct.robust_accuracy)
    assert 0 < direct.robust_accuracy < direct.clean_accuracy  # the comparison says something
    with torch.no_grad():
        counted = (trained(x).argmax(1) == y).float().mean().item()
    assert result["test"]["metrics"]["test/acc1"] == pytest.approx(counted)
    assert result["test"]["conditions"]["data"]["source"] == "tensors"
    assert json.loads((tmp_path / "results.json").read_text()) == result
    assert (tmp_path / "autoattack" / "Linf-10_255" / "rank0.jsonl").is_file()

    # the same call again resumes from the saved outcomes: nothing attacked twice, the same numbers
    again = robust_lightning.evaluate(trained, (x, y), threat_models=LINF, out_dir=tmp_path, batch_size=24, **QUICK)
    assert "AutoAttack Linf-10_255: resuming, 24 images already done" in caplog.text
    assert again["autoattack"]["threat_models"]["Linf-10_255"]["robust_accuracy"] == section["robust_accuracy"]
    assert again["autoattack"]["threat_models"]["Linf-10_255"]["seconds_this_session"] == {}


def test_a_dataloader_and_a_normaliser(trained, points):
    """A DataLoader of (images, labels) gives what the tensors give; a model that expects normalised input is
    evaluated behind mean/std exactly as the same model with the normaliser built in."""
    x, y = points
    mean, std = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)

    class Normalised(nn.Module):  # takes (x - mean) / std
        def forward(self, z):
            shift = torch.tensor(mean).view(1, 3, 1, 1)
            scale = torch.tensor(std).view(1, 3, 1, 1)
            return trained(z * scale + shift)

    loader = DataLoader(TensorDataset(x, y), batch_size=5)
    behind = robust_lightning.evaluate(Normalised(), loader, threat_models=LINF, mean=mean, std=std, **QUICK)
    plain = robust_lightning.evaluate(trained, (x, y), threat_models=LINF, **QUICK)
    for key in ("clean_accuracy", "robust_accuracy"):
        assert behind["autoattack"]["threat_models"]["Linf-10_255"][key] == pytest.approx(
            plain["autoattack"]["threat_models"]["Linf-10_255"][key], abs=1 / 24 + 1e-9
        )  # float error at most
    assert behind["test"]["metrics"]["test/acc1"] == pytest.approx(plain["test"]["metrics"]["test/acc1"])


def test_an_imagenet_val_root_with_the_projects_preprocessing(tmp_path):
    """A folder val tree is read as data.* reads it: labels from ImageNet's map, resize and centre crop."""
    for i, wnid in enumerate(WNIDS):
        write_image(tmp_path / "val" / wnid / f"ILSVRC2012_val_{i + 1:08d}.JPEG", seed=i)
    torch.manual_seed(0)
    model = timm.create_model("test_resnet", num_classes=1000).eval()
    result = robust_lightning.evaluate(
        model, tmp_path, threat_models=[{"norm": "L2", "eps": 0.5}], image_size=32, num_workers=0, **QUICK
    )
    assert result["autoattack"]["threat_models"]["L2-0.5"]["num_points"] == 3
    assert result["test"]["conditions"]["data"]["image_size"] == 32
    with pytest.raises(UserError, match="the model has 10 classes, the data's class map 1000"):
        robust_lightning.evaluate(train_small_cnn(), tmp_path, image_size=32)

    # the whole card by name: its parts are the callbacks', the benchmarks without a root are listed as skipped
    card = robust_lightning.evaluate(
        model,
        tmp_path,
        ["card"],
        image_size=32,
        num_workers=0,
        out_dir=tmp_path / "c",
        datasets={"imagenet_c": "generated"},
        version="apgd-ce",
        options={
            "autoattack": {"n_iter": 3},
            "imagenet_c": {"severities": [1]},
            "resolution_sweep": {"resolutions": [32, 48]},
        },
    )
    assert card["card"]["parts"] == ["autoattack", "imagenet_c", "resolution_sweep"]
    assert {"autoattack", "imagenet_c", "resolution_sweep", "test"} <= set(card)
    assert card["autoattack"]["threat_models"].keys() == {"Linf-4_255", "L2-2", "L1-75"}  # the card's three
    # out_dir holds the card and its plots (README: results.json, the card, plots, outcomes)
    assert {"robustness_card.md", "results.json", "resolution_sweep.png", "imagenet_c_errors.png", "autoattack"} <= {
        path.name for path in (tmp_path / "c").iterdir()
    }


def test_bad_input_is_one_clear_message(trained, points):
    x, y = points
    with pytest.raises(UserError, match=r"images must be in \[0, 1\] \(the model's normalisation goes in mean/std\)"):
        robust_lightning.evaluate(trained, (x * 2 - 1, y))
    with pytest.raises(
        UserError,
        match=r"labels must be class indices of the model's 10 classes, got values in "
        r"\[1, 10\]",
    ):
        robust_lightning.evaluate(trained, (x, torch.where(y == 0, 10, y)))
    with pytest.raises(
        UserError,
        match=r"the model must return logits of shape \(N, classes\); on 2 images it "
        r"returned \(2, 32, 8, 8\)",
    ):
        robust_lightning.evaluate(trained[:4], (x, y))
    with pytest.raises(UserError, match="unknown evaluation 'autoatack'; the evaluations are autoattack, "):
        robust_lightning.evaluate(trained, (x, y), ["autoatack"])
    with pytest.raises(UserError, match=r"evaluation 'imagenet_r' needs its dataset root"):
        robust_lightning.evaluate(trained, (x, y), ["imagenet_r"])
    with pytest.raises(UserError, match="a preprocessing of its own .*give evaluate an ImageNet val root"):
        robust_lightning.evaluate(trained, (x, y), ["resolution_sweep"])
    with pytest.raises(UserError, match="data must be an .images, labels. pair of tensors"):
        robust_lightning.evaluate(trained, x)


def test_the_docs_notebook_example_runs(points):
    """The notebook example of docs/evaluation.md, as printed there, on a small model and points."""
    block = re.search(
        r"```python\n(import robust_lightning\n\nresult = robust_lightning\.evaluate.*?)```",
        (REPO / "docs" / "evaluation.md").read_text(),
        re.S,
    )
    assert block, "docs/evaluation.md lost its notebook example"
    x, y = points
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 10)).eval()  # untrained: every attack ends fast
    scope = {"model": model, "x": x[:4], "y": y[:4]}
    exec(block.group(1), scope)  # noqa: S102 - the docs' own code
    linf = scope["result"]["autoattack"]["threat_models"]["Linf-4_255"]
    assert linf["num_points"] == 4 and 0 <= linf["robust_accuracy"] <= linf["clean_accuracy"]
    assert not Path("results.json").exists()  # without out_dir nothing is left behind


def test_a_leaderboard_claim_only_for_the_leaderboards_evaluation(trained, points, tmp_path, capsys, monkeypatch):
    """robust-lightning claim refuses a results.json of any other evaluation, naming every difference; for the
    leaderboard's (the same file with its data and counts made the leaderboard's) it writes RobustBench's
    model-info JSON."""
    x, y = points
    monkeypatch.chdir(tmp_path)  # the claim's default output is relative to the working directory
    robust_lightning.evaluate(
        trained, (x, y), threat_models=[{"norm": "Linf", "eps": 4 / 255}], out_dir=tmp_path, batch_size=24
    )
    results = tmp_path / "results.json"
    assert main(["claim", str(tmp_path), "--model_name", "Me2026Robust"]) == 2
    err = capsys.readouterr().err
    assert "is not an evaluation the leaderboard accepts" in err and "Traceback" not in err
    assert "24 images evaluated, not the leaderboard's 5000" in err
    assert "data source 'tensors'" in err and "evaluation subset None, not 'robustbench'" in err
    assert not (tmp_path / "model_info").exists()

    content = json.loads(results.read_text())
    linf = content["autoattack"]["threat_models"]["Linf-4_255"]
    linf.update(num_points=5000, clean_accuracy=0.72724, robust_accuracy=0.49456)
    content["test"]["conditions"]["data"] = {
        "source": "shards",
        "eval_split": "val",
        "imagenet_val": True,
        "eval_subset": "robustbench",
        "eval_limit": None,
        "image_size": 224,
        "eval_preprocessing": "resize 256 bicubic, center crop 224",
    }
    results.write_text(json.dumps(content))
    out = tmp_path / "claims" / "Me2026Robust.json"
    assert (
        main(
            [
                "claim",
                str(results),
                "--model_name",
                "Me2026Robust",
                "--architecture",
                "ConvNeXt-T + ConvStem",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    info = json.loads(out.read_text())
    assert (info["clean_acc"], info["autoattack_acc"], info["eps"], info["dataset"]) == (
        "72.72",
        "49.46",
        "4/255",
        "imagenet",
    )
    assert info["architecture"] == "ConvNeXt-T + ConvStem" and info["number_forward_passes"] == 1
    # without --out: RobustBench's layout, model_info/imagenet/<threat model>/<name>.json, as the README says
    assert main(["claim", str(results), "--model_name", "Me2026Robust", "--architecture", "ConvNeXt-T + ConvStem"]) == 0
    assert json.loads((tmp_path / "model_info" / "imagenet" / "Linf" / "Me2026Robust.json").read_text()) == info
    assert {key for key, value in info.items() if value is None} == {
        "link",
        "name",
        "authors",
        "additional_data",
        "venue",
        "reported",
    }
    assert "standard AutoAttack (fast engine, fp32 (TF32 off), seed 0)" in info["footnote"]
    assert info["unreliable"] is False  # no check of the reference AutoAttack was raised
    # RobustBench's ModelInfo (robustbench/utils.py) takes exactly these fields, and its model_info JSON files
    # also carry "unreliable"
    assert set(info) <= {
        "unreliable",
        "link",
        "name",
        "authors",
        "additional_data",
        "number_forward_passes",
        "dataset",
        "venue",
        "architecture",
        "eps",
        "clean_acc",
        "reported",
        "corruptions_acc",
        "corruptions_acc_3d",
        "corruptions_mce",
        "corruptions_mce_3d",
        "autoattack_acc",
        "footnote",
    }

    # a raised check: the claim is written, marked unreliable, and says so
    capsys.readouterr()
    linf["checks"]["randomized"] = {"raised": True, "figures": {}, "advice": "use version='rand'"}
    results.write_text(json.dumps(content))
    assert main(["claim", str(results), "--model_name", "Me2026Robust", "--out", str(out)]) == 0
    flagged = json.loads(out.read_text())
    assert (
        flagged["unreliable"] is True and "The reference AutoAttack's checks raised: randomized." in flagged["footnote"]
    )
    assert "checks randomized were raised" in capsys.readouterr().out

    content["autoattack"]["conditions"]["version"] = "apgd-ce"
    linf["claims_refuted_in_fp32_this_session"] = {"apgd-ce": 2}
    results.write_text(json.dumps(content))
    assert main(["claim", str(results), "--model_name", "Me2026Robust", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "AutoAttack version 'apgd-ce', not 'standard'" in err and "refuted {'apgd-ce': 2}" in err


DDP_SCRIPT = """
import json, sys
import torch
import robust_lightning
from helpers import synthetic_points, train_small_cnn

model = train_small_cnn()  # the architecture; its weights are the test's (training differs across thread counts)
model.load_state_dict(torch.load(sys.argv[2], weights_only=True))
x, y = synthetic_points(24, seed=3)
result = robust_lightning.evaluate(model, (x, y), threat_models=[{"norm": "Linf", "eps": 10 / 255}],
                                   version="apgd-ce", options={"autoattack": {"n_iter": 5}}, out_dir=sys.argv[1],
                                   accelerator="cpu", devices=2, strategy="ddp", batch_size=24)
rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
json.dump(result, open(f"{sys.argv[1]}/returned-rank{rank}.json", "w"))
"""


def test_two_devices_split_the_images_and_return_the_same_result(trained, points, tmp_path):
    """Under DDP (2 CPU ranks, killed after the time limit) every image is attacked once, on one rank, as
    AutoAttack attacks that rank's share directly, and both ranks return results.json's sections."""
    from helpers import run_command

    script = tmp_path / "evaluate_ddp.py"
    script.write_text(DDP_SCRIPT)
    torch.save(trained.state_dict(), tmp_path / "weights.pt")
    done = run_command(
        [str(tmp_path / "out"), str(tmp_path / "weights.pt")],
        cwd=tmp_path,
        timeout=240,
        script=script,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    returned = [json.loads((tmp_path / "out" / f"returned-rank{r}.json").read_text()) for r in (0, 1)]
    assert returned[0] == returned[1] == json.loads((tmp_path / "out" / "results.json").read_text())
    assert returned[0]["test"]["conditions"]["world_size"] == 2
    section = returned[0]["autoattack"]["threat_models"]["Linf-10_255"]
    x, y = points
    robust = []
    for rank in (0, 1):
        path = tmp_path / "out" / "autoattack" / "Linf-10_255" / f"rank{rank}.jsonl"
        [record] = [json.loads(line) for line in path.read_text().splitlines()]  # one batch per rank
        index = [int(key) for key in record["key"]]
        direct = AutoAttack(trained, norm="Linf", eps=10 / 255, version="apgd-ce", n_iter=5).evaluate(
            x[index], y[index], bs=len(index)
        )
        assert record["robust"] == direct.robust.tolist() and record["clean"] == direct.clean.tolist()
        robust += record["robust"]
    assert section["num_points"] == 24 and section["robust_accuracy"] == pytest.approx(sum(robust) / 24)


def test_a_stopped_card_frees_its_outcome_folders_for_the_next_call_in_the_same_process(
    trained, points, tmp_path, monkeypatch
):
    """A notebook keeps the last exception, and with its traceback the stopped call's callbacks. Lightning calls
    on_exception on a stop, not teardown, and the card passes it on to its parts, which free their outcome folders:
    the next call in the same process goes on from the kept outcomes to the numbers of a call left alone."""
    x, y = points
    # of the card's parts, tensors of 10 classes feed only AutoAttack; the sanity checks are another test's
    options = {"autoattack": {"n_iter": 5, "sanity_points": 0}}
    settings = {"threat_models": LINF, "batch_size": 12, "version": "apgd-ce", "options": options}
    alone = robust_lightning.evaluate(trained, (x, y), ["card"], out_dir=tmp_path / "alone", **settings)
    original = AutoAttackEvaluation.on_test_batch_end

    def stop_after_the_batch(self, *args, **kwargs):
        original(self, *args, **kwargs)
        monkeypatch.setattr(JobSignals, "sigterm", True)  # what the SIGTERM handler notes

    monkeypatch.setattr(AutoAttackEvaluation, "on_test_batch_end", stop_after_the_batch)
    with pytest.raises(JobStopped) as stopped:  # kept, with its traceback, as a notebook keeps it
        robust_lightning.evaluate(trained, (x, y), ["card"], out_dir=tmp_path / "stopped", **settings)
    monkeypatch.setattr(AutoAttackEvaluation, "on_test_batch_end", original)
    monkeypatch.setattr(JobSignals, "sigterm", False)
    again = robust_lightning.evaluate(trained, (x, y), ["card"], out_dir=tmp_path / "stopped", **settings)
    assert stopped.value is not None
    sections = [result["autoattack"]["threat_models"]["Linf-10_255"] for result in (alone, again)]
    for section in sections:
        section.pop("seconds_this_session")
        section.pop("claims_refuted_in_fp32_this_session", None)
    assert sections[0] == sections[1] and sections[0]["num_points"] == 24


@pytest.mark.parametrize("taken", [True, False])
def test_a_stop_by_slurms_requeue_signal_is_named_so(trained, points, tmp_path, monkeypatch, capsys, taken):
    """SLURM's requeue signal stops evaluate as SIGTERM does, and its message says what happens next: the requeued
    job runs the script again, or the requeue failed. ``scontrol`` is stood in for (no SLURM here)."""
    x, y = points
    monkeypatch.setattr(interruption, "requeue_this_job", lambda signum, then: taken)

    class NotingTheSignal(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = trained

        def forward(self, images):
            monkeypatch.setattr(JobSignals, "requeue", True)  # what the requeue signal's handler notes
            return self.net(images)

    with pytest.raises(JobStopped):
        robust_lightning.evaluate(
            NotingTheSignal(), (x, y), threat_models=LINF, out_dir=tmp_path, batch_size=12, **QUICK
        )
    message = capsys.readouterr().err.strip().splitlines()[-1]
    if taken:
        assert message == (
            "robust_lightning: evaluate stopped for SLURM's requeue; the requeued job runs the script again, and "
            f"the same call with out_dir={tmp_path} goes on"
        )
    else:
        assert message.startswith("robust_lightning: evaluate stopped by SLURM's requeue signal, but the requeue")
