"""AutoAttack: the fast engine against the reference (pyautoattack), ensemble semantics, invariants, the fp32
safeguard, and the Lightning callback (results, resume, DDP)."""

import copy
import dataclasses
import json
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch import Tensor

from helpers import (
    HostReads,
    eval_config,
    force_device_path,
    run_command,
    run_test,
    synthetic_points,
    tiny_synthetic,
)
from robust_lightning.attacks import ensemble, lp_norm, reference_engine, stand_ins
from robust_lightning.attacks.ensemble import AutoAttack, batched_runs
from robust_lightning.attacks.stand_ins import channels_last_inputs, folded_batchnorm
from robust_lightning.cli import main
from robust_lightning.errors import UserError
from robust_lightning.evaluation.autoattack import AutoAttackEvaluation, append_record, read_outcomes
from robust_lightning.evaluation.results import weights_sha256

EPS = {"Linf": 10 / 255, "L2": 0.75, "L1": 9.0}


@pytest.fixture(scope="module")
def points():
    x, y = synthetic_points(48, seed=1)
    y[:3] = (y[:3] + 1) % 10  # three mislabelled points: misclassified without attack
    return x, y


def evaluate(model, points, norm, engine, **kwargs):
    """The standard version with a quarter of its iterations and a third of Square's queries, in both engines:
    these tests compare the engines on equal settings (the protocol's own settings are compared with the
    reference's in test_the_standard_versions_settings_are_the_references)."""
    x, y = points
    adversary = AutoAttack(model, norm=norm, eps=EPS[norm], seed=0, engine=engine, n_iter=25, n_queries=100, **kwargs)
    adversary.fab.n_iter = 25
    return adversary.evaluate(x, y, bs=32)


@pytest.fixture(scope="module")
def fast_report(trained, points):
    """The fast engine's report per norm, run once for the tests that only read it."""
    reports = {}

    def report(norm):
        if norm not in reports:
            reports[norm] = evaluate(trained, points, norm, "fast")
        return reports[norm]

    return report


@pytest.mark.parametrize("norm", ["Linf", "L2", "L1"])
def test_fast_engine_matches_the_reference(trained, points, fast_report, norm):
    pytest.importorskip("pyautoattack")
    fast = fast_report(norm)
    reference = evaluate(trained, points, norm, "reference")
    assert torch.equal(fast.clean, reference.clean)
    # some points must break and some survive, or the comparison says nothing
    assert 0.15 < reference.robust_accuracy < 0.85 * reference.clean_accuracy
    # the same broken points up to seed effects (random starts, Square's draws): at most 2 of 48 differ
    assert (fast.robust != reference.robust).sum() <= 2
    assert abs(fast.robust_accuracy - reference.robust_accuracy) <= 2 / 48
    # the attacks' own verdicts hold: the fp32 check of the model refutes none of their claims
    assert set(fast.refuted) == set(fast.attacks) and sum(fast.refuted.values()) == 0


@pytest.mark.parametrize("norm", ["Linf", "L2", "L1"])
def test_adversarial_examples_stay_in_the_threat_model_and_are_misclassified(trained, points, fast_report, norm):
    x, y = points
    report = fast_report(norm)
    assert report.x_adv.min() >= 0 and report.x_adv.max() <= 1
    assert (lp_norm(report.x_adv - x, norm) <= EPS[norm] * (1 + 1e-5) + 1e-6).all()
    with torch.no_grad():
        predicted = trained(report.x_adv).argmax(1)
    broken = report.clean & ~report.robust
    assert broken.any() and (predicted[broken] != y[broken]).all()
    assert torch.equal(report.x_adv[report.robust], x[report.robust])  # untouched where nothing succeeded
    assert torch.equal(report.x_adv[~report.clean], x[~report.clean])  # misclassified points are not attacked
    assert all(b == "clean" for b, c in zip(report.broken_by, report.clean.tolist()) if not c)


def test_each_attack_only_sees_the_survivors_of_the_previous_ones(trained, points, monkeypatch):
    seen = {}
    original = AutoAttack._attack

    def spy(self, attack, model, x, y, bs, precision=None):
        seen[attack] = len(x)
        return original(self, attack, model, x, y, bs, precision)

    monkeypatch.setattr(AutoAttack, "_attack", spy)
    report = evaluate(trained, points, "Linf", "fast")
    n = len(points[1])
    assert seen["apgd-ce"] == report.clean.sum()
    previous = report.clean_accuracy
    for before, attack in zip(("apgd-ce", "apgd-t", "fab-t"), ("apgd-t", "fab-t", "square")):
        if attack in seen:
            assert seen[attack] == round(report.robust_after[before] * n)
    for attack in report.attacks:  # robust accuracy never rises along the ensemble
        assert report.robust_after[attack] <= previous
        previous = report.robust_after[attack]
    assert report.robust_after["square"] == report.robust_accuracy


