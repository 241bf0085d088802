"""AutoAttack's ``state_path`` (fra31/auto-attack, pyautoattack 0.2.0): an evaluation stopped between attacks and
called again with the same file ends with the verdicts of the same evaluation left alone, runs only the attacks
left, and refuses a file made by another evaluation."""

import json

import pytest
import torch

from helpers import synthetic_points
from robust_lightning.attacks.ensemble import AutoAttack

EPS = 10 / 255
ATTACKS = ["apgd-ce", "apgd-t", "square"]


@pytest.fixture(scope="module")
def points():
    x, y = synthetic_points(40, seed=1)
    y[:2] = (y[:2] + 1) % 10  # misclassified without attack
    return x, y


def adversary(model, attacks=ATTACKS, eps=EPS) -> AutoAttack:
    attack = AutoAttack(model, norm="Linf", eps=eps, seed=0, version="custom", attacks=list(attacks), n_queries=100)
    attack.apgd.n_restarts, attack.apgd.n_iter = 1, 10
    attack.apgd_targeted.n_iter, attack.apgd_targeted.n_target_classes = 10, 3
    return attack


@pytest.fixture(scope="module")
def left_alone(trained, points):
    return adversary(trained).evaluate(*points, bs=16)


class Stop(Exception):
    """A kill between two attacks (a time limit, a pre-emption)."""


def stopped_before(attack_name: str, adversary_: AutoAttack, monkeypatch) -> None:
    run = adversary_._attack

    def attack(attack, *args, **kwargs):
        if attack == attack_name:
            raise Stop
        return run(attack, *args, **kwargs)

    monkeypatch.setattr(adversary_, "_attack", attack)


def test_a_stopped_evaluation_resumed_from_its_state_ends_as_if_left_alone(trained, points, left_alone, tmp_path):
    x, y = points
    state_path = tmp_path / "state.json"
    first = adversary(trained)
    with pytest.MonkeyPatch.context() as monkeypatch:
        stopped_before("square", first, monkeypatch)
        with pytest.raises(Stop):
            first.evaluate(x, y, bs=16, state_path=state_path)
    saved = json.loads(state_path.read_text())
    assert saved["run_attacks"] == ["apgd-ce", "apgd-t"]

    calls = []
    second = adversary(trained)
    run = second._attack
    second._attack = lambda attack, *args, **kwargs: calls.append(attack) or run(attack, *args, **kwargs)
    resumed = second.evaluate(x, y, bs=16, state_path=state_path)
    assert calls == ["square"]  # only the attack left
    assert torch.equal(resumed.robust, left_alone.robust) and torch.equal(resumed.clean, left_alone.clean)
    assert resumed.robust_after == left_alone.robust_after
    assert 0 < resumed.robust_accuracy < resumed.clean_accuracy  # the comparison is not vacuous
    broken_before = [i for i, by in enumerate(left_alone.broken_by) if by in ("apgd-ce", "apgd-t")]
    # which attack broke each point is kept in the state (a reference file, which does not record it, gives
    # "before the resume")
    assert broken_before and all(resumed.broken_by[i] == left_alone.broken_by[i] for i in broken_before)
    assert torch.equal(resumed.x_adv[broken_before], x[broken_before])  # as the reference: not kept
    by_square = [i for i, by in enumerate(left_alone.broken_by) if by == "square"]
    assert torch.equal(resumed.x_adv[by_square], left_alone.x_adv[by_square])
    assert json.loads(state_path.read_text())["run_attacks"] == ATTACKS

    # a finished state: called again, it attacks nothing and counts nothing twice
    calls.clear()
    again = second.evaluate(x, y, bs=16, state_path=state_path)
    assert calls == [] and torch.equal(again.robust, left_alone.robust)


def test_the_reference_call_takes_a_state_path(trained, points, left_alone, tmp_path):
    x, y = points
    x_adv = adversary(trained).run_standard_evaluation(x, y, bs=16, state_path=tmp_path / "state.json")
    with torch.no_grad():
        robust = trained(x_adv).argmax(1) == y
    assert torch.equal(robust, left_alone.robust)
    assert json.loads((tmp_path / "state.json").read_text())["robust_flags"] == left_alone.robust.tolist()


def test_a_state_of_another_evaluation_is_refused(trained, points, tmp_path):
    x, y = points
    state_path = tmp_path / "state.json"
    adversary(trained, attacks=["apgd-ce"]).evaluate(x, y, bs=16, state_path=state_path)
    with pytest.raises(ValueError, match="attacks"):
        adversary(trained).evaluate(x, y, bs=16, state_path=state_path)
    with pytest.raises(ValueError, match="eps"):
        adversary(trained, attacks=["apgd-ce"], eps=4 / 255).evaluate(x, y, bs=16, state_path=state_path)
    with pytest.raises(ValueError, match="points 40, not points 20"):
        adversary(trained, attacks=["apgd-ce"]).evaluate(x[:20], y[:20], bs=16, state_path=state_path)
    saved = json.loads(state_path.read_text())
    misclassified = 0  # a point the state counts robust that this model gets wrong
    saved["robust_flags"][misclassified] = True
    state_path.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="another model or other points"):
        adversary(trained, attacks=["apgd-ce"]).evaluate(x, y, bs=16, state_path=state_path)
    state_path.write_text("{not json")
    with pytest.raises(ValueError, match="not an AutoAttack state file"):
        adversary(trained, attacks=["apgd-ce"]).evaluate(x, y, bs=16, state_path=state_path)


def test_a_state_file_of_the_reference_is_resumed(trained, points, tmp_path):
    """pyautoattack 0.2.0 writes its set of attacks as a Python set's text and then cannot resume from its own
    file (it compares that text with a set); the file is read here."""
    reference = pytest.importorskip("pyautoattack")
    x, y = points
    state_path = tmp_path / "state.json"
    package = reference.AutoAttack(trained, norm="Linf", eps=EPS, version="standard", device="cpu", seed=0)
    package.attacks_to_run = ["apgd-ce"]
    package.apgd.n_iter = 10
    package.run_standard_evaluation(x, y, batch_size=16, state_path=state_path)
    flags = json.loads(state_path.read_text())["_robust_flags"]
    with pytest.raises(ValueError, match="different set of attacks"):  # the package's own resume
        package.run_standard_evaluation(x, y, batch_size=16, state_path=state_path)

    calls = []
    ours = adversary(trained, attacks=["apgd-ce"])
    run = ours._attack
    ours._attack = lambda attack, *args, **kwargs: calls.append(attack) or run(attack, *args, **kwargs)
    report = ours.evaluate(x, y, bs=16, state_path=state_path)
    assert calls == [] and report.robust.tolist() == flags and 0 < sum(flags) < report.clean.sum()
