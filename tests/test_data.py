import math
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader

from helpers import WNIDS, make_image_tree, write_image
from robust_lightning.data.classes import class_map
from robust_lightning.data.contract import EvaluationSource
from robust_lightning.data.datamodule import ImageNetDataModule
from robust_lightning.data.datasets import Corrupt, LabelledImageFolder, ShardStream
from robust_lightning.data.loaders import collate
from robust_lightning.data.samplers import ExactDistributedSampler
from robust_lightning.data.shards import convert_image_folder, shard_urls
from robust_lightning.data.sources import FolderSource, ShardSource, SyntheticSource, read_eval_subset
from robust_lightning.data.transforms import eval_resize_size, eval_transform
from robust_lightning.errors import UserError


@pytest.fixture(scope="module")
def imagenet_tree(tmp_path_factory):
    """A miniature ImageNet: train/ and val/ with three wnid folders; val lacks most ImageNet classes."""
    root = tmp_path_factory.mktemp("imagenet")
    make_image_tree(root / "train", {w: 4 for w in WNIDS})
    make_image_tree(root / "val", {w: 3 for w in WNIDS}, corrupt=["n01443537/n01443537_broken.JPEG"])
    return root


@pytest.fixture(scope="module")
def val_shards(imagenet_tree, tmp_path_factory):
    out = tmp_path_factory.mktemp("val_shards")
    convert_image_folder(
        imagenet_tree / "val", out, samples_per_shard=3, shuffle=False, verify=False, workers=1, progress=False
    )
    return out


def test_eval_resize_is_floor_of_r_over_crop_pct():
    assert eval_resize_size(224, 0.875) == 256
    assert eval_resize_size(288, 0.875) == 329  # 288 / 0.875 = 329.14
    assert eval_resize_size(320, 0.875) == math.floor(320 / 0.875)


def test_eval_transform_matches_pil_resize_and_centre_crop(tmp_path):
    write_image(tmp_path / "a.png", seed=3, size=70, fmt="PNG")  # 78 x 70, landscape
    image = Image.open(tmp_path / "a.png").convert("RGB")
    r = 48
    short = eval_resize_size(r, 0.875)  # 54
    w, h = image.size
    expected = image.resize((round(w * short / h), short), Image.BICUBIC)
    left, top = round((expected.width - r) / 2), round((expected.height - r) / 2)
    expected = np.asarray(expected.crop((left, top, left + r, top + r)))
    ours = eval_transform(r)(image)
    assert ours.dtype == torch.uint8 and ours.shape == (3, r, r)
    np.testing.assert_array_equal(ours.permute(1, 2, 0).numpy(), expected)


def test_bhojanapallis_preprocessing_resizes_the_whole_image(tmp_path):
    """data.eval_resize whole: the whole image resized to r x r (bicubic), aspect ratio ignored, no crop
    (Bhojanapalli et al. 2021, App. A); results.json's data conditions name it."""
    write_image(tmp_path / "a.png", seed=3, size=70, fmt="PNG")  # 78 x 70, landscape
    image = Image.open(tmp_path / "a.png").convert("RGB")
    expected = np.asarray(image.resize((48, 48), Image.BICUBIC))
    ours = eval_transform(48, 0.875, "whole")(image)
    np.testing.assert_array_equal(ours.permute(1, 2, 0).numpy(), expected)
    make_image_tree(tmp_path / "root" / "val", {w: 1 for w in WNIDS})
    data = ImageNetDataModule(
        source=FolderSource(str(tmp_path / "root")), image_size=48, eval_resize="whole", num_workers=0
    )
    data.setup("test")
    assert data.conditions()["eval_preprocessing"] == (
        "resize 48x48 bicubic (whole image, aspect ratio ignored), no crop"
    )
    with pytest.raises(UserError, match="data.eval_resize must be one of shorter_side, whole, got 'crop'"):
        ImageNetDataModule(eval_resize="crop")


