"""A global batch that does not split evenly over the devices: each rank takes its share, the ranks' losses are
weighted, and one optimiser step on 3 CPU processes (DDP over gloo) equals one step of one process on the same
images.

Run as a script (``python tests/test_uneven_batch.py OUT``), this file is the training side: Lightning's
ddp launcher starts the other ranks by running the same command.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning import Callback, Trainer, seed_everything
from torch.utils.data import DataLoader, DistributedSampler

from helpers import WNIDS, make_image_tree, run_command
from robust_lightning.data.batching import GlobalBatch
from robust_lightning.data.datamodule import ImageNetDataModule
from robust_lightning.data.samplers import GlobalBatchSampler, ShardShare, rank_share
from robust_lightning.data.sources import FolderSource, SyntheticSource
from robust_lightning.training.lightning_module import ImageClassifier

GLOBAL_BATCH, WORLD_SIZE, LR = 20, 3, 0.5


# ------------------------------------------------------------------------------------------ the split
@pytest.mark.parametrize("global_batch, world_size", [(756, 8), (756, 16), (756, 32), (20, 3), (5, 5), (12, 4)])
def test_rank_batch_sizes_cover_the_global_batch_and_differ_by_at_most_one(global_batch, world_size):
    shares = [rank_share(global_batch, world_size, rank) for rank in range(world_size)]
    assert sum(shares) == global_batch
    assert max(shares) - min(shares) <= 1
    assert shares == sorted(shares, reverse=True)  # the extra images go to the first ranks


@pytest.mark.parametrize("shards, world_size", [(1, 3), (2, 3), (3, 8), (40, 64), (5, 5), (7, 3)])
def test_every_shard_sample_goes_to_exactly_one_rank(shards, world_size):
    sizes = [11 + s for s in range(shards)]  # shards of different sizes
    taken = []
    for rank in range(world_size):
        share = ShardShare.of_rank([f"shard-{s}" for s in range(shards)], world_size, rank)
        assert share.urls, "every rank reads something"
        for url in share.urls:
            samples = range(sizes[int(url.split("-")[1])])
            taken += [(url, i) for i in samples[share.reader :: share.readers]]
    assert len(taken) == len(set(taken)) == sum(sizes)


def rank_batches(dataset, world_size: int, global_batch: int, epoch: int = 0) -> list[list[list[int]]]:
    """Each rank's batches of one epoch, through the sampler and a DataLoader as train_dataloader builds them."""
    batches = []
    for rank in range(world_size):
        sampler = GlobalBatchSampler(dataset, world_size, rank, global_batch, seed=3)
        sampler.set_epoch(epoch)
        loader = DataLoader(
            dataset,
            batch_size=rank_share(global_batch, world_size, rank),
            sampler=sampler,
            drop_last=True,
            collate_fn=list,
        )
        batches.append(list(loader))
        assert len(loader) == len(batches[-1])
    return batches


def test_global_batch_sampler_draws_one_global_batch_of_distinct_images_per_step():
    dataset = list(range(47))
    batches = rank_batches(dataset, WORLD_SIZE, GLOBAL_BATCH)
    assert [len(b) for b in batches] == [2, 2, 2]  # 47 // 20 steps on every rank: DDP needs equal counts
    for step in range(2):
        sizes = [len(batches[rank][step]) for rank in range(WORLD_SIZE)]
        assert sizes == [7, 7, 6]
        images = [i for rank in range(WORLD_SIZE) for i in batches[rank][step]]
        assert len(set(images)) == GLOBAL_BATCH
    seen = [i for rank in batches for batch in rank for i in batch]
    assert len(seen) == len(set(seen)) == 40  # no image twice in an epoch
    assert rank_batches(dataset, WORLD_SIZE, GLOBAL_BATCH, epoch=1) != batches  # reshuffled every epoch


def test_even_split_draws_what_torchs_distributed_sampler_draws():
    """Even splits keep the data order of torch's DistributedSampler(shuffle, drop_last), image for image."""
    dataset = list(range(50))
    ours = rank_batches(dataset, 4, 12, epoch=2)
    for rank in range(4):
        sampler = DistributedSampler(dataset, num_replicas=4, rank=rank, shuffle=True, seed=3, drop_last=True)
        sampler.set_epoch(2)
        torchs = list(DataLoader(dataset, batch_size=3, sampler=sampler, drop_last=True, collate_fn=list))
        assert ours[rank] == torchs


