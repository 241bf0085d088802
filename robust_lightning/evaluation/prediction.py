"""The prediction loop of the dataset benchmarks (distribution shifts, ImageNet-C, ImageNet-P): a list of files,
each rank its share, every item exactly once over all ranks, unreadable files skipped and named.

``run_exactly_once`` is the loop; ``predict_split`` runs it over a list of labelled images and returns each
image's prediction and confidence. Images reach the model in [0, 1] (``base.to_model_input``) under the
trainer's precision.

A benchmark's loop can take hours (ImageNet-C's 3.75 million images), longer than many jobs may run. Given a
folder (``rows_folder``), each rank appends each batch's rows and unreadable items to ``rank<r>.jsonl`` there
(fsynced) before the next batch, and the loop run again, e.g. by a requeued job, skips the items saved by any rank
of any earlier run. The folder is named by what the rows were computed with (the weights, the precision, the
benchmark's images and settings), so the same evaluation finds it and another one gets its own.
"""

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence, Sized
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from PIL import Image
from torch.utils.data import Dataset, Subset, default_collate
from torchvision.transforms import v2 as T

from robust_lightning.console import tqdm
from robust_lightning.data.batch import CORRUPT, IMAGE, LABEL
from robust_lightning.data.loaders import data_loader
from robust_lightning.data.samplers import ExactDistributedSampler
from robust_lightning.data.transforms import BICUBIC, ImageTransform, decode_rgb
from robust_lightning.evaluation.base import barrier, gather_objects, outcomes_parent, to_model_input, until_stopped
from robust_lightning.evaluation.outcomes import append_record, claim_directory
from robust_lightning.locking import LOCK_NAME, exclusive

# A row of the prediction loop: the item's dataset index, then what ``step`` measured of it
Row = TypeVar("Row", bound=tuple[int, *tuple[object, ...]])
Unreadable = tuple[int, str]  # (dataset index, reason) of an item that could not be read or scored
Loaded = dict[str, Any]  # an item, or a batch, of the loop's dataset (fields of the dataset's own choosing)


@dataclass
class Split:
    """A named list of (image path, integer label)."""

    name: str
    samples: list[tuple[str, int]]


class ImageList(Dataset[Loaded]):
    """(path, label) pairs -> {image, label, index}, or {corrupt: reason, index} for a file that cannot be read."""

    def __init__(self, samples: list[tuple[str, int]], transform: ImageTransform):
        self.samples, self.transform = samples, transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Loaded:
        path, label = self.samples[index]
        try:
            image = self.transform(Image.open(path))
        except Exception as e:  # one unreadable file must not cost the whole benchmark: skip it, and name it
            return {CORRUPT: f"{path} ({type(e).__name__}: {e})", "index": index}
        return {IMAGE: image, LABEL: label, "index": index}


def collate_readable(items: list[Loaded]) -> Loaded:
    """Batch the readable images; carry (index, reason) of the unreadable ones."""
    good = [item for item in items if IMAGE in item]
    batch: Loaded = default_collate(good) if good else {}
    batch[CORRUPT] = [(item["index"], item[CORRUPT]) for item in items if CORRUPT in item]
    return batch


class ExactSize:
    """Decode; resize to ``size`` x ``size`` (bicubic) only when the image is not that size already (the
    released ImageNet-C / -P / -9 images are 224 x 224 and are fed as they are at 224)."""

    def __init__(self, size: int):
        self.size = size
        self.resize = T.Resize((size, size), interpolation=BICUBIC)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        image = decode_rgb(image)
        if image.size != (self.size, self.size):
            image = self.resize(image)
        pixels: torch.Tensor = T.functional.pil_to_tensor(image)  # torchvision: untyped here
        return pixels


def _as_row(values: list[Any]) -> tuple[Any, ...]:
    """A row as the loop made it, from its JSON form: lists back to tuples, at every depth."""
    return tuple(_as_row(v) if isinstance(v, list) else v for v in values)


