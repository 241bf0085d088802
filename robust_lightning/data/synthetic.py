"""The built-in synthetic dataset: procedurally drawn shapes in WebDataset shards.

Each class is a shape or pattern (circle, square, stripes, ...): its identity is geometry only. Colours of
shape and background are drawn independently of the label, and position, size, rotation, background
gradient/texture/noise and small distractor marks vary per image, so a model has to learn shape. Every image
is a pure function of (seed, split, index), so the dataset is deterministic and generated in parallel.

The shards use the same format as the ImageFolder converter (robust_lightning.data.shards), with
``wnid`` = class name (e.g. ``circle``) and keys like ``synthetic_train_000123``.
"""

from __future__ import annotations

import fcntl
import io
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from robust_lightning.console import tqdm
from robust_lightning.data.shards import (
    MANIFEST_NAME,
    JSONObject,
    Sample,
    shard_name,
    write_json_atomic,
    write_manifest,
    write_shard,
)
from robust_lightning.errors import UserError
from robust_lightning.job_signals import pool_map
from robust_lightning.paths import DATA_DIR

# Bump when the drawing code changes, so existing datasets are regenerated.
GENERATOR_VERSION = 2
PARAMS_NAME = "params.json"
SPLIT_IDS = {"train": 0, "val": 1}  # part of each image's seed: train and val are independent draws
SUPERSAMPLE = 2  # shapes are drawn at 2x and box-filtered down, for anti-aliased edges

# Label order. Shapes whose rotated versions would look like another class (square/diamond, plus/x,
# horizontal/vertical stripes) only rotate by up to MAX_TILT degrees.
CLASS_NAMES = (
    "circle",
    "square",
    "triangle",
    "plus",
    "ring",
    "horizontal_stripes",
    "vertical_stripes",
    "checkerboard",
    "star",
    "diamond",
    "crescent",
    "x_mark",
)
MAX_TILT = 20.0


def synthetic_class_names(num_classes: int = 10) -> list[str]:
    """The class names of the synthetic dataset in label order."""
    if not 2 <= num_classes <= len(CLASS_NAMES):
        raise UserError(f"the synthetic dataset has 2 to {len(CLASS_NAMES)} classes, got num_classes={num_classes}")
    return list(CLASS_NAMES[:num_classes])


# --------------------------------------------------------------------------------------------------------------
# Drawing
# --------------------------------------------------------------------------------------------------------------


def _rect(x0: float, y0: float, x1: float, y1: float) -> np.ndarray:
    return np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]], dtype=float)


def _regular_star(points: int, inner: float) -> np.ndarray:
    angles = np.arange(2 * points) * math.pi / points - math.pi / 2
    radii = np.where(np.arange(2 * points) % 2 == 0, 1.0, inner)
    return np.stack([radii * np.cos(angles), radii * np.sin(angles)], axis=1)


