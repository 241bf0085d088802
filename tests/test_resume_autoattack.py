"""A fit with AutoAttack at its end (``fit_images``), resumed with ``--ckpt_path last``: results.json names and
describes the weights the fit ended with, partial outcomes of those weights are resumed (each image once), and
outcomes of the run's earlier weights neither stop the resumed fit at its end nor are mixed into its numbers.
An outcome folder left by an evaluation that saved no image's outcome is taken over by the next one; one with
outcomes of another evaluation is still refused."""

import json
from pathlib import Path

import pytest

from helpers import eval_config, run_test, tiny_config
from robust_lightning.cli import main
from robust_lightning.errors import UserError
from robust_lightning.evaluation.autoattack import WEIGHTS_HASH_PREFIX, AutoAttackEvaluation, read_outcomes
from robust_lightning.evaluation.outcomes import append_record, claim_directory
from robust_lightning.evaluation.results import file_sha256, weights_sha256
from robust_lightning.training.lightning_module import ImageClassifier

FIT_IMAGES = 8
AUTOATTACK = {
    "class_path": "robust_lightning.evaluation.autoattack.AutoAttackEvaluation",
    "init_args": {
        "threat_models": [{"norm": "Linf", "eps": 4 / 255}],
        "version": "apgd-ce",
        "n_iter": 2,
        "fit_images": FIT_IMAGES,
    },
}


def _config(tmp_path: Path) -> Path:
    # eval batches of 4: the fit-time evaluation appends its outcomes in two batches
    return tiny_config(
        tmp_path,
        **{
            "model.arch": "test_resnet",
            "trainer.limit_train_batches": 2,
            "data.eval_batch_size": 4,
            "trainer.callbacks": [AUTOATTACK],
        },
    )


def _run(tmp_path: Path) -> Path:
    return tmp_path / "runs" / "tiny" / "version_0"


def _final_weights_hash(run: Path) -> str:
    """The hash of the weights in the run's last checkpoint (those a fit ends with, which it evaluates)."""
    module = ImageClassifier.load_from_checkpoint(
        run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True
    )
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
    # <run dir>/autoattack/weights-<hash prefix>/, as the README says
    results_dir = Path(section["conditions"]["results_dir"])
    assert results_dir == (run / "autoattack" / f"weights-{weights[:WEIGHTS_HASH_PREFIX]}").resolve()
    outcomes = results_dir / "Linf-4_255"
    assert json.loads((outcomes / "manifest.json").read_text())["weights_sha256"] == weights
    assert len(read_outcomes(outcomes)) == FIT_IMAGES
    return section


def _saved_batches(section: dict) -> list[int]:
    path = Path(section["conditions"]["results_dir"]) / "Linf-4_255" / "rank0.jsonl"
    return [len(json.loads(line)["key"]) for line in path.read_text().splitlines()]


def test_a_finished_fit_resumed_for_more_epochs_evaluates_its_new_weights(tmp_path):
    config = _config(tmp_path)
    assert main(["fit", "--config", str(config)]) == 0
    run = _run(tmp_path)
    first = _check_results(run, steps=2)

    # the earlier weights' outcomes in the same run directory must not stop the resumed fit at its end
    assert main(["fit", "--config", str(config), "--ckpt_path", "last", "--trainer.max_epochs", "2"]) == 0
    second = _check_results(run, steps=4)
    assert second["conditions"]["weights_sha256"] != first["conditions"]["weights_sha256"]
    assert _saved_batches(second) == [4, 4]  # all evaluated anew: nothing of the earlier weights is mixed in
    assert _saved_batches(first) == [4, 4]  # the earlier weights' outcomes are kept as they were


def test_a_fit_killed_during_its_autoattack_resumes_it_without_redoing_or_double_counting(tmp_path, monkeypatch):
    config = _config(tmp_path)
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


def test_a_fit_resumed_with_nothing_left_to_train_keeps_the_metrics_it_measured(tmp_path):
    config = _config(tmp_path)
    assert main(["fit", "--config", str(config)]) == 0
    path = _run(tmp_path) / "results.json"
    measured = json.loads(path.read_text())["fit"]["metrics"]
    assert "val/acc1" in measured
    assert main(["fit", "--config", str(config), "--ckpt_path", "last"]) == 0  # max_epochs already reached
    fit = json.loads(path.read_text())["fit"]
    assert fit["metrics"] == measured and fit["metrics_from_an_earlier_session"] == sorted(measured)
    _check_results(_run(tmp_path), steps=2)


