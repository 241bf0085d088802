"""Two CPU processes (DDP over gloo) through the real command line: disjoint shards, exact validation. The
progress display is on (printed lines: the output is not a terminal), as a user's batch job has it."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from helpers import WNIDS, make_image_tree, run_command, write_image
from robust_lightning.data.shards import convert_image_folder


def run_ddp(
    tmp_path: Path,
    command: str,
    data: dict,
    record_dir: Path,
    model: dict | None = None,
    devices: int = 2,
    args: tuple[str, ...] = (),
    **trainer,
) -> dict:
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": devices,
            "strategy": "ddp",
            "max_epochs": 1,
            "num_sanity_val_steps": 0,
            "default_root_dir": str(tmp_path / "runs"),
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(tmp_path / "runs"), "name": command},
            },
            "callbacks": [{"class_path": "helpers.KeyRecorder", "init_args": {"out_dir": str(record_dir)}}],
            **trainer,
        },
        "model": {"arch": "test_convnext", "warmup_epochs": 0.5, **(model or {})},
        "data": {"image_size": 32, "batch_size": 4, "eval_batch_size": 4, "num_workers": 1, **data},
    }
    path = tmp_path / f"{command}-{devices}.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run_command([command, "--config", str(path), *args], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(max((tmp_path / "runs" / command).glob("version_*/results.json")).read_text())
    return results[command]


def recorded(record_dir: Path, stage: str, ranks: int = 2) -> list[list[str]]:
    return [json.loads((record_dir / f"{stage}-rank{rank}-e0.json").read_text()) for rank in range(ranks)]


def test_ddp_fit_on_shards_reads_disjoint_shards_and_validates_each_image_once(tmp_path):
    # 30 train images in 6 shards, 15 val images in 4 shards (ranks get 2 and 2 shards, of unequal size)
    trees = tmp_path / "trees"
    make_image_tree(trees / "train", {w: 10 for w in WNIDS})
    make_image_tree(trees / "val", {w: 5 for w in WNIDS})
    for split, per_shard in (("train", 5), ("val", 4)):
        convert_image_folder(
            trees / split,
            tmp_path / "shards" / split,
            samples_per_shard=per_shard,
            shuffle=split == "train",
            workers=1,
            progress=False,
        )
    data = {
        "source": {
            "class_path": "ShardSource",
            "init_args": {"train_shards": str(tmp_path / "shards/train"), "val_shards": str(tmp_path / "shards/val")},
        }
    }
    fit = run_ddp(tmp_path, "fit", data, tmp_path / "keys")

    train = recorded(tmp_path / "keys", "train")
    assert len(train[0]) == len(train[1]) == 12  # 30 // (2 ranks * 4) = 3 steps of 4 on each rank
    assert not set(train[0]) & set(train[1])  # the ranks' shards are disjoint
    val = recorded(tmp_path / "keys", "val")
    assert not set(val[0]) & set(val[1])
    assert len(val[0]) + len(val[1]) == len(set(val[0]) | set(val[1])) == 15
    assert fit["metrics"]["val/num_images"] == 15
    assert fit["conditions"]["world_size"] == 2


def test_ddp_validate_on_a_folder_counts_every_image_once(tmp_path):
    # 3 x 3 = 9 images over 2 ranks: torch's DistributedSampler would pad to 10 and count one twice
    make_image_tree(tmp_path / "imagenet" / "val", {w: 3 for w in WNIDS})
    (tmp_path / "imagenet" / "train").mkdir()
    data = {
        "source": {"class_path": "FolderSource", "init_args": {"root": str(tmp_path / "imagenet")}},
        "num_classes": 1000,
    }
    validate = run_ddp(tmp_path, "validate", data, tmp_path / "keys")
    val = recorded(tmp_path / "keys", "val")
    assert sorted(val[0] + val[1]) == sorted(set(val[0]) | set(val[1]))
    assert len(val[0] + val[1]) == 9
    assert validate["metrics"]["val/num_images"] == 9


def test_ddp_adversarial_fit_selects_on_a_holdout_counted_exactly(tmp_path):
    """APGD-AT with EMA on 2 ranks; robust selection accuracy on 7 held-out train images split over the ranks,
    equal to the same measurement in one process from the saved checkpoint."""

    from robust_lightning.attacks import apgd
    from robust_lightning.data.datamodule import ImageNetDataModule
    from robust_lightning.data.sources import ShardSource
    from robust_lightning.training.lightning_module import ImageClassifier

    trees = tmp_path / "trees"
    make_image_tree(trees / "train", {w: 10 for w in WNIDS})
    make_image_tree(trees / "val", {w: 2 for w in WNIDS})
    for split in ("train", "val"):
        convert_image_folder(
            trees / split,
            tmp_path / "shards" / split,
            samples_per_shard=5,
            shuffle=split == "train",
            workers=1,
            progress=False,
        )
    data = {
        "source": {
            "class_path": "ShardSource",
            "init_args": {"train_shards": str(tmp_path / "shards/train"), "val_shards": str(tmp_path / "shards/val")},
        },
        "holdout": 7,
        "augmentation": "heavy",
    }
    model = {"attack": "apgd", "ema_decay": 0.5, "select_attack_steps": 1, "reuse_attack_forward": True}
    fit = run_ddp(tmp_path, "fit", data, tmp_path / "keys", model)

    train = recorded(tmp_path / "keys", "train")
    val = recorded(tmp_path / "keys", "val")
    held = set(val[0]) | set(val[1])
    assert len(val[0]) + len(val[1]) == len(held) == 7  # split sample by sample, nothing counted twice
    assert not held & (set(train[0]) | set(train[1]))  # held-out images are never trained on
    assert len(train[0]) == len(train[1]) == 8  # 30 - 10 held-out-shard images = 20 // (2 x 4) = 2 steps of 4
    metrics = fit["metrics"]
    assert metrics["val/num_images"] == metrics["val_ema/num_images"] == 7
    assert metrics["val/select_acc"] == metrics["val/robust_acc"]
    assert fit["monitor"] == "val/select_acc"

    # the same measurement in one process, from the checkpoint, over the same 7 images
    module = ImageClassifier.load_from_checkpoint(fit["last_checkpoint"]["path"], weights_only=True).eval()
    options = {**data, "source": ShardSource(**data["source"]["init_args"])}
    dm = ImageNetDataModule(**options, image_size=32, eval_batch_size=7, num_workers=0)
    dm.setup("validate")
    batch = dm.on_after_batch_transfer(next(iter(dm.val_dataloader())), 0)
    assert sorted(batch["key"]) == sorted(held)
    for model_, prefix in ((module.model, "val"), (module.ema.module, "val_ema")):
        robust = apgd(model_, batch["image"], batch["label"], eps=4 / 255, n_iter=1).robust
        clean = (model_(batch["image"]).argmax(1) == batch["label"]).float().mean()
        assert metrics[f"{prefix}/robust_acc"] == pytest.approx(robust.float().mean().item(), abs=1e-6)
        assert metrics[f"{prefix}/acc1"] == pytest.approx(clean.item(), abs=1e-6)


def test_more_ranks_than_validation_shards_split_the_samples_and_count_each_image_once(tmp_path):
    """3 ranks on 2 validation shards (7 and 4 images): ranks 0 and 2 share the first shard sample by sample,
    rank 1 reads the second; the metrics equal those of one process over the same shards."""
    make_image_tree(tmp_path / "trees" / "val", {WNIDS[0]: 4, WNIDS[1]: 4, WNIDS[2]: 3})
    convert_image_folder(
        tmp_path / "trees" / "val",
        tmp_path / "shards" / "val",
        samples_per_shard=7,
        shuffle=False,
        workers=1,
        progress=False,
    )
    data = {
        "source": {"class_path": "ShardSource", "init_args": {"val_shards": str(tmp_path / "shards/val")}},
        "num_classes": 1000,
    }
    three = run_ddp(tmp_path, "validate", data, tmp_path / "keys3", devices=3)["metrics"]
    one = run_ddp(tmp_path, "validate", data, tmp_path / "keys1", devices=1)["metrics"]
    val = recorded(tmp_path / "keys3", "val", ranks=3)
    assert [len(keys) for keys in val] == [4, 4, 3]
    assert len(set(val[0]) | set(val[1]) | set(val[2])) == 11
    assert three["val/num_images"] == one["val/num_images"] == 11
    for name in ("val/acc1", "val/acc5", "val/loss", "val/ece"):
        assert three[name] == pytest.approx(one[name], abs=1e-6), name


def test_ranks_draw_their_own_augmentation_and_a_resumed_run_draws_the_same(tmp_path):
    """Heavy augmentation and 1-step APGD-AT on 2 ranks, every training image the same picture: the ranks'
    augmented batches differ only through their random draws (crop, flip, RandAugment, erasing), and their
    MixUp/CutMix weights differ. Resumed at the epoch boundary, the second epoch is the uninterrupted one's."""
    for i, wnid in enumerate(WNIDS * 4):  # 12 copies of one image in 3 classes
        write_image(tmp_path / "same" / "train" / wnid / f"{wnid}_{i}.JPEG", seed=0)
    make_image_tree(tmp_path / "same" / "val", {w: 1 for w in WNIDS})
    data = {
        "source": {"class_path": "FolderSource", "init_args": {"root": str(tmp_path / "same"), "class_map": "folders"}},
        "augmentation": "heavy",
        "batch_size": 3,
        "eval_batch_size": 3,
    }
    model = {"attack": "apgd", "attack_steps": 1, "ema_decay": 0.9, "label_smoothing": 0.1}
    record = {"class_path": "helpers.AugmentationRecorder", "init_args": {"out_dir": str(tmp_path / "drawn")}}
    callbacks = [{"class_path": "helpers.KeyRecorder", "init_args": {"out_dir": str(tmp_path / "keys")}}, record]
    trainer = {"max_epochs": 2, "log_every_n_steps": 1, "callbacks": callbacks}
    run_ddp(tmp_path, "fit", data, tmp_path / "keys", model, args=("--checkpoint.save_top_k", "-1"), **trainer)

    def batch(rank, epoch, step):
        return torch.load(tmp_path / "drawn" / f"rank{rank}-e{epoch}-b{step}.pt", weights_only=True)

    weights = []
    for epoch, step in ((0, 0), (0, 1), (1, 0), (1, 1)):
        ranks = [batch(rank, epoch, step) for rank in range(2)]
        assert not torch.equal(ranks[0]["image"], ranks[1]["image"])  # the same pictures, drawn differently
        for drawn in ranks:  # MixUp/CutMix weight of the batch, from a pair of differing labels
            label, target = drawn["label"], drawn["target"]
            pairs = [i for i in range(len(label)) if label[i] != label[len(label) - 1 - i]]
            if pairs:
                i = pairs[0]
                weights.append((epoch, step, (target[i, label[i]].item() - 0.1 / 3) / 0.9))
    assert len({w for *_, w in weights}) > len(weights) // 2  # not one weight per step shared by the ranks

    # resumed from the epoch-0 checkpoint: the second epoch draws, trains and ends as the uninterrupted run
    first_epoch = next((tmp_path / "runs" / "fit" / "version_0" / "checkpoints").glob("epoch000-*.ckpt"))
    resumed_record = {"class_path": "helpers.AugmentationRecorder", "init_args": {"out_dir": str(tmp_path / "resumed")}}
    trainer["callbacks"] = [callbacks[0], resumed_record]
    run_ddp(
        tmp_path,
        "fit",
        data,
        tmp_path / "keys",
        model,
        args=("--ckpt_path", str(first_epoch), "--checkpoint.save_top_k", "-1"),
        **trainer,
    )
    for rank in range(2):
        for step in range(2):
            again = torch.load(tmp_path / "resumed" / f"rank{rank}-e1-b{step}.pt", weights_only=True)
            for key, value in batch(rank, 1, step).items():
                torch.testing.assert_close(again[key], value, atol=0, rtol=0, msg=f"rank {rank} step {step} {key}")
    whole, resumed = (
        torch.load(
            next((tmp_path / "runs" / "fit" / f"version_{v}" / "checkpoints").glob("epoch001-*.ckpt")),
            map_location="cpu",
            weights_only=True,
        )["state_dict"]
        for v in (0, 1)
    )
    for name, value in whole.items():
        torch.testing.assert_close(resumed[name], value, atol=1e-6, rtol=0, msg=name)
