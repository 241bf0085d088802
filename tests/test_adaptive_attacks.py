"""The adaptive attacks (robust_lightning.attacks.adaptive) on a zoo of small models with known pitfalls
(tests/attack_zoo.py), each against the same network without its pitfall: BPDA and a transfer attack break a
quantised and a shattered model to within 3 points of the plain network's robust accuracy, where APGD on the masked
model breaks nothing; EoT scores a randomized model over its draws; Square from scratch stays in the threat model and
agrees with the reference's Square with restarts. AutoAttack runs them by itself where its checks call for them,
and leaves a plain model as it was."""

import json
from pathlib import Path

import pytest
import torch
from pyautoattack.square import SquareAttack

from attack_zoo import Noisy, Scaled, quantised, shattered
from helpers import run_test, synthetic_points, train_small_cnn
from robust_lightning.attacks import (
    AutoAttack,
    apgd,
    bpda_attack,
    eot_attack,
    square_from_scratch,
    straight_through,
    transfer_attack,
    without_parts,
)
from robust_lightning.attacks.ensemble import EvaluationStopped
from robust_lightning.attacks.sanity import sanity_checks
from robust_lightning.evaluation.outcomes import read_outcomes

EPS = 16 / 255  # a quantisation step of 1/16: smaller radii cannot move most points across a rounding boundary
N_ITER = 20


@pytest.fixture(scope="module")
def net():
    return train_small_cnn()


@pytest.fixture(scope="module")
def points():
    return synthetic_points(200, seed=5)


def robust_share(model, x, y, **options) -> float:
    """APGD-CE's robust accuracy (the plain gradient attack, no approximation)."""
    run = apgd(model, x, y, norm="Linf", eps=EPS, n_iter=N_ITER, loss="ce", random_start=True, generator=0, **options)
    return run.robust.float().mean().item()


@pytest.fixture(scope="module")
def plain(net, points):
    """The plain network's robust accuracy under the same attacks (APGD-CE and APGD-T)."""
    x, y = points
    return transfer_attack(net, net, x, y, norm="Linf", eps=EPS, n_iter=N_ITER).robust.mean().item()


@pytest.mark.parametrize("masked, part", [(quantised, "quantise"), (shattered, "shatter")])
def test_bpda_and_transfer_break_a_masked_model_to_the_plain_networks_figure(net, points, plain, masked, part):
    x, y = points
    model = masked(net)
    assert robust_share(model, x, y) > plain + 0.5  # the masking is real: APGD on the model itself breaks nothing
    bpda = bpda_attack(model, x, y, parts=[part], norm="Linf", eps=EPS, n_iter=N_ITER)
    transfer = transfer_attack(model, without_parts(model, [part]), x, y, norm="Linf", eps=EPS, n_iter=N_ITER)
    for result in (bpda, transfer):
        assert abs(result.robust.mean().item() - plain) <= 0.03
        # every success holds on the real model, inside the threat model
        broken = result.robust == 0
        with torch.no_grad():
            assert (model(result.x_adv[broken]).argmax(1) != y[broken]).all()
        assert (result.x_adv - x).abs().amax() <= EPS + 1e-6 and 0 <= result.x_adv.min() <= result.x_adv.max() <= 1


def test_eot_scores_a_randomized_model_over_its_draws(net, points):
    x, y = points[0][:100], points[1][:100]
    model = Noisy(net)
    torch.manual_seed(0)
    result = eot_attack(model, x, y, norm="Linf", eps=8 / 255, draws=20, eot_iter=5, n_iter=N_ITER)
    # an independent estimate of each point's expected accuracy on its adversarial example, over 200 draws: the
    # attack's 20-draw shares agree on average (a share's standard error is at most 0.11, their mean's 0.011)
    with torch.no_grad():
        shares = torch.stack([(model(result.x_adv).argmax(1) == y).float() for _ in range(200)]).mean(0)
    assert abs(result.robust.mean().item() - shares.mean().item()) < 0.04
    # the gradient averaged over draws attacks at least as well as one draw's, scored the same way (up to noise),
    # and no attack leaves more than the clean images' expected accuracy
    one_draw = eot_attack(model, x, y, norm="Linf", eps=8 / 255, draws=20, eot_iter=1, n_iter=N_ITER)
    assert result.robust.mean().item() <= one_draw.robust.mean().item() + 0.05
    with torch.no_grad():
        clean = torch.stack([(model(x).argmax(1) == y).float() for _ in range(200)]).mean()
    assert result.robust.mean().item() <= clean.item() + 0.04
    assert ((result.x_adv - x).abs().amax() <= 8 / 255 + 1e-6) and 0 < result.robust.mean() < 1