def test_folder_labels_follow_the_imagenet_map_not_the_folder_order(imagenet_tree):
    dataset = LabelledImageFolder(imagenet_tree / "val", class_map("imagenet"), eval_transform(32))
    labels = {
        sample["key"]: sample["label"]
        for sample in map(dataset.__getitem__, range(len(dataset)))
        if not isinstance(sample, Corrupt)
    }
    assert labels["n01440764_0"] == 0
    assert labels["n01443537_2"] == 1
    assert labels["n15075141_2"] == 999  # third folder, ImageNet label 999


def test_unknown_class_folder_is_a_clear_error(tmp_path):
    make_image_tree(tmp_path / "val", {"dogs": 1})
    dm = ImageNetDataModule(source=FolderSource(str(tmp_path)), image_size=32, num_workers=0)
    with pytest.raises(UserError, match="not in the class map"):
        dm.setup("validate")


def test_missing_dataset_root_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        ImageNetDataModule(source=FolderSource(str(tmp_path / "nowhere")))
    dm = ImageNetDataModule(source=FolderSource(str(tmp_path)))
    with pytest.raises(UserError, match="val"):
        dm.setup("validate")
    with pytest.raises(UserError, match="do not exist"):
        ImageNetDataModule(source=ShardSource(val_shards=str(tmp_path / "val-{000000..000003}.tar"))).setup("validate")


def _read_all(dm: ImageNetDataModule):
    samples, corrupt = {}, []
    for batch in dm.val_dataloader():
        corrupt += batch["corrupt"]
        for key, label, image in zip(batch["key"], batch["label"].tolist(), batch["image"]):
            assert key not in samples, f"{key} read twice"
            samples[key] = (label, image)
    return samples, corrupt


def test_folder_and_shards_give_the_same_labels_and_pixels(imagenet_tree, val_shards):
    folder = ImageNetDataModule(
        source=FolderSource(str(imagenet_tree)), image_size=32, eval_batch_size=4, num_workers=0
    )
    shards = ImageNetDataModule(
        source=ShardSource(val_shards=str(val_shards)), image_size=32, eval_batch_size=4, num_workers=2
    )
    folder.setup("validate")
    shards.setup("validate")
    from_folder, corrupt_folder = _read_all(folder)
    from_shards, corrupt_shards = _read_all(shards)
    assert len(from_folder) == 9 and len(corrupt_folder) == 1
    # the converter (verify=False) copied the broken file too: the reader skips and names it
    assert len(corrupt_shards) == 1 and "n01443537_broken" in corrupt_shards[0]
    assert from_folder.keys() == from_shards.keys()
    for key, (label, image) in from_folder.items():
        assert from_shards[key][0] == label
        assert torch.equal(from_shards[key][1], image)


def test_corrupt_sample_in_a_shard_is_skipped_without_shifting_labels(tmp_path):
    path = tmp_path / "mixed-000000.tar"
    good = tmp_path / "good.jpg"
    with wds.TarWriter(str(path)) as sink:
        for i in range(6):
            write_image(good, seed=i)
            payload = b"garbage" if i == 2 else good.read_bytes()
            sink.write({"__key__": f"s{i}", "jpg": payload, "cls": i})
        sink.write({"__key__": "nolabel", "jpg": good.read_bytes()})
    stream = ShardStream([str(path)], eval_transform(16), repeat=False)
    items = list(stream)
    batch = collate(items)
    assert batch["key"] == ["s0", "s1", "s3", "s4", "s5"]
    assert batch["label"].tolist() == [0, 1, 3, 4, 5]
    assert len(batch["corrupt"]) == 2 and "s2" in batch["corrupt"][0] and "nolabel" in batch["corrupt"][1]


def test_all_corrupt_batch_collates_to_an_empty_batch():
    batch = collate([Corrupt("a", "bad"), Corrupt("b", "bad")])
    assert batch["label"].numel() == 0 and batch["corrupt"] == ["a (bad)", "b (bad)"]


