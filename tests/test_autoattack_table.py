"""AutoAttack's table of attacks (robust_lightning.attacks.ensemble.ATTACKS): the versions name its attacks, a
new attack is a runner and a row, and ``version: custom`` runs the attacks of ``attacks_to_run`` from a config."""

import pytest
import torch

from helpers import run_test, synthetic_points
from robust_lightning.attacks import ensemble, fgsm
from robust_lightning.attacks.ensemble import ATTACKS, VERSIONS, Attack, AutoAttack
from robust_lightning.attacks.reference_engine import REFERENCE_ATTACKS
from robust_lightning.errors import UserError
from robust_lightning.evaluation.autoattack import AutoAttackEvaluation

EPS = 10 / 255


def test_the_versions_run_attacks_of_the_table_and_the_reference_engine_has_them_all():
    assert {attack for attacks in VERSIONS.values() for attack in attacks} <= set(ATTACKS)
    assert tuple(ATTACKS) == REFERENCE_ATTACKS  # today's attacks are the reference's, by its names


def run_fgsm(adversary, model, x, y, bs):
    """FGSM (Goodfellow et al., 2015) as an attack of the ensemble: one signed-gradient step of size eps."""
    candidates = fgsm(model, x, y, eps=adversary.eps)
    with torch.no_grad():
        robust = model(candidates).argmax(1) == y
    return torch.where(robust.view(-1, 1, 1, 1), x, candidates), robust


def test_a_new_attack_is_a_runner_and_a_row(trained, monkeypatch):
    monkeypatch.setitem(ensemble.ATTACKS, "fgsm", Attack(run_fgsm, "apgd"))
    x, y = synthetic_points(32, seed=1)
    adversary = AutoAttack(trained, eps=EPS, version="custom", attacks_to_run=["fgsm", "apgd-ce"], verbose=False)
    adversary.apgd.n_restarts, adversary.apgd.n_iter = 1, 10
    report = adversary.evaluate(x, y, bs=16)
    assert report.attacks == ("fgsm", "apgd-ce") and list(report.robust_after) == ["fgsm", "apgd-ce"]
    by_fgsm = torch.tensor([by == "fgsm" for by in report.broken_by])
    assert by_fgsm.any() and (report.x_adv[by_fgsm] - x[by_fgsm]).abs().amax() <= EPS + 1e-6
    with torch.no_grad():
        assert (trained(report.x_adv[by_fgsm]).argmax(1) != y[by_fgsm]).all()  # verified on the model
    # the evaluation callback takes it from a config too; the reference engine does not have it
    assert AutoAttackEvaluation(version="custom", attacks_to_run=["fgsm"]).attacks == ("fgsm",)
    with pytest.raises(UserError, match="the reference engine has no attack 'fgsm'"):
        AutoAttackEvaluation(version="custom", attacks_to_run=["fgsm"], engine="reference")
    with pytest.raises(ValueError, match="engine='reference' runs pyautoattack's attacks"):
        AutoAttack(trained, version="custom", attacks_to_run=["fgsm"], engine="reference")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"version": "custom", "attacks_to_run": ["apgd-ce", "pgd"]}, "unknown attack 'pgd'; the attacks are apgd-ce"),
        ({"version": "custom"}, "version custom needs attacks_to_run"),
        ({"version": "standard", "attacks_to_run": ["apgd-ce"]}, "attacks_to_run is for version: custom"),
        ({"version": "custom", "attacks_to_run": ["square", "square"]}, "names an attack twice"),
    ],
)
def test_the_callback_refuses_a_wrong_attack_list_in_one_line(options, message):
    with pytest.raises(UserError, match=message) as error:
        AutoAttackEvaluation(**options)
    assert "\n" not in str(error.value)


def test_version_custom_runs_the_attacks_to_run_of_a_config(tmp_path, autoattack_checkpoint):
    result = run_test(
        tmp_path,
        autoattack_checkpoint,
        version="custom",
        attacks_to_run=["square", "apgd-ce"],
        n_queries=50,
        sanity_points=0,
    )
    section = result["threat_models"]["Linf-4_255"]
    assert result["conditions"]["version"] == "custom"
    assert result["conditions"]["attacks"] == ["square", "apgd-ce"]
    assert list(section["robust_accuracy_after"]) == ["square", "apgd-ce"]
    assert section["num_points"] == 20 and section["robust_accuracy"] <= section["robust_accuracy_after"]["square"]
