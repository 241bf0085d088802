"""ImageNet-C: CE / mCE arithmetic against the data files read independently, the data files themselves,
no re-resizing of the released 224 images, layout errors, and one run through the CLI on a tiny replica.
ImageNet-C generated on the fly (source: generated): a CLI run on a tiny val tree against a direct computation,
its checks before any work, and (in the DDP test) each image counted once across ranks.
(The corruptions themselves are tested against the reference in tests/test_corruptions.py.)"""

import csv
import json
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from helpers import run_command
from robust_lightning.data.datamodule import ImageNetDataModule
from robust_lightning.data.sources import SyntheticSource
from robust_lightning.errors import UserError
from robust_lightning.evaluation import imagenet_c
from robust_lightning.evaluation.corruptions import CorruptedEvalTransform
from robust_lightning.evaluation.imagenet_c import (
    ALEXNET_CLEAN_ERROR,
    ALL,
    ALL_IMAGES,
    STANDARD,
    ImageNetC,
    alexnet_errors_per_severity,
    alexnet_mean_errors,
    corruption_errors,
    imagenet_c_cells,
    images_short_of_the_benchmark,
)
from robust_lightning.job_signals import JobSignals, JobStopped
from robust_lightning.paths import DATA_DIR
from shift_data import imagenet_c_config, imagenet_c_tree, write_square

WNIDS = ("n01440764", "n01443537", "n15075141")  # ImageNet labels 0, 1, 999
LAYOUT = r"<root>/<corruption>/<severity 1\.\.5>/<wnid>/\*\.JPEG"


def read_csv(name: str) -> list[dict[str, str]]:
    with open(DATA_DIR / name, newline="") as f:
        return list(csv.DictReader(f))


# -------------------------------------------------------------------------------------------- data files
def test_alexnet_data_files_parse():
    per_severity = read_csv("imagenet_c_alexnet_err_per_severity.csv")
    assert [r["corruption"] for r in per_severity] == list(STANDARD)
    for row in per_severity:
        values = [float(row[f"sev{s}"]) for s in range(1, 6)]
        assert all(0 < v < 1 for v in values) and np.mean(values) == pytest.approx(float(row["mean"]), abs=1e-9)
    baselines = read_csv("imagenet_c_alexnet_baselines.csv")
    assert [r["corruption"] for r in baselines] == list(ALL) and len(ALL) == 19
    assert all(0 < float(r["alexnet_err"]) < 1 for r in baselines)
    # the module reads the same numbers
    assert alexnet_errors_per_severity()["fog"] == (0.67474, 0.76050, 0.84378, 0.87260, 0.94500)
    assert alexnet_mean_errors()["saturate"] == 0.6583
    for row in per_severity:  # the means of the two files agree
        assert alexnet_mean_errors()[row["corruption"]] == float(row["mean"])


# ------------------------------------------------------------------------------------------------ metrics
def test_mce_and_relative_mce_match_explicit_arithmetic():
    alexnet = {
        r["corruption"]: [float(r[f"sev{s}"]) for s in range(1, 6)]
        for r in read_csv("imagenet_c_alexnet_err_per_severity.csv")
    }
    errors = {c: {s: 0.3 + 0.1 * s + 0.004 * i for s in range(1, 6)} for i, c in enumerate(STANDARD)}
    clean = 0.25
    result = corruption_errors(errors, clean_error=clean)

    ce = [sum(errors[c][s] for s in range(1, 6)) / sum(alexnet[c]) for c in STANDARD]
    relative = [
        sum(errors[c][s] - clean for s in range(1, 6)) / sum(a - ALEXNET_CLEAN_ERROR for a in alexnet[c])
        for c in STANDARD
    ]
    assert result["ce"]["gaussian_noise"] == pytest.approx(
        (0.4 + 0.5 + 0.6 + 0.7 + 0.8) / (0.69528 + 0.82542 + 0.93554 + 0.98138 + 0.99452), abs=1e-12
    )
    assert [result["ce"][c] for c in STANDARD] == pytest.approx(ce, abs=1e-12)
    assert result["mce"] == pytest.approx(sum(ce) / 15, abs=1e-12)
    assert result["relative_mce"] == pytest.approx(sum(relative) / 15, abs=1e-12)
    assert "mce_partial" not in result
    # AlexNet against itself: every CE and the mCE are exactly 1
    itself = corruption_errors({c: dict(zip(range(1, 6), alexnet[c])) for c in STANDARD}, ALEXNET_CLEAN_ERROR)
    assert itself["mce"] == pytest.approx(1.0) and itself["relative_mce"] == pytest.approx(1.0)