@pytest.mark.parametrize("n,world", [(10, 3), (9, 3), (2, 4), (7, 1)])
def test_exact_sampler_covers_every_index_once(n, world):
    dataset = list(range(n))
    seen = [i for rank in range(world) for i in ExactDistributedSampler(dataset, world, rank)]
    assert sorted(seen) == dataset
    assert sum(len(ExactDistributedSampler(dataset, world, rank)) for rank in range(world)) == n


def test_evaluation_source_says_where_the_evaluation_images_come_from(imagenet_tree, val_shards, tmp_path):
    folder = ImageNetDataModule(source=FolderSource(str(imagenet_tree)), eval_subset="robustbench", eval_limit=7)
    assert folder.evaluation_source() == EvaluationSource(
        "folder", str(imagenet_tree), True, "robustbench", 7, val_folder=str(imagenet_tree / "val")
    )
    shards = ImageNetDataModule(source=ShardSource(val_shards=str(val_shards)))
    assert shards.evaluation_source() == EvaluationSource("shards", str(val_shards), True, None, None)
    # not ImageNet val: another label map, a held-out part of train, the built-in set
    for source, other in ((FolderSource(str(imagenet_tree), class_map="folders"), {}), (folder.source, {"holdout": 2})):
        data = ImageNetDataModule(source=source, **other)
        assert not data.evaluation_source().imagenet_val
    synthetic = ImageNetDataModule(source=SyntheticSource(root=str(tmp_path / "synthetic")))
    assert synthetic.evaluation_source() == EvaluationSource("synthetic", str(tmp_path / "synthetic"), False)


def test_shard_stream_workers_and_ranks_read_disjoint_shards(val_shards):
    urls = shard_urls(val_shards)
    assert len(urls) == 4  # 10 files in shards of 3
    keys_per_rank = []
    for rank in range(2):
        dm = ImageNetDataModule(
            source=ShardSource(val_shards=str(val_shards)), image_size=16, eval_batch_size=2, num_workers=2
        )
        dm.rank, dm.world_size = rank, 2
        dm.setup("validate")
        keys, _ = _read_all(dm)
        keys_per_rank.append(set(keys))
    assert not keys_per_rank[0] & keys_per_rank[1]
    assert len(keys_per_rank[0] | keys_per_rank[1]) == 9


def test_training_stream_reshuffles_each_epoch_and_keeps_epoch_length(tmp_path):
    src = make_image_tree(tmp_path / "train", {w: 6 for w in WNIDS})
    out = tmp_path / "shards"
    convert_image_folder(src, out, samples_per_shard=3, workers=1, progress=False, verify=False)
    dm = ImageNetDataModule(
        source=ShardSource(train_shards=str(out), val_shards=str(out)),
        image_size=16,
        batch_size=4,
        num_workers=2,
        shuffle_buffer=4,
        seed=1,
    )
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert len(loader) == 18 // 4
    epoch = {"n": 0}
    loader.current_epoch = lambda: epoch["n"]
    first = [k for b in loader for k in b["key"]]
    again = [k for b in loader for k in b["key"]]
    epoch["n"] = 1
    second = [k for b in loader for k in b["key"]]
    assert len(first) == len(second) == 16
    assert first == again  # same epoch, same order: deterministic
    assert first != second


def test_uint8_batches_become_unit_range_floats_on_the_device():
    dm = ImageNetDataModule()
    batch = dm.on_after_batch_transfer({"image": torch.tensor([[0, 255]], dtype=torch.uint8)}, 0)
    assert batch["image"].dtype == torch.float32 and batch["image"].tolist() == [[0.0, 1.0]]