def test_claimed_successes_are_verified_in_fp32_and_refuted_ones_attacked_again_in_fp32(trained, points, monkeypatch):
    attacks, check_numerics = [], []

    def attack(self, model, x, y, bs):
        attacks.append((len(x), torch.is_autocast_enabled("cpu")))
        if torch.is_autocast_enabled("cpu"):  # "succeeds" on every point unmoved, as bf16 could wrongly suggest
            return x + 0.0, torch.zeros(len(x), dtype=torch.bool)
        return apgd_ce.run(self, model, x, y, bs)  # in fp32: the real attack

    def model(images):  # every forward outside the stubbed bf16 attack is an fp32 check or the fp32 attack
        check_numerics.append((torch.is_autocast_enabled("cpu"), torch.backends.cudnn.allow_tf32))
        return trained(images)

    apgd_ce = ensemble.ATTACKS["apgd-ce"]
    monkeypatch.setitem(ensemble.ATTACKS, "apgd-ce", dataclasses.replace(apgd_ce, run=attack))
    x, y = points
    report = AutoAttack(model, norm="Linf", eps=EPS["Linf"], version="apgd-ce", precision="bf16").evaluate(x, y)
    n_clean = int(report.clean.sum())
    assert attacks == [(n_clean, True), (n_clean, False)]  # bf16, then fp32 for every refuted claim
    assert report.refuted == {"apgd-ce": n_clean} and report.summary()["claims_refuted_in_fp32"] == report.refuted
    assert check_numerics and not any(a or b for a, b in check_numerics)
    fp32 = AutoAttack(trained, norm="Linf", eps=EPS["Linf"], version="apgd-ce").evaluate(x, y)
    assert torch.equal(report.robust, fp32.robust) and not torch.equal(report.robust, report.clean)
    assert "verified in fp32" in report.summary()["precision"]


def test_the_reference_engine_runs_in_true_fp32(trained, points, monkeypatch):
    # PyTorch lets cuDNN convolutions use TF32 by default; an "fp32" reference number must not
    seen = []
    monkeypatch.setattr(
        reference_engine,
        "reference_attack",
        lambda adversary, attack, x, y, bs: (
            seen.append((torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)) or x
        ),
    )
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    x, y = points
    report = AutoAttack(trained, norm="Linf", eps=EPS["Linf"], version="apgd-ce", engine="reference").evaluate(x, y)
    assert seen == [(False, False)] and torch.backends.cudnn.allow_tf32  # off during the attack, restored after
    assert report.summary()["precision"] == "fp32 (TF32 off)"


def test_channels_last_inputs_change_the_layout_not_the_result(trained, points):
    x, _y = points
    layouts = []

    def recording(images):
        layouts.append(images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous())
        return trained(images)

    # the gradient reaches the attack in the standard layout, with the plain model's values
    x_req = x[:8].clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(channels_last_inputs(recording)(x_req).logsumexp(1).sum(), x_req)
    x_req = x[:8].clone().requires_grad_(True)
    (plain,) = torch.autograd.grad(trained(x_req).logsumexp(1).sum(), x_req)
    assert layouts == [True] and grad.is_contiguous() and torch.allclose(grad, plain, rtol=1e-4, atol=1e-7)

    on, off = (evaluate(trained, points, "Linf", "fast", channels_last=flag) for flag in (True, False))
    assert on.summary()["channels_last"] and not off.summary()["channels_last"]
    assert torch.equal(on.clean, off.clean) and torch.equal(on.robust, off.robust)
    assert AutoAttack(trained).channels_last  # the CPU default
    assert not AutoAttack(trained, engine="reference").channels_last
    with pytest.raises(ValueError, match="fast engine only"):
        AutoAttack(trained, engine="reference", channels_last=True)

    class ViewsItsInput(nn.Module):  # as older code does: images.view(batch, -1) before a linear layer
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3 * 16 * 16, 10)

        def forward(self, images):
            return self.linear(images.view(len(images), -1))

    # such a model cannot take channels_last inputs: a clear error, and the way out
    flat = ViewsItsInput()
    predicted = flat(x[:4]).argmax(1)  # labels it gets right, so the attack runs
    with pytest.raises(RuntimeError, match="channels_last=False"):
        AutoAttack(flat, version="apgd-ce", n_iter=2).evaluate(x[:4], predicted)
    report = AutoAttack(flat, version="apgd-ce", n_iter=2, channels_last=False).evaluate(x[:4], predicted)
    assert report.clean.all()