def test_folder_loaders_of_an_uneven_split(tmp_path):
    make_image_tree(tmp_path / "in" / "train", {w: 4 for w in WNIDS})  # 12 images
    make_image_tree(tmp_path / "in" / "val", {w: 1 for w in WNIDS})
    keys = []
    for rank in range(WORLD_SIZE):
        dm = ImageNetDataModule(
            source=FolderSource(str(tmp_path / "in")), image_size=32, num_workers=0, global_batch_size=5
        )
        dm.trainer = type("T", (), {"global_rank": rank, "world_size": WORLD_SIZE})()
        dm.setup("fit")
        loader = dm.train_dataloader()
        batches = [batch["key"] for batch in loader]
        assert len(loader) == len(batches) == 2  # 12 // 5 steps
        assert [len(b) for b in batches] == [rank_share(5, WORLD_SIZE, rank)] * 2 == [[2, 2, 1][rank]] * 2
        keys.append(batches)
        assert dm.conditions()["global_batch_size"] == 5
    for step in range(2):
        assert len({key for rank in keys for key in rank[step]}) == 5
    assert len({key for rank in keys for batch in rank for key in batch}) == 10


def test_shard_loaders_take_the_same_number_of_steps_on_every_rank(tmp_path):
    synthetic = SyntheticSource(
        num_classes=4,
        train_per_class=8,
        val_per_class=3,
        image_size=32,
        samples_per_shard=4,
        root=str(tmp_path / "synthetic"),
    )
    sizes = []
    for rank in range(WORLD_SIZE):
        dm = ImageNetDataModule(source=synthetic, image_size=32, num_workers=0, global_batch_size=10)
        dm.trainer = type("T", (), {"global_rank": rank, "world_size": WORLD_SIZE, "current_epoch": 0})()
        dm.setup("fit")
        loader = dm.train_dataloader()
        sizes.append([len(batch["label"]) for batch in loader])
        assert len(loader) == 3  # 32 // 10
    assert sizes == [[4, 4, 4], [3, 3, 3], [3, 3, 3]]


def test_a_global_batch_larger_than_the_training_set_is_refused(tmp_path):
    from robust_lightning.errors import UserError

    make_image_tree(tmp_path / "in" / "train", {w: 2 for w in WNIDS})
    make_image_tree(tmp_path / "in" / "val", {w: 1 for w in WNIDS})
    dm = ImageNetDataModule(
        source=FolderSource(str(tmp_path / "in")), image_size=32, num_workers=0, global_batch_size=7
    )
    dm.setup("fit")
    with pytest.raises(UserError, match="6 training images are fewer than one global batch of 7"):
        dm.train_dataloader()


# ------------------------------------------------------------------------- one step on three processes
class SGDClassifier(ImageClassifier):
    """Plain SGD: the step is lr x the gradient, so the parameters show any error of the averaged gradient
    (AdamW's first step is nearly lr x sign(gradient) and would hide a wrong scale)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=LR)


class StepRecorder(Callback):
    """Saves, per rank: the weights before training, the micro-batches of the first step (as the model got them),
    the gradient after DDP averaged it, and the weights after the step."""

    def __init__(self, out_dir: str):
        self.out_dir = Path(out_dir)
        self.batches = []

    def _save(self, trainer, name, value):
        torch.save(value, self.out_dir / f"{name}-rank{trainer.global_rank}.pt")

    def on_train_start(self, trainer, pl_module):
        self._save(trainer, "init", {k: v.clone() for k, v in pl_module.model.state_dict().items()})

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append({"image": batch["image"].clone(), "label": batch["label"].clone(), "key": batch["key"]})
        self._save(trainer, "batches", self.batches)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._save(trainer, "grad", {n: p.grad.clone() for n, p in pl_module.model.named_parameters()})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._save(trainer, "final", {k: v.clone() for k, v in pl_module.model.state_dict().items()})
        self._save(
            trainer,
            "steps",
            {
                "global_step": trainer.global_step,
                "micro_batches": len(self.batches),
                "accumulate_grad_batches": trainer.accumulate_grad_batches,
            },
        )


# no label smoothing: the reference below is then plain cross-entropy on the labels
MODEL = dict(arch="test_convnext", num_classes=3, label_smoothing=0.0, warmup_epochs=0)


def train_one_step(out: Path, world_size: int, max_device_batch_size: int | None) -> None:
    """Folder data: the ranks' shares come from GlobalBatchSampler, which Lightning must keep (the shard
    source's split is the per-rank batch size alone, checked above)."""
    seed_everything(0)
    trainer = Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy="ddp" if world_size > 1 else "auto",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        inference_mode=False,
        callbacks=[StepRecorder(str(out))],
        default_root_dir=str(out),
    )
    data = ImageNetDataModule(
        source=FolderSource(str(out / "in"), class_map="folders"),
        image_size=32,
        num_workers=0,
        global_batch_size=GLOBAL_BATCH,
        max_device_batch_size=max_device_batch_size,
    )
    trainer.fit(SGDClassifier(**MODEL), datamodule=data)