def test_dataloader_with_workers_yields_each_folder_image_once(imagenet_tree):
    dm = ImageNetDataModule(source=FolderSource(str(imagenet_tree)), image_size=16, eval_batch_size=4, num_workers=2)
    dm.setup("validate")
    assert isinstance(dm.val_dataloader(), DataLoader)
    samples, corrupt = _read_all(dm)
    assert len(samples) == 9 and len(corrupt) == 1


def test_brace_patterns_and_pipe_urls_read_the_same_shards(val_shards):
    from_dir = ImageNetDataModule(source=ShardSource(val_shards=str(val_shards)), image_size=16, num_workers=0)
    pattern = f"{val_shards}/val-{{000000..000003}}.tar"
    from_pattern = ImageNetDataModule(source=ShardSource(val_shards=pattern), image_size=16, num_workers=0)
    from_pipe = ImageNetDataModule(source=ShardSource(val_shards=f"pipe:cat {pattern}"), image_size=16, num_workers=0)
    keys = []
    for dm in (from_dir, from_pattern, from_pipe):
        dm.setup("validate")
        keys.append(sorted(_read_all(dm)[0]))
    assert len(keys[0]) == 9 and keys[0] == keys[1] == keys[2]
    training = ImageNetDataModule(source=ShardSource(train_shards=pattern, val_shards=pattern), image_size=16)
    with pytest.raises(UserError, match="train_size"):
        training.setup("fit")


# ------------------------------------------------------------------------------- evaluation subsets
def _subset_tree(tmp_path: Path) -> tuple[Path, list[str]]:
    """An ImageNet-style val tree and a subset file listing some of its images in a scrambled order."""
    root = tmp_path / "imagenet"
    make_image_tree(root / "val", {w: 4 for w in WNIDS})
    make_image_tree(root / "train", {w: 1 for w in WNIDS})
    listed = [
        f"{WNIDS[2]}/{WNIDS[2]}_3.JPEG",
        f"{WNIDS[0]}/{WNIDS[0]}_1.JPEG",
        f"{WNIDS[1]}/{WNIDS[1]}_0.JPEG",
        f"{WNIDS[0]}/{WNIDS[0]}_0.JPEG",
        f"{WNIDS[2]}/{WNIDS[2]}_0.JPEG",
    ]
    (tmp_path / "subset.txt").write_text("\n".join(listed))  # no trailing newline, like RobustBench's file
    return root, listed


def test_eval_subset_from_a_folder_tree_keeps_the_files_order(tmp_path):
    root, listed = _subset_tree(tmp_path)
    dm = ImageNetDataModule(
        source=FolderSource(str(root)),
        image_size=16,
        eval_batch_size=10,
        num_workers=0,
        eval_subset=str(tmp_path / "subset.txt"),
    )
    dm.setup("test")
    batch = next(iter(dm.test_dataloader()))
    assert batch["key"] == [Path(name).stem for name in listed]
    labels = class_map("imagenet")
    assert batch["label"].tolist() == [labels[name.split("/")[0]] for name in listed]
    dm = ImageNetDataModule(
        source=FolderSource(str(root)),
        image_size=16,
        eval_batch_size=10,
        num_workers=0,
        eval_subset=str(tmp_path / "subset.txt"),
        eval_limit=2,
    )
    dm.setup("test")
    assert next(iter(dm.test_dataloader()))["key"] == [Path(name).stem for name in listed[:2]]


def test_eval_subset_from_shards_keeps_exactly_the_listed_images(tmp_path):
    root, listed = _subset_tree(tmp_path)
    convert_image_folder(root / "val", tmp_path / "val_shards", samples_per_shard=5, workers=1, progress=False)
    dm = ImageNetDataModule(
        source=ShardSource(val_shards=str(tmp_path / "val_shards")),
        image_size=16,
        eval_batch_size=20,
        num_workers=0,
        eval_subset=str(tmp_path / "subset.txt"),
    )
    dm.setup("test")
    keys = [k for batch in dm.test_dataloader() for k in batch["key"]]
    assert sorted(keys) == sorted(Path(name).stem for name in listed) and dm.conditions()["eval_images"] == 5


