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
from robust_lightning.data.datamodule import ImageNetDataModule, SyntheticData
from robust_lightning.data.samplers import GlobalBatchSampler, ShardShare, rank_share
from robust_lightning.training.lightning_module import ImageClassifier

REPO = Path(__file__).resolve().parents[1]
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
        loader = DataLoader(dataset, batch_size=rank_share(global_batch, world_size, rank), sampler=sampler,
                            drop_last=True, collate_fn=list)
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
        dm = ImageNetDataModule(source="folder", root=str(tmp_path / "in"), image_size=32, num_workers=0,
                                global_batch_size=5)
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
    synthetic = SyntheticData(num_classes=4, train_per_class=8, val_per_class=3, image_size=32, samples_per_shard=4,
                              root=str(tmp_path / "synthetic"))
    sizes = []
    for rank in range(WORLD_SIZE):
        dm = ImageNetDataModule(image_size=32, num_workers=0, global_batch_size=10, synthetic=synthetic)
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
    dm = ImageNetDataModule(source="folder", root=str(tmp_path / "in"), image_size=32, num_workers=0,
                            global_batch_size=7)
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
    """Saves, per rank: the weights before training, the batch of the first step (as the model got it), the
    gradient after DDP averaged it, and the weights after the step."""

    def __init__(self, out_dir: str):
        self.out_dir = Path(out_dir)

    def _save(self, trainer, name, value):
        torch.save(value, self.out_dir / f"{name}-rank{trainer.global_rank}.pt")

    def on_train_start(self, trainer, pl_module):
        self._save(trainer, "init", {k: v.clone() for k, v in pl_module.model.state_dict().items()})

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._save(trainer, "batch", {"image": batch["image"].clone(), "label": batch["label"].clone(),
                                      "key": batch["key"]})

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._save(trainer, "grad", {n: p.grad.clone() for n, p in pl_module.model.named_parameters()})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._save(trainer, "final", {k: v.clone() for k, v in pl_module.model.state_dict().items()})


# no label smoothing: the reference below is then plain cross-entropy on the labels
MODEL = dict(arch="test_convnext", num_classes=3, label_smoothing=0.0, warmup_epochs=0)


def train_one_step(out: Path) -> None:
    """Folder data: the ranks' shares come from GlobalBatchSampler, which Lightning must keep (the shard
    source's split is the per-rank batch size alone, checked above)."""
    seed_everything(0)
    trainer = Trainer(accelerator="cpu", devices=WORLD_SIZE, strategy="ddp", max_steps=1, logger=False,
                      enable_checkpointing=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, inference_mode=False,
                      callbacks=[StepRecorder(str(out))], default_root_dir=str(out))
    data = ImageNetDataModule(source="folder", root=str(out / "in"), class_map="folders", image_size=32,
                              num_workers=0, global_batch_size=GLOBAL_BATCH)
    trainer.fit(SGDClassifier(**MODEL), datamodule=data)


def test_one_step_on_three_ranks_equals_one_process_on_the_same_twenty_images(tmp_path):
    make_image_tree(tmp_path / "in" / "train", {w: 9 for w in WNIDS})  # 27 images: one step of 20
    make_image_tree(tmp_path / "in" / "val", {w: 1 for w in WNIDS})
    result = run_command([str(tmp_path)], script=Path(__file__), cwd=tmp_path, timeout=300,
                         env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    load = lambda name, rank: torch.load(tmp_path / f"{name}-rank{rank}.pt", weights_only=True)  # noqa: E731

    batches = [load("batch", rank) for rank in range(WORLD_SIZE)]
    assert [len(b["label"]) for b in batches] == [7, 7, 6]
    assert len({key for b in batches for key in b["key"]}) == GLOBAL_BATCH  # 20 distinct images

    # the reference: one process, the same initial weights, the mean loss over all 20 images, one SGD step
    module = SGDClassifier(**MODEL)
    module.model.load_state_dict(load("init", 0))
    images = torch.cat([b["image"] for b in batches])
    labels = torch.cat([b["label"] for b in batches])
    F.cross_entropy(module.model(images), labels).backward()
    reference_grad = {n: p.grad.clone() for n, p in module.model.named_parameters()}
    with torch.no_grad():
        for p in module.model.parameters():
            p -= LR * p.grad
    expected = module.model.state_dict()

    for rank in range(WORLD_SIZE):
        grad, final = load("grad", rank), load("final", rank)
        for name, value in reference_grad.items():
            torch.testing.assert_close(grad[name], value, atol=1e-6, rtol=1e-5, msg=f"gradient of {name}")
        for name, value in expected.items():
            torch.testing.assert_close(final[name], value, atol=1e-6, rtol=1e-5, msg=f"{name} after the step")

    # the check has teeth: the plain average of the ranks' mean-loss gradients (no weights) is measurably off
    module.model.load_state_dict(load("init", 0))
    module.model.zero_grad()
    for b in batches:
        (F.cross_entropy(module.model(b["image"]), b["label"]) / WORLD_SIZE).backward()
    error = max((p.grad - reference_grad[n]).abs().max().item() for n, p in module.model.named_parameters())
    assert error > 1e-4


if __name__ == "__main__":
    train_one_step(Path(sys.argv[1]))