def batchnorm_net() -> nn.Module:
    """A conv net with BatchNorm whose running statistics are not the initial ones (so folding changes weights)."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 16 * 16, 10),
        nn.BatchNorm1d(10),
    )
    with torch.no_grad():
        for _ in range(3):
            net(torch.rand(16, 3, 16, 16) * 2)
    return net.eval()


def test_batchnorm_is_folded_into_a_copy_with_the_same_logits():
    net = batchnorm_net()
    state = copy.deepcopy(net.state_dict())
    folded = folded_batchnorm(net)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in folded.modules())
    assert not any(p.requires_grad for p in folded.parameters())  # input gradients only
    x = torch.rand(4, 3, 16, 16)
    torch.testing.assert_close(folded(x), net(x), rtol=1e-5, atol=1e-5)
    # the model itself is left as it was
    assert isinstance(net[1], nn.BatchNorm2d) and all(torch.equal(v, net.state_dict()[k]) for k, v in state.items())

    assert folded_batchnorm(net.train()) is None  # training mode normalises with batch statistics: nothing to fold
    assert folded_batchnorm(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).eval()) is None  # no BatchNorm
    assert folded_batchnorm(nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 8, 3)).eval()) is None  # none after a layer
    assert folded_batchnorm(lambda images: net.eval()(images)) is None  # not a module

    class Branches(nn.Module):  # control flow on the data: torch.fx cannot trace it
        def __init__(self):
            super().__init__()
            self.net = batchnorm_net()

        def forward(self, images):
            return self.net(images) if images.mean() > 0.5 else -self.net(images)

    with pytest.warns(UserWarning, match="cannot trace"):
        assert folded_batchnorm(Branches().eval()) is None


def test_folding_follows_the_weights_and_its_claims_are_checked_on_the_model(trained, points, monkeypatch):
    x, y = points
    net = copy.deepcopy(trained)
    adversary = AutoAttack(net, norm="Linf", eps=EPS["Linf"], version="apgd-ce", n_iter=10)
    first = adversary.evaluate(x, y)
    assert first.batchnorm_folded and first.summary()["batchnorm_folded"]
    unfolded = AutoAttack(net, norm="Linf", eps=EPS["Linf"], version="apgd-ce", n_iter=10, fold_batchnorm=False)
    assert not unfolded.evaluate(x, y).batchnorm_folded
    with pytest.raises(ValueError, match="fast engine only"):
        AutoAttack(net, engine="reference", fold_batchnorm=True)

    # the folded copy is made per evaluation: after the weights change it attacks the new ones
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean += 0.2  # enough to change some outcomes of the fixture's model
    second, expected = adversary.evaluate(x, y), unfolded.evaluate(x, y)
    assert not torch.equal(second.robust, first.robust)
    assert torch.equal(second.clean, expected.clean) and torch.equal(second.robust, expected.robust)

    # a stand-in that misleads the attack (here: it misclassifies every point, so every point looks broken at
    # once) claims nothing the model refutes: those points are attacked again on the model as given
    attacked = []
    original = AutoAttack._attack

    def spy(self, attack, model, x, y, bs, precision=None):
        attacked.append(model)
        return original(self, attack, model, x, y, bs, precision)

    class Negated(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, images):
            return -self.model(images)

    monkeypatch.setattr(stand_ins, "folded_batchnorm", Negated)
    monkeypatch.setattr(AutoAttack, "_attack", spy)
    misled = adversary.evaluate(x, y)
    assert misled.batchnorm_folded and attacked[-1] is net and len(attacked) == 2
    assert torch.equal(misled.robust, expected.robust) and not torch.equal(misled.robust, misled.clean)


def test_the_reference_keeps_the_l1_restarts_when_the_iterations_are_changed(trained, points, monkeypatch):
    pyautoattack = pytest.importorskip("pyautoattack")
    settings = []

    def record(self, x, y, batch_size):
        settings.append((self.apgd.n_restarts, self.apgd.n_iter, self.apgd.use_largereps))
        return x, None

    monkeypatch.setattr(pyautoattack.AutoAttack, "run_standard_evaluation", record)
    x, y = points
    AutoAttack(trained, norm="L1", eps=EPS["L1"], engine="reference", n_iter=10).evaluate(x, y)
    assert settings[0] == (5, 10, True)  # as the fast engine: 5 restarts of the 3/2/1 x eps schedule


def test_quick_modes_and_the_reference_style_call(trained, points):
    x, y = points
    quick = AutoAttack(trained, norm="Linf", eps=EPS["Linf"], version="apgd-t")
    assert quick.attacks == ("apgd-t",) and quick.n_iter == 40 and quick.n_target_classes == 3
    selection = AutoAttack(trained, norm="Linf", eps=EPS["Linf"], version="apgd-ce", n_iter=10)
    x_adv = selection.run_standard_evaluation(x, y, bs=16)
    assert x_adv.shape == x.shape and (x_adv - x).abs().max() <= EPS["Linf"] + 1e-6
    with pytest.raises(ValueError, match="norm must be one of"):
        AutoAttack(trained, norm="L3")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        selection.evaluate(x * 2 - 1, y)


@pytest.mark.parametrize("norm", ["Linf", "L1"])
@pytest.mark.parametrize("version", ["apgd-ce", "apgd-t"])
def test_the_fast_engine_reads_back_between_runs_not_per_iteration(trained, points, norm, version, monkeypatch):
    """On the path GPUs take, what the fast engine reads back to the host (to re-batch the survivors between
    target classes and restarts, to verify successes, to let broken points leave an APGD run after its
    iterations 1, 2, 4, 8, ...) does not grow with the attacks' iterations."""
    force_device_path(monkeypatch)
    x, y = points
    reads = []
    # iterations with the same exits: after 1, 2, 4, 8 (L1: in the last stage of its eps schedule, 6 and 8
    # iterations long, after 1, 2, 4)
    for n_iter in {"Linf": (9, 16), "L1": (16, 20)}[norm]:
        # a radius that breaks nothing, so that both runs batch the same survivors the same way
        adversary = AutoAttack(trained, norm=norm, eps=1e-4, version=version, n_iter=n_iter)
        with HostReads() as recorder:
            report = adversary.evaluate(x, y, bs=32)
        assert torch.equal(report.robust, report.clean)
        reads.append(len(recorder.calls))
    assert reads[0] == reads[1] > 0