def test_shard_images_of_another_class_than_listed_are_a_clear_error(tmp_path):
    root, listed = _subset_tree(tmp_path)
    convert_image_folder(root / "val", tmp_path / "val_shards", samples_per_shard=5, workers=1, progress=False)
    moved = f"{WNIDS[1]}/{Path(listed[1]).name}"  # an image listed under another class than its own
    (tmp_path / "subset.txt").write_text("\n".join([listed[0], moved]))
    dm = ImageNetDataModule(
        source=ShardSource(val_shards=str(tmp_path / "val_shards")),
        image_size=16,
        num_workers=0,
        eval_subset=str(tmp_path / "subset.txt"),
    )
    dm.setup("test")
    with pytest.raises(UserError, match=f"is of class {WNIDS[0]}, but data.eval_subset lists it under {WNIDS[1]}"):
        list(dm.test_dataloader())


def _robustbench_tree(tmp_path: Path, n: int) -> Path:
    """A val tree (and a train tree of the same classes) holding the first n images of the RobustBench subset."""
    lines = (Path(__file__).resolve().parents[1] / "data" / "robustbench_imagenet_test_image_ids.txt").read_text()
    root = tmp_path / "imagenet"
    for seed, entry in enumerate(lines.splitlines()[:n]):
        write_image(root / "val" / entry, seed)
        (root / "train" / entry.split("/")[0]).mkdir(parents=True, exist_ok=True)
    return root


@pytest.mark.parametrize("source", ["folder", "shards"])
def test_the_robustbench_subset_needs_the_imagenet_labels(tmp_path, source):
    """Its labels are ImageNet's: a class map that labels its classes otherwise is refused, not evaluated."""
    root = _robustbench_tree(tmp_path, 3)
    imagenet = class_map("imagenet")
    for labels in ("imagenet", "folders"):  # folders: the three classes become 0, 1, 2
        if source == "folder":
            where = FolderSource(str(root), class_map=labels)
        else:
            out = tmp_path / f"shards_{labels}"
            convert_image_folder(root / "val", out, samples_per_shard=2, class_map=labels, workers=1, progress=False)
            where = ShardSource(val_shards=str(out))
        dm = ImageNetDataModule(source=where, image_size=16, num_workers=0, eval_subset="robustbench", eval_limit=3)
        if labels == "imagenet":
            dm.setup("test")
            batch = next(iter(dm.test_dataloader()))
            assert len(batch["key"]) == 3
            wnids = {Path(e).stem: e.split("/")[0] for e in read_eval_subset(dm.eval_subset, dm.eval_limit)}
            assert batch["label"].tolist() == [imagenet[wnids[k]] for k in batch["key"]]
        else:
            with pytest.raises(UserError, match="standard ImageNet map"):
                dm.setup("test")
                list(dm.test_dataloader())


def test_eval_limit_takes_the_first_images_of_any_eval_set(tmp_path):
    root, _ = _subset_tree(tmp_path)
    convert_image_folder(root / "val", tmp_path / "val_shards", samples_per_shard=5, workers=1, progress=False)
    dm = ImageNetDataModule(
        source=ShardSource(val_shards=str(tmp_path / "val_shards")),
        image_size=16,
        eval_batch_size=20,
        num_workers=0,
        eval_limit=7,
    )
    dm.setup("test")
    assert sum(len(b["key"]) for b in dm.test_dataloader()) == 7 and dm.conditions()["eval_images"] == 7
    dm = ImageNetDataModule(
        source=FolderSource(str(root)), image_size=16, eval_batch_size=20, num_workers=0, eval_limit=7
    )
    dm.setup("test")
    assert len(next(iter(dm.test_dataloader()))["key"]) == 7


