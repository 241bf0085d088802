"""The base of the evaluation callbacks: weights, images, gathering, eval mode, publishing, atomic writes, and the
the example evaluation of docs/contributing.md run through a Trainer on synthetic data."""

import json
import os
import re
from pathlib import Path

import pytest
import torch
from lightning import Trainer
from lightning.pytorch.loggers import CSVLogger

from helpers import REPO
from robust_lightning.atomic import atomic_folder_files, atomic_write_json, atomic_write_text, temporary_path
from robust_lightning.data.datamodule import ImageNetDataModule
from robust_lightning.data.samplers import rank_share
from robust_lightning.data.sources import SyntheticSource
from robust_lightning.errors import UserError
from robust_lightning.evaluation.base import Evaluation, evaluating, gather_objects, sum_over_ranks
from robust_lightning.evaluation.results import RunResults
from robust_lightning.training.lightning_module import ImageClassifier


def docs_example() -> dict:
    """The code block of "Writing a new evaluation" in docs/contributing.md, executed as it is written there."""
    text = (REPO / "docs" / "contributing.md").read_text()
    section = text[text.index("### Writing a new evaluation") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {"__name__": "docs_example"}
    exec(compile(code, "docs/contributing.md", "exec"), namespace)  # noqa: S102 (the repository's own docs)
    return namespace


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    return SyntheticSource(num_classes=4, train_per_class=4, val_per_class=5, image_size=32, root=str(root))


def datamodule(synthetic) -> ImageNetDataModule:
    return ImageNetDataModule(source=synthetic, image_size=32, batch_size=4, eval_batch_size=3, num_workers=0)


def run_test(tmp_path, synthetic, callbacks, module=None):
    torch.manual_seed(0)
    module = module or ImageClassifier(arch="test_resnet", num_classes=4, image_size=32)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=CSVLogger(tmp_path, name="run"),
        callbacks=callbacks,
        inference_mode=False,
    )
    trainer.test(module, datamodule=datamodule(synthetic))
    return trainer, module


def test_the_docs_example_measures_clean_top1_on_the_first_images(tmp_path, synthetic, capsys):
    example = docs_example()["CleanTop1"](max_images=7)
    trainer, module = run_test(tmp_path, synthetic, [RunResults(), example])
    # independently: the first 7 evaluation images through the data module's own loader
    data = datamodule(synthetic)
    data.setup("test")
    images, labels = zip(*((b["image"], b["label"]) for b in data.test_dataloader()))
    images, labels = torch.cat(images)[:7].float() / 255, torch.cat(labels)[:7]
    module.eval()
    with torch.no_grad():
        expected = (module.model(images).argmax(1) == labels).double().mean().item()
    run = Path(trainer.log_dir)
    results = json.loads((run / "results.json").read_text())
    assert results["clean_top1"] == {"images": 7, "acc1": pytest.approx(expected)}
    assert "test" in results  # the run's own section (written first) is kept beside it
    logged = (run / "metrics.csv").read_text().splitlines()
    assert "clean_top1/acc1" in logged[0]
    assert f"clean_top1: acc1={expected:.4g}; results: {(run / 'results.json').resolve()}" in capsys.readouterr().out


class Probe(Evaluation):
    """Records what the base gives it, and publishes a figure and a table."""

    name = "probe"

    def __init__(self, limit=None, weights="raw"):
        self.limit, self.weights = limit, weights

    def on_test_end(self, trainer, pl_module):
        self.batches = list(self.eval_batches(trainer, pl_module, limit=self.limit))
        with evaluating(pl_module):
            self.mode_inside = pl_module.training
        import matplotlib.pyplot as plt

        figure = plt.figure()
        self.published = self.publish(
            trainer,
            {"n": 1},
            {"probe/x": 2.0},
            figure,
            {"rows": (["a"], [[1]]), "empty": (["a"], [])},
            message="probe done",
        )


def test_eval_batches_are_unit_floats_on_the_device_up_to_the_limit(tmp_path, synthetic, capsys):
    probe = Probe(limit=5)
    trainer, module = run_test(tmp_path, synthetic, [probe])
    assert [len(b["key"]) for b in probe.batches] == [3, 2]  # eval_batch_size 3, cut at the limit
    images = torch.cat([b["image"] for b in probe.batches])
    assert images.dtype == torch.float32 and images.min() >= 0 and images.max() <= 1
    assert images.device == module.device and len(set(k for b in probe.batches for k in b["key"])) == 5
    assert probe.mode_inside is False
    run = Path(trainer.log_dir)
    section = json.loads((run / "results.json").read_text())["probe"]
    assert section["n"] == 1 and section["plot"] == str((run / "probe.png").resolve()) and (run / "probe.png").is_file()
    assert probe.published == section
    assert "probe done" in capsys.readouterr().out