@pytest.mark.parametrize(
    "attack, asked, n_iter, where",
    [("apgd-ce", 3, 30, "apgd"), ("apgd-t", 3, 10, "batched_runs"), ("square", 2, 10, "square_attack")],
)
def test_a_stop_inside_an_attack_resumes_to_the_report_of_the_evaluation_left_alone(
    trained, points, tmp_path, attack, asked, n_iter, where
):
    """A job's stop is asked inside the fast engine's attacks too: every 10 iterations of an APGD run (APGD-CE: the
    third time it is asked, at its first run's 10th iteration), between APGD-T's target classes (the third time:
    after its first runs) and every STOP_CHECK_PASSES passes of Square (the second time: at pass 50). The evaluation
    stops there with the attacks before it kept in the state file, and the same call again runs that attack from
    its start and ends with the report of the evaluation left alone."""
    x, y = points
    attacks = ["apgd-ce", "apgd-t", "square"]
    settings = {"norm": "Linf", "eps": EPS["Linf"], "version": "custom", "attacks_to_run": attacks}
    settings.update(n_iter=n_iter, n_queries=200)
    alone = AutoAttack(trained, **settings).evaluate(x, y, bs=48)
    state = tmp_path / "state.json"
    asked_in_the_attack = []

    def stop() -> bool:
        finished = json.loads(state.read_text())["run_attacks"] if state.exists() else []
        if attacks[len(finished)] == attack:
            asked_in_the_attack.append(True)
        return len(asked_in_the_attack) == asked

    with pytest.raises(ensemble.EvaluationStopped, match="inside an attack") as stopped:
        AutoAttack(trained, **settings).evaluate(x, y, bs=48, state_path=state, stop=stop)
    assert [frame.name for frame in traceback.extract_tb(stopped.value.__traceback__)][-2] == where
    assert json.loads(state.read_text())["run_attacks"] == attacks[: attacks.index(attack)]
    resumed = AutoAttack(trained, **settings).evaluate(x, y, bs=48, state_path=state)
    assert 0 < alone.robust.sum() < alone.clean.sum()  # some points broken, some not: the comparison says something
    assert torch.equal(resumed.robust, alone.robust) and resumed.broken_by == alone.broken_by
    assert resumed.robust_after == alone.robust_after


def test_batched_runs_keep_the_sequential_semantics():
    """Runs batched up to bs rows give each point what one run at a time would: the earliest run that breaks
    it, and no run on a point already broken by an earlier batch."""
    n_points, runs = 6, range(2, 11)
    # breaks[p, r]: run r breaks point p (a fixed table, so the expected outcome is known in advance)
    breaks = torch.zeros(n_points, 11, dtype=torch.bool)
    breaks[0, 2] = breaks[1, 5] = breaks[1, 7] = breaks[2, 10] = breaks[4, 3] = breaks[4, 4] = True
    x = torch.arange(n_points, dtype=torch.float32).view(n_points, 1, 1, 1).expand(n_points, 1, 2, 2)
    for bs in (1, 6, 13, 1000):
        calls = []

        def attack(rows, run_ids, calls=calls):
            calls.append((rows.tolist(), run_ids.tolist()))
            candidates = x[rows] + run_ids.view(-1, 1, 1, 1) / 100  # encodes the run that produced it
            return candidates, ~breaks[rows, run_ids]

        x_adv, robust = batched_runs(attack, x, runs, bs)
        for p in range(n_points):
            hits = [r for r in runs if breaks[p, r]]
            expected = p + hits[0] / 100 if hits else p
            assert torch.allclose(x_adv[p], torch.full((1, 2, 2), float(expected))), (bs, p)
            assert robust[p] == (not hits)
        attacked = [(row, run) for rows, run_ids in calls for row, run in zip(rows, run_ids)]
        assert sorted({run for _, run in attacked}) == list(runs)  # every run happens, each once per point
        assert len(attacked) == len(set(attacked))
        for rows, run_ids in calls:
            assert len(rows) <= max(bs, n_points)
            for row, _run in zip(rows, run_ids):  # only points not broken by an earlier batch are attacked
                assert not any(breaks[row, r] for r in runs if r < min(run_ids))
    assert len(calls) == 1  # bs=1000: all nine runs in one batch

    # As few batches as bs allows, evenly filled: with room for four runs of the six points, nine runs go
    # three by three (not 4 + 4 + 1).
    runs_per_call = []

    def unbroken(rows, run_ids):
        runs_per_call.append(len(set(run_ids.tolist())))
        return x[rows], torch.ones(len(rows), dtype=torch.bool)

    batched_runs(unbroken, x, runs, bs=24)
    assert runs_per_call == [3, 3, 3]