def test_partial_evaluations_get_a_different_key_and_extras_need_all_severities():
    alexnet = {
        r["corruption"]: [float(r[f"sev{s}"]) for s in range(1, 6)]
        for r in read_csv("imagenet_c_alexnet_err_per_severity.csv")
    }
    extra_mean = {r["corruption"]: float(r["alexnet_err"]) for r in read_csv("imagenet_c_alexnet_baselines.csv")}
    errors = {
        "fog": {1: 0.3, 3: 0.5},
        "snow": {1: 0.4, 3: 0.6},
        "spatter": {1: 0.5, 3: 0.5},
        "saturate": {s: 0.2 for s in range(1, 6)},
    }
    result = corruption_errors(errors)  # no clean error: relative values are None
    fog = 0.8 / (alexnet["fog"][0] + alexnet["fog"][2])
    snow = 1.0 / (alexnet["snow"][0] + alexnet["snow"][2])
    assert "mce" not in result and "relative_mce" not in result
    assert result["mce_partial"] == {
        "value": pytest.approx((fog + snow) / 2, abs=1e-12),
        "corruptions": ["snow", "fog"],
        "severities": [1, 3],
        "images": ALL_IMAGES,
    }
    assert result["relative_mce_partial"]["value"] is None
    assert result["ce"]["spatter"] is None  # only the 5-severity mean is published for the extra corruptions
    assert result["ce"]["saturate"] == pytest.approx(1.0 / (5 * extra_mean["saturate"]), abs=1e-12)


def test_every_cell_on_fewer_images_is_partial_too():
    errors = {c: {s: 0.3 + 0.1 * s for s in range(1, 6)} for c in STANDARD}
    full = corruption_errors(errors, clean_error=0.25)
    fewer = corruption_errors(errors, clean_error=0.25, fewer_images="5000 of the 50000 ImageNet val images")
    assert "mce" not in fewer and "relative_mce" not in fewer
    for key in ("mce", "relative_mce"):  # the same numbers, under the partial key with the images they cover
        assert fewer[f"{key}_partial"] == {
            "value": full[key],
            "corruptions": list(STANDARD),
            "severities": [1, 2, 3, 4, 5],
            "images": "5000 of the 50000 ImageNet val images",
        }
    assert images_short_of_the_benchmark(50_000) is None
    assert images_short_of_the_benchmark(49_999) == "49999 of the 50000 ImageNet val images in the smallest cell"
    assert images_short_of_the_benchmark(50_000, imagenet_val=False) == "50000 images per cell, not of ImageNet val"


# ------------------------------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("grouped", [False, True])
def test_cells_read_both_released_layouts(tmp_path, grouped):
    root = imagenet_c_tree(tmp_path / "c", grouped=grouped)
    cells, groups = imagenet_c_cells(root, ["gaussian_noise", "brightness"], [1, 5])
    assert sorted(cells) == [("brightness", 1), ("brightness", 5), ("gaussian_noise", 1), ("gaussian_noise", 5)]
    assert [label for _, label in cells["brightness", 5]] == [0, 0, 1, 1]
    assert groups == (
        {"gaussian_noise": "noise", "brightness": "weather"}
        if grouped
        else {"gaussian_noise": None, "brightness": None}
    )
    limited, _ = imagenet_c_cells(root, ["brightness"], [2], limit_per_class=1)
    assert [Path(p).name for p, _ in limited["brightness", 2]] == [
        "ILSVRC2012_val_00000000.JPEG",
        "ILSVRC2012_val_10000000.JPEG",
    ]
    capped, _ = imagenet_c_cells(root, ["brightness"], [2], max_images=2)
    assert [label for _, label in capped["brightness", 2]] == [0, 1]  # evenly spaced: both classes