def _shape_parts(name: str, rng: np.random.Generator) -> list[tuple[str, np.ndarray, int]]:
    """The shape in unit coordinates (radius ~1, centred at 0) as (kind, points, fill) drawing steps.

    kind is 'poly' (polygon vertices) or 'ellipse' (two opposite corners of its box); fill 255 draws the
    shape, 0 cuts a hole.
    """
    if name == "circle":
        return [("ellipse", np.array([[-1, -1], [1, 1]], dtype=float), 255)]
    if name == "ring":
        inner = rng.uniform(0.5, 0.65)
        return [
            ("ellipse", np.array([[-1, -1], [1, 1]], dtype=float), 255),
            ("ellipse", np.array([[-inner, -inner], [inner, inner]]), 0),
        ]
    if name == "crescent":
        shift = rng.uniform(0.45, 0.65)
        return [
            ("ellipse", np.array([[-1, -1], [1, 1]], dtype=float), 255),
            ("ellipse", np.array([[-1 + shift, -1.05], [1 + shift, 0.95]]), 0),
        ]
    if name == "square":
        return [("poly", _rect(-0.85, -0.85, 0.85, 0.85), 255)]
    if name == "diamond":
        width = rng.uniform(0.55, 0.75)  # a rhombus, narrower than tall, so it is not just a turned square
        return [("poly", np.array([[0, -1], [width, 0], [0, 1], [-width, 0]], dtype=float), 255)]
    if name == "triangle":
        return [("poly", _regular_star(3, 0.5)[::2] * 1.1 + [0, 0.2], 255)]
    if name == "star":
        return [("poly", _regular_star(5, rng.uniform(0.38, 0.5)), 255)]
    if name in ("plus", "x_mark"):
        arm = rng.uniform(0.22, 0.32)
        return [("poly", _rect(-1, -arm, 1, arm), 255), ("poly", _rect(-arm, -1, arm, 1), 255)]
    if name in ("horizontal_stripes", "vertical_stripes"):
        count = int(rng.integers(3, 5))
        edges = np.linspace(-0.9, 0.9, 2 * count)  # stripe, gap, stripe, ... ending with a stripe
        parts = [("poly", _rect(-0.9, edges[i], 0.9, edges[i + 1]), 255) for i in range(0, 2 * count - 1, 2)]
        if name == "vertical_stripes":
            parts = [(kind, pts[:, ::-1], fill) for kind, pts, fill in parts]
        return parts
    if name == "checkerboard":
        cells = int(rng.integers(3, 5))
        edges = np.linspace(-0.9, 0.9, cells + 1)
        return [
            ("poly", _rect(edges[i], edges[j], edges[i + 1], edges[j + 1]), 255)
            for i in range(cells)
            for j in range(cells)
            if (i + j) % 2 == 0
        ]
    raise ValueError(f"unknown synthetic class {name!r}")


def _rotation_degrees(name: str, rng: np.random.Generator) -> float:
    if name in ("circle", "ring", "crescent", "triangle", "star"):
        return rng.uniform(0, 360)
    base = 45.0 if name == "x_mark" else 0.0
    return base + rng.uniform(-MAX_TILT, MAX_TILT)


def _random_colour(rng: np.random.Generator) -> np.ndarray:
    return rng.uniform(0, 255, size=3).astype(np.float32)  # float32 keeps the per-pixel maths cheap


def _luma(colour: np.ndarray) -> float:
    return float(colour @ [0.299, 0.587, 0.114])


def _shape_mask(name: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """Anti-aliased coverage (size x size floats in [0, 1]) of one randomly placed, scaled and rotated shape."""
    big = size * SUPERSAMPLE
    radius = rng.uniform(0.22, 0.36) * big
    centre = rng.uniform(radius, big - radius, size=2)
    theta = math.radians(_rotation_degrees(name, rng))
    rotation = np.array([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]])
    mask = Image.new("L", (big, big), 0)
    draw = ImageDraw.Draw(mask)
    for kind, points, fill in _shape_parts(name, rng):
        if kind == "poly":
            xy = points @ rotation.T * radius + centre
            draw.polygon([tuple(p) for p in xy], fill=fill)
        else:  # an ellipse is rotated by moving its centre (circles need no rotation of their own)
            mid = (points[0] + points[1]) / 2
            half = (points[1] - points[0]) / 2 * radius
            c = rotation @ mid * radius + centre
            draw.ellipse([tuple(c - half), tuple(c + half)], fill=fill)
    return np.asarray(mask.reduce(SUPERSAMPLE), dtype=np.float32) / 255.0


