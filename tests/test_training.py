import itertools
import math

import pytest
import torch
from lightning import Trainer

from robust_lightning.data.datamodule import ImageNetDataModule
from robust_lightning.data.sources import SyntheticSource
from robust_lightning.training.lightning_module import ImageClassifier
from robust_lightning.training.schedule import warmup_cosine


def test_warmup_cosine_against_the_closed_form():
    peak, low, total, warm = 1e-3, 1e-5, 100, 10
    lr = [warmup_cosine(s, total, warm, peak, low) for s in range(total)]
    assert lr[0] == pytest.approx(peak / warm)
    assert lr[warm - 1] == pytest.approx(peak)  # the peak is reached at the end of warm-up
    assert all(b > a for a, b in itertools.pairwise(lr[:warm]))
    mid = warm + (total - warm) // 2
    assert lr[mid] == pytest.approx(low + (peak - low) * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert all(b <= a for a, b in zip(lr[warm:], lr[warm + 1 :]))
    assert warmup_cosine(total, total, warm, peak, low) == pytest.approx(low)


def test_no_weight_decay_on_biases_norms_and_embeddings():
    module = ImageClassifier(arch="test_vit", num_classes=4, image_size=32)
    module.trainer = type("T", (), {"estimated_stepping_batches": 10, "max_epochs": 2})()
    optimizer = module.configure_optimizers()["optimizer"]
    assert optimizer.defaults["betas"] == (0.9, 0.95)
    names = {id(p): n for n, p in module.model.net.named_parameters()}
    decayed = [names[id(p)] for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]]
    free = [names[id(p)] for g in optimizer.param_groups if g["weight_decay"] == 0 for p in g["params"]]
    assert all(p.ndim > 1 for n, p in module.model.net.named_parameters() if n in decayed)
    assert "pos_embed" in free and "cls_token" in free
    assert any(n.endswith("norm1.weight") for n in free) and any(n.endswith(".bias") for n in free)
    assert all(g["weight_decay"] == 0.05 for g in optimizer.param_groups if g["weight_decay"] > 0)


def _trainer(tmp_path, **kwargs):
    options = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    return Trainer(**{**options, **kwargs})


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    synthetic = SyntheticSource(
        num_classes=4, train_per_class=8, val_per_class=4, image_size=32, root=str(tmp_path_factory.mktemp("synthetic"))
    )
    return dict(source=synthetic, image_size=32, batch_size=8, num_workers=0)


def test_learning_rate_follows_the_schedule_every_step(tmp_path, tiny_data):
    module = ImageClassifier(arch="test_convnext", num_classes=4, lr=1e-2, min_lr=1e-4, warmup_epochs=1)
    seen = []

    trainer = _trainer(tmp_path, max_epochs=2, limit_val_batches=0)
    original = module.on_train_batch_start

    def record(batch, batch_idx):
        seen.append(trainer.optimizers[0].param_groups[0]["lr"])
        return original(batch, batch_idx)

    module.on_train_batch_start = record
    trainer.fit(module, datamodule=ImageNetDataModule(**tiny_data))
    total = trainer.global_step
    assert total == 8  # 32 images / batch 8 = 4 steps per epoch, 2 epochs
    expected = [warmup_cosine(s, total, 4, 1e-2, 1e-4) for s in range(total)]
    assert seen == pytest.approx(expected)


@pytest.mark.parametrize("precision,channels_last", [("bf16-mixed", False), ("32-true", True)])
def test_bf16_and_channels_last_adversarial_training_and_robust_validation(
    tmp_path, tiny_data, precision, channels_last
):
    module = ImageClassifier(
        arch="convnext_atto_convstem", num_classes=4, channels_last=channels_last, attack="apgd", select_attack_steps=1
    )
    trainer = _trainer(tmp_path, precision=precision, limit_train_batches=2, inference_mode=False)
    trainer.fit(module, datamodule=ImageNetDataModule(**tiny_data))
    assert trainer.callback_metrics["val/num_images"] == 16
    assert torch.isfinite(trainer.callback_metrics["val/loss"])
    assert 0 <= trainer.callback_metrics["val/robust_acc"] <= trainer.callback_metrics["val/acc1"]
    if channels_last:
        assert module.model.net.stem[0].weight.is_contiguous(memory_format=torch.channels_last)