def test_layout_errors_name_the_expected_layout(tmp_path):
    with pytest.raises(UserError, match=rf"nowhere does not exist; expected {LAYOUT}"):
        imagenet_c_cells(tmp_path / "nowhere", ["fog"], [1])
    (tmp_path / "empty" / "cats").mkdir(parents=True)
    with pytest.raises(UserError, match=rf"no corruption folders; expected {LAYOUT}"):
        imagenet_c_cells(tmp_path / "empty", ["fog"], [1])
    root = imagenet_c_tree(tmp_path / "c")
    with pytest.raises(UserError, match=rf"requested corruptions \['contrast'\] not found .*expected {LAYOUT}"):
        imagenet_c_cells(root, ["gaussian_noise", "contrast"], [1])
    (root / "brightness" / "6").mkdir()
    with pytest.raises(UserError, match=rf"severity folders .*'6'.* not among 1..5; expected {LAYOUT}"):
        imagenet_c_cells(root, ["brightness"], [1])
    (root / "brightness" / "6").rmdir()
    write_square(root / "gaussian_noise" / "3" / "n00000000" / "x.JPEG", 0)
    with pytest.raises(UserError, match=rf"unknown wnid folders \['n00000000'\]; expected {LAYOUT}"):
        imagenet_c_cells(root, ["gaussian_noise"], [3])
    imagenet_c_tree(tmp_path / "c", corruptions=("brightness",), grouped=True)  # now both flat and in weather/
    with pytest.raises(UserError, match=r"more than one place"):
        imagenet_c_cells(root, ["brightness"], [1])
    with pytest.raises(UserError, match="unknown"):
        ImageNetC(root=str(root), corruptions=["gaussian_noize"])
    with pytest.raises(UserError, match="among 1..5"):
        ImageNetC(root=str(root), severities=[0, 1])


# ----------------------------------------------------------------------------------------- preprocessing
class Recorder(torch.nn.Module):
    """Stands in for the LightningModule: records every input batch, predicts class 0."""

    def __init__(self, image_size: int):
        super().__init__()
        self.hparams = {"image_size": image_size}
        self.inputs: list[torch.Tensor] = []

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.inputs.append(images.clone())
        logits = torch.zeros(len(images), 1000)
        logits[:, 0] = 1.0
        return logits


def run_callback(
    tmp_path: Path, root: Path, model_size: int, model: Recorder | None = None, **settings
) -> tuple[Recorder, dict]:
    settings = {"corruptions": ["brightness"], "severities": [2], **settings}
    callback = ImageNetC(root=str(root), clean_error=0.1, batch_size=3, num_workers=0, plot=False, **settings)
    trainer = SimpleNamespace(
        world_size=1,
        global_rank=0,
        is_global_zero=True,
        log_dir=str(tmp_path / "run"),
        default_root_dir=str(tmp_path),  # where the prediction rows are kept (tmp_path/predictions)
        precision="32-true",
        strategy=SimpleNamespace(barrier=lambda: None),
        loggers=[],
        global_step=0,
        ckpt_path=None,
        callback_metrics={},
        datamodule=None,
        precision_plugin=SimpleNamespace(test_step_context=nullcontext),
    )
    model = model or Recorder(model_size)
    callback.on_test_start(trainer, model)
    callback.on_test_end(trainer, model)
    return model, json.loads((tmp_path / "run" / "results.json").read_text())["imagenet_c"]


