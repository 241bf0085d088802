"""results.json: one machine-readable file per run with every metric and the conditions it was measured under.

Each command (fit, validate, test, and later each evaluation callback) writes its own section; sections are
merged into the file atomically, so a crash never leaves a half-written results.json and later sections
never erase earlier ones.
"""

import contextlib
import csv
import hashlib
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning import Callback
from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

import robust_lightning
from robust_lightning.atomic import atomic_write_json
from robust_lightning.data.batch import PredictedBatch
from robust_lightning.data.contract import evaluation_data
from robust_lightning.data.corrupt_report import CorruptImageReport
from robust_lightning.evaluation.evaluated_module import model_conditions
from robust_lightning.job_signals import JobStopped
from robust_lightning.paths import run_directory
from robust_lightning.trainer_attributes import callbacks_of

log = logging.getLogger(__name__)


RESULTS_FILE = "results.json"


class ResultsFile:
    """The one writer of a run's results.json. Each stage and evaluation hands it its section (``write``), and
    readers in the same process (the robustness card) read the sections from it (``sections``), not from disk.

    There is one writer per file in a process (``of``). Every write rewrites the whole file atomically, merged
    over what another process wrote to it since (an earlier session of the run, a sweep's bookkeeping)."""

    _writers: ClassVar[dict[Path, "ResultsFile"]] = {}

    def __init__(self, path: Path) -> None:
        self.path = path
        self._sections: dict[str, Any] = {}
        self._seen: tuple[int, int] | None = None  # (mtime_ns, size) of the file as this writer last saw it

    @classmethod
    def of(cls, run_dir: str | Path) -> "ResultsFile":
        """The writer of ``run_dir/results.json`` in this process."""
        path = (Path(run_dir) / RESULTS_FILE).absolute()
        if path not in cls._writers:
            cls._writers[path] = cls(path)
        return cls._writers[path]

    def _stamp(self) -> tuple[int, int] | None:
        try:
            status = self.path.stat()
        except FileNotFoundError:
            return None
        return status.st_mtime_ns, status.st_size

    @property
    def sections(self) -> dict[str, Any]:
        """The run's sections: those written here, and those another process wrote to the file."""
        stamp = self._stamp()
        if stamp != self._seen:
            self._sections = json.loads(self.path.read_text()) if stamp is not None else {}
            self._seen = stamp
        return self._sections

    def write(self, sections: dict[str, Any]) -> dict[str, Any]:
        """Add or replace ``sections`` (name: section) and write the file; returns all the run's sections."""
        content = self.sections
        content.update(sections)
        atomic_write_json(self.path, content, default=str)
        self._seen = self._stamp()
        return content


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def weights_sha256(module: torch.nn.Module) -> str:
    """sha256 of a module's parameters and buffers (names, dtypes, shapes and values): the weights actually
    evaluated, whether they came from a checkpoint file or from training in the same process."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        values = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name} {values.dtype} {tuple(tensor.shape)}".encode())
        digest.update(values.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def software_versions() -> dict[str, str]:
    """Versions of everything that shapes a number: the model and training stack, the image decoding and the
    corruptions (Pillow, OpenCV, numpy, SciPy, scikit-image), the reference AutoAttack. Keys are distribution
    names; OpenCV under whichever of its wheels is installed, and "opencv" the library's own version."""
    versions = {"python": platform.python_version(), "robust_lightning": robust_lightning.__version__}
    for package in (
        "torch",
        "torchvision",
        "lightning",
        "timm",
        "torchmetrics",
        "webdataset",
        "pillow",
        "numpy",
        "scipy",
        "scikit-image",
        "opencv-python-headless",
        "opencv-python",
        "opencv-contrib-python-headless",
        "opencv-contrib-python",
        "pyautoattack",
    ):
        with contextlib.suppress(PackageNotFoundError):
            versions[package] = version(package)
    try:
        import cv2  # noqa: PLC0415 (only for its version)

        versions["opencv"] = cv2.__version__
    except ImportError:
        pass
    versions["cuda"] = torch.version.cuda or "none"
    if torch.cuda.is_available():
        versions["gpu"] = torch.cuda.get_device_name()
    return versions


@runtime_checkable
class FitSummary(Protocol):
    """A callback whose summary of the fit goes into the fit's section of results.json under ``summary_key``
    (robust_lightning.training.throughput.Throughput)."""

    summary_key: str

    def summary(self) -> dict[str, Any] | None: ...


