"""ImageNet-P (Hendrycks & Dietterich) as a Lightning callback:
``robust-lightning test --config configs/eval/imagenet_p.yaml --ckpt_path CKPT``.

Protocol, read from the reference code hendrycks/robustness (commit e0377d46, ImageNet-P/test.py and
video_loader.py, ImageNet-P/create_p/make_imagenet_p.py) and Hendrycks & Dietterich, ICLR 2019:

- Released layout ``<root>/<perturbation>/<wnid>/<ILSVRC2012_val_...>.mp4`` (test.py opens
  ``ImageNet-P/<perturbation>``; video_loader.py ``VideoFolder`` takes the ``.mp4`` files of the wnid folders).
  Noise perturbations also come at difficulty 2 and 3 in their own folders ``<perturbation>_<2|3>``
  (test.py, and the commented-out variants in make_imagenet_p.py); difficulty 1 is the benchmark (Hendrycks,
  hendrycks/robustness issue #23: "Most people only measure with difficulty 1").
- Frames: every frame of the video in order, BGR -> RGB (video_loader.py ``__getitem__``); they are 224 x 224
  already (make_imagenet_p.py: resize 256, centre crop 224, then perturb), so they are fed as decoded. A model at
  another resolution gets them resized (bicubic); results.json records it. Sequences have 31 frames (translate
  41); in the noise sequences frame 0 is the clean image (make_imagenet_p.py).
- 14 perturbations (test.py ``--perturbation`` choices): 10 test ones (gaussian_noise, shot_noise, motion_blur,
  zoom_blur, snow, brightness, translate, rotate, tilt, scale) and 4 validation ones (speckle_noise,
  gaussian_blur, spatter, shear), reported apart.
- Which frames are compared (test.py ``flip_prob`` and ``ranking_dist``): for the noise perturbations (names
  containing "noise": gaussian_noise, shot_noise, speckle_noise) every frame j >= 1 against frame 0; for the others
  each frame against the previous one (at difficulty d > 1: frame j against frame j - d, the frames d apart).
- Flip probability of a sequence = the share of compared pairs whose top-1 differs; top-5 distance of a pair
  (``dist(mode='top5')``, the paper's d(tau(x), tau(x')) = sum_{i=1..5} sum_{j=min(i,s(i))+1}^{max(i,s(i))}
  1(1 <= j-1 <= 5) with s(i) the rank in the later frame of the earlier frame's i-th class) reduces to
  sum_{i=1..5} |i - min(s(i), 6)|. Ranks are ordinal: ties go to the lower class index (``rankdata(method=
  'ordinal')`` on the negated logits; argmax also takes the first maximum). Both are averaged over the pairs of a
  sequence, then over the sequences of a perturbation (``result += np.mean(result_for_vid) / len(...)``).
- FR_p = FP_p / FP_p^AlexNet (AlexNet flip probabilities in data/imagenet_p_alexnet_flip_probs.csv, difficulty 1);
  mFR = mean FR over the 10 test perturbations. There are no published AlexNet top-5 distances, so T5D and
  mT5D (mean over the 10) are reported unnormalised: they are not the paper's AlexNet-normalised mT5D percentages.
  Over fewer than the 10, the means are reported as ``mfr_partial`` / ``mt5d_partial``.

Like ImageNetC: the layout is checked in ``on_test_start`` (a wrong root fails before any work), everything runs in
``on_test_end`` after the model's own test set, and under DDP the sequences are split over the ranks without
padding and gathered exactly (every sequence once). An unreadable video is skipped and named in results.json.
A sequence may also be stored as a folder of frame images (``<wnid>/<sequence>/<frames>``, in natural order of
the file names: img2 before img10).
"""

import csv
import importlib.util
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from PIL import Image
from torch.utils.data import Dataset

