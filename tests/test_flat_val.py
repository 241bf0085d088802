"""ImageNet's val as distributed: one flat folder of images, the labels in a separate file (data.source.val_labels, and
robust-lightning shards --val_labels). The same images sorted into class folders are the reference."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from helpers import REPO, WNIDS, folder_source, tiny_config, write_image
from robust_lightning.cli import main
from robust_lightning.data.datamodule import ImageNetDataModule
from robust_lightning.data.shards import shard_urls
from robust_lightning.data.sources import FolderSource, ShardSource
from robust_lightning.data.transforms import eval_transform
from robust_lightning.errors import UserError

# the class of each image ILSVRC2012_val_0000000<i>.JPEG, i = 1..9 (indices into WNIDS: labels 0, 1, 999)
CLASSES = [2, 0, 1, 1, 2, 0, 0, 1, 2]
IMAGENET_INDEX = json.loads((REPO / "data" / "imagenet_class_index.json").read_text())
LABEL = {wnid: int(i) for i, (wnid, _) in IMAGENET_INDEX.items()}  # independent of robust_lightning's map


def _name(i: int) -> str:
    return f"ILSVRC2012_val_{i:08d}.JPEG"


def _loc_csv(path: Path, labels: dict[str, str]) -> Path:
    """A file in the format of Kaggle's LOC_val_solution.csv: ImageId (no extension), then the WNID and a box for
    each object; rows in no particular order."""
    rows = [f"{Path(name).stem},{wnid} 10 12 30 33 {wnid} 1 2 20 21" for name, wnid in reversed(labels.items())]
    path.write_text("\n".join(["ImageId,PredictionString", *rows]) + "\n")
    return path


@pytest.fixture(scope="module")
def val(tmp_path_factory):
    """(flat root, class-folder root, labels file): the same nine images as ROOT/val/*.JPEG and as
    ROOT/val/<wnid>/*.JPEG."""
    tmp = tmp_path_factory.mktemp("flat_val")
    labels = {_name(i + 1): WNIDS[c] for i, c in enumerate(CLASSES)}
    for i, (name, wnid) in enumerate(labels.items()):
        write_image(tmp / "flat" / "val" / name, seed=i)
        (tmp / "tree" / "val" / wnid).mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp / "flat" / "val" / name, tmp / "tree" / "val" / wnid / name)
    # the real file labels all 50,000 images: a row for an image that is not in the folder is fine
    csv = _loc_csv(tmp / "LOC_val_solution.csv", {**labels, _name(50000): WNIDS[0]})
    return tmp / "flat", tmp / "tree", csv


def _results(save_dir: Path, stage: str) -> dict:
    return json.loads(next(save_dir.glob("tiny/version_*/results.json")).read_text())[stage]


def test_validate_and_predict_on_a_flat_folder_equal_the_class_folders(val, tmp_path):
    flat, tree, csv = val
    metrics = {}
    for name, options in {
        "flat": folder_source(flat, val_labels=str(csv)),
        "tree": folder_source(tree),
    }.items():
        (tmp_path / name).mkdir()
        config = tiny_config(tmp_path / name, **{"data.source": options, "model.arch": "test_resnet"})
        assert main(["validate", "--config", str(config)]) == 0
        metrics[name] = _results(tmp_path / name / "runs", "validate")["metrics"]
    assert metrics["flat"]["val/num_images"] == metrics["flat"]["val/expected_images"] == len(CLASSES)
    # the loss (and calibration) of an untrained model depend on every label; the images come in another order
    assert {"val/acc1", "val/loss", "val/ece"} <= metrics["flat"].keys()
    assert metrics["flat"] == pytest.approx(metrics["tree"], rel=1e-5)

    # every image under its key (the file stem) with the label of its WNID in the labels file
    config = tmp_path / "flat" / "tiny.yaml"
    assert main(["predict", "--config", str(config), "--trainer.logger.init_args.save_dir", str(tmp_path / "p")]) == 0
    rows = next((tmp_path / "p").glob("tiny/version_*/predictions-rank0.csv")).read_text().splitlines()[1:]
    predicted = {row.split(",")[0]: int(row.split(",")[1]) for row in rows}
    assert predicted == {Path(_name(i + 1)).stem: LABEL[WNIDS[c]] for i, c in enumerate(CLASSES)}