def test_the_mode_is_restored_even_when_the_evaluation_fails():
    module = torch.nn.Linear(2, 2)
    module.train()
    with pytest.raises(RuntimeError), evaluating(module):
        assert not module.training
        raise RuntimeError("boom")
    assert module.training
    module.eval()
    with evaluating(module):
        pass
    assert not module.training


def test_weights_raw_or_ema():
    module = ImageClassifier(arch="test_resnet", num_classes=4, image_size=32)
    assert Probe().network(module) is module.model
    with pytest.raises(UserError, match="Probe.weights 'ema' needs a model trained with model.ema_decay"):
        Probe(weights="ema").network(module)
    ema = ImageClassifier(arch="test_resnet", num_classes=4, image_size=32, ema_decay=0.9)
    assert Probe(weights="ema").network(ema) is ema.ema.module


def test_one_process_gathers_itself_and_shares_split_exactly():
    assert gather_objects({"a": 1}) == [{"a": 1}]
    assert sum_over_ranks({"apgd-ce": 1.5}) == {"apgd-ce": 1.5}
    for total in (0, 1, 7, 10):
        for world in (1, 3, 4):
            shares = [rank_share(total, world, rank) for rank in range(world)]
            assert sum(shares) == total and max(shares) - min(shares) <= 1


def test_atomic_writes_replace_whole_files_and_leave_nothing_on_failure(tmp_path):
    path = tmp_path / "deep" / "results.json"
    atomic_write_json(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}

    class Unserialisable:
        pass

    with pytest.raises(TypeError):
        atomic_write_json(path, {"b": Unserialisable()})
    assert json.loads(path.read_text()) == {"a": 1}  # the old file, whole
    assert not temporary_path(path).exists() and sorted(p.name for p in path.parent.iterdir()) == ["results.json"]
    atomic_write_text(path, "x")
    assert path.read_text() == "x"


def test_a_folders_files_move_in_together_when_their_block_completes(tmp_path, monkeypatch):
    """atomic_folder_files: the staged files replace their namesakes only at the block's end (other files stay),
    an error in the block leaves the folder as it was and no staging folder, and "." is a folder like another."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "a.txt").write_text("old a")
    (folder / "keep.txt").write_text("kept")
    with pytest.raises(RuntimeError), atomic_folder_files(folder) as staging:
        (staging / "a.txt").write_text("new a")
        raise RuntimeError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert {p.name: p.read_text() for p in folder.iterdir()} == {"a.txt": "old a", "keep.txt": "kept"}
    monkeypatch.chdir(folder)
    with atomic_folder_files(".") as staging:
        (staging / "a.txt").write_text("new a")
        (staging / "b.txt").write_text("new b")
        assert (folder / "a.txt").read_text() == "old a" and staging.parent == folder
        assert staging.name.startswith(".")  # hidden
    assert {p.name: p.read_text() for p in folder.iterdir()} == {"a.txt": "new a", "b.txt": "new b", "keep.txt": "kept"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    # Ctrl-C right after the first rename: the other file follows all the same, so no write is left half-done
    replace, renames = os.replace, []

    def interrupted_after_the_first(source, target):
        replace(source, target)
        renames.append(target)
        if len(renames) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted_after_the_first)
    with pytest.raises(KeyboardInterrupt), atomic_folder_files(folder) as staging:
        (staging / "a.txt").write_text("third a")
        (staging / "b.txt").write_text("third b")
    assert {p.name: p.read_text() for p in folder.iterdir()} == {
        "a.txt": "third a",
        "b.txt": "third b",
        "keep.txt": "kept",
    }


def test_evaluations_ask_the_data_module_only_what_evaluation_data_lists():
    """Evaluations and analyses reach the data module only through ``evaluation_data(trainer)``, whose type is
    EvaluationData (mypy then allows only its members): no use of trainer.datamodule or datamodule_of in
    evaluation/ and analysis/, and no getattr/hasattr on what evaluation_data returns."""
    import ast  # noqa: PLC0415

    direct, through_the_contract = [], 0
    for path in sorted((REPO / "robust_lightning").glob("*/*.py")):
        if path.parent.name not in ("evaluation", "analysis"):
            continue
        tree = ast.parse(path.read_text())
        data_names = {
            target.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) == "evaluation_data"
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "datamodule":
                direct.append((path.name, node.lineno, "trainer.datamodule"))
            if isinstance(node, ast.Call):
                called = getattr(node.func, "id", None)
                through_the_contract += called == "evaluation_data"
                if called == "datamodule_of":
                    direct.append((path.name, node.lineno, "datamodule_of"))
                if called in ("getattr", "hasattr") and getattr(node.args[0], "id", None) in data_names:
                    direct.append((path.name, node.lineno, f"{called} on evaluation_data's result"))
    assert through_the_contract, "the check found no use at all: it is not looking where the evaluations are"
    assert direct == []