def one_step(tmp_path: Path, world_size: int, max_device_batch_size: int | None = None):
    """One SGD step of a global batch of 20 on ``world_size`` processes (a subprocess with a hard time limit
    beyond one), and what each rank recorded."""
    make_image_tree(tmp_path / "in" / "train", {w: 9 for w in WNIDS})  # 27 images: one step of 20
    make_image_tree(tmp_path / "in" / "val", {w: 1 for w in WNIDS})
    if world_size == 1:
        train_one_step(tmp_path, 1, max_device_batch_size)
    else:
        args = [str(tmp_path), str(world_size), str(max_device_batch_size or 0)]
        result = run_command(args, script=Path(__file__), cwd=tmp_path, timeout=300, env={"OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stderr[-3000:]
    return lambda name, rank: torch.load(tmp_path / f"{name}-rank{rank}.pt", weights_only=True)


def reference_step(init: dict, images: torch.Tensor, labels: torch.Tensor) -> tuple[dict, dict]:
    """One process, the same initial weights, the mean loss over all the step's images in one batch, one SGD step:
    (gradient, weights after the step)."""
    module = SGDClassifier(**MODEL)
    module.model.load_state_dict(init)
    F.cross_entropy(module.model(images), labels).backward()
    grad = {n: p.grad.clone() for n, p in module.model.named_parameters()}
    with torch.no_grad():
        for p in module.model.parameters():
            p -= LR * p.grad
    return grad, module.model.state_dict()


def assert_same_step(load, world_size: int, reference_grad: dict, expected: dict) -> None:
    for rank in range(world_size):
        grad, final = load("grad", rank), load("final", rank)
        for name, value in reference_grad.items():
            torch.testing.assert_close(grad[name], value, atol=1e-6, rtol=1e-5, msg=f"gradient of {name}")
        for name, value in expected.items():
            torch.testing.assert_close(final[name], value, atol=1e-6, rtol=1e-5, msg=f"{name} after the step")


def step_images(load, world_size: int) -> tuple[list[list[dict]], torch.Tensor, torch.Tensor]:
    batches = [load("batches", rank) for rank in range(world_size)]
    images = torch.cat([b["image"] for rank in batches for b in rank])
    labels = torch.cat([b["label"] for rank in batches for b in rank])
    assert len({key for rank in batches for b in rank for key in b["key"]}) == GLOBAL_BATCH  # 20 distinct images
    return batches, images, labels


def test_one_step_on_three_ranks_equals_one_process_on_the_same_twenty_images(tmp_path):
    load = one_step(tmp_path, WORLD_SIZE)
    batches, images, labels = step_images(load, WORLD_SIZE)
    assert [len(b[0]["label"]) for b in batches] == [7, 7, 6]

    reference_grad, expected = reference_step(load("init", 0), images, labels)
    assert_same_step(load, WORLD_SIZE, reference_grad, expected)

    # the check has teeth: the plain average of the ranks' mean-loss gradients (no weights) is measurably off
    module = SGDClassifier(**MODEL)
    module.model.load_state_dict(load("init", 0))
    for rank in batches:
        (F.cross_entropy(module.model(rank[0]["image"]), rank[0]["label"]) / WORLD_SIZE).backward()
    error = max((p.grad - reference_grad[n]).abs().max().item() for n, p in module.model.named_parameters())
    assert error > 1e-4


def test_micro_batches_of_at_most_seven_give_the_step_of_the_whole_global_batch(tmp_path):
    """Global batch 20, at most 7 images per forward pass, one process: 3 micro-batches (7, 7, 6) whose
    gradients are accumulated into one optimiser step, equal to the step of the 20 images in one batch."""
    load = one_step(tmp_path, 1, max_device_batch_size=7)
    batches, images, labels = step_images(load, 1)
    assert [len(b["label"]) for b in batches[0]] == [7, 7, 6]
    assert load("steps", 0) == {"global_step": 1, "micro_batches": 3, "accumulate_grad_batches": 3}
    reference_grad, expected = reference_step(load("init", 0), images, labels)
    assert_same_step(load, 1, reference_grad, expected)

    # teeth: Lightning's own accumulation averages the micro-batches' mean losses, which weighs the 6 images of the
    # last micro-batch more than the others
    module = SGDClassifier(**MODEL)
    module.model.load_state_dict(load("init", 0))
    for b in batches[0]:
        (F.cross_entropy(module.model(b["image"]), b["label"]) / 3).backward()
    error = max((p.grad - reference_grad[n]).abs().max().item() for n, p in module.model.named_parameters())
    assert error > 1e-5


def test_micro_batches_on_two_ranks_give_the_step_of_the_whole_global_batch(tmp_path):
    """Global batch 20 on 2 ranks, at most 4 images per forward pass: 3 micro-batches (4, 3, 3) on each rank."""
    load = one_step(tmp_path, 2, max_device_batch_size=4)
    batches, images, labels = step_images(load, 2)
    assert [[len(b["label"]) for b in rank] for rank in batches] == [[4, 3, 3], [4, 3, 3]]
    assert load("steps", 1) == {"global_step": 1, "micro_batches": 3, "accumulate_grad_batches": 3}
    reference_grad, expected = reference_step(load("init", 0), images, labels)
    assert_same_step(load, 2, reference_grad, expected)


def test_trainer_accumulation_with_a_global_batch_is_refused_naming_the_option(tmp_path):
    from robust_lightning.errors import UserError

    make_image_tree(tmp_path / "in" / "train", {w: 4 for w in WNIDS})
    make_image_tree(tmp_path / "in" / "val", {w: 1 for w in WNIDS})
    dm = ImageNetDataModule(
        source=FolderSource(str(tmp_path / "in")), image_size=32, num_workers=0, global_batch_size=6
    )
    dm.trainer = type("T", (), {"global_rank": 0, "world_size": 1, "accumulate_grad_batches": 2})()
    with pytest.raises(UserError, match="set data.max_device_batch_size"):
        dm.setup("fit")
    dm = ImageNetDataModule(
        source=FolderSource(str(tmp_path / "in")),
        image_size=32,
        num_workers=0,
        global_batch_size=6,
        max_device_batch_size=2,
    )
    dm.trainer = type("T", (), {"global_rank": 0, "world_size": 1, "accumulate_grad_batches": 1})()
    dm.setup("fit")
    assert dm.trainer.accumulate_grad_batches == 3 and len(dm.train_dataloader()) == 2 * 3
    # without a global batch, the trainer's accumulation would be replaced by the data module's (one pass) unsaid
    dm = ImageNetDataModule(source=FolderSource(str(tmp_path / "in")), image_size=32, num_workers=0, batch_size=2)
    dm.trainer = type("T", (), {"global_rank": 0, "world_size": 1, "accumulate_grad_batches": 4})()
    with pytest.raises(UserError, match="set data.global_batch_size .* and data.max_device_batch_size"):
        dm.setup("fit")


def test_the_model_takes_its_micro_batches_from_the_global_batch():
    """Global batch 20, at most 7 images per forward pass: the model weighs the micro-batches (7, 7, 6) of a step
    by the three passes that the data module's GlobalBatch decided. The trainer here carries no
    accumulate_grad_batches: the model reads the count from the global batch, not from the trainer's copy."""
    global_batch = GlobalBatch(configured=20, per_device=20, max_device_batch=7)
    global_batch.place(world_size=1, rank=0)
    module = SGDClassifier(**MODEL)
    module.trainer = type("T", (), {"world_size": 1, "datamodule": type("D", (), {"global_batch": global_batch})()})()
    assert module._shares_a_step()
    module._start_step()
    weights = [module.global_batch_weight(images) for images in (7, 7, 6)]
    assert weights == pytest.approx([21 / 20, 21 / 20, 18 / 20])
    # a micro-batch's mean loss, so weighted and divided by Lightning by the 3 passes, gives each image 1/20
    per_image = [w / images / 3 for w, images in zip(weights, (7, 7, 6), strict=True)]
    assert per_image == pytest.approx([1 / 20] * 3)


if __name__ == "__main__":
    train_one_step(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) or None)
