"""The APGD-AT recipe: the training step, EMA, robust checkpoint selection, the held-out split, export (recipes:
tests/test_recipes.py)."""

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning import Trainer

from robust_lightning.attacks import apgd
from robust_lightning.data.batch import soft_targets
from robust_lightning.data.datamodule import ImageNetDataModule
from robust_lightning.data.sources import FolderSource, SyntheticSource
from robust_lightning.models.checkpoints import read_checkpoint
from robust_lightning.training import lightning_module as classifier_module
from robust_lightning.training.export import export_weights
from robust_lightning.training.lightning_module import ImageClassifier, has_mode_dependent_layers

EPS = 4 / 255


def mixed_batch(num_classes=10, n=6, size=32, seed=0):
    """Images and MixUp-style soft targets: each image mixed with its flipped partner, labels smoothed."""
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(n, 3, size, size, generator=g)
    labels = torch.randint(0, num_classes, (n,), generator=g)
    lam = 0.7
    mixed = lam * images + (1 - lam) * images.flip(0)
    one_hot = soft_targets(labels, num_classes, 0.1)
    return mixed, lam * one_hot + (1 - lam) * one_hot.flip(0)


def test_soft_targets_match_label_smoothing():
    logits, labels = torch.randn(5, 7), torch.tensor([0, 3, 6, 2, 2])
    targets = soft_targets(labels, 7, 0.1)
    assert torch.allclose(targets.sum(1), torch.ones(5))
    assert F.cross_entropy(logits, targets).item() == pytest.approx(
        F.cross_entropy(logits, labels, label_smoothing=0.1).item(), rel=1e-6
    )


