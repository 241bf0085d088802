"""model.compile: torch.compile of the network gives the eager run's training, step for step (CPU, inductor)."""

import csv
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters, guard_failures

from helpers import tiny_config
from robust_lightning.cli import main
from robust_lightning.training.lightning_module import ImageClassifier


def train_losses(run: Path) -> list[float]:
    with open(run / "metrics.csv") as f:
        return [float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")]


def test_three_compiled_steps_give_the_eager_losses(tmp_path):
    """APGD-AT on a model without BatchNorm (the attack's last forward reused, the re-forward bucketed); the
    attack's passes run with detached parameters, compiled or not."""
    losses = {}
    for compiled in (False, True):
        (tmp_path / str(compiled)).mkdir()
        config = tiny_config(
            tmp_path / str(compiled),
            **{
                "trainer.max_steps": 3,
                "trainer.log_every_n_steps": 1,
                "trainer.limit_val_batches": 0,
                "model.arch": "test_vit",
                "model.attack": "apgd",
                "model.attack_steps": 1,
                "model.compile": compiled,
                "data.batch_size": 8,
            },
        )
        assert main(["fit", "--config", str(config)]) == 0
        losses[compiled] = train_losses(tmp_path / str(compiled) / "runs" / "tiny" / "version_0")
    assert len(losses[False]) == 3
    assert losses[True] == pytest.approx(losses[False], rel=1e-4, abs=1e-5)


def test_a_compiled_fit_compiles_one_graph_per_kind_of_pass(tmp_path):
    """A fit compiles three graphs, each once for every batch size: the attack's passes with input gradients
    (training's and validation's attack, parameters detached), the passes without gradients (validation, for the
    raw weights; validation's attack's last iterate) and the update's pass with parameter gradients (the reused
    last attack forward and the bucketed re-forward too). The run changes what each sees: micro-batches of 5 and
    4 images (9 split in two), validation batches of 6, 6 and 4 and its attack's batches, which shrink to a
    single row as points break (forwarded as two rows: a batch of one would get a graph of its own), train and
    eval mode, a re-forward of one point (padded to two likewise), the EMA's weights (a copy, run eager). Before,
    each change compiled again: 8 graphs here, Dynamo's limit per function (past it, a function runs eager)."""
    torch._dynamo.reset()  # the compiled code of other tests in this process would serve this fit
    counters.clear()
    config = tiny_config(
        tmp_path,
        **{
            "trainer.max_steps": 2,
            "trainer.limit_train_batches": 4,
            "trainer.log_every_n_steps": 1,
            "model.arch": "test_vit",
            "model.attack": "apgd",
            "model.attack_steps": 2,
            "model.attack_eps": 0.25,  # large: some points' best iterate is the first (the re-forward runs)
            "model.reuse_attack_forward": True,
            "model.ema_decay": 0.99,
            "model.select_attack_steps": 2,
            "model.compile": True,
            "data.global_batch_size": 9,
            "data.max_device_batch_size": 5,
            "data.eval_batch_size": 6,
        },
    )
    try:
        # no dynamic dimensions remembered from earlier processes (Dynamo's profile-guided automatic dynamic)
        with torch._dynamo.config.patch(automatic_dynamic_local_pgo=False):
            assert main(["fit", "--config", str(config)]) == 0
        compiled = {key: dict(counters[key]) for key in ("frames", "stats", "graph_break")}
        reasons = [reason for failures in guard_failures.values() for reason in failures]
    finally:
        torch._dynamo.reset()
    assert not compiled["graph_break"], compiled
    assert compiled["frames"]["ok"] == compiled["stats"]["unique_graphs"] == 3, "\n".join([str(compiled), *reasons])


def test_a_single_row_is_forwarded_as_two_and_keeps_its_logits_and_gradient():
    """What a compiled model does with a batch of one in eval mode (here without compiling: the arithmetic of the
    padding): the row is forwarded twice; its logits, and its input gradient in the attack's pass, are its own."""
    torch.manual_seed(0)
    module = ImageClassifier(arch="test_vit", num_classes=4, image_size=32).eval()
    x = torch.rand(1, 3, 32, 32)
    with torch.no_grad():
        expected = module.model(x)
    x_req = x.clone().requires_grad_()
    (expected_grad,) = torch.autograd.grad(module._run_for_attack(module.model, x_req).logsumexp(1).sum(), x_req)
    module.hparams.compile = True  # the compiled path's padding (a batch of two, the first row kept)
    calls = []
    module.model.register_forward_pre_hook(lambda _, args: calls.append(len(args[0])))
    with torch.no_grad():
        logits = module.run_network(module.model, x)
    (grad,) = torch.autograd.grad(module._run_for_attack(module.model, x_req).logsumexp(1).sum(), x_req)
    assert calls == [2, 2]
    torch.testing.assert_close(logits, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, expected_grad, atol=1e-7, rtol=1e-5)