def test_fab_target_ranks_batched_in_one_run_match_one_rank_at_a_time(trained, points):
    """FAB-T has no randomness: attacking all target ranks in one batch finds what one rank at a time does."""
    x, y = points
    adversary = AutoAttack(trained, norm="Linf", eps=EPS["Linf"], seed=0)
    clean = trained(x).argmax(1) == y
    one_at_a_time, robust_one = ensemble.run_fab_t(adversary, trained, x[clean], y[clean], bs=1)
    all_at_once, robust_all = ensemble.run_fab_t(adversary, trained, x[clean], y[clean], bs=10_000)
    moved = (one_at_a_time != x[clean]).flatten(1).any(1)
    assert moved.any() and not moved.all() and torch.equal(moved, ~robust_one)
    assert torch.equal(moved, (all_at_once != x[clean]).flatten(1).any(1)) and torch.equal(robust_one, robust_all)
    # same points moved, same verdicts; the iterates agree up to the float rounding of batched products
    # (FAB's projections are sensitive to it, see attacks/fab.py)
    assert torch.allclose(one_at_a_time, all_at_once, atol=1e-4)


# ------------------------------------------------------------------------------------------ the callback


def direct_outcomes(checkpoint, batches: list[list[str]]) -> dict[str, bool]:
    """Robust flags from AutoAttack run directly (no Lightning) on the same batches of images."""
    from robust_lightning.data.datamodule import ImageNetDataModule
    from robust_lightning.training.lightning_module import ImageClassifier

    ckpt, synthetic_root = checkpoint
    module = ImageClassifier.load_from_checkpoint(ckpt, map_location="cpu", weights_only=True).eval()
    data = ImageNetDataModule(source=tiny_synthetic(synthetic_root), image_size=32, eval_batch_size=100, num_workers=0)
    data.setup("test")
    everything = next(iter(data.test_dataloader()))
    where = {key: i for i, key in enumerate(everything["key"])}
    flags = {}
    for keys in batches:
        index = torch.tensor([where[k] for k in keys])
        x, y = everything["image"][index].float() / 255, everything["label"][index]
        report = AutoAttack(module, norm="Linf", eps=4 / 255, version="apgd-ce", n_iter=5).evaluate(x, y, bs=6)
        flags.update(zip(keys, report.robust.tolist()))
    return flags


def saved_batches(path: Path) -> list[list[str]]:
    return [json.loads(line)["key"] for line in path.read_text().splitlines()]


def test_callback_results_match_a_direct_evaluation_and_resume_without_double_counting(tmp_path, checkpoint):
    # an interrupted evaluation: only the first two batches got done
    partial = run_test(tmp_path, checkpoint, "--trainer.limit_test_batches", "2")
    assert partial["threat_models"]["Linf-4_255"]["num_points"] == 12
    final = run_test(tmp_path, checkpoint)["threat_models"]["Linf-4_255"]
    assert final["num_points"] == 20  # 4 classes x 5 val images, each exactly once
    assert final["claims_refuted_in_fp32_this_session"] == {"apgd-ce": 0}  # of the resumed session's 2 images
    batches = saved_batches(tmp_path / "outcomes" / "Linf-4_255" / "rank0.jsonl")
    assert [len(keys) for keys in batches] == [6, 6, 6, 2]  # the resumed run only did the rest

    outcomes = read_outcomes(tmp_path / "outcomes" / "Linf-4_255")
    direct = direct_outcomes(checkpoint, batches)
    assert {key: o["robust"] for key, o in outcomes.items()} == direct
    assert final["robust_accuracy"] == sum(direct.values()) / 20
    assert 0 < sum(direct.values()) < final["clean_accuracy"] * 20  # the comparison is not vacuous


def test_outcomes_of_another_evaluation_are_refused(tmp_path, checkpoint, capsys):
    first = run_test(tmp_path, checkpoint, "--trainer.limit_test_batches", "1")
    assert first["conditions"]["channels_last"]  # the fast engine's CPU default
    assert first["conditions"]["batchnorm_folded"]  # test_resnet has BatchNorm after its convolutions
    ckpt, synthetic_root = checkpoint
    config = eval_config(tmp_path, synthetic_root, n_iter=7)
    assert main(["test", "--config", str(config), "--ckpt_path", str(ckpt)]) == 2  # a clear error, nothing mixed
    assert "(n_iter differ)" in capsys.readouterr().err
    # other images (another resolution, so other preprocessing) are another evaluation too
    config = eval_config(tmp_path, synthetic_root)
    assert main(["test", "--config", str(config), "--ckpt_path", str(ckpt), "--data.image_size", "24"]) == 2
    assert "(data_image_size differ)" in capsys.readouterr().err
    # the input layout only changes float rounding: the evaluation resumes, and results.json says which ran
    resumed = run_test(tmp_path, checkpoint, channels_last=False)
    assert resumed["threat_models"]["Linf-4_255"]["num_points"] == 20 and not resumed["conditions"]["channels_last"]