def read_rows(directory: Path) -> tuple[list[Any], list[Unreadable]]:
    """The rows and unreadable items saved in ``directory`` by every rank of every run, each item once; a line cut
    short by a kill is ignored (its batch is done again)."""
    rows: dict[int, Any] = {}
    corrupt: dict[int, str] = {}
    for path in sorted(directory.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                batch = json.loads(line)
            except json.JSONDecodeError:
                continue
            for row in batch["rows"]:
                rows.setdefault(row[0], _as_row(row))
            for index, reason in batch["corrupt"]:
                corrupt.setdefault(index, reason)
    return list(rows.values()), list(corrupt.items())


def rows_folder(trainer: pl.Trainer, benchmark: str, weights_hash: str, settings: dict[str, Any]) -> Path:
    """The folder where ``benchmark``'s prediction loop keeps its rows (module docstring): under
    ``<default_root_dir>/predictions`` (:func:`outcomes_parent`), named by a digest of the weights' sha256, the
    trainer's precision and ``settings`` (what else decides the rows: the images, their preprocessing), which its
    manifest.json records."""
    identity = {"benchmark": benchmark, "weights_sha256": weights_hash, "precision": str(trainer.precision)}
    text = json.dumps(identity | settings, sort_keys=True, default=str)
    identity = json.loads(text)  # as the manifest reads back (tuples as lists), to compare with it
    digest = hashlib.sha256(text.encode()).hexdigest()
    folder = outcomes_parent(trainer) / "predictions" / f"{benchmark}-{digest[:16]}"
    claim_directory(folder, identity, trainer.is_global_zero, benchmark, saved_records=lambda d: read_rows(d)[0])
    return folder


def samples_digest(samples: Iterable[Sequence[object]]) -> str:
    """sha256 of a list of items such as (path, label), a tab-separated line each: which images a benchmark's
    rows are of, and how they are read."""
    digest = hashlib.sha256()
    for sample in samples:
        digest.update(("\t".join(map(str, sample)) + "\n").encode())
    return digest.hexdigest()


@torch.no_grad()
def run_exactly_once(
    trainer: pl.Trainer,
    dataset: Dataset[Loaded],
    collate_fn: Callable[[list[Loaded]], Loaded],
    step: Callable[[Loaded], tuple[list[Row], list[Unreadable]]],
    *,
    batch_size: int,
    num_workers: int,
    desc: str,
    what: str = "images",
    records: Path | None = None,
) -> tuple[list[Row], list[Unreadable]]:
    """Run ``step`` on every batch of this rank's share of ``dataset`` and gather every rank's results.

    ``collate_fn`` puts (index, reason) of unreadable items under ``corrupt``; ``step(batch)`` returns (rows,
    more unreadable (index, reason)), each row a tuple starting with the item's dataset index. Returns (rows,
    unreadable) of all ranks, sorted by index, on every rank, having checked each index came exactly once.
    Ranks split the items without padding (``ExactDistributedSampler``; a rank may get none). ``records``: the
    folder (:func:`rows_folder`) whose saved items are taken as they are and to which each batch's are appended.
    """
    saved_rows, saved_corrupt = read_rows(records) if records is not None else ([], [])
    done = {row[0] for row in saved_rows} | {index for index, _ in saved_corrupt}
    items: Dataset[Loaded] = dataset
    if done:
        items = Subset(dataset, [i for i in range(len(cast(Sized, dataset))) if i not in done])
        rank_zero_info(f"{desc}: resuming, {len(done)} {what} already predicted in {records}")
    barrier(trainer)  # every rank has read the saved items before any adds to them
    sampler = ExactDistributedSampler(items, trainer.world_size, trainer.global_rank)
    # the data module's loaders: workers that leave the job's signals to this process, and restarted where one
    # never started
    loader = data_loader(items, batch_size, num_workers=num_workers, sampler=sampler, collate_fn=collate_fn)
    rows: list[Row] = []
    corrupt: list[Unreadable] = []
    with ExitStack() as lock:
        if records is not None and trainer.is_global_zero:  # another run writing the folder stops at once
            lock.enter_context(exclusive(records / LOCK_NAME, f"{desc} prediction folder {records}"))
        for batch in until_stopped(tqdm(loader, desc=desc, disable=not trainer.is_global_zero, leave=False)):
            more_rows, more_corrupt = step(batch)
            more_corrupt = [*batch[CORRUPT], *more_corrupt]
            if records is not None:
                append_record(
                    records / f"rank{trainer.global_rank}.jsonl", {"rows": more_rows, "corrupt": more_corrupt}
                )
            rows += more_rows
            corrupt += more_corrupt
    parts = gather_objects((rows, corrupt))
    rows = sorted([*saved_rows, *(row for part in parts for row in part[0])])
    corrupt = sorted([*saved_corrupt, *(item for part in parts for item in part[1])])
    seen = sorted([row[0] for row in rows] + [index for index, _ in corrupt])
    assert seen == list(range(len(cast(Sized, dataset)))), f"{what} lost or counted twice across ranks"
    return rows, corrupt


def predict(logits: torch.Tensor, classes: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(prediction, confidence = max softmax) from 1000-class logits. With ``classes`` (the 1000-class indices of a
    200-class benchmark) the logits are sliced first, so the prediction is a position among those classes."""
    if classes is not None:
        logits = logits[:, torch.tensor(classes, device=logits.device)]
    confidence, prediction = logits.float().softmax(1).max(1)
    return prediction, confidence


@dataclass
class Predictions:
    """Per readable image, in dataset order: its index in the dataset, label, prediction, confidence."""

    index: torch.Tensor
    label: torch.Tensor
    prediction: torch.Tensor
    confidence: torch.Tensor
    corrupt: list[str]  # the unreadable images, skipped and named


def predict_split(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    split: Split,
    transform: ImageTransform,
    classes: tuple[int, ...] | None,
    *,
    batch_size: int,
    num_workers: int,
    records: Path | None = None,
) -> Predictions:
    """Predictions for every readable image of ``split``, over all ranks, each image exactly once.
    ``classes``: logit indices the softmax and argmax are restricted to (prediction = position in them).
    ``records``: see :func:`run_exactly_once`."""

    def step(batch: Loaded) -> tuple[list[tuple[int, int, int, float]], list[Unreadable]]:
        if IMAGE not in batch:
            return [], []
        with trainer.precision_plugin.test_step_context():
            logits: torch.Tensor = pl_module(to_model_input(batch[IMAGE], pl_module.device))
            prediction, confidence = predict(logits, classes)
        return list(zip(batch["index"].tolist(), batch[LABEL].tolist(), prediction.tolist(), confidence.tolist())), []

    rows, corrupt = run_exactly_once(
        trainer,
        ImageList(split.samples, transform),
        collate_readable,
        step,
        batch_size=batch_size,
        num_workers=num_workers,
        desc=split.name,
        records=records,
    )
    index, label, prediction, confidence = (
        (torch.tensor(column) for column in zip(*rows))
        if rows
        else (torch.empty(0, dtype=torch.long),) * 3 + (torch.empty(0, dtype=torch.double),)
    )
    return Predictions(index, label, prediction, confidence.double(), [reason for _, reason in corrupt])