def test_images_at_model_resolution_reach_the_model_as_decoded(tmp_path):
    root = imagenet_c_tree(tmp_path / "c", corruptions=("brightness",))
    model, section = run_callback(tmp_path, root, model_size=32)
    seen = torch.cat(model.inputs)
    files = sorted((root / "brightness" / "2").glob("*/*.JPEG"))
    decoded = (
        torch.stack([torch.from_numpy(np.array(Image.open(f).convert("RGB"))).permute(2, 0, 1) for f in files]).float()
        / 255
    )
    assert seen.shape == (4, 3, 32, 32) and torch.equal(seen, decoded)  # no resize, no crop
    assert section["preprocessing"] == "none (decoded as released)"
    assert section["corruptions"]["brightness"]["acc1"] == {"2": 0.5}  # class 0 predicted: 2 of 4 right


class StoppedAt(Recorder):
    """Predicts from the pixels (another class per image), and notes a job's stop in its ``stop_at``-th pass."""

    def __init__(self, image_size: int, stop_at: int | None = None):
        super().__init__(image_size)
        self.stop_at = stop_at

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.inputs.append(images.clone())
        if len(self.inputs) == self.stop_at:
            JobSignals.sigterm = True
        logits = torch.zeros(len(images), 1000)
        logits[:, 1] = images.float().mean((1, 2, 3)) - 0.5  # class 1 for bright images, else class 0
        return logits


def test_a_stopped_run_keeps_its_batches_and_the_same_run_goes_on_to_the_numbers_left_alone(tmp_path, monkeypatch):
    """A job's signal in the second of three batches: the run stops after it, with the rows of both batches saved;
    the same run again predicts only the third batch's images and publishes the section of the run left alone.
    Run once more, it predicts nothing. The callback runs with a stand-in trainer and without loader workers: what
    is kept does not depend on them, and tests/test_imagenet_p.py's SIGTERM test runs the same prediction loop
    with the config's workers and bars, resuming on two ranks."""
    root = imagenet_c_tree(tmp_path / "c", corruptions=("brightness", "contrast"))  # 8 images, batches of 3
    settings = {"corruptions": ["brightness", "contrast"]}
    alone, alone_section = run_callback(tmp_path / "alone", root, 32, model=StoppedAt(32), **settings)
    assert len(torch.cat(alone.inputs)) == 8

    monkeypatch.setattr(JobSignals, "sigterm", False)
    with pytest.raises(JobStopped):
        run_callback(tmp_path / "stopped", root, 32, model=StoppedAt(32, stop_at=2), **settings)
    monkeypatch.setattr(JobSignals, "sigterm", False)
    resumed, section = run_callback(tmp_path / "stopped", root, 32, model=StoppedAt(32), **settings)
    assert len(torch.cat(resumed.inputs)) == 2  # the third batch only
    assert section == alone_section and 0 < section["mean_acc1"] < 1
    again, _ = run_callback(tmp_path / "stopped", root, 32, model=StoppedAt(32), **settings)
    assert again.inputs == []


def test_images_are_resized_only_for_another_model_resolution(tmp_path):
    root = imagenet_c_tree(tmp_path / "c", corruptions=("brightness",))
    model, section = run_callback(tmp_path, root, model_size=24)
    assert torch.cat(model.inputs).shape == (4, 3, 24, 24)
    assert section["preprocessing"] == "resize 32 x 32 to 24 x 24 (bicubic)"
    assert section["conditions"]["image_size"] == 24


def test_mce_only_on_every_image_of_every_cell(tmp_path, monkeypatch):
    root = imagenet_c_tree(tmp_path / "c", corruptions=STANDARD)  # 4 images per cell
    all_cells = {"corruptions": "standard", "severities": [1, 2, 3, 4, 5]}
    _, partial = run_callback(tmp_path, root, model_size=32, **all_cells)
    assert "mce" not in partial and "relative_mce" not in partial
    assert partial["mce_partial"]["images"] == "4 of the 50000 ImageNet val images in the smallest cell"
    assert partial["relative_mce_partial"]["images"] == partial["mce_partial"]["images"]
    monkeypatch.setattr(imagenet_c, "IMAGENET_VAL_IMAGES", 4)  # as if the tree held all of val
    _, section = run_callback(tmp_path, root, model_size=32, **all_cells)
    assert "mce_partial" not in section and "relative_mce_partial" not in section
    assert section["mce"] == partial["mce_partial"]["value"] and 0 < section["mce"] < 2
    _, section = run_callback(tmp_path, root, model_size=32, max_images=3, **all_cells)  # a quick look
    assert "mce" not in section and section["mce_partial"]["images"].startswith("3 of the 4 ImageNet val images")