def test_square_from_scratch_stays_in_the_ball_and_agrees_with_the_reference(net, points):
    x, y = points[0][:64], points[1][:64]
    eps = 8 / 255
    once = square_from_scratch(net, x, y, norm="Linf", eps=eps, n_queries=100, n_restarts=1)
    thrice = square_from_scratch(net, x, y, norm="Linf", eps=eps, n_queries=100, n_restarts=3)
    assert thrice.robust.mean() <= once.robust.mean()  # restarts only attack the points still standing
    with torch.no_grad():
        clean = net(x).argmax(1) == y
    assert (thrice.robust[~clean] == 0).all()
    assert (thrice.x_adv - x).abs().amax() <= eps + 1e-6 and 0 <= thrice.x_adv.min() <= thrice.x_adv.max() <= 1
    reference = SquareAttack(net, norm="Linf", eps=eps, n_queries=100, n_restarts=3, seed=0, device="cpu")
    with torch.no_grad():
        adversarial = reference.perturb(x, y)
        reference_robust = (net(adversarial).argmax(1) == y).float().mean().item()
    assert abs(thrice.robust.mean().item() - reference_robust) <= 0.05  # other random draws


def test_straight_through_keeps_the_forward_and_passes_the_identitys_gradient(net, points):
    x = points[0][:8]
    model = quantised(net)
    approximated = straight_through(model, ["quantise"])
    assert isinstance(model.quantise, torch.nn.Module) and type(model.quantise).__name__ == "Quantise"  # untouched
    with torch.no_grad():
        assert torch.equal(approximated(x), model(x))
    grid = (torch.round(16 * x) / 16).requires_grad_(True)  # on the grid, the quantisation is the identity
    approximated(grid).sum().backward()
    expected = grid.detach().clone().requires_grad_(True)
    net(expected).sum().backward()
    assert torch.allclose(grid.grad, expected.grad)
    with pytest.raises(ValueError, match="did you mean quantise"):
        straight_through(model, ["quantize"])
    flattening = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 10))
    with pytest.raises(ValueError, match="give a differentiable stand-in"):
        straight_through(flattening, ["0"])(x)


def test_autoattack_runs_the_adaptive_attacks_its_checks_call_for(net, points):
    """On the quantised model, the DLR attack's starts have zero gradients: AutoAttack's figure is the masked one,
    and the adaptive attacks it runs by itself bring the reported figure to the plain network's. On the plain
    network no check is raised and nothing more runs."""
    x, y = points[0][:100], points[1][:100]
    settings = {"norm": "Linf", "eps": EPS, "version": "apgd-t", "n_iter": N_ITER, "n_queries": 200}
    model = quantised(net)
    with pytest.warns(UserWarning, match="zero_gradients"):
        report = AutoAttack(model, bpda=["quantise"], **settings).evaluate(x, y, bs=100)
    plain = AutoAttack(net, **settings).evaluate(x, y, bs=100)
    assert report.robust_accuracy > plain.robust_accuracy + 0.5
    assert set(report.adaptive) == {"bpda", "transfer", "square"}
    assert abs(report.reported_robust_accuracy - plain.robust_accuracy) <= 0.03
    summary = report.summary()
    assert summary["robust_accuracy"] == report.robust_accuracy  # the leaderboard's figure stays AutoAttack's
    assert summary["reported_robust_accuracy"] == report.reported_robust_accuracy
    assert plain.adaptive == {} and plain.reported_robust_accuracy == plain.robust_accuracy
    assert not any(check.raised for check in plain.checks)
    # without the parts to approximate, the check's answers that need them are named as not run
    alone = AutoAttack(model, **settings).evaluate(x, y, bs=100)
    assert set(alone.adaptive) == {"square"} and set(alone.adaptive_notes) == {"bpda", "transfer"}


