"""A job's signal stops an analysis inside its own loops, not only between its batches of images: LesionStudy
before its next pass over the images, HessianSpectrum on training images before its next minibatch, the attack
sweeps and the transfer matrix before their next batch's attack, and the spatial attack before its next forward
pass. A long analysis of a large model would otherwise outlast a scheduler's
grace period after SIGTERM. The command ends with status 143 and publishes nothing, as a stopped evaluation does.

The commands run in the test's process, and the signal is the flag that the command's SIGTERM handler sets
(robust_lightning.job_signals.JobSignals); tests/test_evaluation_stops.py sends real signals to commands. The
shipped configs run without loader workers and the trainer's progress bar here (helpers.shipped_analysis_config), as
in the other in-process analysis tests: the stop inside an analysis does not pass through them, and
tests/test_imagenet_p.py sends a real SIGTERM to an evaluation's loader workers. The analyses' own bars are on."""

import gc

import pytest
import torch

from helpers import run_analysis, shipped_analysis_config, untrained_checkpoint
from robust_lightning.analysis import attack_sweeps, hessian
from robust_lightning.analysis.core import Analysis
from robust_lightning.attacks.spatial import spatial_grid_attack
from robust_lightning.job_signals import JobSignals


def signal_at_call(monkeypatch, owner, name: str, call: int) -> list[int]:
    """Make ``owner.name``'s ``call``-th call note a SIGTERM first. Returns the list its calls are counted in."""
    original, calls = getattr(owner, name), []

    def noting(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            monkeypatch.setattr(JobSignals, "sigterm", True)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, noting)
    return calls


def test_lesion_study_stops_before_its_next_pass_over_the_images(tmp_path, monkeypatch, capsys):
    """The analysis's own progress bar (on: it follows the rank, not the trainer's bar) is closed before the stop
    message, with the count it reached, so that a log file does not end with a bar line written at exit."""
    checkpoint = untrained_checkpoint(tmp_path, "test_resnet")
    config = shipped_analysis_config(tmp_path, "lesion_bhojanapalli_fig8", checkpoint, random_counts=[1], samples=2)
    passes = signal_at_call(monkeypatch, Analysis, "accuracy", 3)
    status, results, _ = run_analysis(tmp_path, config)
    assert status == 143 and results is None
    assert len(passes) == 3  # the intact model, one lesion, then the stop before the third pass
    gc.collect()  # a bar left open would write its line when it is collected
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1].startswith("robust-lightning: test interrupted by SIGTERM (exit status 143)")
    assert lines[-2].startswith("lesion: ") and " 2/7 " in lines[-2]


@pytest.mark.parametrize("analysis", ["pgd_sweep_chen", "transfer_matrix"])
def test_the_attack_sweeps_stop_before_their_next_attack(tmp_path, monkeypatch, analysis):
    """An attack sweep runs every curve and radius on the same images, and the transfer matrix every source model's
    attack: after the images are read, a stop comes before the next batch's attack."""
    checkpoint = untrained_checkpoint(tmp_path, "test_resnet")
    own = {"checkpoints": [str(checkpoint)], "steps": 2} if analysis == "transfer_matrix" else {"steps": [1, 2]}
    config = shipped_analysis_config(tmp_path, analysis, checkpoint, images=4, batch_size=2, **own)
    attacks = signal_at_call(monkeypatch, attack_sweeps, "attack_batch", 3)
    status, results, _ = run_analysis(tmp_path, config)
    assert status == 143 and results is None
    assert len(attacks) == 3  # of 2 batches x 2 models, or 2 step counts x 5 radii x 2 batches


def hessian_config(tmp_path, checkpoint, **init_args):
    """configs/analysis/hessian_parkkim_fig4.yaml (the paper's protocol on training images) in three minibatches."""
    config = shipped_analysis_config(
        tmp_path, "hessian_parkkim_fig4", checkpoint, images=12, batch_size=4, max_iter=5, train_fraction=1.0
    )
    config["trainer"]["callbacks"][0]["init_args"] |= init_args
    config["data"]["source"]["init_args"]["train_per_class"] = 4
    assert config["trainer"]["callbacks"][0]["init_args"]["data"] == "train"
    return config


def test_hessian_spectrum_stops_before_its_next_minibatch_and_resumes_to_the_spectrum_left_alone(
    tmp_path, monkeypatch, capsys
):
    """Stopped after its second minibatch, the paper's protocol keeps the two minibatches' eigenvalues; the same
    command computes only the third and publishes the spectrum of the run left alone. A larger max_images computes
    only the minibatches it adds, a smaller one only its shorter last minibatch. Other settings are refused the
    folder."""
    checkpoint = untrained_checkpoint(tmp_path, "test_resnet")
    (tmp_path / "alone").mkdir()
    status, alone, _ = run_analysis(tmp_path / "alone", hessian_config(tmp_path / "alone", checkpoint))
    assert status == 0 and len(alone["hessian"]["minibatches"]) == 3

    config = hessian_config(tmp_path, checkpoint)
    minibatches = signal_at_call(monkeypatch, hessian, "training_targets", 3)
    status, results, _ = run_analysis(tmp_path, config)
    assert status == 143 and results is None
    assert len(minibatches) == 3  # the signal came as the third minibatch was read, the stop before its spectrum
    folder = tmp_path / "runs" / "hessian"
    assert sorted(hessian.read_minibatches(folder)) == [0, 1]

    monkeypatch.setattr(JobSignals, "sigterm", False)
    computed = signal_at_call(monkeypatch, hessian, "minibatch_spectrum", 0)
    status, results, _ = run_analysis(tmp_path, config)
    assert status == 0 and len(computed) == 1  # the third minibatch only
    section = results["hessian"]
    assert section["minibatches"] == alone["hessian"]["minibatches"] and section["nep"] == alone["hessian"]["nep"]
    assert section["conditions"]["results_dir"] == str(folder.resolve())

    # another cap goes on from the saved minibatches: the first ones are the same whatever the cap
    computed.clear()
    status, results, _ = run_analysis(tmp_path, hessian_config(tmp_path, checkpoint, max_images=16), "more.yaml")
    assert status == 0 and len(computed) == 1  # the fourth minibatch only
    assert results["hessian"]["minibatches"][:3] == alone["hessian"]["minibatches"]
    computed.clear()
    status, results, _ = run_analysis(tmp_path, hessian_config(tmp_path, checkpoint, max_images=6), "fewer.yaml")
    assert status == 0 and len(computed) == 1  # the second minibatch again, of 2 images now
    assert results["hessian"]["minibatches"][0] == alone["hessian"]["minibatches"][0]

    capsys.readouterr()
    status, _, _ = run_analysis(tmp_path, hessian_config(tmp_path, checkpoint, top_k=3), "other.yaml")
    error = capsys.readouterr().err
    assert status == 2 and "top_k" in error and "HessianSpectrum.results_dir" in error and "Traceback" not in error


def test_the_spatial_attack_asks_to_stop_before_each_forward_pass():
    x, y = torch.rand(2, 3, 8, 8), torch.tensor([0, 1])
    forward_passes, asked = [], []

    def model(images):
        forward_passes.append(len(images))
        return torch.zeros(len(images), 2)

    def stop_point():
        asked.append(1)
        if len(asked) == 3:
            raise RuntimeError("stopped")

    with pytest.raises(RuntimeError, match="stopped"):
        spatial_grid_attack(
            model, x, y, translations=3, max_shift=1, rotations=3, max_angle=10, batch_size=4, stop_point=stop_point
        )
    assert forward_passes == [4, 4]  # of the 18 transformed images, 4 a pass
