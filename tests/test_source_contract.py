"""A data source is one class (robust_lightning.data.sources): the resume identities of saved outcomes record every
source's location, so that two datasets of one class do not share outcomes, and nothing outside the sources asks
which class a source is."""

import ast
import json
from types import SimpleNamespace

import pytest
from PIL import Image
from torch.utils.data import Dataset

from helpers import REPO
from robust_lightning.data.datamodule import ImageNetDataModule
from robust_lightning.data.sources import DataSets, DataSource, FolderSource, SetRequest, ShardSource, SyntheticSource
from robust_lightning.errors import UserError
from robust_lightning.evaluation.autoattack import AutoAttackEvaluation
from robust_lightning.evaluation.outcomes import append_record, claim_directory
from robust_lightning.evaluation.resolution import CLEAN, Cell, ResolutionSweep
from robust_lightning.official_differences import data_differences

COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}


def name(index: int) -> str:
    """An image's entry in an evaluation subset file: ``class_folder/file_name``."""
    return f"{list(COLOURS)[index % 3]}/{index}.png"


def solid(index: int, transform) -> dict:
    """Image ``index``: one colour per class, through the request's transform, as the project's datasets give it."""
    out = transform(Image.new("RGB", (40, 40), list(COLOURS.values())[index % 3]))
    return {**(out if isinstance(out, dict) else {"image": out}), "label": index % 3, "key": str(index)}


class Listed(Dataset):
    def __init__(self, indices: list[int], transform):
        self.indices, self.transform = indices, transform

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict:
        return solid(self.indices[index], self.transform)


class ListedSource(DataSource):
    """A source of the test's own: training images 0..train-1 and val images 100.., in memory. It applies the
    holdout (the last training images), the subset (by name, in the file's order) and the limit itself, except the
    one named by ``ignores``."""

    kind = "listed"

    def __init__(self, train: int = 12, val: int = 8, ignores: str | None = None, location: str = "memory"):
        self.train, self.val, self.ignores, self.where = train, val, ignores, location

    def num_classes(self, requested: int | None) -> int:
        return requested or 3

    def indices(self, request: SetRequest) -> tuple[list[int], list[int]]:
        """(training, evaluation) images for ``request``."""
        train, val = list(range(self.train)), list(range(100, 100 + self.val))
        if request.holdout and self.ignores != "holdout":
            train, held = train[: -request.holdout], train[-request.holdout :]
            if request.on_holdout:
                return train, held
        if request.subset is not None and self.ignores != "subset":
            by_name = {name(i): i for i in val}
            return train, [by_name[entry] for entry in request.subset]
        if request.limit and self.ignores != "limit":
            return train, val[: request.limit]
        return train, val

    def build(self, request: SetRequest) -> DataSets:
        train, evaluation = self.indices(request)
        return DataSets(
            train=Listed(train, request.training) if request.needs_train else None,
            evaluation=Listed(evaluation, request.evaluation),
        )

    def location(self) -> str:
        return self.where

    def conditions(self) -> dict:
        return {"images": self.train + self.val}


def _data(source: DataSource, **options) -> ImageNetDataModule:
    return ImageNetDataModule(source=source, image_size=16, batch_size=4, num_workers=0, **options)


def _trainer(location: str) -> SimpleNamespace:
    return SimpleNamespace(datamodule=_data(ListedSource(location=location)))


def test_two_datasets_of_one_class_have_different_resume_identities(tmp_path):
    attack = AutoAttackEvaluation(threat_models=[{"norm": "Linf", "eps": 4 / 255}], version="apgd-ce")
    threat = attack.threat_models[0]
    first, second = (attack._identity(_trainer(where), "0" * 64, threat) for where in ("lmdb-a", "lmdb-b"))
    assert (first["data_location"], second["data_location"]) == ("lmdb-a", "lmdb-b")
    sweep = ResolutionSweep(resolutions=[16])
    sweep.weights_sha256 = "0" * 64
    cell = Cell(16, CLEAN, None, tmp_path, None)
    first, second = (sweep._identity(_trainer(where), cell) for where in ("lmdb-a", "lmdb-b"))
    assert (first["data_location"], second["data_location"]) == ("lmdb-a", "lmdb-b")