def test_a_stop_before_the_adaptive_attacks_resumes_to_the_same_report(net, points, tmp_path):
    """Stopped after the standard attacks, before the adaptive ones (a job's signal), the evaluation resumes from
    state_path: the zero gradients counted before the stop still raise the check, and the adaptive attacks run."""
    x, y = points[0][:60], points[1][:60]
    settings = {"norm": "Linf", "eps": EPS, "version": "apgd-t", "n_iter": N_ITER, "n_queries": 200}
    settings["bpda"] = ["quantise"]
    model = quantised(net)
    with pytest.warns(UserWarning, match="zero_gradients"):
        alone = AutoAttack(model, **settings).evaluate(x, y, bs=60)
    adversary = AutoAttack(model, **settings)
    state = tmp_path / "state.json"

    def stop() -> bool:  # asked before and inside each standard attack, then before each adaptive one
        return state.exists() and len(json.loads(state.read_text())["run_attacks"]) == len(adversary.attacks)

    with pytest.warns(UserWarning, match="zero_gradients"), pytest.raises(EvaluationStopped, match="adaptive"):
        adversary.evaluate(x, y, bs=60, state_path=state, stop=stop)
    with pytest.warns(UserWarning, match="zero_gradients"):
        resumed = AutoAttack(model, **settings).evaluate(x, y, bs=60, state_path=state)
    assert set(resumed.adaptive) == set(alone.adaptive) == {"bpda", "transfer", "square"}
    assert torch.equal(resumed.robust, alone.robust) and torch.equal(resumed.reported, alone.reported)


def test_a_stop_inside_an_adaptive_attack_resumes_to_the_same_report(net, points, tmp_path):
    """A job's stop is asked inside the adaptive attacks too: here the fourth time it is asked after the standard
    attacks (before Square from scratch, before its batch, before its first restart, then at Square's 50th pass).
    The evaluation stops there, and the same call with the state file ends with the report left alone."""
    x, y = points[0][:60], points[1][:60]
    settings = {"norm": "Linf", "eps": EPS, "version": "custom", "attacks_to_run": ["apgd-ce"], "n_iter": N_ITER}
    settings.update(n_queries=200, adaptive=["square"])
    alone = AutoAttack(net, **settings).evaluate(x, y, bs=60)
    state = tmp_path / "state.json"
    asked_after_the_standard_attacks = []

    def stop() -> bool:
        if state.exists() and json.loads(state.read_text())["run_attacks"] == ["apgd-ce"]:
            asked_after_the_standard_attacks.append(True)
        return len(asked_after_the_standard_attacks) == 4

    with pytest.raises(EvaluationStopped, match="inside an attack"):
        AutoAttack(net, **settings).evaluate(x, y, bs=60, state_path=state, stop=stop)
    resumed = AutoAttack(net, **settings).evaluate(x, y, bs=60, state_path=state)
    assert 0 < alone.adaptive["square"].robust.sum() < alone.clean.sum()  # a comparison that says something
    assert torch.equal(resumed.robust, alone.robust) and torch.equal(resumed.reported, alone.reported)


def test_the_test_command_runs_a_requested_adaptive_attack_and_resumes_it(tmp_path, autoattack_checkpoint):
    """``robust-lightning test`` with ``adaptive: [square]`` on the tiny AutoAttack checkpoint: Square from scratch
    runs on every image beside AutoAttack, and an evaluation cut after two batches and run again ends with the
    same per-image figures as the same evaluation left alone."""
    options = {"adaptive": ["square"], "n_queries": 50}
    (tmp_path / "alone").mkdir()
    (tmp_path / "cut").mkdir()
    alone = run_test(tmp_path / "alone", autoattack_checkpoint, **options)["threat_models"]["Linf-4_255"]
    run_test(tmp_path / "cut", autoattack_checkpoint, "--trainer.limit_test_batches", "2", **options)
    resumed = run_test(tmp_path / "cut", autoattack_checkpoint, **options)["threat_models"]["Linf-4_255"]
    assert alone["num_points"] == resumed["num_points"] == 20
    square = alone["adaptive"]["square"]
    assert square["robust_accuracy"] >= alone["reported_robust_accuracy"]
    assert alone["reported_robust_accuracy"] <= alone["robust_accuracy"]
    for key in ("robust_accuracy", "adaptive", "reported_robust_accuracy"):
        assert resumed[key] == alone[key]
    outcomes = {run: read_outcomes(tmp_path / run / "outcomes" / "Linf-4_255") for run in ("alone", "cut")}
    assert outcomes["alone"] == outcomes["cut"] and all("reported" in o for o in outcomes["alone"].values())