def test_the_automatic_reuse_is_the_cpus_and_the_bucketed_reforward_changes_no_logit():
    """reuse_attack_forward None reuses on the CPU only (on an H100 it measured no faster); an explicit true holds on
    any device. Off the CPU the re-forward runs at one of eight batch sizes: the logits are those of one forward."""
    auto = ImageClassifier(arch="convnext_atto", num_classes=10, attack="apgd")
    forced = ImageClassifier(arch="convnext_atto", num_classes=10, attack="apgd", reuse_attack_forward=True)
    assert auto.reuse_forward and forced.reuse_forward
    assert not auto.to("meta").reuse_forward and forced.to("meta").reuse_forward
    module = ImageClassifier(arch="convnext_atto", num_classes=10, attack="apgd").eval()
    x_adv = torch.rand(13, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    best_is_last = torch.rand(13, generator=torch.Generator().manual_seed(1)) < 0.6
    with torch.no_grad():
        stale = torch.zeros(13, 10)  # the last iterate's logits: kept where it was the best
        expected = torch.where(best_is_last[:, None], stale, module(x_adv))
        unbucketed = module._with_best_iterates(stale, x_adv, best_is_last)
        module.hparams.compile = True  # the bucketed path, which every device but the CPU takes
        bucketed = module._with_best_iterates(stale, x_adv, best_is_last)
    assert torch.allclose(unbucketed, expected, atol=1e-5) and torch.allclose(bucketed, expected, atol=1e-5)


def test_reusing_the_last_attack_forward_gives_the_same_update():
    """7/3 pass structure: the last attack forward doubles as the update's forward; loss and parameter
    gradients equal those of the plain 8/3 structure (a separate forward on x_best)."""
    torch.manual_seed(0)
    reuse = ImageClassifier(arch="convnext_atto", num_classes=10, attack="apgd", reuse_attack_forward=True)
    plain = ImageClassifier(arch="convnext_atto", num_classes=10, attack="apgd", reuse_attack_forward=False)
    plain.load_state_dict(reuse.state_dict())
    assert reuse.reuse_forward and not plain.reuse_forward
    images, targets = mixed_batch()
    grads = []
    for module in (reuse, plain):
        module.train()
        _logits, loss, _ = module.adversarial_loss(images, targets)
        loss.backward()
        grads.append([p.grad.clone() for p in module.model.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def test_reuse_recomputes_the_points_whose_best_iterate_is_not_the_last(monkeypatch):
    """Force x_best != last iterate for some points: those get their own forward, and the loss is still the
    loss on x_best."""
    torch.manual_seed(0)
    module = ImageClassifier(arch="convnext_atto", num_classes=10, attack="apgd").train()
    images, targets = mixed_batch()
    real_apgd = classifier_module.apgd

    def apgd_with_old_best(*args, **kwargs):
        result = real_apgd(*args, **kwargs)
        result.best_is_last = torch.tensor([True, False, True, False, True, True])
        result.x_best = torch.where(result.best_is_last[:, None, None, None], result.x_best, images)
        return result

    monkeypatch.setattr(classifier_module, "apgd", apgd_with_old_best)
    logits, loss, _ = module.adversarial_loss(images, targets)
    seen = {}
    monkeypatch.setattr(classifier_module, "apgd", lambda *a, **k: seen.setdefault("r", apgd_with_old_best(*a, **k)))
    with torch.no_grad():
        module.adversarial_loss(images, targets)
        expected = module(seen["r"].x_best)
    assert torch.allclose(logits.detach(), expected, atol=1e-5)
    assert loss.item() == pytest.approx(F.cross_entropy(expected, targets).item(), rel=1e-5)


def test_attack_runs_in_eval_mode_on_the_mixed_batch_and_the_update_in_train_mode(monkeypatch):
    module = ImageClassifier(arch="resnet18", num_classes=10, attack="apgd")  # BatchNorm: no reuse possible
    assert has_mode_dependent_layers(module.model) and not module.reuse_forward
    modes = []
    module.model.register_forward_pre_hook(lambda m, inp: modes.append(m.training))
    captured = {}
    real_apgd = classifier_module.apgd

    def spy(model, x, y, **kwargs):
        captured.update(x=x, y=y, **kwargs)
        return real_apgd(model, x, y, **kwargs)

    monkeypatch.setattr(classifier_module, "apgd", spy)
    images, targets = mixed_batch()
    module.train()
    module.adversarial_loss(images, targets)
    assert modes == [False, False, False, True]  # 3 attack forwards (2 steps), then the update
    assert captured["x"] is images and captured["y"] is targets  # the mixed batch, its soft targets
    assert (captured["norm"], captured["eps"], captured["n_iter"], captured["loss"]) == ("Linf", EPS, 2, "ce")
    assert captured["random_start"] is False
    assert module.training and all(p.grad is None for p in module.parameters())


def test_training_attack_equals_apgd_x_best():
    """The update sees exactly APGD's highest-loss iterate of the soft-target CE (no random start)."""
    torch.manual_seed(1)
    module = ImageClassifier(arch="convnext_atto", num_classes=10, attack="apgd", reuse_attack_forward=False)
    images, targets = mixed_batch()
    module.train()
    logits, _, clean_logits = module.adversarial_loss(images, targets)
    module.eval()
    reference = apgd(module.model, images, targets, eps=EPS, n_iter=2)
    with torch.no_grad():
        assert torch.allclose(logits.detach(), module.model(reference.x_best), atol=1e-5)
        assert torch.allclose(clean_logits, module.model(images), atol=1e-5)  # the attack's first forward
    assert (reference.x_best - images).abs().max() <= EPS + 1e-6


@pytest.mark.parametrize("attack,norm", [("pgd", "Linf"), ("pgd", "L2"), ("fgsm", "Linf"), ("fgsm_rs", "Linf")])
def test_simpler_training_attacks_stay_in_the_ball(attack, norm):
    eps = EPS if norm == "Linf" else 0.5
    module = ImageClassifier(arch="convnext_atto", num_classes=10, attack=attack, attack_norm=norm, attack_eps=eps)
    images, targets = mixed_batch()
    module.train()
    logits, loss, _ = module.adversarial_loss(images, targets)
    loss.backward()
    assert torch.isfinite(loss) and logits.shape == (6, 10)


def test_eps_warm_up_is_linear_in_steps():
    module = ImageClassifier(arch="test_convnext", num_classes=4, attack="apgd", eps_warmup_epochs=2)
    module.trainer = type("T", (), {"estimated_stepping_batches": 40, "max_epochs": 4, "global_step": 0})()
    seen = []
    for step in (0, 9, 19, 30):
        module.trainer.global_step = step
        seen.append(module.current_eps())
    assert seen == pytest.approx([EPS / 20, EPS / 2, EPS, EPS])


# ------------------------------------------------------------------------------------------------- EMA
@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    synthetic = SyntheticSource(
        num_classes=4, train_per_class=8, val_per_class=4, image_size=32, root=str(tmp_path_factory.mktemp("synthetic"))
    )
    return dict(source=synthetic, image_size=32, batch_size=8, num_workers=0)


def _trainer(tmp_path, **kwargs):
    options = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
        inference_mode=False,
    )
    return Trainer(**{**options, **kwargs})


def test_ema_follows_every_optimiser_step_and_round_trips_through_a_checkpoint(tmp_path, tiny_data):
    decay = 0.6
    module = ImageClassifier(
        arch="test_convnext",
        num_classes=4,
        attack="apgd",
        ema_decay=decay,
        lr=1e-2,
        warmup_epochs=0,
        select_attack_steps=1,
    )
    expected = {k: v.clone() for k, v in module.model.state_dict().items()}  # recomputed independently

    def after_step(trainer, pl_module, outputs, batch, batch_idx):
        for k, v in pl_module.model.state_dict().items():
            expected[k] = decay * expected[k] + (1 - decay) * v if v.is_floating_point() else v.clone()

    from lightning.pytorch.callbacks import Callback

    follower = type("Follower", (Callback,), {"on_train_batch_end": staticmethod(after_step)})()
    trainer = _trainer(tmp_path, callbacks=[follower], limit_train_batches=3)
    trainer.fit(module, datamodule=ImageNetDataModule(**tiny_data))
    assert trainer.global_step == 3
    ema = module.ema.module.state_dict()
    for k, v in expected.items():
        assert torch.allclose(ema[k], v, atol=1e-6), k
    assert not torch.allclose(ema["net.head.fc.weight"], module.model.state_dict()["net.head.fc.weight"])
    metrics = trainer.callback_metrics
    for prefix in ("val", "val_ema"):
        assert metrics[f"{prefix}/num_images"] == 16
        assert 0 <= metrics[f"{prefix}/robust_acc"] <= metrics[f"{prefix}/acc1"]

    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    loaded = ImageClassifier.load_from_checkpoint(path, weights_only=True)
    for k, v in loaded.ema.module.state_dict().items():
        assert torch.equal(v, ema[k])

    # export: the raw and the EMA weights, each loadable as a warm start that reproduces the model exactly
    x = torch.rand(2, 3, 32, 32)
    for use_ema, source in ((False, module.model), (True, module.ema.module)):
        out = export_weights(path, tmp_path / f"w-{use_ema}.safetensors", ema=use_ema)
        fresh = ImageClassifier(arch="test_convnext", num_classes=4, init_from=str(out))
        fresh.trainer = type("T", (), {"ckpt_path": None})()
        fresh.warm_start()
        with torch.no_grad():
            assert torch.allclose(fresh.model.eval()(x), source.eval()(x), atol=1e-6)
    assert read_checkpoint(path).has_ema and not read_checkpoint(tmp_path / "w-True.safetensors").has_ema


def test_export_refuses_a_checkpoint_without_ema(tmp_path, tiny_data):
    from robust_lightning.errors import UserError

    module = ImageClassifier(arch="test_convnext", num_classes=4)
    trainer = _trainer(tmp_path, limit_train_batches=1, limit_val_batches=1)
    trainer.fit(module, datamodule=ImageNetDataModule(**tiny_data))
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    with pytest.raises(UserError, match="no EMA weights"):
        export_weights(tmp_path / "m.ckpt", tmp_path / "x.safetensors", ema=True)


# ---------------------------------------------------------------------------------------- selection
def test_robust_selection_keeps_the_most_robust_checkpoint(tmp_path, tiny_data, monkeypatch):
    """Clean accuracy rises every epoch but robust accuracy peaks at epoch 1: the kept checkpoint is epoch 1's,
    and val/select_acc is the robust accuracy."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    robust_by_epoch = {0: 0.25, 1: 0.75, 2: 0.5}
    module = ImageClassifier(arch="test_convnext", num_classes=4, select_attack_steps=1)

    def scripted_robust(model, images, labels):  # per-image flags whose mean is the scripted accuracy
        share = robust_by_epoch[module.current_epoch]
        return torch.arange(labels.numel()) < round(share * labels.numel())

    monkeypatch.setattr(module, "_robust", scripted_robust)
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path / "ckpt",
        monitor="val/select_acc",
        mode="max",
        filename="epoch{epoch}",
        auto_insert_metric_name=False,
    )
    trainer = _trainer(tmp_path, max_epochs=3, callbacks=[checkpoint], enable_checkpointing=True)
    trainer.fit(module, datamodule=ImageNetDataModule(**tiny_data, eval_batch_size=4))
    assert Path(checkpoint.best_model_path).name == "epoch1.ckpt"
    assert checkpoint.best_model_score.item() == pytest.approx(0.75)
    assert trainer.callback_metrics["val/select_acc"] == trainer.callback_metrics["val/robust_acc"] == 0.5


def test_selection_accuracy_is_apgd_robust_accuracy_of_the_model(tmp_path, tiny_data):
    module = ImageClassifier(arch="test_convnext", num_classes=4, select_attack_steps=2)
    trainer = _trainer(tmp_path, limit_train_batches=2)
    dm = ImageNetDataModule(**tiny_data, eval_batch_size=16)
    trainer.fit(module, datamodule=dm)
    batch = dm.on_after_batch_transfer(next(iter(dm.val_dataloader())), 0)
    module.eval()
    robust = apgd(module.model, batch["image"], batch["label"], eps=EPS, n_iter=2).robust.float().mean()
    assert trainer.callback_metrics["val/robust_acc"].item() == pytest.approx(robust.item(), abs=1e-6)


# ------------------------------------------------------------------------------------------ holdout
def test_folder_holdout_is_fixed_exact_and_disjoint_from_training(tmp_path):
    from helpers import WNIDS, make_image_tree

    make_image_tree(tmp_path / "in" / "train", {w: 7 for w in WNIDS})
    make_image_tree(tmp_path / "in" / "val", {w: 2 for w in WNIDS})
    keys = []
    for seed in (0, 1):  # the data-order seed does not move the held-out split
        dm = ImageNetDataModule(
            source=FolderSource(str(tmp_path / "in")), image_size=32, holdout=5, num_workers=0, seed=seed
        )
        dm.setup("fit")
        held = {Path(dm.eval_set.dataset.samples[i][0]).stem for i in dm.eval_set.indices}
        train = {Path(dm.train_set.dataset.samples[i][0]).stem for i in dm.train_set.indices}
        assert len(held) == 5 and len(train) == 16 and not held & train
        keys.append(held)
        assert dm.eval_set[0]["image"].shape == (3, 32, 32)  # evaluation preprocessing on the held-out images
    assert keys[0] == keys[1]
    dm.setup("test")
    assert len(dm.eval_set) == 6  # test still runs on val


def test_holdout_needs_enough_training_images(tmp_path, tiny_data):
    from robust_lightning.errors import UserError

    dm = ImageNetDataModule(**{**tiny_data, "holdout": 10_000})
    with pytest.raises(UserError, match="holdout"):
        dm.setup("fit")


def test_global_batch_size_is_split_over_any_device_count(tiny_data):
    from robust_lightning.errors import UserError

    dm = ImageNetDataModule(**{**tiny_data, "global_batch_size": 12})
    dm.trainer = type("T", (), {"global_rank": 0, "world_size": 3})()
    # the tiny set has one shard: ranks beyond the first share its samples
    dm.setup("test")
    assert dm.global_batch.share == 4
    dm.trainer.world_size = 5  # uneven: the first 12 % 5 = 2 ranks take one image more
    shares = []
    for rank in range(5):
        dm.trainer.global_rank = rank
        dm.setup("test")
        shares.append(dm.global_batch.share)
    assert shares == [3, 3, 2, 2, 2]
    dm.trainer.world_size = 13
    with pytest.raises(UserError, match="12 leaves some of the 13 devices without an image"):
        dm.setup("test")


def test_heavy_augmentation_gives_soft_targets_on_training_batches_only(tiny_data):
    dm = ImageNetDataModule(**{**tiny_data, "augmentation": "heavy"})
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    dm.trainer = type("T", (), {"training": True})()
    train = dm.on_after_batch_transfer(copy.deepcopy(batch), 0)
    assert train["target"].shape == (8, 4) and torch.allclose(train["target"].sum(1), torch.ones(8))
    assert train["image"].dtype == torch.float32 and train["image"].min() >= 0 and train["image"].max() <= 1
    dm.trainer.training = False
    val_batch = next(iter(dm.val_dataloader()))
    evaluation = dm.on_after_batch_transfer(copy.deepcopy(val_batch), 0)
    assert "target" not in evaluation and torch.equal(evaluation["image"], val_batch["image"].float() / 255)


def test_cpu_side_augmentation_stays_uint8_and_mixes_on_the_device(tiny_data):
    dm = ImageNetDataModule(**{**tiny_data, "augmentation": "heavy", "augment_on": "cpu"})
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["image"].dtype == torch.uint8  # augmented in the worker, still a quarter of float size
    dm.trainer = type("T", (), {"training": True})()
    assert dm.on_after_batch_transfer(batch, 0)["target"].shape == (8, 4)


# ------------------------------------------------------------------------------------ transfer inputs
def test_small_input_strides_keep_a_7x7_last_stage_on_32px():
    for arch in ("convnext_atto", "convnext_atto_convstem"):
        module = ImageClassifier(arch=arch, num_classes=10, small_input=True)
        assert module.model.net.forward_features(torch.rand(1, 3, 32, 32)).shape[-2:] == (7, 7)
    from robust_lightning.errors import UserError

    with pytest.raises(UserError, match="ConvNeXt"):
        ImageClassifier(arch="test_vit", num_classes=10, image_size=32, small_input=True)
