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
    "old",
    [
        ["--data.source", "folder", "--data.root", "/datasets/imagenet"],
        ["--data.root", "/datasets/imagenet"],
        ["--data.synthetic.num_classes", "3"],
    ],
)
def test_the_old_form_of_data_source_gets_a_message_with_the_new_one(tmp_path, old):
    result = run_cli("validate", "--config", str(tiny_config(tmp_path)), *old)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "data.source names a class with its own options: FolderSource (root" in result.stderr
    assert "--data.source FolderSource --data.source.root DIR" in result.stderr