class RunResults(Callback):
    """Writes the run's metrics and conditions to ``<run dir>/results.json`` and prints a summary."""

    def __init__(self) -> None:
        self.started = time.time()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.started = time.time()

    def _conditions(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        data = evaluation_data(trainer)
        return {
            "command": " ".join(sys.argv),
            "model": model_conditions(pl_module),
            "data": data.conditions() if data is not None else None,
            "seed": int(os.environ.get("PL_GLOBAL_SEED", -1)),
            "precision": str(trainer.precision),
            "accelerator": type(trainer.accelerator).__name__,
            "world_size": trainer.world_size,
            "max_epochs": trainer.max_epochs,
            "versions": software_versions(),
        }

    def _write(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        section: str,
        extra: dict[str, Any],
        run_dir: Path | None = None,
    ) -> None:
        run_dir = run_dir or run_directory(trainer, every_rank=True)  # every rank is here
        if not trainer.is_global_zero:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        results = ResultsFile.of(run_dir)
        earlier = results.sections.get(section, {}).get("metrics", {}) if section == "fit" and trainer.ckpt_path else {}
        if set(earlier) - set(metrics):
            # A fit resumed in its run directory logs only what its own session measured: a fit stopped in a
            # validation or in its end-of-fit evaluation, resumed, trains no step, and one that had finished trains
            # nothing at all. The last value of each metric the run measured is the earlier session's where this one
            # did not measure it again.
            extra = {**extra, "metrics_from_an_earlier_session": sorted(set(earlier) - set(metrics))}
            metrics = {**earlier, **metrics}
        payload = {
            "metrics": dict(sorted(metrics.items())),
            **extra,
            "seconds": round(time.time() - self.started, 1),
            "conditions": self._conditions(trainer, pl_module),
        }
        callbacks = callbacks_of(trainer)
        corrupt = next((cb.totals for cb in callbacks if isinstance(cb, CorruptImageReport)), None)
        if corrupt:
            payload["corrupt_images"] = dict(corrupt)
        if section == "fit":  # e.g. images/s per device, step time, data-wait share (training.throughput)
            for callback in callbacks:
                if isinstance(callback, FitSummary) and (summary := callback.summary()):
                    payload[callback.summary_key] = summary
        counts = next((cb.image_counts for cb in callbacks if isinstance(cb, CorruptImageReport)), None)
        if counts:  # expected, read, corrupt and missing images of the last evaluation epoch
            payload["eval_image_counts"] = dict(counts)
        results.write({section: payload})
        shown = ", ".join(f"{k}={v:.4g}" for k, v in payload["metrics"].items() if not k.startswith("train/"))
        ended = (
            f"interrupted after {payload['seconds']:.0f}s"
            if "interrupted" in extra
            else f"finished in {payload['seconds']:.0f}s"
        )
        print(f"\n{section} {ended}: {shown or 'no metrics logged yet'}\nresults: {results.path.resolve()}", flush=True)

    def _checkpoint(self, path: str | Path | None) -> dict[str, str] | None:
        if not path or not Path(path).is_file():
            return None
        return {"path": str(Path(path).resolve()), "sha256": file_sha256(path)}

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        checkpoint = trainer.checkpoint_callback
        extra: dict[str, object] = {"epochs": trainer.current_epoch, "steps": trainer.global_step}
        if isinstance(checkpoint, ModelCheckpoint):
            extra["best_checkpoint"] = self._checkpoint(checkpoint.best_model_path)
            extra["best_score"] = None if checkpoint.best_model_score is None else float(checkpoint.best_model_score)
            extra["monitor"] = checkpoint.monitor
            extra["last_checkpoint"] = self._checkpoint(checkpoint.last_model_path)
        self._write(trainer, pl_module, "fit", extra)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """An interrupted fit (SIGTERM, Ctrl-C) still leaves its results.json: what it reached, marked interrupted."""
        interrupted = isinstance(exception, SIGTERMException) or (
            isinstance(exception, KeyboardInterrupt) and trainer.world_size == 1
        )  # Ctrl-C: one rank only
        if interrupted and trainer.state.fn == "fit" and trainer.is_global_zero:
            checkpoint = trainer.checkpoint_callback
            last = checkpoint.last_model_path if isinstance(checkpoint, ModelCheckpoint) else None
            stop = exception if isinstance(exception, JobStopped) else None
            if stop is not None and stop.checkpoint:  # what the stop saved (robust_lightning.training.interruption)
                last = stop.checkpoint
            self._write(
                trainer,
                pl_module,
                "fit",
                run_dir=run_directory(trainer),  # no collective: the ranks may have stopped at other steps
                extra={
                    "interrupted": (
                        "SIGINT"
                        if (stop is None and isinstance(exception, KeyboardInterrupt)) or (stop and stop.ctrl_c)
                        else "SLURM requeue"
                        if stop is not None and stop.requeue
                        else "SIGTERM"
                    ),
                    "epochs": trainer.current_epoch,
                    "steps": trainer.global_step,
                    "last_checkpoint": self._checkpoint(last),
                },
            )

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "validate":
            self._write(trainer, pl_module, "validate", {"checkpoint": self._checkpoint(trainer.ckpt_path)})

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer, pl_module, "test", {"checkpoint": self._checkpoint(trainer.ckpt_path)})


class PredictionWriter(BasePredictionWriter):
    """Writes ``predict`` output as CSV, one file per rank: key, label, top-5 classes and probabilities."""

    def __init__(self) -> None:
        super().__init__(write_interval="batch")

    @staticmethod
    def run_dir(trainer: pl.Trainer) -> Path:
        return run_directory(trainer)  # no collective: ranks may predict different batch counts

    def write_on_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        prediction: PredictedBatch,
        batch_indices: Sequence[int] | None,
        batch: object,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        run_dir = self.run_dir(trainer)
        path = run_dir / f"predictions-rank{trainer.global_rank}.csv"
        new = batch_idx == 0
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(path, "w" if new else "a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(["key", "label", "top5", "top5_prob"])
            for key, label, top, prob in zip(
                prediction["key"],
                prediction["label"].tolist(),
                prediction["top5"].tolist(),
                prediction["top5_prob"].tolist(),
            ):
                writer.writerow([key, label, " ".join(map(str, top)), " ".join(f"{p:.5f}" for p in prob)])

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            # a line of its own: a progress bar may still hold the current one
            print(f"\npredictions: {self.run_dir(trainer).resolve()}/predictions-rank*.csv", flush=True)