def test_the_reference_engines_own_warning_points_to_this_projects_docs(net, points):
    """pyautoattack's APGD warns of zero gradients and refers to its repository's flags_doc.md; run by the
    reference engine, its warning refers to the docs shipped here. (The adaptive attacks the raised check calls for
    are left out: other tests run them, and this one is about the warning's words.)"""
    x, y = points[0][:20], points[1][:20]
    adversary = AutoAttack(
        quantised(net), norm="Linf", eps=EPS, version="apgd-t", n_iter=5, engine="reference", adaptive="none"
    )
    with pytest.warns(Warning) as caught:
        adversary.evaluate(x, y, bs=20)
    messages = [str(w.message) for w in caught if "zero gradient" in str(w.message)]
    assert messages and all("robust-lightning's docs/evaluation.md" in m for m in messages)
    assert not any("flags_doc.md" in str(w.message) for w in caught)


def test_a_large_logit_scale_is_not_taken_for_masking(net, points):
    """Logits x 1e4 saturate the softmax: the cross-entropy gradient is zero in fp32 for most points, but the DLR
    loss, which ignores the scale, still finds the network's adversarial examples."""
    x, y = points[0][:64], points[1][:64]
    found = {check.name: check for check in sanity_checks(Scaled(net), x, y, "Linf", EPS)}
    assert found["unbounded"].figures["ce_gradient_zero_share"] > 0.5
    assert not found["unbounded"].raised and not found["eps_monotonic"].raised


def test_evaluate_and_the_card_report_autoattacks_figure_each_adaptive_one_and_the_lowest(net, points, tmp_path):
    """robust_lightning.evaluate (the evaluation callback, under Lightning's test loop) on the quantised model:
    results.json keeps standard AutoAttack's figure as the leaderboard's, each adaptive attack's with the images it
    broke beyond it, and the lowest per image; the card shows them side by side, and lists the parts that tensors
    cannot feed; the same call again resumes every image's outcome, the adaptive ones included."""
    import robust_lightning

    x, y = points[0][:60], points[1][:60]
    threat = [{"norm": "Linf", "eps": EPS}]
    quick = {"version": "apgd-t", "n_iter": N_ITER, "n_queries": 200, "batch_size": 30}
    plain = AutoAttack(net, norm="Linf", eps=EPS, version="apgd-t", n_iter=N_ITER, n_queries=200).evaluate(x, y)
    options = {"autoattack": {"sanity_points": 0}}
    settings = {"threat_models": threat, "bpda": ["quantise"], "options": options, **quick}
    results = robust_lightning.evaluate(quantised(net), (x, y), ["card"], out_dir=tmp_path / "card", **settings)
    [section] = results["autoattack"]["threat_models"].values()
    assert section["robust_accuracy"] > plain.robust_accuracy + 0.5  # AutoAttack's own figure: masked
    assert set(section["adaptive"]) == {"bpda", "transfer", "square"}
    assert abs(section["reported_robust_accuracy"] - plain.robust_accuracy) <= 0.05  # two batches, two checks
    bpda = section["adaptive"]["bpda"]
    assert bpda["broke_beyond_autoattack"] == len(bpda["keys_broken_beyond_autoattack"]) > 0
    assert results["autoattack"]["conditions"]["budget"] == {"n_iter": N_ITER, "n_queries": 200}
    card = Path(results["card"]["markdown"]).read_text()
    assert "| threat model | AutoAttack | bpda | square | transfer | reported |" in card
    assert {s["benchmark"] for s in results["card"]["skipped"]} >= {"resolution_sweep"}

    again = robust_lightning.evaluate(quantised(net), (x, y), ["card"], out_dir=tmp_path / "card", **settings)
    session = ("seconds_this_session", "claims_refuted_in_fp32_this_session")  # what each call itself did
    for sections in (again, results):
        for threat_model in sections["autoattack"]["threat_models"].values():
            for key in session:
                threat_model.pop(key)
    assert again["autoattack"]["threat_models"] == results["autoattack"]["threat_models"]