def _distractors(image: Image.Image, rng: np.random.Generator, count: int) -> None:
    """Small random strokes and dots: clutter that carries no label information."""
    size = image.size[0]
    draw = ImageDraw.Draw(image)
    for _ in range(count):
        colour = tuple(int(c) for c in rng.integers(0, 256, size=3))
        x, y = rng.uniform(0, size, size=2)
        if rng.random() < 0.6:
            length, angle = rng.uniform(0.06, 0.2) * size, rng.uniform(0, 2 * math.pi)
            end = (x + length * math.cos(angle), y + length * math.sin(angle))
            draw.line([(x, y), end], fill=colour, width=int(rng.integers(1, 3)))
        else:
            r = rng.uniform(0.5, 0.04 * size + 0.5)
            draw.ellipse([x - r, y - r, x + r, y + r], fill=colour)


def render_image(label: int, size: int, rng: np.random.Generator) -> Image.Image:
    """One RGB image of class ``label`` drawn with the random stream ``rng``."""
    name = CLASS_NAMES[label]
    # Background: a gradient between two random colours, a smooth low-frequency texture, distractors.
    bg0, bg1 = _random_colour(rng), _random_colour(rng)
    angle = rng.uniform(0, 2 * math.pi)
    coords = (np.arange(size, dtype=np.float32) + 0.5) / size - 0.5
    ramp = (coords[None, :] * math.cos(angle) + coords[:, None] * math.sin(angle)) + 0.5
    background = bg0 + ramp[..., None] * (bg1 - bg0)
    blobs = Image.fromarray(rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)).resize(
        (size, size), Image.Resampling.BILINEAR
    )
    background += (np.asarray(blobs, dtype=np.float32) - 127.5) * rng.uniform(0.05, 0.3)
    back_image = Image.fromarray(np.clip(background, 0, 255).astype(np.uint8))
    _distractors(back_image, rng, int(rng.integers(1, 5)))
    background = np.asarray(back_image, dtype=np.float32)

    # Foreground colour: random, but with enough contrast to the background for the shape to be visible.
    mean_bg = background.mean(axis=(0, 1))
    for _ in range(20):
        fg = _random_colour(rng)
        if abs(_luma(fg) - _luma(mean_bg)) > 45 or np.linalg.norm(fg - mean_bg) > 140:
            break
    alpha = _shape_mask(name, size, rng)[..., None]
    shading = 1 + (ramp[..., None] - 0.5) * rng.uniform(-0.3, 0.3)  # some light falloff across the shape
    image = background * (1 - alpha) + np.clip(fg * shading, 0, 255) * alpha
    image += rng.standard_normal(size=image.shape, dtype=np.float32) * rng.uniform(2, 10)
    out = Image.fromarray(np.clip(image, 0, 255).astype(np.uint8))
    _distractors(out, rng, int(rng.integers(0, 3)))  # some on top of the shape, partly occluding it
    return out


def synthetic_sample(seed: int, split: str, index: int, *, num_classes: int, image_size: int) -> Sample:
    """The WebDataset sample ``index`` of ``split``: a pure function of its arguments."""
    rng = np.random.default_rng([seed, SPLIT_IDS[split], index])
    label = index % num_classes  # balanced, and classes interleave in every shard
    image = render_image(label, image_size, rng)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return {
        "__key__": f"synthetic_{split}_{index:06d}",
        "jpg": buffer.getvalue(),
        "cls": label,
        "wnid": CLASS_NAMES[label],
    }


# --------------------------------------------------------------------------------------------------------------
# Dataset on disk
# --------------------------------------------------------------------------------------------------------------


def _write_synthetic_shard(
    out: Path, split: str, shard: int, start: int, stop: int, seed: int, num_classes: int, image_size: int
) -> JSONObject:
    samples = (
        synthetic_sample(seed, split, i, num_classes=num_classes, image_size=image_size) for i in range(start, stop)
    )
    return write_shard(out / shard_name(split, shard), samples)