# ------------------------------------------------------------------------------------------ through the CLI
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny untrained 1000-class classifier at 32 px that favours class 0, so accuracies are not all zero."""
    from lightning import Trainer

    from robust_lightning.training.lightning_module import ImageClassifier

    torch.manual_seed(0)
    module = ImageClassifier(arch="test_resnet", num_classes=1000, image_size=32)
    with torch.no_grad():
        module.model.net.fc.bias[0] += 3.0
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    path = tmp_path_factory.mktemp("imagenet-c-ckpt") / "tiny.ckpt"
    trainer.save_checkpoint(path)
    return path


def direct_accuracy(checkpoint: Path, cell: Path) -> float:
    """Top-1 of one corruption x severity folder without the callback or Lightning's loops."""
    from robust_lightning.data.classes import class_map
    from robust_lightning.training.lightning_module import ImageClassifier

    module = ImageClassifier.load_from_checkpoint(checkpoint, map_location="cpu", weights_only=True).eval()
    labels = class_map("imagenet")
    right = []
    for path in sorted(cell.glob("*/*.JPEG")):
        image = torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1).float() / 255
        with torch.no_grad():
            right.append(int(module(image[None]).argmax()) == labels[path.parent.name])
    return float(np.mean(right))


def test_cli_run_writes_the_imagenet_c_section(tmp_path, checkpoint):
    from robust_lightning.cli import main

    root = imagenet_c_tree(tmp_path / "imagenet-c", grouped=True, uneven=True)
    config = imagenet_c_config(tmp_path, {"root": str(root), "corruptions": ["gaussian_noise", "brightness"]})
    assert main(["test", "--config", str(config), "--ckpt_path", str(checkpoint)]) == 0
    results_file = next((tmp_path / "runs" / "c").glob("version_*/results.json"))
    results = json.loads(results_file.read_text())
    section = results["imagenet_c"]

    assert section["layout"] == "group folders" and section["num_images"] == 2 * (5 * 4 + 10)
    assert section["preprocessing"] == "none (decoded as released)"
    alexnet = {
        r["corruption"]: [float(r[f"sev{s}"]) for s in range(1, 6)]
        for r in read_csv("imagenet_c_alexnet_err_per_severity.csv")
    }
    accs = []
    for corruption, group in (("gaussian_noise", "noise"), ("brightness", "weather")):
        values = section["corruptions"][corruption]
        assert values["group"] == group and values["num_images"] == 30
        for s in range(1, 6):
            expected = direct_accuracy(checkpoint, root / group / corruption / str(s))
            assert values["acc1"][str(s)] == pytest.approx(expected, abs=1e-12)
            assert values["error"][str(s)] == pytest.approx(1 - expected, abs=1e-12)
            accs.append(expected)
        errors = [values["error"][str(s)] for s in range(1, 6)]
        assert values["ce"] == pytest.approx(sum(errors) / sum(alexnet[corruption]), abs=1e-12)
        assert 0 <= values["ece"] <= 1
    assert section["mean_acc1"] == pytest.approx(np.mean(accs), abs=1e-12)
    assert len(set(accs)) > 1  # the check discriminates: not every cell at one value
    assert "mce" not in section and section["mce_partial"]["corruptions"] == ["gaussian_noise", "brightness"]
    # the clean error comes from this run's own ImageNet val test
    assert section["clean_error"] == pytest.approx(1 - results["test"]["metrics"]["test/acc1"], abs=1e-6)
    assert section["clean_error_source"].startswith("1 - test/acc1")
    plot = results_file.parent / "imagenet_c_errors.png"
    assert section["plot"] == str(plot.resolve()) and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    logged = (results_file.parent / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"imagenet_c/mce_partial", "imagenet_c/brightness/acc1", "imagenet_c/brightness/3/acc1"} <= set(logged)