def test_a_flat_folder_without_labels_names_the_option(val, tmp_path, capsys):
    flat, _, _ = val
    config = tiny_config(
        tmp_path,
        **{"data.source": folder_source(flat), "model.arch": "test_resnet"},
    )
    assert main(["validate", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1
    assert f"{flat / 'val'} holds images directly" in err and "data.source.val_labels" in err
    assert "LOC_val_solution.csv" in err

    assert main(["shards", str(flat / "val"), str(tmp_path / "out"), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert "holds images directly" in err and "--val_labels" in err and "Traceback" not in err


def _setup(root: Path, labels: Path | str, **options) -> ImageNetDataModule:
    data = ImageNetDataModule(
        source=FolderSource(str(root), val_labels=str(labels)), image_size=32, num_workers=0, **options
    )
    data.setup("validate")
    return data


def test_bad_labels_files_are_one_clear_message_each(val, tmp_path):
    flat, tree, csv = val
    lines = csv.read_text().splitlines()
    without = tmp_path / "without.csv"
    without.write_text("\n".join(line for line in lines if not line.startswith(Path(_name(4)).stem)))
    with pytest.raises(
        UserError,
        match=rf"1 of the 9 images in .*val are not in data.source.val_labels {without} "
        rf"\(first: {_name(4)}\)",
    ):
        _setup(flat, without)
    unknown = tmp_path / "unknown.csv"
    unknown.write_text("\n".join([*lines[:3], f"{Path(_name(7)).stem},n99999999 1 2 3 4", *lines[3:]]))
    with pytest.raises(UserError, match=r"unknown.csv, line 4: 'n99999999' is not a class of the class map"):
        _setup(flat, unknown)
    with pytest.raises(
        UserError,
        match=rf"data.source.val_labels {tmp_path / 'nowhere.csv'} does not exist; expected "
        "Kaggle's LOC_val_solution.csv",
    ):
        _setup(flat, tmp_path / "nowhere.csv")
    devkit = tmp_path / "ILSVRC2012_validation_ground_truth.txt"
    devkit.write_text("490\n361\n171\n822\n297\n482\n13\n704\n599\n")
    with pytest.raises(
        UserError,
        match=rf"devkit's meta.mat beside the labels file, and {tmp_path / 'meta.mat'} "
        "does not exist; copy it there from ILSVRC2012_devkit_t12/data/",
    ):
        _setup(flat, devkit)
    (tmp_path / "meta.mat").write_text("not a MATLAB file")
    with pytest.raises(UserError, match="meta.mat is not the ImageNet devkit's meta.mat"):
        _setup(flat, devkit)
    with pytest.raises(
        UserError, match="holds none directly; for class folders <wnid>/<images> leave data.source.val_labels"
    ):
        _setup(tree, csv)
    with pytest.raises(TypeError, match="val_labels"):  # shards hold their labels: robust-lightning shards --val_labels
        ShardSource(val_shards=str(tmp_path), val_labels=str(csv))


def test_other_label_file_formats(val, tmp_path):
    flat, _, _ = val
    expected = {Path(_name(i + 1)).stem: LABEL[WNIDS[c]] for i, c in enumerate(CLASSES)}
    spaced, commas = tmp_path / "labels.txt", tmp_path / "labels.csv"
    spaced.write_text("".join(f"{_name(i + 1)} {WNIDS[c]}\n" for i, c in enumerate(CLASSES)))
    commas.write_text("".join(f"{_name(i + 1)},{WNIDS[c]}\n" for i, c in enumerate(CLASSES)))
    for labels in (spaced, commas):
        data = _setup(flat, labels)
        read = {item["key"]: item["label"] for item in (data.eval_set[i] for i in range(len(data.eval_set)))}
        assert read == expected


def _devkit_meta(path: Path) -> dict[str, int]:
    """A meta.mat in the devkit's layout (a struct array ``synsets``): the 1000 leaf classes numbered in an order of
    their own (reversed WNIDs here, as the devkit's order is not the sorted one), plus an inner synset that is not a
    class. Returns the ILSVRC2012_ID of each WNID."""
    from scipy.io import savemat

    wnids = [wnid for _, (wnid, _) in sorted(IMAGENET_INDEX.items(), key=lambda item: int(item[0]))]
    ids = {wnid: number for number, wnid in enumerate(reversed(wnids), start=1)}
    synsets = np.array(
        [(number, wnid, 0) for wnid, number in ids.items()] + [(1001, "n00001740", 3)],
        dtype=[("ILSVRC2012_ID", "O"), ("WNID", "O"), ("num_children", "O")],
    )
    savemat(str(path), {"synsets": synsets.reshape(-1, 1)})
    return ids


def test_the_devkit_ground_truth_file_is_read_with_its_meta_mat(val, tmp_path):
    flat, _, _ = val
    devkit = tmp_path / "data"
    devkit.mkdir()
    ids = _devkit_meta(devkit / "meta.mat")
    truth = devkit / "ILSVRC2012_validation_ground_truth.txt"
    truth.write_text("".join(f"{ids[WNIDS[c]]}\n" for c in CLASSES) + f"{ids[WNIDS[0]]}\n")  # a 10th, absent image
    data = _setup(flat, truth)
    read = {item["key"]: item["label"] for item in (data.eval_set[i] for i in range(len(data.eval_set)))}
    assert read == {Path(_name(i + 1)).stem: LABEL[WNIDS[c]] for i, c in enumerate(CLASSES)}


def test_shards_of_a_flat_folder_equal_those_of_class_folders(val, tmp_path, capsys):
    flat, tree, csv = val
    assert (
        main(
            [
                "shards",
                str(flat / "val"),
                str(tmp_path / "flat"),
                "--val_labels",
                str(csv),
                "--shuffle",
                "false",
                "--samples_per_shard",
                "4",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "shards",
                str(tree / "val"),
                str(tmp_path / "tree"),
                "--shuffle",
                "false",
                "--samples_per_shard",
                "4",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    assert "Wrote 9 samples of 3 classes" in capsys.readouterr().out

    def samples(out: Path) -> dict[str, tuple]:
        read = [s for url in shard_urls(out) for s in wds.WebDataset(url, shardshuffle=False, empty_check=False)]
        return {s["__key__"]: (s["jpg"], int(s["cls"]), s["wnid"].decode()) for s in read}

    from_flat = samples(tmp_path / "flat")
    assert from_flat == samples(tmp_path / "tree")
    for i, c in enumerate(CLASSES):  # the images' own bytes under the label of the WNID the labels file gives
        assert from_flat[Path(_name(i + 1)).stem] == (
            (flat / "val" / _name(i + 1)).read_bytes(),
            LABEL[WNIDS[c]],
            WNIDS[c],
        )
    manifest = json.loads((tmp_path / "flat" / "manifest.json").read_text())
    assert manifest["options"]["val_labels"] == str(csv.resolve())
    assert manifest["class_counts"] == {WNIDS[0]: 3, WNIDS[1]: 3, WNIDS[2]: 3}


def test_the_robustbench_subset_and_other_subsets_from_a_flat_folder(tmp_path):
    listed = (REPO / "data" / "robustbench_imagenet_test_image_ids.txt").read_text().split()[:6]
    labels = {entry.split("/")[1]: entry.split("/")[0] for entry in listed}
    labels[_name(3)] = WNIDS[1]  # an image the subset does not list
    for seed, name in enumerate(labels):
        write_image(tmp_path / "val" / name, seed=seed)
    csv = _loc_csv(tmp_path / "LOC_val_solution.csv", labels)

    # the RobustBench subset's first six images (data.eval_limit), in the list's order, with ImageNet's labels
    data = ImageNetDataModule(
        source=FolderSource(str(tmp_path), val_labels=str(csv)),
        eval_subset="robustbench",
        eval_limit=6,
        image_size=32,
        num_workers=0,
    )
    data.setup("test")
    expected = ([Path(entry).stem for entry in listed], [LABEL[entry.split("/")[0]] for entry in listed])
    for loader in (data.test_dataloader(), data.eval_dataloader_with(eval_transform(24))):
        batches = list(loader)
        assert ([k for b in batches for k in b["key"]], [int(y) for b in batches for y in b["label"]]) == expected
        assert batches[0]["image"].shape[-1] in (24, 32)

    # a subset file of some of the images, in its own order
    subset = tmp_path / "subset.txt"
    subset.write_text(f"{WNIDS[1]}/{_name(3)}\n{listed[4]}\n{listed[1]}\n")
    data = ImageNetDataModule(
        source=FolderSource(str(tmp_path), val_labels=str(csv)), eval_subset=str(subset), image_size=32, num_workers=0
    )
    data.setup("test")
    batch = next(iter(data.test_dataloader()))
    assert batch["key"] == [Path(_name(3)).stem, Path(listed[4]).stem, Path(listed[1]).stem]
    assert batch["label"].tolist() == [LABEL[WNIDS[1]], LABEL[listed[4].split("/")[0]], LABEL[listed[1].split("/")[0]]]

    # a subset that lists an image under another class than the labels file is an error, not a silent relabel
    subset.write_text(f"{WNIDS[0]}/{_name(3)}\n")
    data = ImageNetDataModule(
        source=FolderSource(str(tmp_path), val_labels=str(csv)), eval_subset=str(subset), image_size=32, num_workers=0
    )
    with pytest.raises(
        UserError,
        match=rf"data.eval_subset lists {_name(3)} under {WNIDS[0]}, but data.source.val_labels "
        rf".* labels it {WNIDS[1]}",
    ):
        data.setup("test")