# ------------------------------------------------------------------------ outcome folders of other evaluations
def test_a_folder_with_only_another_evaluations_manifest_is_taken_over(
    tmp_path,
    checkpoint,
    monkeypatch,
    caplog,
):
    ckpt, synthetic_root = checkpoint

    def stopped_before_attacking(self, *args, **kwargs):  # as a run stopped at a missing dataset root
        raise RuntimeError("stopped")

    monkeypatch.setattr(AutoAttackEvaluation, "on_test_batch_end", stopped_before_attacking)
    with pytest.raises(RuntimeError, match="stopped"):
        main(["test", "--config", str(eval_config(tmp_path, synthetic_root, n_iter=7)), "--ckpt_path", str(ckpt)])
    monkeypatch.undo()
    folder = tmp_path / "outcomes" / "Linf-4_255"
    assert json.loads((folder / "manifest.json").read_text())["n_iter"] == 7 and not read_outcomes(folder)

    with caplog.at_level("INFO"):
        section = run_test(tmp_path, checkpoint)  # n_iter 5: another evaluation, which proceeds
    assert f"{folder}: no image's outcome saved by an earlier evaluation with other settings (n_iter)" in caplog.text
    assert section["threat_models"]["Linf-4_255"]["num_points"] == 20
    assert len(read_outcomes(folder)) == 20
    assert json.loads((folder / "manifest.json").read_text())["n_iter"] == 5


def test_a_folder_with_outcomes_of_another_evaluation_is_still_refused(tmp_path, checkpoint, capsys):
    ckpt, synthetic_root = checkpoint
    run_test(tmp_path, checkpoint, "--trainer.limit_test_batches", "2", n_iter=7)  # ("1" would read as 100%)
    folder = tmp_path / "outcomes" / "Linf-4_255"
    saved = {name: (folder / name).read_text() for name in ("manifest.json", "rank0.jsonl")}
    assert len(read_outcomes(folder)) == 12
    assert main(["test", "--config", str(eval_config(tmp_path, synthetic_root)), "--ckpt_path", str(ckpt)]) == 2
    assert f"{folder} holds outcomes of a different evaluation (n_iter differ)" in capsys.readouterr().err
    assert {name: (folder / name).read_text() for name in saved} == saved  # nothing replaced, nothing added


OURS = {"weights_sha256": "b" * 64, "norm": "Linf", "eps": 4 / 255, "n_iter": 5}
THEIRS = {**OURS, "weights_sha256": "a" * 64}
OUTCOME = {"key": ["x"], "label": [0], "clean": [True], "robust": [False], "broken_by": ["apgd-ce"], "seconds": {}}


def _folder_of_theirs(tmp_path: Path, rank_file: str) -> Path:
    folder = tmp_path / "Linf-4_255"
    claim_directory(folder, THEIRS, True, "AutoAttackEvaluation")
    (folder / "rank0.jsonl").write_text(rank_file)
    return folder


@pytest.mark.parametrize("rank_file", ["", json.dumps(OUTCOME)[:25]], ids=["empty", "cut-line"])
def test_rank_files_without_any_outcome_do_not_block_another_evaluation(tmp_path, rank_file):
    folder = _folder_of_theirs(tmp_path, rank_file)
    claim_directory(folder, OURS, True, "AutoAttackEvaluation")
    assert json.loads((folder / "manifest.json").read_text()) == OURS
    claim_directory(folder, OURS, True, "AutoAttackEvaluation")  # a re-run of ours resumes as usual
    append_record(folder / "rank0.jsonl", OUTCOME)  # on a line of its own, after a cut one
    assert list(read_outcomes(folder)) == ["x"]


def test_one_complete_line_beside_a_cut_one_is_an_outcome_of_the_other_evaluation(tmp_path):
    folder = _folder_of_theirs(tmp_path, json.dumps(OUTCOME) + "\n" + json.dumps(OUTCOME)[:25])
    with pytest.raises(UserError, match=r"holds outcomes of a different evaluation \(weights_sha256 differ\)"):
        claim_directory(folder, OURS, True, "AutoAttackEvaluation")
    assert json.loads((folder / "manifest.json").read_text()) == THEIRS


@pytest.fixture
def checkpoint(autoattack_checkpoint):
    """The session's tiny AutoAttack checkpoint (tests/conftest.py) and its synthetic data."""
    return autoattack_checkpoint
