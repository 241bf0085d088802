"""A fit resumed from a checkpoint written in the middle of an epoch (a step checkpoint; SLURM's hpc_ckpt_N.ckpt and a
SIGTERM's last.ckpt are written at the same point, the end of a step) trains exactly the batches of that epoch that
the interrupted attempt had not trained, with the same random draws: its final weights are bit for bit those of the
same fit left alone. On the CPU, with loader workers on, for image folders and shards, in one process and on two
gloo ranks, with the crop made in the loader workers (data.full_resolution_decode, the recipes' setting, whose
random draws the workers replay from the images' headers) and on the device."""

import csv
from pathlib import Path

import pytest
import torch
from PIL import Image

from helpers import WNIDS, folder_source, make_image_tree, run_command, synthetic_source, tiny_config
from robust_lightning.cli import main
from robust_lightning.data.augment import BatchAugment
from robust_lightning.data.datasets import Corrupt, LabelledImageFolder, ReplayableSubset, Replayed
from robust_lightning.data.loaders import TrainingPosition, collate, with_draws
from robust_lightning.data.samplers import GlobalBatchSampler, ReplayIndex
from robust_lightning.data.transforms import CanvasDecode, draw_without_decoding, train_transform

STEPS_PER_EPOCH = 6  # 3 classes x 8 images in global batches of 4
RESUMED_AT = 8  # the step checkpoint written two steps into the second epoch


@pytest.fixture(scope="module")
def image_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("imagenet")
    make_image_tree(root / "train", {w: 8 for w in WNIDS})
    make_image_tree(root / "val", {w: 1 for w in WNIDS})
    return root


def config(tmp_path: Path, source: dict, devices: int = 1, **extra) -> Path:
    """Two epochs of 6 steps, heavy augmentation, 1-step APGD-AT and EMA, loader workers on, a checkpoint every
    4 steps (steps 4 and 8 are in the middle of an epoch)."""
    options = {
        "trainer.max_epochs": 2,
        "trainer.limit_train_batches": None,
        "trainer.log_every_n_steps": 1,
        "trainer.limit_val_batches": 0,  # training alone decides the weights compared here
        "data.batch_size": 4 // devices,
        "data.num_workers": 2 // devices,  # a worker per rank on two ranks: two cores run this test
        "data.augmentation": "heavy",
        "model.arch": "test_resnet",
        "model.attack": "apgd",
        "model.attack_steps": 1,
        "model.ema_decay": 0.9,
        "checkpoint.every_n_train_steps": 4,
        "checkpoint.monitor": None,  # no validation here: every step checkpoint is kept
        "checkpoint.save_top_k": -1,
        "checkpoint.filename": "step{step:03d}",
        **source,
        **extra,
    }
    if devices > 1:
        options.update({"trainer.devices": devices, "trainer.strategy": "ddp"})
    return tiny_config(tmp_path, **options)


FOLDER = {"data.source": folder_source("<image_root>"), "data.full_resolution_decode": True}
SHARDS = {  # shards the data module writes; 6 training shards: several per worker and per rank
    "data.source": synthetic_source(num_classes=3, train_per_class=8, val_per_class=1, samples_per_shard=4),
}


def fit(config_path: Path, devices: int, *args: str) -> None:
    if devices == 1:
        assert main(["fit", "--config", str(config_path), *args]) == 0
        return
    result = run_command(["fit", "--config", str(config_path), *args], cwd=config_path.parent, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]


def checkpoint_at(run: Path, step: int) -> Path:
    path = run / "checkpoints" / f"step{step:03d}.ckpt"
    assert torch.load(path, map_location="cpu", weights_only=True)["global_step"] == step
    return path