from robust_lightning.data.batch import CORRUPT
from robust_lightning.data.classes import class_map
from robust_lightning.errors import UserError
from robust_lightning.evaluation.base import Evaluation, evaluating, evaluation_resolution, new_figure, to_model_input
from robust_lightning.evaluation.benchmarks import IMAGE_SUFFIXES, choose
from robust_lightning.evaluation.prediction import (
    ExactSize,
    Loaded,
    Unreadable,
    rows_folder,
    run_exactly_once,
    samples_digest,
)
from robust_lightning.evaluation.results import weights_sha256
from robust_lightning.paths import DATA_DIR

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TEST = (
    "gaussian_noise",
    "shot_noise",
    "motion_blur",
    "zoom_blur",
    "snow",
    "brightness",
    "translate",
    "rotate",
    "tilt",
    "scale",
)
VALIDATION = ("speckle_noise", "gaussian_blur", "spatter", "shear")
ALL = TEST + VALIDATION
NOISE = tuple(p for p in ALL if "noise" in p)  # test.py: noise_perturbation = 'noise' in args.perturbation
DIFFICULTIES = (1, 2, 3)
VIDEO_SUFFIXES = (".mp4",)
TOP_K = 5

EXPECTED = (
    f"<root>/<perturbation>/<wnid>/<sequence>.mp4 (the released ImageNet-P layout; a sequence may also be "
    f"a folder of frame images <root>/<perturbation>/<wnid>/<sequence>/<frames>); noise perturbations at "
    f"difficulty 2 or 3 in <root>/<perturbation>_<difficulty>/; perturbations: {', '.join(ALL)}; "
    f"wnids: the ImageNet-1k class folders (n01440764 ...)"
)
MT5D_NOTE = (
    "mean top-5 distance, not AlexNet-normalised (no published AlexNet T5D constants): not comparable "
    "with the mT5D percentages of Hendrycks & Dietterich"
)


@cache
def alexnet_flip_probabilities() -> dict[str, float]:
    """AlexNet's flip probability per perturbation at difficulty 1 (the FR denominators), all 14."""
    with open(DATA_DIR / "imagenet_p_alexnet_flip_probs.csv", newline="") as f:
        table = {row["perturbation"]: float(row["alexnet_flip_prob"]) for row in csv.DictReader(f)}
    assert sorted(table) == sorted(ALL), "data/imagenet_p_alexnet_flip_probs.csv: unexpected perturbations"
    return table