def test_listed_images_that_never_arrive_are_reported_not_silently_left_out(tmp_path, checkpoint):
    # shards are filtered by key as they stream, so a listed image missing from them shows only at the end
    subset = tmp_path / "subset.txt"
    # (synthetic image i is of class i % 4, listed under its class folder)
    subset.write_text("plus/synthetic_val_000003\ncircle/synthetic_val_000000\ncircle/synthetic_val_999999")
    # data.on_missing_images warn: evaluate what arrived (the default, error, stops the run:
    # tests/test_missing_images.py)
    section = run_test(tmp_path, checkpoint, "--data.eval_subset", str(subset), "--data.on_missing_images", "warn")[
        "threat_models"
    ]["Linf-4_255"]
    assert section["num_points"] == 2 and section["images_not_evaluated"] == 1
    assert section["keys_not_evaluated"] == ["synthetic_val_999999"]


def test_the_weights_hash_covers_every_value_of_the_evaluated_weights():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    same = copy.deepcopy(model)
    assert weights_sha256(model) == weights_sha256(same)
    with torch.no_grad():
        same[1].running_var[2] += 1e-6  # a buffer, not a parameter
    assert weights_sha256(model) != weights_sha256(same)
    assert weights_sha256(copy.deepcopy(model).to(torch.bfloat16)) != weights_sha256(model)


