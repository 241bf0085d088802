"""W&B end to end, offline: a tiny APGD-AT fit and a tiny evaluation run through robust_lightning.cli.main with
configs/loggers/wandb.yaml composed in, then what they logged read back from the offline runs' own files (the
run-*.wandb record log and the files/ folder), never through the network."""

import json
from pathlib import Path

import pytest
import torch
import wandb
import yaml

from helpers import REPO, make_image_tree, tiny_config
from robust_lightning.cli import main
from robust_lightning.loggers import WANDB_CONFIG_FILE
from robust_lightning.wandb_records import history_rows, read_records
from shift_data import imagenet_c_config, imagenet_c_tree, imagenet_p_tree

WANDB_YAML = str(REPO / "configs" / "loggers" / "wandb.yaml")


# --------------------------------------------------------------------------- reading an offline run back
# (the run-*.wandb record log and the files/ folder, read with robust_lightning.wandb_records)


class OfflineRun:
    """What one offline run logged: run (group, tags), config, history rows, saved files."""

    def __init__(self, run_dir: Path):
        self.dir = run_dir
        [wandb_file] = run_dir.glob("run-*.wandb")
        records = read_records(wandb_file)
        assert records[-1].WhichOneof("record_type") == "exit", "the run's file is incomplete"
        self.run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        self.config, self.history, self.saved, self.metrics = {}, [], [], {}
        for r in records:
            kind = r.WhichOneof("record_type")
            if kind == "config":
                self.config.update({item.key: json.loads(item.value_json) for item in r.config.update})
            elif kind == "history":
                self.history += history_rows([r])  # media (tables, images) come nested, as W&B nests them
            elif kind == "files":
                self.saved += [f.path for f in r.files.files]
            elif kind == "metric" and r.metric.name:  # define_metric: a key's step metric and summary
                self.metrics[r.metric.name] = r.metric

    def logged(self, key: str) -> list:
        return [row[key] for row in self.history if key in row]

    def table(self, key: str) -> dict:
        [value] = self.logged(key)
        assert value["_type"] == "table-file"
        return json.loads((self.dir / "files" / value["path"]).read_text())

    def image(self, key: str) -> bytes:
        [value] = self.logged(key)
        [name] = value["filenames"]
        return (self.dir / "files" / name).read_bytes()