# --------------------------------------------------------------------------------------------------- metrics
def comparison_pairs(num_frames: int, first_frame: bool, step: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(earlier, later) frame indices of the pairs a sequence is scored on: every frame against frame 0
    (``first_frame``, the noise perturbations), else every frame against the one ``step`` frames before."""
    later = torch.arange(1 if first_frame else step, num_frames)
    return (torch.zeros_like(later) if first_frame else later - step), later


def flip_probability(predictions: torch.Tensor, first_frame: bool, step: int = 1) -> torch.Tensor:
    """Per sequence, the share of compared frame pairs whose top-1 prediction differs.
    ``predictions``: (frames,) or (sequences, frames) class indices; returns () or (sequences,) float64."""
    earlier, later = comparison_pairs(predictions.shape[-1], first_frame, step)
    return (predictions[..., later] != predictions[..., earlier]).double().mean(-1)


def ranking(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(classes best first, 1-based rank of every class) along the last dim. Ordinal: of tied logits the lower
    class index ranks first, as scipy's rankdata(-logits, 'ordinal') in the reference and as argmax."""
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices
    positions = torch.arange(1, logits.shape[-1] + 1, device=logits.device).expand_as(order)
    return order, torch.empty_like(order).scatter_(-1, order, positions)


def top5_distance(logits: torch.Tensor, first_frame: bool, step: int = 1) -> torch.Tensor:
    """Per sequence, the mean top-5 distance over its compared frame pairs.
    ``logits``: (frames, classes) or (sequences, frames, classes); returns () or (sequences,) float64."""
    order, ranks = ranking(logits.float())
    earlier, later = comparison_pairs(logits.shape[-2], first_frame, step)
    # s(i): the rank in the later frame of the class ranked i in the earlier one
    s = ranks[..., later, :].gather(-1, order[..., earlier, :TOP_K])
    i = torch.arange(1, TOP_K + 1, device=logits.device)
    return (i - s.clamp(max=TOP_K + 1)).abs().sum(-1).double().mean(-1)


def sequence_scores(logits: torch.Tensor, first_frame: bool, step: int = 1) -> tuple[float, float]:
    """(flip probability, top-5 distance) of one sequence from its (frames, classes) logits."""
    predictions = logits.float().argmax(-1)  # the first maximum: the class ranked 1 by ``ranking``
    return flip_probability(predictions, first_frame, step).item(), top5_distance(logits, first_frame, step).item()


def perturbation_summary(scores: dict[str, dict[str, float | None]], difficulty: int = 1) -> dict[str, Any]:
    """FR per perturbation and the means, from ``scores[perturbation] = {"fp", "t5d"}`` (each the mean over the
    perturbation's sequences, None when none was readable).

    Returns {"fr": {p: FR or None}} plus "mfr" and "mt5d" when all 10 test perturbations are present, else
    "mfr_partial" / "mt5d_partial" = {"value", "perturbations"}; and, when validation perturbations are present,
    "validation" = {"perturbations", "mfr", "mt5d"} over them. A mean is None when a value it needs is. FR needs
    difficulty 1 (the AlexNet constants' difficulty)."""
    alexnet = alexnet_flip_probabilities()
    fr = {p: None if difficulty != 1 or s["fp"] is None else s["fp"] / alexnet[p] for p, s in scores.items()}

    def mean(values: dict[str, float | None], names: list[str]) -> float | None:
        picked = [values[p] for p in names]
        known = [v for v in picked if v is not None]
        return None if not picked or len(known) < len(picked) else sum(known) / len(known)

    t5d = {p: s["t5d"] for p, s in scores.items()}
    test, validation = [p for p in TEST if p in scores], [p for p in VALIDATION if p in scores]
    result: dict[str, Any] = {"fr": fr}
    if len(test) == len(TEST):
        result.update(mfr=mean(fr, test), mt5d=mean(t5d, test))
    else:  # a different key, so a partial number is never mistaken for the benchmark's mFR
        result.update(
            mfr_partial={"value": mean(fr, test), "perturbations": test},
            mt5d_partial={"value": mean(t5d, test), "perturbations": test},
        )
    if validation:
        result["validation"] = {"perturbations": validation, "mfr": mean(fr, validation), "mt5d": mean(t5d, validation)}
    return result


# ---------------------------------------------------------------------------------------------------- layout
def _natural_key(name: str) -> list[int | str]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _subfolders(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir())


def perturbation_folder(perturbation: str, difficulty: int) -> str:
    """The released folder name: noise perturbations above difficulty 1 have their own ``<name>_<d>`` folders;
    the others use the same videos and compare frames ``difficulty`` apart."""
    return f"{perturbation}_{difficulty}" if perturbation in NOISE and difficulty > 1 else perturbation


def imagenet_p_sequences(
    root: str | Path, perturbations: list[str], difficulty: int = 1, max_per_perturbation: int | None = None
) -> dict[str, list[str]]:
    """The sequences (video files or frame folders) of every requested perturbation, sorted by wnid and name.
    ``max_per_perturbation``: keep that many, evenly spaced over the sorted list. Raises UserError on any layout
    problem, naming the layout expected."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"ImageNet-P root {root} does not exist; expected {EXPECTED}")
    known = {perturbation_folder(p, d) for p in ALL for d in DIFFICULTIES}
    found = [p.name for p in _subfolders(root) if p.name in known]
    if not found:
        raise UserError(f"ImageNet-P root {root} holds no perturbation folders; expected {EXPECTED}")
    folders = {p: perturbation_folder(p, difficulty) for p in perturbations}
    missing = [name for name in folders.values() if name not in found]
    if missing:
        raise UserError(
            f"ImageNet-P root {root}: perturbation folders {missing} not found (found {found}); expected {EXPECTED}"
        )
    wnids = class_map("imagenet")
    sequences = {}
    for perturbation, name in folders.items():
        folder = root / name
        classes = _subfolders(folder)
        unknown = [c.name for c in classes if c.name not in wnids]
        if not classes or unknown:
            what = f"unknown wnid folders {unknown[:5]}" if unknown else "no wnid folders"
            raise UserError(f"{folder}: {what}; expected {EXPECTED}")
        found_here = [
            str(p)
            for c in classes
            for p in sorted(c.iterdir(), key=lambda p: _natural_key(p.name))
            if p.suffix.lower() in VIDEO_SUFFIXES or p.is_dir()
        ]
        if not found_here:
            raise UserError(f"{folder} holds no .mp4 sequences; expected {EXPECTED}")
        if max_per_perturbation is not None and len(found_here) > max_per_perturbation:
            found_here = [found_here[i * len(found_here) // max_per_perturbation] for i in range(max_per_perturbation)]
        sequences[perturbation] = found_here
    return sequences


# ---------------------------------------------------------------------------------------------------- frames
def read_frames(path: str) -> list[Image.Image]:
    """Every frame of a video (OpenCV, decoded in order, BGR -> RGB) or of a folder of frame images."""
    if Path(path).is_dir():
        files = sorted(
            (p for p in Path(path).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES), key=lambda p: _natural_key(p.name)
        )
        return [Image.open(p) for p in files]
    import cv2  # noqa: PLC0415 (only the video path needs OpenCV)

    capture = cv2.VideoCapture(path)
    frames = []
    try:
        if not capture.isOpened():
            raise ValueError("OpenCV cannot open it as a video")
        while True:
            ok, frame = capture.read()
            if not ok:
                break
            frames.append(Image.fromarray(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)))
    finally:
        capture.release()
    return frames


class SequenceList(Dataset[Loaded]):
    """One item per sequence: its frames as a (frames, 3, H, W) uint8 tensor, or the reason it is unreadable."""

    def __init__(self, paths: list[str], transform: Callable[[Image.Image], torch.Tensor]):
        self.paths, self.transform = paths, transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Loaded:
        path = self.paths[index]
        try:
            images = read_frames(path)
            if len(images) < 2:
                raise ValueError(f"{len(images)} frame(s) decoded, a sequence needs at least 2")
            size = images[0].size
            frames = torch.stack([self.transform(image) for image in images])
        except Exception as e:  # one unreadable video must not cost the whole benchmark: skip it, and name it
            return {CORRUPT: f"{path} ({type(e).__name__}: {e})", "index": index}
        return {"frames": frames, "index": index, "size": size}


def collate_sequences(items: list[Loaded]) -> Loaded:
    """Like prediction.collate_readable, but sequences differ in length (translate has 41 frames, a damaged video
    fewer): their frames are concatenated, with the length of each."""
    good = [item for item in items if "frames" in item]
    return {
        "frames": torch.cat([item["frames"] for item in good]) if good else None,
        "length": [len(item["frames"]) for item in good],
        "index": [item["index"] for item in good],
        "size": [item["size"] for item in good],
        CORRUPT: [(item["index"], item[CORRUPT]) for item in items if CORRUPT in item],
    }


# A scored sequence: (index, flip probability, top-5 distance, frames, frame size)
Scored = tuple[int, float, float, int, tuple[int, int]]


@dataclass
class SequenceScores:
    """Per readable sequence, in dataset order: index, flip probability, top-5 distance, number of frames."""

    index: torch.Tensor
    fp: torch.Tensor
    t5d: torch.Tensor
    frames: torch.Tensor
    corrupt: list[tuple[int, str]]  # (index, reason) of the unreadable sequences
    sizes: list[tuple[int, int]]  # the distinct frame sizes (width, height) as decoded


def score_sequences(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    paths: list[str],
    rules: list[tuple[bool, int]],
    transform: Callable[[Image.Image], torch.Tensor],
    *,
    batch_size: int,
    num_workers: int,
    records: Path | None = None,
) -> SequenceScores:
    """Flip probability and top-5 distance of every readable sequence, over all ranks, each exactly once.
    ``rules[i]``: (compare with the first frame, step) of sequence i. ``batch_size`` counts sequences."""

    def step(batch: Loaded) -> tuple[list[Scored], list[Unreadable]]:
        if batch["frames"] is None:
            return [], []
        rows: list[Scored] = []
        too_short: list[Unreadable] = []
        with trainer.precision_plugin.test_step_context():
            logits: torch.Tensor = pl_module(to_model_input(batch["frames"], pl_module.device))
        for index, length, size, sequence in zip(
            batch["index"], batch["length"], batch["size"], torch.split(logits, batch["length"])
        ):
            first_frame, step = rules[index]
            if not first_frame and length <= step:
                too_short.append((index, f"{paths[index]} ({length} frames: none {step} apart to compare)"))
                continue
            rows.append((index, *sequence_scores(sequence, first_frame, step), length, tuple(size)))
        return rows, too_short

    rows, corrupt = run_exactly_once(
        trainer,
        SequenceList(paths, transform),
        collate_sequences,
        step,
        batch_size=batch_size,
        num_workers=num_workers,
        desc="imagenet_p",
        what="sequences",
        records=records,
    )
    columns = list(zip(*rows)) if rows else [(), (), (), (), ()]
    return SequenceScores(
        torch.tensor(columns[0], dtype=torch.long),
        torch.tensor(columns[1], dtype=torch.double),
        torch.tensor(columns[2], dtype=torch.double),
        torch.tensor(columns[3], dtype=torch.long),
        corrupt,
        sorted(set(columns[4])),
    )


# -------------------------------------------------------------------------------------------------- callback
class ImageNetP(Evaluation):
    """ImageNet-P flip probability, flip rate (FR, mFR) and top-5 distance (T5D, mT5D) after ``test`` (see the
    module docstring).

    Args:
        root: the released ImageNet-P folder (see ``EXPECTED``).
        perturbations: "standard" (the 10 test perturbations of mFR, default), "all" (the 10 + the 4 validation
            ones, reported apart) or a list of names.
        difficulty: 1 (the benchmark, default), 2 or 3. Noise perturbations read ``<name>_<difficulty>``, the others
            compare frames ``difficulty`` apart. FR needs difficulty 1 (the AlexNet constants').
        image_size: evaluation resolution (default: the model's ``image_size``, else the data's, else 224).
            Frames are resized (bicubic, to image_size x image_size) only when it is not their size.
        batch_size: sequences per forward pass on each device (a sequence is 31 frames, translate 41).
        num_workers: decoding processes per device.
        max_videos_per_perturbation: evaluate only n sequences per perturbation, evenly spaced over the
            (class-sorted) list: a quick look, labelled in results.json, not comparable with published numbers.
        plot: save a bar plot of FP (beside AlexNet's) and T5D per perturbation (imagenet_p.png beside
            results.json; also logged to W&B when a WandbLogger is present).
    """

    name = "imagenet_p"

    def __init__(
        self,
        root: str,
        perturbations: str | list[str] = "standard",
        difficulty: int = 1,
        image_size: int | None = None,
        batch_size: int = 8,
        num_workers: int = 4,
        max_videos_per_perturbation: int | None = None,
        plot: bool = True,
    ):
        perturbations = choose(perturbations, TEST, ALL, "ImageNetP perturbations")
        if difficulty not in DIFFICULTIES:
            raise UserError(f"ImageNetP difficulty must be 1, 2 or 3, got {difficulty}")
        if max_videos_per_perturbation is not None and max_videos_per_perturbation < 1:
            raise UserError(
                f"ImageNetP max_videos_per_perturbation must be a positive number, got {max_videos_per_perturbation}"
            )
        self.root = root
        self.perturbations = perturbations
        self.difficulty, self.image_size = difficulty, image_size
        self.batch_size, self.num_workers = batch_size, num_workers
        self.max_videos, self.plot = max_videos_per_perturbation, plot

    def _comparison(self, perturbation: str) -> tuple[bool, int]:
        """(compare with the first frame, step) of a perturbation's sequences."""
        return (True, 1) if perturbation in NOISE else (False, self.difficulty)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check the whole layout before any work: a wrong root fails the run at once, not hours in."""
        self.sequences = imagenet_p_sequences(self.root, self.perturbations, self.difficulty, self.max_videos)
        videos = any(Path(s).suffix.lower() in VIDEO_SUFFIXES for paths in self.sequences.values() for s in paths)
        if videos and importlib.util.find_spec("cv2") is None:
            raise UserError(
                "ImageNet-P videos are decoded with OpenCV: pip install opencv-python-headless (or opencv-python)"
            )
        self.resolution = evaluation_resolution(trainer, pl_module, self.image_size)

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # one dataset over every perturbation: one loader, one gather; perturbation_of maps a sequence back
        paths = [s for p in self.perturbations for s in self.sequences[p]]
        perturbation_of = [p for p in self.perturbations for _ in self.sequences[p]]
        rules = [self._comparison(p) for p in perturbation_of]
        # the sequences and how each is compared (with the first frame or the previous one, and the step)
        sequences = samples_digest((path, *rule) for path, rule in zip(paths, rules))
        settings = {"sequences": sequences, "image_size": self.resolution}
        with evaluating(pl_module):
            scores = score_sequences(
                trainer,
                pl_module,
                paths,
                rules,
                ExactSize(self.resolution),
                batch_size=self.batch_size,
                num_workers=self.num_workers,
                records=rows_folder(trainer, "imagenet_p", weights_sha256(pl_module), settings),
            )
        if not trainer.is_global_zero:
            self.publish(trainer, None, None)  # the run directory is agreed over all ranks
            return
        section = self._section(trainer, paths, perturbation_of, scores)
        figure = self._plot(section) if self.plot else None
        if figure is None:
            section["plot"] = "not requested"
        # a table per perturbation, beside the scalars and the plot
        columns = ["split", "num_sequences", "fp", "alexnet_fp", "fr", "t5d"]
        table = (
            ["perturbation", *columns],
            [[p, *(v[k] for k in columns)] for p, v in section["perturbations"].items()],
        )
        mfr = section.get("mfr", (section.get("mfr_partial") or {}).get("value"))
        mt5d = section.get("mt5d", (section.get("mt5d_partial") or {}).get("value"))
        partial = "" if "mfr" in section else "partial "
        self.publish(
            trainer,
            section,
            flat_metrics(section),
            figure,
            {"per_perturbation": table},
            f"imagenet_p: {partial}mFR {mfr}, {partial}mT5D (unnormalised) {mt5d}",
        )

    def _section(
        self, trainer: pl.Trainer, paths: list[str], perturbation_of: list[str], scores: SequenceScores
    ) -> dict[str, Any]:
        of = [perturbation_of[i] for i in scores.index.tolist()]
        corrupt: dict[str, list[str]] = {p: [] for p in self.perturbations}
        for index, reason in scores.corrupt:
            corrupt[perturbation_of[index]].append(reason)
        alexnet = alexnet_flip_probabilities()
        per_perturbation, means, unusual = {}, {}, []
        for p in self.perturbations:
            mine = torch.tensor([q == p for q in of], dtype=torch.bool)
            n, frames = int(mine.sum()), scores.frames[mine]
            means[p] = {
                "fp": scores.fp[mine].mean().item() if n else None,
                "t5d": scores.t5d[mine].mean().item() if n else None,
            }
            first_frame, step = self._comparison(p)
            per_perturbation[p] = {
                "split": "test" if p in TEST else "validation",
                "folder": perturbation_folder(p, self.difficulty),
                "compared": (
                    "every frame with the first"
                    if first_frame
                    else "consecutive frames"
                    if step == 1
                    else f"frames {step} apart"
                ),
                "num_sequences": n,
                "num_frames": {"min": int(frames.min()), "max": int(frames.max())} if n else None,
                "fp": means[p]["fp"],
                "alexnet_fp": alexnet[p] if self.difficulty == 1 else None,
                "t5d": means[p]["t5d"],
                "corrupt_files": corrupt[p],
            }
            if n:  # a truncated video decodes fewer frames than the others of its perturbation: name it
                usual = Counter(frames.tolist()).most_common(1)[0][0]
                unusual += [
                    f"{paths[i]} ({f} frames, most have {usual})"
                    for i, f in zip(scores.index[mine].tolist(), frames.tolist())
                    if f != usual
                ]
        summary = perturbation_summary(means, self.difficulty)
        for p in self.perturbations:
            per_perturbation[p]["fr"] = summary["fr"][p]
        r = self.resolution
        return {
            "root": str(Path(self.root).resolve()),
            "difficulty": self.difficulty,
            "perturbations": per_perturbation,
            **{k: v for k, v in summary.items() if k != "fr"},
            "mt5d_note": MT5D_NOTE,
            "num_sequences": len(scores.index),
            "corrupt_files": [reason for _, reason in scores.corrupt],
            "unusual_length": unusual,
            "preprocessing": (
                "none (frames fed as decoded)"
                if scores.sizes in ([(r, r)], [])
                else f"resize {' / '.join(f'{w} x {h}' for w, h in scores.sizes)} to {r} x {r} (bicubic)"
            ),
            "conditions": {
                "image_size": r,
                "frame_sizes": [list(s) for s in scores.sizes],
                "difficulty": self.difficulty,
                "subsampled": self.max_videos is not None,
                "max_videos_per_perturbation": self.max_videos,
                "alexnet_flip_probabilities": "data/imagenet_p_alexnet_flip_probs.csv",
                "checkpoint": trainer.ckpt_path,
            },
        }

    @staticmethod
    def _plot(section: dict[str, Any]) -> "Figure":
        names = list(section["perturbations"])
        values = section["perturbations"]
        x = torch.arange(len(names)).numpy()
        fig, (left, right) = new_figure(1, 2, figsize=(max(8, 0.9 * len(names)), 4))
        left.bar(x - 0.2, [values[p]["fp"] or 0 for p in names], 0.4, label="this model")
        left.bar(x + 0.2, [values[p]["alexnet_fp"] or 0 for p in names], 0.4, label="AlexNet")
        left.set_ylabel("flip probability")
        left.set_title("ImageNet-P flip probability (FR = model / AlexNet)")
        left.legend()
        right.bar(x, [values[p]["t5d"] or 0 for p in names])
        right.set_ylabel("top-5 distance (unnormalised)")
        right.set_title("ImageNet-P top-5 distance")
        for ax in (left, right):
            ax.set_xticks(x, names, rotation=60, ha="right")
        fig.tight_layout()
        return fig


def flat_metrics(section: dict[str, Any]) -> dict[str, float]:
    """The scalars of the results section as ``imagenet_p/...`` logger keys (None values left out)."""
    metrics = {}
    for key in ("mfr", "mt5d"):
        metrics[f"imagenet_p/{key}"] = section.get(key)
        metrics[f"imagenet_p/{key}_partial"] = (section.get(f"{key}_partial") or {}).get("value")
        metrics[f"imagenet_p/validation/{key}"] = (section.get("validation") or {}).get(key)
    for p, values in section["perturbations"].items():
        for key in ("fp", "fr", "t5d"):
            metrics[f"imagenet_p/{p}/{key}"] = values[key]
    return {k: float(v) for k, v in metrics.items() if v is not None}
