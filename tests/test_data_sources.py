"""Data sources are classes chosen in the config (robust_lightning.data.sources): each has only its own options, a
new one is one class, and a config in the old form gets a message saying how it is written now."""

import pytest
import torch
from torch.utils.data import Dataset

from helpers import run_cli, tiny_config
from robust_lightning.cli import command_line_check, main
from robust_lightning.data.datamodule import ImageNetDataModule
from robust_lightning.data.sources import DataSets, DataSource, SetRequest
from robust_lightning.errors import UserError


class SolidColours(Dataset):
    """Images of one colour per class, as a decoded-file dataset hands them to the evaluation transform."""

    def __init__(self, count: int, transform):
        self.count, self.transform = count, transform

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict:
        from PIL import Image

        label = index % 3
        image = Image.new("RGB", (40, 40), ((255, 0, 0), (0, 255, 0), (0, 0, 255))[label])
        return {"image": self.transform(image), "label": label, "key": f"solid_{index}"}


class SolidColourSource(DataSource):
    """A source of a test's own: three classes of solid colours, built in memory."""

    kind = "solid"

    def __init__(self, images: int = 6):
        self.images = images

    def num_classes(self, requested: int | None) -> int:
        return requested or 3

    def build(self, request: SetRequest) -> DataSets:
        return DataSets(evaluation=SolidColours(self.images, request.evaluation))

    def location(self) -> str:
        return "memory"

    def conditions(self) -> dict:
        return {"images": self.images}


def test_a_new_source_is_one_class_chosen_in_the_config(tmp_path):
    """validate through the command line on a source class defined here: the data module needs no change. With a
    user's progress display and loader workers (tiny_config turns both off)."""
    config = tiny_config(
        tmp_path,
        **{"data.source": {"class_path": f"{__name__}.SolidColourSource", "init_args": {"images": 6}}},
        **{"model.arch": "test_resnet", "data.num_classes": 3},
        **{"trainer.enable_progress_bar": True, "data.num_workers": 2},
    )
    assert main(["validate", "--config", str(config)]) == 0
    results = next((tmp_path / "runs").rglob("results.json")).read_text()
    assert '"source": "solid"' in results and '"images": 6' in results


def test_each_source_takes_only_its_own_options(tmp_path):
    config = tiny_config(tmp_path)
    check = command_line_check()
    check(["validate", "--config", str(config), "--data.source.train_per_class", "2"])  # SyntheticSource's own
    with pytest.raises(UserError, match="train_shards"):  # ShardSource's option on the synthetic source
        check(["validate", "--config", str(config), "--data.source.train_shards", "/x"])
    data = ImageNetDataModule(source=SolidColourSource(4), image_size=16, num_workers=0)
    data.setup("validate")
    batch = next(iter(data.val_dataloader()))
    assert batch["image"].shape == (4, 3, 16, 16) and torch.equal(batch["label"], torch.tensor([0, 1, 2, 0]))


@pytest.mark.parametrize(
    ("old", "line"),
    [
        (
            ["--data.source", "folder", "--data.root", "/datasets/imagenet"],
            "--data.source folder --data.root /datasets/imagenet is now written --data.source FolderSource "
            "--data.source.root /datasets/imagenet (data.source names a class with its own options)",
        ),
        (
            ["--data.root", "/datasets/imagenet"],
            "--data.root /datasets/imagenet is now written --data.source FolderSource --data.source.root "
            "/datasets/imagenet (data.source names a class with its own options)",
        ),
        (
            ["--data.source", "FolderSource", "--data.source.roots", "/datasets/imagenet"],
            "data.source FolderSource takes no option roots; did you mean root?",
        ),
    ],
)
def test_an_old_or_misspelt_data_source_option_is_answered_by_one_line_naming_what_to_write(tmp_path, old, line):
    """The parser's own text ("Expected a path but folder either not accessible or invalid", a did-you-mean of
    unrelated keys) does not come before it."""
    result = run_cli("validate", "--config", str(tiny_config(tmp_path)), *old)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"robust-lightning validate: error: {line}"]


def test_a_misspelt_option_in_a_source_configs_init_args_names_the_option(tmp_path):
    typo = tmp_path / "typo.yaml"
    typo.write_text("data:\n  source:\n    class_path: FolderSource\n    init_args:\n      roots: /datasets/imagenet\n")
    result = run_cli("validate", "--config", str(tiny_config(tmp_path)), "--config", str(typo))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "robust-lightning validate: error: data.source FolderSource takes no option roots; did you mean root?"
    ]


@pytest.mark.parametrize(
    ("old", "line"),
    [
        (
            ["--data.synthetic.num_classes", "3"],
            "--data.synthetic.num_classes 3 is now written --data.source SyntheticSource --data.source.num_classes 3 "
            "(data.source names a class with its own options)",
        ),
        (
            ["--data.source=shards", "--data.train_shards=/x"],
            "--data.source shards --data.train_shards /x is now written --data.source ShardSource "
            "--data.source.train_shards /x (data.source names a class with its own options)",
        ),
        (
            ["--data.source", "FolderSource", "--data.root", "/d"],
            "--data.root /d is now written --data.source.root /d (data.source names a class with its own options)",
        ),
        (
            ["--config", "data: {root: /d}"],
            "data.root is now written data.source.root: in a config, data.source.class_path FolderSource and "
            "data.source.init_args.root",
        ),
        (
            ["--config", "data: {source: folder, root: /d}"],
            "data.source folder is now written data.source.class_path FolderSource, with its options (root, "
            "class_map, val_labels) under data.source.init_args",
        ),
        (
            ["--data.source.train_shards", "/x"],  # the config's SyntheticSource
            "data.source SyntheticSource takes no option train_shards; its options: num_classes, train_per_class, "
            "val_per_class, image_size, samples_per_shard, root",
        ),
    ],
)
def test_the_old_form_of_data_source_in_any_spelling_gets_the_new_one(tmp_path, old, line):
    """The same line from the parse-only check that the sweep runs on each cell's command."""
    config = tiny_config(tmp_path)
    if old[0] == "--config":
        (tmp_path / "old.yaml").write_text(old[1])
        old = ["--config", str(tmp_path / "old.yaml")]
    with pytest.raises(UserError) as error:
        command_line_check()(["validate", "--config", str(config), *old])
    assert str(error.value) == line
