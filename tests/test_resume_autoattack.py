"""A fit with AutoAttack at its end (``fit_images``), resumed with ``--ckpt_path last``: results.json names and
describes the weights the fit ended with, partial outcomes of those weights are resumed (each image once), and
outcomes of the run's earlier weights neither stop the resumed fit at its end nor are mixed into its numbers."""

import json
from pathlib import Path

import pytest

from robust_lightning.cli import main
from robust_lightning.evaluation.autoattack import AutoAttackEvaluation, read_outcomes
from robust_lightning.evaluation.results import file_sha256, weights_sha256
from robust_lightning.training.lightning_module import ImageClassifier
from test_cli import tiny_config

FIT_IMAGES = 8
AUTOATTACK = {"class_path": "robust_lightning.evaluation.autoattack.AutoAttackEvaluation",
              "init_args": {"threat_models": [{"norm": "Linf", "eps": 4 / 255}], "version": "apgd-ce", "n_iter": 2,
                            "fit_images": FIT_IMAGES}}


@pytest.fixture(scope="module")
def synthetic_root(tmp_path_factory):
    return tmp_path_factory.mktemp("synthetic")


def _config(tmp_path: Path, synthetic_root: Path) -> Path:
    # eval batches of 4: the fit-time evaluation appends its outcomes in two batches
    return tiny_config(tmp_path, synthetic_root, **{"model.arch": "test_resnet", "trainer.limit_train_batches": 2,
                                                    "data.eval_batch_size": 4, "trainer.callbacks": [AUTOATTACK]})


def _run(tmp_path: Path) -> Path:
    return tmp_path / "runs" / "tiny" / "version_0"


def _final_weights_hash(run: Path) -> str:
    """The hash of the weights in the run's last checkpoint (those a fit ends with, which it evaluates)."""
    module = ImageClassifier.load_from_checkpoint(run / "checkpoints" / "last.ckpt", map_location="cpu",
                                                  weights_only=True)
    return weights_sha256(module.model)


def _check_results(run: Path, steps: int) -> dict:
    """results.json describes the files and weights it names; returns its autoattack section."""
    results = json.loads((run / "results.json").read_text())
    fit = results["fit"]
    assert fit["steps"] == steps
    for name in ("last_checkpoint", "best_checkpoint"):
        assert fit[name]["sha256"] == file_sha256(fit[name]["path"]), name
    section = results["autoattack"]
    weights = _final_weights_hash(run)
    assert section["conditions"]["weights_sha256"] == weights
    linf = section["threat_models"]["Linf-4_255"]
    assert linf["num_points"] == FIT_IMAGES
    # the outcomes summarised are those of these weights, every image once
    outcomes = Path(section["conditions"]["results_dir"]) / "Linf-4_255"
    assert json.loads((outcomes / "manifest.json").read_text())["weights_sha256"] == weights
    assert len(read_outcomes(outcomes)) == FIT_IMAGES
    return section


def _saved_batches(section: dict) -> list[int]:
    path = Path(section["conditions"]["results_dir"]) / "Linf-4_255" / "rank0.jsonl"
    return [len(json.loads(line)["key"]) for line in path.read_text().splitlines()]


def test_a_finished_fit_resumed_for_more_epochs_evaluates_its_new_weights(tmp_path, synthetic_root):
    config = _config(tmp_path, synthetic_root)
    assert main(["fit", "--config", str(config)]) == 0
    run = _run(tmp_path)
    first = _check_results(run, steps=2)

    # the earlier weights' outcomes in the same run directory must not stop the resumed fit at its end
    assert main(["fit", "--config", str(config), "--ckpt_path", "last", "--trainer.max_epochs", "2"]) == 0
    second = _check_results(run, steps=4)
    assert second["conditions"]["weights_sha256"] != first["conditions"]["weights_sha256"]
    assert _saved_batches(second) == [4, 4]  # all evaluated anew: nothing of the earlier weights is mixed in
    assert _saved_batches(first) == [4, 4]  # the earlier weights' outcomes are kept as they were


def test_a_fit_killed_during_its_autoattack_resumes_it_without_redoing_or_double_counting(tmp_path, synthetic_root,
                                                                                            monkeypatch):
    config = _config(tmp_path, synthetic_root)
    evaluate_batch = AutoAttackEvaluation.on_test_batch_end
    calls = []

    def killed_at_the_second_batch(self, *args, **kwargs):
        calls.append(None)
        if len(calls) == 2:
            raise RuntimeError("killed")
        return evaluate_batch(self, *args, **kwargs)

    monkeypatch.setattr(AutoAttackEvaluation, "on_test_batch_end", killed_at_the_second_batch)
    with pytest.raises(RuntimeError, match="killed"):
        main(["fit", "--config", str(config)])
    monkeypatch.setattr(AutoAttackEvaluation, "on_test_batch_end", evaluate_batch)

    run = _run(tmp_path)
    assert main(["fit", "--config", str(config), "--ckpt_path", "last"]) == 0  # the same weights: resumed
    section = _check_results(run, steps=2)
    assert _saved_batches(section) == [4, 4]  # the first batch was not redone

    # killed again during the evaluation of a longer fit, then resumed: only the final weights' outcomes count
    calls.clear()
    monkeypatch.setattr(AutoAttackEvaluation, "on_test_batch_end", killed_at_the_second_batch)
    with pytest.raises(RuntimeError, match="killed"):
        main(["fit", "--config", str(config), "--ckpt_path", "last", "--trainer.max_epochs", "2"])
    monkeypatch.setattr(AutoAttackEvaluation, "on_test_batch_end", evaluate_batch)
    assert main(["fit", "--config", str(config), "--ckpt_path", "last", "--trainer.max_epochs", "2"]) == 0
    longer = _check_results(run, steps=4)
    assert longer["conditions"]["weights_sha256"] != section["conditions"]["weights_sha256"]
    assert _saved_batches(longer) == [4, 4]


def test_a_fit_resumed_with_nothing_left_to_train_keeps_the_metrics_it_measured(tmp_path, synthetic_root):
    config = _config(tmp_path, synthetic_root)
    assert main(["fit", "--config", str(config)]) == 0
    path = _run(tmp_path) / "results.json"
    measured = json.loads(path.read_text())["fit"]["metrics"]
    assert "val/acc1" in measured
    assert main(["fit", "--config", str(config), "--ckpt_path", "last"]) == 0  # max_epochs already reached
    fit = json.loads(path.read_text())["fit"]
    assert fit["metrics"] == measured and fit["metrics_from_an_earlier_session"] is True
    _check_results(_run(tmp_path), steps=2)