OUTCOME = {"key": ["x"], "label": [0], "clean": [True], "robust": [False], "broken_by": ["apgd-ce"], "seconds": {}}


@pytest.mark.parametrize(
    ("earlier", "today", "resumes"),
    [
        # AutoAttack recorded a folder's root and the val shards under keys of their own, other sources' nothing
        ({"data_source": "folder", "data_root": "/a", "data_val_shards": None}, {"data_source": "folder"}, True),
        ({"data_source": "shards", "data_root": None, "data_val_shards": "/a"}, {"data_source": "shards"}, True),
        ({"data_source": "folder", "data_root": "/b", "data_val_shards": None}, {"data_source": "folder"}, False),
        ({"data_source": "synthetic", "data_root": None, "data_val_shards": None}, {"data_source": "synthetic"}, True),
        ({}, {"data_source": "folder"}, True),  # the resolution sweep recorded neither
    ],
)
def test_outcomes_saved_before_every_location_was_recorded_still_resume(tmp_path, earlier, today, resumes):
    folder = tmp_path / "Linf-4_255"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"n_iter": 5, **earlier}))
    append_record(folder / "rank0.jsonl", OUTCOME)
    identity = {"n_iter": 5, **today, "data_location": "/a"}
    if resumes:
        claim_directory(folder, identity, True, "AutoAttackEvaluation")
    else:
        with pytest.raises(UserError, match=r"holds outcomes of a different evaluation \(data_location differ\)"):
            claim_directory(folder, identity, True, "AutoAttackEvaluation")


def test_the_official_differences_come_from_the_source(tmp_path):
    line = "training images read from WebDataset shards"
    shards = ShardSource(val_shards=str(tmp_path / "val-{000000..000001}.tar"))
    for source, recorded in ((shards, True), (FolderSource(str(tmp_path)), False), (SyntheticSource(), False)):
        assert any(line in d for d in data_differences(ImageNetDataModule(source=source))) == recorded


SOURCE_CLASSES = (FolderSource, ShardSource, SyntheticSource)
NAMES = {cls.kind for cls in SOURCE_CLASSES} | {"tensors"}  # "tensors": robust_lightning.evaluate's images


def _kind(node: ast.AST) -> bool:
    """``x.kind``, or a recorded source's name: ``x["source"]``, ``x.get("source")``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "kind"
    key = node.slice if isinstance(node, ast.Subscript) else None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        key = node.args[0]
    return isinstance(key, ast.Constant) and key.value == "source"


def _branches_on_a_source(node: ast.AST) -> bool:
    """A comparison with a source's name for itself (read from it, or a local ``kind`` against a source's name), or
    an isinstance test against a source class."""
    if isinstance(node, ast.Compare):
        operands = [node.left, *node.comparators]
        named = {c.value for o in operands for c in [o, *getattr(o, "elts", [])] if isinstance(c, ast.Constant)}
        local = any(isinstance(o, ast.Name) and o.id == "kind" for o in operands) and bool(named & NAMES)
        return local or any(_kind(o) for o in operands)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
        classes = {cls.__name__ for cls in SOURCE_CLASSES}
        return any(isinstance(n, ast.Name) and n.id in classes for n in ast.walk(node))
    return False


def test_no_module_asks_which_class_a_source_is():
    """Only the sources' own module may tell them apart: every other module asks a source through its methods."""
    found = []
    for path in sorted((REPO / "robust_lightning").rglob("*.py")):
        if path == REPO / "robust_lightning" / "data" / "sources.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if _branches_on_a_source(node):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_the_check_finds_the_branches_it_is_for():
    for code in (
        'source.kind == "folder"',
        'kind == "shards"',
        'data.get("source") in ("folder", "shards")',
        "isinstance(s, ShardSource)",
    ):
        assert any(_branches_on_a_source(node) for node in ast.walk(ast.parse(code))), code