def _is_complete(root: Path, params: JSONObject) -> bool:
    # params.json is written last, after both splits are in place: its presence marks a finished dataset.
    try:
        saved = json.loads((root / PARAMS_NAME).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return saved == params and all((root / split / MANIFEST_NAME).is_file() for split in SPLIT_IDS)


def _generate(out: Path, params: JSONObject, progress: bool, workers: int) -> None:
    """Write both splits (shards + manifests) into ``out``."""
    per_class = {"train": params["train_per_class"], "val": params["val_per_class"]}
    per_shard = params["samples_per_shard"]
    tasks = []
    for split in SPLIT_IDS:
        (out / split).mkdir(parents=True)
        total = per_class[split] * params["num_classes"]
        for shard, start in enumerate(range(0, total, per_shard)):
            tasks.append(
                (
                    out / split,
                    split,
                    shard,
                    start,
                    min(start + per_shard, total),
                    params["seed"],
                    params["num_classes"],
                    params["image_size"],
                )
            )
    stats: dict[tuple[str, int], JSONObject] = {}
    with tqdm(total=len(tasks), desc="synthetic dataset", unit="shard", disable=not progress) as bar:
        if workers <= 1:
            for task in tasks:
                stats[task[1], task[2]] = _write_synthetic_shard(*task)
                bar.update()
        else:
            for task, shard_stats in zip(tasks, pool_map(_write_synthetic_shard, tasks, workers, bar.update)):
                stats[task[1], task[2]] = shard_stats

    names = synthetic_class_names(params["num_classes"])
    for split in SPLIT_IDS:
        split_stats = [stats[key] for key in sorted(k for k in stats if k[0] == split)]
        write_manifest(
            out / split,
            split_stats,
            class_map="synthetic",
            labels={n: i for i, n in enumerate(names)},
            source=f"synthetic (generator {GENERATOR_VERSION}, seed {params['seed']}, {params['image_size']}px)",
        )


def ensure_synthetic_dataset(
    root: str | Path = DATA_DIR / "synthetic",
    *,
    num_classes: int = 10,
    train_per_class: int = 600,
    val_per_class: int = 100,
    image_size: int = 64,
    seed: int = 0,
    samples_per_shard: int = 500,
    progress: bool = True,
    workers: int | None = None,
) -> Path:
    """Generate the synthetic dataset into ``root`` unless it is already there with these parameters.

    ``root/train`` and ``root/val`` hold shards and a manifest.json each. Safe to call from several processes
    at once (a lock file serialises generation) and safe to kill (a new dataset is built in a temporary
    directory and swapped in; ``root/params.json`` is written last and marks it complete).
    """
    root = Path(root)
    synthetic_class_names(num_classes)  # validates num_classes
    for name, value, low in (
        ("train_per_class", train_per_class, 1),
        ("val_per_class", val_per_class, 1),
        ("image_size", image_size, 16),
        ("samples_per_shard", samples_per_shard, 1),
    ):
        if value < low:
            raise UserError(f"synthetic dataset: {name} must be at least {low}, got {value}")
    params = {
        "generator": GENERATOR_VERSION,
        "num_classes": num_classes,
        "train_per_class": train_per_class,
        "val_per_class": val_per_class,
        "image_size": image_size,
        "seed": seed,
        "samples_per_shard": samples_per_shard,
    }
    if _is_complete(root, params):
        return root

    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (also when the process dies)
        if _is_complete(root, params):  # another process generated it while we waited
            return root
        for stale in root.glob(".tmp-*"):  # left by a killed run; we hold the lock, so nobody is writing it
            shutil.rmtree(stale)
        tmp = root / f".tmp-{os.getpid()}"
        _generate(tmp, params, progress, workers or os.cpu_count() or 1)
        # Swap in the new splits. From here until params.json is written the dataset looks incomplete, so a
        # kill in between means regeneration, never a mix of old and new shards.
        (root / PARAMS_NAME).unlink(missing_ok=True)
        for split in SPLIT_IDS:
            if (root / split).exists():
                os.replace(root / split, tmp / f"old-{split}")
            os.replace(tmp / split, root / split)
        write_json_atomic(root / PARAMS_NAME, params)
        shutil.rmtree(tmp)
    return root