def test_cli_fails_at_test_start_on_a_bad_root(tmp_path, checkpoint, capsys):
    from robust_lightning.cli import main

    root = imagenet_c_tree(tmp_path / "imagenet-c", corruptions=("brightness",))
    config = imagenet_c_config(tmp_path, {"root": str(root)})  # the default 15 corruptions: 14 are missing
    assert main(["test", "--config", str(config), "--ckpt_path", str(checkpoint)]) == 2
    assert "not found" in capsys.readouterr().err
    assert not list((tmp_path / "runs").glob("**/results.json"))  # failed before any work


def test_ddp_splits_the_images_over_ranks_and_counts_each_once(tmp_path, checkpoint):

    root = imagenet_c_tree(tmp_path / "imagenet-c", corruptions=("brightness",), per_class=3)  # 6 per cell: odd splits
    # the same run also generates corruptions from the 5 val images (3 + 2 over the ranks); its section is replaced
    # by the released one (the last callback), so it is read back from the logged metrics (other corruptions)
    generated = {"source": "generated", "corruptions": ["glass_blur", "fog"], "severities": [2, 5], "batch_size": 2}
    released = {"root": str(root), "corruptions": ["brightness"], "severities": [1, 4]}
    config = imagenet_c_config(tmp_path, generated, released)
    settings = yaml.safe_load(config.read_text())
    settings["trainer"].update(devices=2, strategy="ddp")
    config.write_text(yaml.safe_dump(settings))
    result = run_command(["test", "--config", str(config), "--ckpt_path", str(checkpoint)], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    section = json.loads(next((tmp_path / "runs" / "c").glob("version_*/results.json")).read_text())["imagenet_c"]
    assert section["num_images"] == 12 and section["corruptions"]["brightness"]["num_images"] == 12
    for s in (1, 4):
        expected = direct_accuracy(checkpoint, root / "brightness" / str(s))
        assert section["corruptions"]["brightness"]["acc1"][str(s)] == pytest.approx(expected, abs=1e-12)
    # generated: each val image counted once over the ranks (checked in the run), with the draws of one process
    metrics = next((tmp_path / "runs" / "c").glob("version_*/metrics.csv")).read_text().splitlines()
    rows = [dict(zip(metrics[0].split(","), line.split(","))) for line in metrics[1:]]

    def logged(key: str) -> list[float]:
        return [float(row[key]) for row in rows if row.get(key)]

    for corruption in ("glass_blur", "fog"):
        acc, ece = direct_generated(checkpoint, tmp_path / "imagenet" / "val", corruption, [2, 5])
        assert logged(f"imagenet_c/{corruption}/ece") == [pytest.approx(ece, abs=1e-9)]
        for s in (2, 5):
            assert logged(f"imagenet_c/{corruption}/{s}/acc1") == [pytest.approx(acc[s], abs=1e-9)]


# ------------------------------------------------------------------------------------- generated on the fly
def direct_generated(
    checkpoint: Path, val: Path, corruption: str, severities: list[int], seed: int = 0
) -> tuple[dict[int, float], float]:
    """(top-1 per severity, ECE over the severities pooled) of generated cells without the callback, the data
    module or Lightning: each image alone through the pipeline (so the draws cannot depend on batches, workers or
    ranks). The tiny model predicts class 0 for nearly every image, so the top-1 hardly tells images apart; the
    ECE (here |top-1 - mean confidence|) does: it is a fingerprint of the exact images."""
    from robust_lightning.data.classes import class_map
    from robust_lightning.evaluation.benchmarks import expected_calibration_error
    from robust_lightning.training.lightning_module import ImageClassifier

    module = ImageClassifier.load_from_checkpoint(checkpoint, map_location="cpu", weights_only=True).eval()
    transform = CorruptedEvalTransform(corruption, severities, resolution=32, seed=seed)
    labels = class_map("imagenet")
    paths = sorted(val.glob("*/*.JPEG"))
    images = torch.stack([transform(Image.open(path)) for path in paths]).float() / 255  # N x S x 3 x 32 x 32
    with torch.no_grad():
        confidence, prediction = module(images.flatten(0, 1)).softmax(1).max(1)
    target = torch.tensor([labels[path.parent.name] for path in paths]).repeat_interleave(len(severities))
    correct = prediction == target
    acc = {s: correct.view(len(paths), -1)[:, i].double().mean().item() for i, s in enumerate(severities)}
    return acc, expected_calibration_error(confidence.double(), correct)


def test_generated_cli_run_writes_its_section(tmp_path, checkpoint):
    from robust_lightning.cli import main

    config = imagenet_c_config(
        tmp_path,
        {
            "source": "generated",
            "corruptions": ["gaussian_noise", "contrast", "frost"],
            "severities": [1, 5],
            "seed": 3,
            "batch_size": 3,
            "num_workers": 2,
        },
    )
    assert main(["test", "--config", str(config), "--ckpt_path", str(checkpoint)]) == 0
    results_file = next((tmp_path / "runs" / "c").glob("version_*/results.json"))
    results = json.loads(results_file.read_text())
    section = results["imagenet_c"]
    assert section["source"] == "generated" and "root" not in section  # never mistaken for the released set

    generated = section["generated"]
    assert generated["from"].startswith("ImageNet val") and generated["num_source_images"] == 5
    assert generated["seed"] == 3 and generated["resolution"] == 32  # the model's
    assert (
        "resize shorter side to 36 (bilinear, as the release), centre crop 32, corrupt, JPEG quality 85"
        in generated["pipeline"]
    )
    assert "robust_lightning.evaluation.corruptions" in generated["implementation"]
    assert Path(generated["frost_textures"], "frost1.png").is_file()
    assert "approximations" in section["alexnet"]["note"]
    assert section["num_images"] == 5 * 3 * 2 and section["severities"] == [1, 5]
    alexnet = {
        r["corruption"]: [float(r[f"sev{s}"]) for s in range(1, 6)]
        for r in read_csv("imagenet_c_alexnet_err_per_severity.csv")
    }
    for corruption, group in (("gaussian_noise", "noise"), ("contrast", "digital"), ("frost", "weather")):
        values = section["corruptions"][corruption]
        assert values["group"] == group and values["num_images"] == 10
        acc, ece = direct_generated(checkpoint, tmp_path / "imagenet" / "val", corruption, [1, 5], seed=3)
        assert values["acc1"] == {"1": pytest.approx(acc[1], abs=1e-12), "5": pytest.approx(acc[5], abs=1e-12)}
        assert values["ece"] == pytest.approx(ece, abs=1e-9)
        if corruption != "contrast":  # the check tells the draws apart: another seed gives other images
            _, other = direct_generated(checkpoint, tmp_path / "imagenet" / "val", corruption, [1, 5], seed=4)
            assert abs(other - ece) > 1e-7
        errors = [values["error"]["1"], values["error"]["5"]]
        assert values["ce"] == pytest.approx(sum(errors) / (alexnet[corruption][0] + alexnet[corruption][4]), abs=1e-12)
    assert "mce" not in section and section["mce_partial"]["corruptions"] == ["gaussian_noise", "frost", "contrast"]
    assert section["clean_error"] == pytest.approx(1 - results["test"]["metrics"]["test/acc1"], abs=1e-6)
    plot = results_file.parent / "imagenet_c_errors.png"
    assert section["plot"] == str(plot.resolve()) and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    logged = (results_file.parent / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"imagenet_c/mce_partial", "imagenet_c/frost/acc1", "imagenet_c/contrast/5/acc1"} <= set(logged)


def test_a_stopped_generated_run_goes_on_with_the_corruptions_left(tmp_path, checkpoint, monkeypatch):
    """The generated corruptions' rows are kept once gathered, corruption by corruption: a stop in the second
    corruption (fog) ends the run (status 143); the same command computes only the second and third, and writes
    the section of the run left alone. In the test's process, so the signal is the flag its handler sets, and
    without loader workers (forks of the test process): a corruption's rows are kept after its gather, whatever
    read the images."""
    from robust_lightning.cli import main

    settings = {"source": "generated", "corruptions": ["gaussian_noise", "contrast", "fog"], "severities": [1, 5]}
    settings |= {"seed": 3, "batch_size": 3}
    predict, computed = ImageNetC._predict_generated, []

    def stopping_in(corruption):
        def counted(self, trainer, pl_module, c):
            computed.append(c)
            if c == corruption:
                JobSignals.sigterm = True  # what the SIGTERM handler notes
            return predict(self, trainer, pl_module, c)

        return counted

    sections = {}
    for name in ("alone", "stopped"):
        config = imagenet_c_config(tmp_path / name, settings)
        command = ["test", "--config", str(config), "--ckpt_path", str(checkpoint)]
        if name == "stopped":
            monkeypatch.setattr(ImageNetC, "_predict_generated", stopping_in("fog"))
            assert main(command) == 143
            monkeypatch.setattr(JobSignals, "sigterm", False)
            computed.clear()
        monkeypatch.setattr(ImageNetC, "_predict_generated", stopping_in(None))
        assert main(command) == 0
        results = next((tmp_path / name / "runs" / "c").glob("version_*/results.json"))
        section = json.loads(results.read_text())["imagenet_c"]
        section.pop("plot")
        sections[name] = json.loads(json.dumps(section).replace(str(tmp_path / name), "<test folder>"))
    # in the benchmark's order (noise, weather, digital): gaussian_noise's rows were kept by the stopped run
    assert computed == ["fog", "contrast"]
    assert sections["stopped"] == sections["alone"]


def test_generated_checks_before_any_work(tmp_path):
    for kwargs, message in (
        ({"source": "generated", "seed": -1}, "seed must be a non-negative integer"),
        ({"source": "generated", "root": str(tmp_path)}, "leave root out"),
        ({"source": "generated", "max_images": 10}, "data.eval_subset / data.eval_limit"),
        ({"source": "made up"}, "'released' \\(with root\\) or 'generated'"),
        ({}, "ImageNetC needs root"),
    ):
        with pytest.raises(UserError, match=message):
            ImageNetC(**kwargs)
    # a data module that provides the evaluation images (EvaluationData), never set up: nothing is read
    trainer = SimpleNamespace(datamodule=ImageNetDataModule(source=SyntheticSource(root=str(tmp_path / "none"))))
    callback = ImageNetC(source="generated", corruptions=["frost"], frost_dir=str(tmp_path))
    with pytest.raises(UserError, match=r"frost texture folder .* lacks frost1.png"):
        callback.on_test_start(trainer, Recorder(224))
    with pytest.raises(UserError, match="at least 32 px"):
        ImageNetC(source="generated", corruptions=["fog"]).on_test_start(trainer, Recorder(16))
    with pytest.raises(UserError, match="needs robust_lightning's ImageNetDataModule"):
        ImageNetC(source="generated").on_test_start(SimpleNamespace(datamodule=None), Recorder(224))


def test_generated_from_fewer_images_than_all_of_val_is_partial(tmp_path, checkpoint):
    from robust_lightning.cli import main

    config = imagenet_c_config(tmp_path, {"source": "generated", "batch_size": 25})  # all 15 corruptions x 5 severities
    assert main(["test", "--config", str(config), "--ckpt_path", str(checkpoint), "--data.eval_limit", "3"]) == 0
    results_file = next((tmp_path / "runs" / "c").glob("version_*/results.json"))
    section = json.loads(results_file.read_text())["imagenet_c"]
    assert section["generated"]["from"].endswith("eval_limit=3)") and section["generated"]["num_source_images"] == 3
    assert "mce" not in section and "relative_mce" not in section
    partial = section["mce_partial"]
    assert partial["corruptions"] == list(STANDARD) and partial["severities"] == [1, 2, 3, 4, 5]
    assert partial["images"] == "3 of the 50000 ImageNet val images in the smallest cell"
    logged = (results_file.parent / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "imagenet_c/mce_partial" in logged and "imagenet_c/mce" not in logged