def test_a_subset_naming_missing_images_is_a_clear_error(tmp_path):
    root, listed = _subset_tree(tmp_path)
    (tmp_path / "subset.txt").write_text("\n".join([*listed, f"{WNIDS[0]}/ILSVRC2012_val_00000001.JPEG"]))
    dm = ImageNetDataModule(
        source=FolderSource(str(root)), image_size=16, num_workers=0, eval_subset=str(tmp_path / "subset.txt")
    )
    with pytest.raises(UserError, match="1 of the 6 images of data.eval_subset are not in"):
        dm.setup("test")
    with pytest.raises(UserError, match="no file"):
        ImageNetDataModule(source=FolderSource(str(root)), eval_subset=str(tmp_path / "nope.txt")).setup("test")


def test_fewer_evaluation_images_than_processes_is_a_clear_error(tmp_path):
    # a rank without a batch would skip the evaluation loop and leave the others waiting at its barriers
    root, _ = _subset_tree(tmp_path)
    dm = ImageNetDataModule(source=FolderSource(str(root)), image_size=16, num_workers=0, eval_limit=2)
    dm.setup("test")
    dm.world_size, dm.rank = 4, 3
    with pytest.raises(UserError, match="2 evaluation images cannot be split over 4 processes"):
        dm.test_dataloader()
    dm.world_size, dm.rank = 2, 1
    assert [b["key"] for b in dm.test_dataloader()] == [[f"{WNIDS[0]}_1"]]


def test_the_robustbench_subset_file_is_the_5000_image_list():
    lines = (Path(__file__).resolve().parents[1] / "data" / "robustbench_imagenet_test_image_ids.txt").read_text()
    entries = lines.splitlines()
    assert len(entries) == 5000 and len(set(entries)) == 5000
    assert all(e.count("/") == 1 and e.split("/")[1].startswith("ILSVRC2012_val_") for e in entries)


@pytest.mark.parametrize("source", ["folder", "shards"])
def test_eval_dataloader_with_another_transform_reads_the_same_images(tmp_path, source):
    root, _listed = _subset_tree(tmp_path)
    where = FolderSource(str(root))
    if source == "shards":
        convert_image_folder(root / "val", tmp_path / "val_shards", samples_per_shard=5, workers=1, progress=False)
        where = ShardSource(val_shards=str(tmp_path / "val_shards"))
    dm = ImageNetDataModule(
        source=where, image_size=16, eval_batch_size=20, num_workers=0, eval_subset=str(tmp_path / "subset.txt")
    )
    dm.setup("test")
    plain = next(iter(dm.test_dataloader()))
    larger = next(iter(dm.eval_dataloader_with(eval_transform(24))))
    assert larger["key"] == plain["key"] and torch.equal(larger["label"], plain["label"])
    assert larger["image"].shape[-2:] == (24, 24) and plain["image"].shape[-2:] == (16, 16)
    assert next(iter(dm.test_dataloader()))["image"].shape[-2:] == (16, 16)  # the original set is untouched


def test_images_sharing_a_file_name_in_two_class_folders_get_distinct_keys(tmp_path):
    """Keys are file stems where those are unique (ImageNet); where a stem repeats across class folders, the
    relative path without the extension: predictions and outcomes never merge two images."""
    from helpers import WNIDS, write_image
    from robust_lightning.data.datamodule import ImageNetDataModule

    for i, wnid in enumerate(WNIDS[:2]):
        write_image(tmp_path / "in" / "val" / wnid / "0001.JPEG", seed=i)
    write_image(tmp_path / "in" / "val" / WNIDS[2] / "unique.JPEG", seed=5)
    dm = ImageNetDataModule(source=FolderSource(str(tmp_path / "in")), image_size=32, num_workers=0, eval_batch_size=8)
    dm.setup("predict")
    keys = [key for batch in dm.predict_dataloader() for key in batch["key"]]
    assert sorted(keys) == sorted([f"{WNIDS[0]}/0001", f"{WNIDS[1]}/0001", f"{WNIDS[2]}/unique"])