def train_losses(run: Path) -> dict[int, float]:
    with open(run / "metrics.csv") as f:
        return {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")}


@pytest.mark.parametrize(
    "source, devices",
    [
        pytest.param(FOLDER, 1, id="folder-1-process"),
        pytest.param({**SHARDS, "data.full_resolution_decode": True}, 1, id="shards-1-process"),
        pytest.param(FOLDER, 2, id="folder-2-ranks"),
        pytest.param(SHARDS, 2, id="shards-2-ranks-crop-on-device"),
    ],
)
def test_a_fit_resumed_mid_epoch_ends_with_the_weights_of_the_fit_left_alone(tmp_path, image_root, source, devices):
    if source is FOLDER:
        source = {**source, "data.source": folder_source(image_root)}
    (tmp_path / "whole").mkdir()
    (tmp_path / "resumed").mkdir()
    synthetic = {"synthetic_root": tmp_path / "synthetic"}  # one generated copy for both runs
    whole = tmp_path / "whole" / "runs" / "tiny" / "version_0"
    fit(config(tmp_path / "whole", source, devices, **synthetic), devices)

    # the checkpoint of step 8 holds the training loader's position: 2 steps into epoch 1
    step_8 = checkpoint_at(whole, RESUMED_AT)
    loops = torch.load(step_8, map_location="cpu", weights_only=True)["loops"]
    assert loops["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 1, "micro_batches": 2}]

    # the resumed attempt: the same config, from that checkpoint, in a directory of its own
    resumed = tmp_path / "resumed" / "runs" / "tiny" / "version_0"
    fit(config(tmp_path / "resumed", source, devices, **synthetic), devices, "--ckpt_path", str(step_8))

    expected, got = train_losses(whole), train_losses(resumed)
    assert sorted(expected) == list(range(2 * STEPS_PER_EPOCH))
    assert sorted(got) == list(range(RESUMED_AT, 2 * STEPS_PER_EPOCH))  # the epoch's last 4 steps, once each
    assert {step: got[step] for step in got} == {step: expected[step] for step in got}
    final_whole = torch.load(whole / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    final_resumed = torch.load(resumed / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert final_resumed["global_step"] == final_whole["global_step"] == 2 * STEPS_PER_EPOCH
    assert any(name.startswith("ema.") for name in final_whole["state_dict"])
    for name, value in final_whole["state_dict"].items():
        assert torch.equal(final_resumed["state_dict"][name], value), name


# ------------------------------------------------------------------------------------------------ the parts


def test_replaying_an_image_draws_what_loading_it_draws(tmp_path):
    """A replayed image's transform makes the random draws its load makes, from the header alone, for every size
    (RandomResizedCrop's draws depend on it), so the worker's stream stands where it stood in the interrupted
    attempt; the canvas decode draws nothing."""
    for size in (40, 17, 300):
        path = tmp_path / f"{size}.jpg"
        Image.new("RGB", (size, size * 2 // 3 + 1), (20, 90, 200)).save(path)
        for transform in (train_transform(32), CanvasDecode(64)):
            torch.manual_seed(size)
            transform(Image.open(path))
            loaded = torch.get_rng_state()
            torch.manual_seed(size)
            image = Image.open(path)
            draw_without_decoding(transform, image)
            assert torch.equal(torch.get_rng_state(), loaded)
            assert image._im is None  # never decoded


@pytest.mark.parametrize("scheme", ["basic", "3aug", "deit3", "heavy"])
def test_a_replayed_batch_draws_what_the_workers_augmentation_draws(scheme):
    """data.augment_on cpu: the workers augment each batch; a replayed batch makes the same draws on stand-ins."""
    augment = BatchAugment(scheme, 1000, flip=scheme != "basic", mix=False, erase_prob=0)
    torch.manual_seed(0)
    images = torch.randint(0, 256, (5, 3, 32, 32), dtype=torch.uint8)
    collate([{"image": image, "label": 1, "key": str(i)} for i, image in enumerate(images)], augment)
    loaded = torch.get_rng_state()
    torch.manual_seed(0)
    torch.randint(0, 256, (5, 3, 32, 32), dtype=torch.uint8)
    assert collate([Replayed(str(i)) for i in range(5)], augment) == {"replayed": 5}
    assert torch.equal(torch.get_rng_state(), loaded)


def test_the_sampler_marks_the_steps_trained_before_the_resume(tmp_path, image_root):
    dataset = LabelledImageFolder(image_root / "train", {w: i for i, w in enumerate(WNIDS)}, train_transform(32))
    sampler = GlobalBatchSampler(dataset, num_replicas=2, rank=1, global_batch=4, seed=3)
    sampler.set_epoch(1)
    plain = list(sampler)
    sampler.replay_steps = 2
    marked = list(sampler)
    assert marked == plain and len(sampler) == len(plain) == 12  # the same order, the same length
    assert [isinstance(i, ReplayIndex) for i in marked] == [True] * 4 + [False] * 8  # 2 steps x 2 images of rank 1
    assert isinstance(dataset[marked[0]], Replayed) and isinstance(dataset[marked[4]], dict)
    subset = ReplayableSubset(dataset, [5, 7, 9])
    assert isinstance(subset[ReplayIndex(1)], Replayed) and subset.__getitems__([ReplayIndex(0), 2])[1]["key"]


def test_replayed_batches_keep_their_draw_keys_and_are_not_trained():
    batches = [{"replayed": 4}, {"replayed": 4}, {"image": torch.zeros(4), "label": torch.zeros(4), "corrupt": []}]
    out = list(with_draws(batches, epoch=3, micro_batches=2))
    assert [b["draw"] for b in out] == [(3, 4), (3, 5)]  # the third step's two micro-batches


def test_the_position_is_of_its_epoch_and_used_once():
    position = TrainingPosition()
    position.record((2, 5))  # the sixth micro-batch of epoch 2 is about to be trained
    assert position.state_dict() == {"epoch": 2, "micro_batches": 6}
    resumed = TrainingPosition()
    resumed.load_state_dict(position.state_dict())
    assert resumed.replay_steps(epoch=2, micro_batches=3) == 2 and resumed.replay_steps(2, 3) == 0
    resumed.load_state_dict({"epoch": 2, "micro_batches": 6})
    assert resumed.replay_steps(epoch=3, micro_batches=3) == 0  # a checkpoint at the end of epoch 2


def test_an_unreadable_image_is_corrupt_when_replayed_too(tmp_path):
    root = make_image_tree(tmp_path / "train", {WNIDS[0]: 1}, corrupt=[f"{WNIDS[0]}/broken.JPEG"])
    dataset = LabelledImageFolder(root, {WNIDS[0]: 0}, train_transform(32))
    broken = next(i for i, (path, _) in enumerate(dataset.samples) if "broken" in path)
    assert isinstance(dataset[ReplayIndex(broken)], Corrupt) and isinstance(dataset[broken], Corrupt)