# -------------------------------------------------------------------------------------------- the two runs
@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Offline W&B inside a temporary directory, which is also the working directory: configs/loggers/wandb.yaml
    writes to ./runs. wandb.setup() reads the environment once per process, hence a teardown before the first run
    and after every run (the rest of the suite goes back to WANDB_MODE=disabled)."""
    tmp_path = tmp_path_factory.mktemp("wandb")
    wandb.finish()  # a WandbLogger would attach to a run another test left open
    wandb.teardown()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        for name, value in {
            "WANDB_MODE": "offline",
            "WANDB_DIR": tmp_path,
            "WANDB_CONFIG_DIR": tmp_path / "config",
            "WANDB_CACHE_DIR": tmp_path / "cache",
            "WANDB_DATA_DIR": tmp_path / "data",
            "WANDB_SILENT": "true",
            "WANDB_DISABLE_GIT": "true",
        }.items():
            patch.setenv(name, str(value))
        patch.delenv("WANDB_API_KEY", raising=False)
        yield tmp_path


def run_cli(workdir: Path, *args: str) -> OfflineRun:
    """main(args), then the offline run it created."""
    before = set(workdir.glob("runs/wandb/offline-run-*"))
    assert main(list(args)) == 0
    # A command line run ends with its process, which finishes the W&B run. Here: finish it, then wait for W&B's
    # service to write the rest of the run's file (wandb.finish alone may return before that).
    wandb.finish()
    wandb.teardown()
    [run_dir] = set(workdir.glob("runs/wandb/offline-run-*")) - before
    return OfflineRun(run_dir)


@pytest.fixture(scope="module")
def fitted(workdir):
    """APGD-AT (1 step) with EMA and 1-step robust selection for 3 steps; group and tags set on the command line."""
    config = tiny_config(workdir)
    return run_cli(
        workdir,
        "fit",
        "--config",
        str(config),
        "--config",
        WANDB_YAML,
        "--model.attack",
        "apgd",
        "--model.attack_steps",
        "1",
        "--trainer.log_every_n_steps",
        "1",
        "--model.ema_decay",
        "0.9",
        "--model.select_attack_steps",
        "1",
        "--trainer.logger.init_args.group",
        "sweep-a",
        "--trainer.logger.init_args.tags",
        "[at, tiny]",
    )


@pytest.fixture(scope="module")
def evaluated(workdir, fitted):
    """A test run with ImageNet-C (released layout), quick AutoAttack, ImageNet-V2, ImageNet-P and a resolution
    sweep on tiny replicas; group and tags from the environment, as `robust-lightning sweep` sets them."""
    torch.manual_seed(0)
    from lightning import Trainer

    from robust_lightning.training.lightning_module import ImageClassifier

    module = ImageClassifier(arch="test_resnet", num_classes=1000, image_size=32)
    with torch.no_grad():
        module.model.net.fc.bias[0] += 3.0  # favours class 0: accuracies are not all zero
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    checkpoint = workdir / "tiny.ckpt"
    trainer.save_checkpoint(checkpoint)

    imagenet_c = imagenet_c_tree(workdir / "imagenet-c", per_class=1)
    imagenet_p_tree(workdir / "imagenet-p")
    v2 = make_image_tree(workdir / "v2", {"n01440764": 2, "n01443537": 1})
    path = imagenet_c_config(workdir, {"root": str(imagenet_c), "corruptions": ["gaussian_noise", "brightness"]})
    config = yaml.safe_load(path.read_text())
    config["trainer"]["logger"]["init_args"]["name"] = "tiny"  # the fit's CSV run folder: version_1 next to it
    config["trainer"]["callbacks"] += [
        {
            "class_path": "robust_lightning.evaluation.autoattack.AutoAttackEvaluation",
            "init_args": {
                "threat_models": [{"norm": "Linf", "eps": 4 / 255}],
                "version": "apgd-ce",
                "n_iter": 2,
                "n_queries": 20,  # Square from scratch, which the untrained model's raised checks call for
                "results_dir": str(workdir / "outcomes"),
            },
        },
        {
            "class_path": "robust_lightning.evaluation.benchmarks.DistributionShiftBenchmarks",
            "init_args": {"imagenet_v2": str(v2), "batch_size": 4, "num_workers": 0},
        },
        {
            "class_path": "robust_lightning.evaluation.imagenet_p.ImageNetP",
            "init_args": {
                "root": str(workdir / "imagenet-p"),
                "perturbations": ["gaussian_noise", "brightness"],
                "batch_size": 4,
                "num_workers": 0,
                "max_videos_per_perturbation": 1,
            },
        },
        {
            "class_path": "robust_lightning.evaluation.resolution.ResolutionSweep",
            "init_args": {"resolutions": [24, 32], "attack": None, "results_dir": str(workdir / "sweep")},
        },
    ]
    path.write_text(yaml.safe_dump(config))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_RUN_GROUP", "sweep-b")
        patch.setenv("WANDB_TAGS", "sweep:b,paper")
        return run_cli(workdir, "test", "--config", str(path), "--config", WANDB_YAML, "--ckpt_path", str(checkpoint))


# --------------------------------------------------------------------------------------------------- tests
def test_the_full_config_and_the_training_curves_are_logged(fitted):
    config = fitted.config
    # the whole parsed config under the command line's key names, beside the model's own hyperparameters
    assert config["trainer.max_epochs"] == 1 and config["trainer.limit_train_batches"] == 3
    assert config["data.image_size"] == 32 and config["data.source.init_args.num_classes"] == 4
    assert config["model.attack"] == "apgd" and config["model.attack_steps"] == 1
    assert config["checkpoint.monitor"] == "val/select_acc" and "ckpt_path" in config
    assert [entry["class_path"].rsplit(".", 1)[1] for entry in config["trainer.logger"]] == ["CSVLogger", "WandbLogger"]
    assert config["arch"] == "convnext_atto_convstem"  # Lightning's model hyperparameters, still there
    # the exact YAML is one of the run's files
    assert WANDB_CONFIG_FILE in fitted.saved
    saved = yaml.safe_load((fitted.dir / "files" / WANDB_CONFIG_FILE).read_text())
    assert saved["model"]["attack_steps"] == 1 and saved["trainer"]["max_epochs"] == 1
    # training curves: one point per step (3 steps), then the epoch's metrics
    for key in ("train/clean_loss", "train/adv_loss", "train/lr", "train/eps"):
        assert len(fitted.logged(key)) == 3, key
    assert fitted.logged("train/eps") == pytest.approx([4 / 255] * 3)
    assert fitted.logged("train/lr")[0] < fitted.logged("train/lr")[1]  # the warm-up
    for key in ("train/clean_acc1", "train/adv_acc1", "val/acc1", "val/loss"):
        assert len(fitted.logged(key)) == 1, key


def test_group_and_tags_come_from_the_config_or_the_environment(fitted, evaluated):
    assert fitted.run.run_group == "sweep-a" and list(fitted.run.tags) == ["at", "tiny"]
    assert evaluated.run.run_group == "sweep-b" and list(evaluated.run.tags) == ["sweep:b", "paper"]


def test_each_run_keeps_its_own_config_yaml(workdir, fitted, evaluated):
    runs = workdir / "runs"
    fit, test = (yaml.safe_load((runs / "tiny" / v / "config.yaml").read_text()) for v in ("version_0", "version_1"))
    assert fit["model"]["attack"] == "apgd" and fit["ckpt_path"] is None
    assert test["ckpt_path"].endswith("tiny.ckpt") and len(test["trainer"]["callbacks"]) == 5
    assert not (runs / "config.yaml").exists()
    assert evaluated.config["ckpt_path"] == test["ckpt_path"]


def test_evaluation_tables_and_plots_are_logged(evaluated):
    per_severity = evaluated.table("imagenet_c/per_severity")
    assert per_severity["columns"] == ["corruption", "severity", "acc1", "error"]
    assert len(per_severity["data"]) == 2 * 5
    assert {(c, s) for c, s, *_ in per_severity["data"]} == {
        (c, s) for c in ("gaussian_noise", "brightness") for s in range(1, 6)
    }
    assert all(acc1 + error == pytest.approx(1) for _, _, acc1, error in per_severity["data"])
    per_corruption = evaluated.table("imagenet_c/per_corruption")
    assert per_corruption["columns"] == ["corruption", "mean_acc1", "mean_error", "ce", "relative_ce", "ece"]
    assert [row[0] for row in per_corruption["data"]] == ["gaussian_noise", "brightness"]
    assert all(row[3] > 0 for row in per_corruption["data"])  # CE against AlexNet

    autoattack = evaluated.table("autoattack/summary")
    assert autoattack["columns"] == ["threat_model", "images", "clean", "robust", "apgd-ce"]
    assert len(autoattack["data"]) == 1 and autoattack["data"][0][1] == 5

    benchmarks = evaluated.table("benchmarks/summary")
    assert benchmarks["columns"] == ["benchmark", "metric", "value"]
    assert [row[:2] for row in benchmarks["data"]] == [["imagenet_v2", "acc1"], ["imagenet_v2", "ece"]]
    assert benchmarks["data"][0][2] == evaluated.logged("benchmarks/imagenet_v2/acc1")[0]

    imagenet_p = evaluated.table("imagenet_p/per_perturbation")
    assert imagenet_p["columns"] == ["perturbation", "split", "num_sequences", "fp", "alexnet_fp", "fr", "t5d"]
    assert [row[:3] for row in imagenet_p["data"]] == [["gaussian_noise", "test", 1], ["brightness", "test", 1]]

    resolution = evaluated.table("resolution_sweep/summary")
    assert [row[0] for row in resolution["data"]] == [24, 32]

    for key in ("imagenet_c/errors", "imagenet_p/plot", "resolution_sweep/plot"):
        assert evaluated.image(key)[:8] == b"\x89PNG\r\n\x1a\n", key


def test_throughput_and_best_scores_are_in_the_run(workdir, fitted):
    # images/s per device, step time and data-wait share every log_every_n_steps (here 1) optimiser steps
    for key in ("perf/images_per_s", "perf/step_seconds", "perf/data_wait_share"):
        assert len(fitted.logged(key)) == 3, key
    assert all(value > 0 for value in fitted.logged("perf/images_per_s"))
    assert all(0 <= value <= 1 for value in fitted.logged("perf/data_wait_share"))
    # results.json: the run's averages over its logging intervals but the first (start-up)
    fit = json.loads((workdir / "runs" / "tiny" / "version_0" / "results.json").read_text())["fit"]
    assert fit["throughput"]["steps"] == 2 and fit["throughput"]["images_per_device"] == 2 * 8
    per_step = fitted.logged("perf/step_seconds")[1:]
    assert fit["throughput"]["step_seconds"] == pytest.approx(sum(per_step) / 2, rel=1e-3)
    # the summaries of the validation scores keep their best value beside the last (W&B's default)
    for key in ("val/select_acc", "val/robust_acc", "val_ema/robust_acc"):
        assert fitted.metrics[key].summary.max and fitted.metrics[key].summary.last, key
        assert fitted.metrics[key].step_metric == "trainer/global_step", key


def test_the_workspace_shows_what_the_runs_log(fitted, evaluated):
    """The workspace of `robust-lightning workspace`, built offline: every curve it plots is a key the fit
    logged, and every table one the evaluation logged or another evaluation callback logs."""
    from robust_lightning.scale.workspace import TABLES, build_workspace, describe

    workspace = build_workspace("ENTITY", "robust-lightning", "robust-lightning")
    sections = describe(workspace)
    assert list(sections) == ["Adversarial training", "Validation", "Throughput", "Evaluation tables"]
    curves = [key for name in list(sections)[:3] for keys in sections[name] for key in keys]
    missing = [key for key in curves if not fitted.logged(key)]
    assert not missing, f"plotted but never logged: {missing}"
    assert sections["Evaluation tables"] == list(TABLES)
    for table in ("autoattack/summary", "imagenet_c/per_corruption", "benchmarks/summary", "resolution_sweep/summary"):
        assert evaluated.table(table)["data"], table


def test_the_workspace_command_prints_offline_and_refuses_to_save_without_w_and_b(capsys, monkeypatch):
    assert main(["workspace", "--project", "robust-lightning", "--dry_run", "true"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["Throughput"] == [["perf/images_per_s"], ["perf/step_seconds"], ["perf/data_wait_share"]]
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main(["workspace", "--project", "robust-lightning", "--entity", "my-team"]) == 2
    assert "saving a workspace needs W&B online" in capsys.readouterr().err