def test_a_line_cut_short_by_a_kill_is_redone(tmp_path):
    directory = tmp_path / "Linf"
    directory.mkdir()
    good = {"key": ["a"], "label": [0], "clean": [True], "robust": [True], "broken_by": [None], "seconds": {}}
    (directory / "rank0.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(good)[:20])
    assert list(read_outcomes(directory)) == ["a"]
    # the resumed run's next batch starts on a line of its own, not glued onto the cut one
    append_record(directory / "rank0.jsonl", {**good, "key": ["b"]})
    assert list(read_outcomes(directory)) == ["a", "b"]


def test_ddp_evaluation_splits_points_and_gathers_them_exactly(tmp_path, checkpoint):
    ckpt, synthetic_root = checkpoint
    config = eval_config(tmp_path, synthetic_root, devices=2)
    result = run_command(["test", "--config", str(config), "--ckpt_path", str(ckpt)], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(next((tmp_path / "runs" / "aa").glob("version_*/results.json")).read_text())
    summary = summary["autoattack"]["threat_models"]["Linf-4_255"]
    files = sorted((tmp_path / "outcomes" / "Linf-4_255").glob("rank*.jsonl"))
    per_rank = [{key for keys in saved_batches(path) for key in keys} for path in files]
    assert len(per_rank) == 2 and not per_rank[0] & per_rank[1] and len(per_rank[0] | per_rank[1]) == 20
    direct = direct_outcomes(checkpoint, [keys for path in files for keys in saved_batches(path)])
    assert summary["num_points"] == 20 and summary["robust_accuracy"] == sum(direct.values()) / 20


def test_images_sharing_a_key_are_refused_not_counted_once():
    callback = AutoAttackEvaluation()
    callback.seen = set()
    batch = {"image": torch.zeros(2, 3, 8, 8), "label": torch.zeros(2, dtype=torch.long), "key": ["img_0", "img_0"]}
    with pytest.raises(UserError, match="share the key 'img_0'"):
        callback.on_test_batch_end(None, None, None, batch, 0)
    callback.seen = {"img_0"}  # an earlier batch of this session had it
    with pytest.raises(UserError, match="share the key 'img_0'"):
        callback.on_test_batch_end(None, None, None, {**batch, "key": ["img_0", "img_1"]}, 1)


def test_l1_quick_modes_need_an_iteration_per_stage_of_the_eps_schedule():
    with pytest.raises(UserError, match="n_iter must be at least 3 with an L1 threat model"):
        AutoAttackEvaluation(threat_models=[{"norm": "L1", "eps": 1.0}], version="apgd-ce", n_iter=2)
    with pytest.raises(ValueError, match="n_iter must be at least 3"):
        AutoAttack(nn.Identity(), norm="L1", eps=1.0, version="apgd-ce", n_iter=2)


def test_the_call_signatures_of_both_reference_codes_work_unchanged(trained, points):
    """Code written for pyautoattack 0.2.0 (keyword-only constructor, batch_size=, (x_adv, y_adv) back, budgets
    set on the attack objects) and for fra31/auto-attack (bs=, return_labels) runs as it is."""
    pyautoattack = pytest.importorskip("pyautoattack")
    x, y = points

    def written_for_pyautoattack(cls):  # the same lines for both classes
        adversary = cls(
            trained, attacks=["apgd-ce", "square"], device="cpu", eps=EPS["Linf"], norm="Linf", seed=0, version="custom"
        )
        adversary.apgd.n_restarts, adversary.apgd.n_iter = 1, 100
        adversary.square.n_queries = 300
        return adversary

    ours, theirs = written_for_pyautoattack(AutoAttack), written_for_pyautoattack(pyautoattack.AutoAttack)
    theirs.logger.disabled = True
    x_adv, y_adv = ours.run_standard_evaluation(x, y, batch_size=32)
    x_ref, y_ref = theirs.run_standard_evaluation(x, y, batch_size=32)
    assert ours.attacks == ("apgd-ce", "square") and ours.epsilon == theirs.epsilon
    assert (x_adv - x).abs().max() <= EPS["Linf"] + 1e-6 and x_adv.min() >= 0 and x_adv.max() <= 1
    with torch.no_grad():
        assert torch.equal(y_adv, trained(x_adv).argmax(1)) and torch.equal(y_ref, trained(x_ref).argmax(1))
    robust, robust_ref = y_adv == y, y_ref == y
    assert 0 < robust.sum() < (trained(x).argmax(1) == y).sum()  # the comparison says something
    assert (robust != robust_ref).sum() <= 2  # random starts and Square's draws differ
    assert ours.clean_accuracy(x, y, bs=16) == pytest.approx(theirs.clean_accuracy(x, y, bs=16))

    individual = ours.run_standard_evaluation_individual(x, y, batch_size=32)
    assert list(individual) == ["apgd-ce", "square"] and ours.attacks_to_run == ["apgd-ce", "square"]
    alone = {attack: (adv_y == y).sum().item() for attack, (_, adv_y) in individual.items()}
    assert min(alone.values()) >= robust.sum().item()  # each attack alone breaks at most what the ensemble breaks

    # fra31/auto-attack's spelling: x_adv alone, or with the labels (budgets cut: the calls are what is tested)
    fra31 = shortened(AutoAttack(trained, norm="Linf", eps=EPS["Linf"], version="standard", verbose=False))
    assert torch.is_tensor(fra31.run_standard_evaluation(x[:8], y[:8], bs=8))
    assert len(fra31.run_standard_evaluation(x[:8], y[:8], bs=8, return_labels=True)) == 2


def shortened(adversary: AutoAttack) -> AutoAttack:
    """Small budgets set through the reference's attributes, where a test checks calls rather than strength."""
    adversary.apgd.n_iter = adversary.apgd_targeted.n_iter = adversary.fab.n_iter = 5
    adversary.apgd_targeted.n_target_classes = adversary.fab.n_target_classes = 2
    adversary.square.n_queries = 20
    return adversary


def predicted(model, x: Tensor, bs: int) -> Tensor:
    with torch.no_grad():
        return torch.cat([model(x[i : i + bs]).argmax(1) for i in range(0, len(x), bs)])


def test_robustbench_benchmark_call_prints_and_logs_fra31_lines(trained, points, tmp_path, capsys):
    """robustbench 1.1.1's benchmark() (robustbench/eval.py) calls AutoAttack(model, norm=..., eps=...,
    version='standard', device=device, log_path=log_path), then run_standard_evaluation(x, y, bs=batch_size,
    state_path=aa_state_path); fra31's verbose default prints its lines, and log_path gets the same."""
    x, y = points[0][:16], points[1][:16]
    log = tmp_path / "autoattack.log"
    adversary = shortened(
        AutoAttack(
            trained, norm="Linf", eps=EPS["Linf"], version="standard", device=torch.device("cpu"), log_path=str(log)
        )
    )
    x_adv = adversary.run_standard_evaluation(x, y, bs=8, state_path=None)
    printed = capsys.readouterr().out.splitlines()
    assert log.read_text().splitlines() == printed
    clean = (predicted(trained, x, 8) == y).float().mean().item()
    robust = (predicted(trained, x_adv, 8) == y).float().mean().item()
    assert 0 < robust < clean  # the lines below say something
    assert printed[0] == "using standard version including apgd-ce, apgd-t, fab-t, square."
    assert printed[1] == f"initial accuracy: {clean:.2%}"
    after = [line for line in printed if line.startswith("robust accuracy after ")]
    assert [line.split(":")[0] for line in after] == [
        f"robust accuracy after {attack}" for attack in ("APGD-CE", "APGD-T", "FAB-T", "SQUARE")
    ]
    assert after[-1].startswith(f"robust accuracy after SQUARE: {robust:.2%} (total time ")
    broken = [int(line.split(" - ")[1].split()[0]) for line in printed if "successfully perturbed" in line]
    assert sum(broken) == round((clean - robust) * len(x))
    largest = (x_adv - x).abs().flatten(1).amax(1).max().item()
    assert printed[-2].startswith(f"max Linf perturbation: {largest:.5f}, nan in tensor: 0")
    assert largest <= EPS["Linf"] + 1e-6 and x_adv.min() >= 0 and x_adv.max() <= 1
    assert printed[-1] == f"robust accuracy: {robust:.2%}"

    adversary.clean_accuracy(x, y, bs=8)  # RobustBench's own clean_accuracy is a separate function; fra31 prints
    assert capsys.readouterr().out == f"clean accuracy: {clean:.2%}\n"


def test_fra31_readme_calls_run_unchanged(trained, points, capsys):
    """fra31/auto-attack's README: the positional constructor, version='custom' with attacks_to_run set as an
    attribute and budgets on the attack objects, the seed as an attribute, the individual evaluation."""
    x, y = points[0][:16], points[1][:16]
    positional = AutoAttack(trained, "L2", 0.5, None, False, [], "standard", False, "cpu", None)
    assert (positional.norm, positional.eps, positional.verbose, positional.device) == (
        "L2",
        0.5,
        False,
        torch.device("cpu"),
    )
    assert positional.attacks == ("apgd-ce", "apgd-t", "fab-t", "square") and isinstance(positional.seed, int)

    adversary = AutoAttack(trained, norm="Linf", eps=EPS["Linf"], version="custom")
    adversary.attacks_to_run = ["apgd-ce", "fab"]  # the README's example, untargeted FAB included
    adversary.apgd.n_restarts = 2
    adversary.fab.n_restarts = 2
    adversary.seed = 0
    shortened(adversary)
    capsys.readouterr()
    dict_adv = adversary.run_standard_evaluation_individual(x, y, bs=8)
    assert list(dict_adv) == ["apgd-ce", "fab"] and all(torch.is_tensor(v) for v in dict_adv.values())
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "using custom version including apgd-ce, fab"
    for attack, line in zip(("apgd-ce", "fab"), printed[1:], strict=True):
        accuracy = (predicted(trained, dict_adv[attack], 8) == y).float().mean().item()
        assert line.startswith(f"robust accuracy by {attack.upper()}\t{accuracy:.2%}\t(time attack: ")

    with pytest.raises(ValueError, match="needs the attacks to run: AutoAttack"):
        AutoAttack(trained, version="custom").run_standard_evaluation(x, y, bs=8)
    with pytest.raises(ValueError, match="is_tf_model=True .* is not implemented here"):
        AutoAttack(trained, is_tf_model=True)
    with pytest.raises(ValueError, match="set by version='standard'; give them with version='custom' only"):
        AutoAttack(trained, attacks_to_run=["apgd-ce"])
    with pytest.raises(ValueError, match="attacks_to_run .* or attacks .*, not both"):
        AutoAttack(trained, version="custom", attacks_to_run=["apgd-ce"], attacks=["apgd-ce"])


@pytest.mark.parametrize("norm", ["Linf", "L2", "L1"])
def test_the_standard_versions_settings_are_the_references(trained, norm):
    pyautoattack = pytest.importorskip("pyautoattack")

    def settings(adversary) -> tuple:
        apgd, targeted, fab = adversary.apgd, adversary.apgd_targeted, adversary.fab
        return (
            list(adversary.attacks_to_run),
            (apgd.n_restarts, apgd.n_iter, targeted.n_target_classes, targeted.n_iter),
            (fab.n_restarts, fab.n_target_classes, fab.n_iter, adversary.square.n_queries),
        )

    theirs = pyautoattack.AutoAttack(trained, norm=norm, eps=EPS[norm], version="standard", device="cpu")
    assert settings(AutoAttack(trained, norm=norm, eps=EPS[norm], version="standard")) == settings(theirs)


def test_custom_starts_from_the_reference_constructors_budgets(trained):
    pyautoattack = pytest.importorskip("pyautoattack")
    for norm in ("Linf", "L1"):
        ours = AutoAttack(trained, norm=norm, version="custom", attacks_to_run=["apgd-ce", "apgd-t"])
        theirs = pyautoattack.AutoAttack(
            trained, norm=norm, version="custom", attacks=["apgd-ce", "apgd-t"], device="cpu"
        )
        assert (ours.apgd.n_restarts, ours.apgd_targeted.n_target_classes, ours.square.n_queries) == (
            theirs.apgd.n_restarts,
            theirs.apgd_targeted.n_target_classes,
            theirs.square.n_queries,
        )


def test_budgets_set_on_the_attack_objects_reach_the_attacks(trained, points, monkeypatch):
    x, y = points
    calls = []
    real_apgd = ensemble.apgd

    def spy(*args, **kwargs):
        calls.append((kwargs["n_iter"], kwargs["loss"]))
        return real_apgd(*args, **kwargs)

    monkeypatch.setattr(ensemble, "apgd", spy)
    adversary = AutoAttack(trained, norm="Linf", eps=EPS["Linf"], version="custom", attacks=["apgd-dlr", "apgd-t"])
    adversary.apgd.n_iter, adversary.apgd_targeted.n_iter, adversary.apgd_targeted.n_target_classes = 7, 5, 2
    adversary.evaluate(x, y, bs=48)
    assert {call for call in calls} == {(7, "dlr"), (5, "dlr-targeted")}
    with pytest.raises(ValueError, match="attacks must be a non-empty list"):
        adversary.attacks_to_run = ["apgd-ce", "pgd"]
        adversary.evaluate(x, y)
    seeded_by_the_clock = AutoAttack(trained, seed=None)
    assert isinstance(seeded_by_the_clock.seed, int)
    with pytest.raises(UserError, match="version custom needs attacks_to_run"):  # a config names them too
        AutoAttackEvaluation(version="custom")


def test_the_progress_bar_shows_the_attacks_only_when_asked(trained, points, capsys):
    x, y = points
    adversary = AutoAttack(trained, norm="Linf", eps=EPS["Linf"], version="apgd-ce", n_iter=5)
    quiet = adversary.evaluate(x, y, bs=48)
    assert "autoattack" not in capsys.readouterr().err
    shown = adversary.evaluate(x, y, bs=48, progress_bar=True)
    assert "autoattack" in capsys.readouterr().err
    assert torch.equal(quiet.robust, shown.robust)


@pytest.fixture
def checkpoint(autoattack_checkpoint):
    """The session's tiny AutoAttack checkpoint (tests/conftest.py) and its synthetic data."""
    return autoattack_checkpoint
