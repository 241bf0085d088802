"""A data source is one class and its contract is checked (robust_lightning.data.sources): the data module counts
what a source built against the holdout, evaluation subset and limit it asked for and refuses a source that left one
out; any sized IterableDataset streams; the resume identities record every source's location; and nothing outside
the sources asks which class a source is."""

import ast
import itertools
import json
from types import SimpleNamespace

import pytest
from PIL import Image
from torch.utils.data import Dataset, IterableDataset

from helpers import REPO, tiny_config
from robust_lightning.cli import main
from robust_lightning.data.datamodule import ImageNetDataModule
from robust_lightning.data.loaders import StreamTrainLoader
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


class Stream(IterableDataset):
    """The given images in order, endless for training: a sized stream that is not a ShardStream."""

    def __init__(self, indices: list[int], transform, endless: bool):
        self.indices, self.transform, self.endless = indices, transform, endless

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self):
        order = itertools.cycle(self.indices) if self.endless else self.indices
        return (solid(index, self.transform) for index in order)


class StreamSource(ListedSource):
    kind = "stream"

    def build(self, request: SetRequest) -> DataSets:
        train, evaluation = self.indices(request)
        return DataSets(
            train=Stream(train, request.training, endless=True) if request.needs_train else None,
            evaluation=Stream(evaluation, request.evaluation, endless=False),
        )


def _data(source: DataSource, **options) -> ImageNetDataModule:
    # No loader workers: these tests count what a source builds, and the test's Stream does not split itself between
    # workers (a real stream must; docs/training.md). Loaders with workers, a user's default, read the built-in
    # sources in tests/test_data_sources.py and the end-to-end tests.
    return ImageNetDataModule(source=source, image_size=16, batch_size=4, num_workers=0, **options)


def _evaluated(data: ImageNetDataModule) -> list[str]:
    return [key for batch in data.val_dataloader() for key in batch["key"]]


def _subset_file(tmp_path) -> str:
    path = tmp_path / "subset.txt"
    path.write_text("".join(f"{name(i)}\n" for i in (105, 100, 104)))
    return str(path)


def test_a_source_that_applies_the_holdout_the_subset_and_the_limit_is_accepted(tmp_path):
    held = _data(ListedSource(), holdout=3)
    held.setup("fit")
    assert held.sets.training()[1] == 9 and _evaluated(held) == ["9", "10", "11"]
    listed = _data(ListedSource(), eval_subset=_subset_file(tmp_path))
    listed.setup("test")
    assert _evaluated(listed) == ["105", "100", "104"] and listed.expected_eval_image_count() == 3
    limited = _data(ListedSource(), eval_limit=5)
    limited.setup("test")
    assert _evaluated(limited) == ["100", "101", "102", "103", "104"]


@pytest.mark.parametrize(
    ("ignored", "options", "stage", "line"),
    [
        (
            "holdout",
            {"holdout": 3},
            "fit",
            "data.source ListedSource ignored data.holdout 3: it built 8 evaluation images",
        ),
        (
            "subset",
            {"eval_subset": "SUBSET"},
            "test",
            "data.source ListedSource ignored data.eval_subset: it built 8 evaluation images for the 3 listed",
        ),
        (
            "limit",
            {"eval_limit": 5},
            "test",
            "data.source ListedSource ignored data.eval_limit 5: it built 8 evaluation images",
        ),
    ],
)
def test_a_source_that_ignores_the_holdout_the_subset_or_the_limit_is_refused(tmp_path, ignored, options, stage, line):
    options = {key: _subset_file(tmp_path) if value == "SUBSET" else value for key, value in options.items()}
    data = _data(ListedSource(ignores=ignored), **options)
    with pytest.raises(UserError) as error:
        data.setup(stage)
    assert str(error.value) == line


def test_the_refusal_is_one_line_of_the_command(tmp_path, capsys):
    config = tiny_config(
        tmp_path,
        **{"data.source": {"class_path": f"{__name__}.ListedSource", "init_args": {"ignores": "limit"}}},
        **{"model.arch": "test_resnet", "data.num_classes": 3, "data.eval_limit": 5},
    )
    assert main(["validate", "--config", str(config)]) == 2
    refusals = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert refusals == [
        "robust-lightning: error: data.source ListedSource ignored data.eval_limit 5: it built 8 evaluation images"
    ]


def test_any_sized_iterable_dataset_streams(tmp_path):
    """Evaluation reads the stream without a sampler (one the map-style path would give it is refused by torch),
    its length is the count the limit is checked against; training cuts the endless stream into epochs of
    training images // global batch steps."""
    data = _data(StreamSource(), eval_limit=5)
    data.setup("fit")
    assert _evaluated(data) == ["100", "101", "102", "103", "104"] and data.expected_eval_image_count() == 5
    train = data.train_dataloader()
    assert isinstance(train, StreamTrainLoader) and len(train) == 3
    batches = list(train)
    assert [batch["draw"] for batch in batches] == [(0, 0), (0, 1), (0, 2)]
    assert [key for batch in batches for key in batch["key"]] == [str(i) for i in range(12)]
    sample = data.training_sample("cpu", max_images=6)
    assert sample.images == 6 and sum(len(batch["label"]) for batch in sample.batches) == 6
    with pytest.raises(UserError, match="StreamSource ignored data.eval_limit 5: it built 8 evaluation images"):
        _data(StreamSource(ignores="limit"), eval_limit=5).setup("test")


class Unsized(IterableDataset):
    def __init__(self, stream: Stream):
        self.stream = stream

    def __iter__(self):
        return iter(self.stream)


class UncountedSource(StreamSource):
    """A training stream that neither has a length nor reports its images: its steps per epoch are unknown."""

    def build(self, request: SetRequest) -> DataSets:
        sets = super().build(request)
        sets.train = Unsized(sets.train)
        return sets


def test_a_training_stream_of_unknown_length_is_refused():
    with pytest.raises(UserError) as error:
        _data(UncountedSource()).setup("fit")
    assert str(error.value) == (
        "data.source UncountedSource built a training stream that neither reports its images nor has a length"
    )


def test_a_resumed_epoch_of_a_stream_drops_the_batches_it_had_trained():
    data = _data(StreamSource())
    data.setup("fit")
    data.training_position.load_state_dict({"epoch": 0, "micro_batches": 2})
    batches = list(data.train_dataloader())
    assert [batch["draw"] for batch in batches] == [(0, 2)] and batches[0]["key"] == ["8", "9", "10", "11"]


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
