"""The small datasets and checkpoints that the distribution-shift tests build (ImageNet-R/A/O/9/V2 trees,
ImageNet-C and ImageNet-P layouts), shared by their test modules, the card's and W&B's."""

from pathlib import Path

import cv2
import numpy as np
import torch
import yaml
from PIL import Image

from helpers import make_image_tree, write_image
from robust_lightning.evaluation.benchmarks import IN9_FOLDERS, subset_classes

WNIDS = ("n01440764", "n01443537", "n15075141")  # ImageNet labels 0, 1, 999
SIZE = 32  # the ImageNet-P frames' side


def tree(root: Path, folders, per_folder: int = 2, seed: int = 0) -> Path:
    for f, folder in enumerate(folders):
        for i in range(per_folder):
            write_image(root / folder / f"img_{i}.JPEG", seed + 10 * f + i)
    return root


A_FAVOURED = next(
    i for i, index in enumerate(subset_classes("imagenet_a")[1]) if index not in subset_classes("imagenet_r")[1]
)


def write_favouring_checkpoint(path: Path) -> Path:
    """A Lightning checkpoint of a tiny untrained 1000-class classifier (the benchmarks read 1000 logits) that
    favours one ImageNet-R and one ImageNet-A class, so that their accuracies are known and not zero."""
    from lightning import Trainer

    from robust_lightning.training.lightning_module import ImageClassifier

    torch.manual_seed(0)
    module = ImageClassifier(arch="test_resnet", num_classes=1000, image_size=32)
    with torch.no_grad():
        favoured = [subset_classes("imagenet_r")[1][0], subset_classes("imagenet_a")[1][A_FAVOURED]]
        module.model.net.fc.bias[favoured] += 5.0
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(path)
    return path


def benchmark_trees(root: Path) -> dict[str, str]:
    """Tiny replicas of every layout but ImageNet-Sketch (left out to be reported as skipped)."""
    r, a, o = (subset_classes(name)[0] for name in ("imagenet_r", "imagenet_a", "imagenet_o"))
    # ImageNet val: two ImageNet-O classes (in-distribution) and tench (not ImageNet-O: must be ignored)
    tree(root / "imagenet" / "val", [o[0], o[1], "n01440764"], seed=100)
    tree(root / "in9" / "original" / "val", IN9_FOLDERS[:3], seed=200)
    tree(root / "in9" / "mixed_same" / "val", IN9_FOLDERS[:3], seed=300)
    tree(root / "in9" / "mixed_rand" / "val", IN9_FOLDERS[:3], seed=400)
    return {
        "imagenet_r": str(tree(root / "r", r[:3], seed=500)),
        "imagenet_a": str(tree(root / "a", a[A_FAVOURED : A_FAVOURED + 2], seed=600)),
        "imagenet_v2": str(tree(root / "v2", ["0", "1", "999"], seed=700)),
        "imagenet_o": str(tree(root / "o", o[:3], seed=800)),
        "imagenet_val": str(root / "imagenet" / "val"),
        "imagenet_9": str(root / "in9"),
    }


def write_square(path: Path, seed: int, size: int = 32) -> None:
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path, quality=85)


def imagenet_c_tree(
    root: Path,
    corruptions=("gaussian_noise", "brightness"),
    grouped: bool = False,
    per_class: int = 2,
    size: int = 32,
    uneven: bool = False,
) -> Path:
    """``uneven``: the second class gets severity - 1 more images, so each cell has its own class balance."""
    groups = {"gaussian_noise": "noise", "brightness": "weather", "contrast": "digital", "saturate": "extra"}
    for c, corruption in enumerate(corruptions):
        folder = root / groups[corruption] / corruption if grouped else root / corruption
        for severity in range(1, 6):
            for w, wnid in enumerate(WNIDS[:2]):
                for i in range(per_class + (severity - 1) * (uneven and w == 1)):
                    write_square(
                        folder / str(severity) / wnid / f"ILSVRC2012_val_{w}{i:07d}.JPEG",
                        1000 * c + 100 * severity + 10 * w + i,
                        size,
                    )
    return root


def shift_config(tmp_path: Path, name: str, callbacks: list[dict], devices: int = 1, **trainer) -> Path:
    """``tmp_path/<name>.yaml``: a test run of the tiny 1000-class model on the ImageNet val tree under
    ``tmp_path/imagenet`` with ``callbacks``, logged by a CSVLogger under ``tmp_path/runs/<name>``; ``trainer``
    adds Trainer options."""
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": devices,
            "default_root_dir": str(tmp_path / "runs"),
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(tmp_path / "runs"), "name": name},
            },
            "callbacks": callbacks,
            **({"strategy": "ddp"} if devices > 1 else {}),
            **trainer,
        },
        "model": {"arch": "test_resnet"},
        "data": {
            "source": {
                "class_path": "FolderSource",
                "init_args": {"root": str(tmp_path / "imagenet"), "class_map": "imagenet"},
            },
            "image_size": 32,
            "eval_batch_size": 8,
            "num_workers": 0,
        },
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def imagenet_c_config(tmp_path: Path, *callback_args: dict) -> Path:
    """A test run on a 5-image ImageNet val tree with an ImageNetC callback for each ``callback_args``."""
    make_image_tree(tmp_path / "imagenet" / "val", {WNIDS[0]: 2, WNIDS[1]: 2, WNIDS[2]: 1})
    callbacks = [
        {
            "class_path": "robust_lightning.evaluation.imagenet_c.ImageNetC",
            "init_args": {"batch_size": 7, "num_workers": 0, **args},
        }
        for args in callback_args
    ]
    return shift_config(tmp_path, "c", callbacks)


def frames_of(seed: int, count: int) -> list[np.ndarray]:
    """RGB frames with a square moving over a gradient (so a model's predictions change along the sequence)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:SIZE, 0:SIZE]
    background = np.stack([x * 7 % 256, y * 5 % 256, (x + 2 * y) * 3 % 256], -1).astype(np.uint8)
    colour = rng.integers(0, 256, 3)
    frames = []
    for i in range(count):
        frame = background.copy()
        top, left = (3 * i + seed) % 20, (5 * i + 2 * seed) % 20
        frame[top : top + 12, left : left + 12] = colour
        frames.append(frame)
    return frames


def write_video(path: Path, frames: list[np.ndarray]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 1, (SIZE, SIZE))
    assert writer.isOpened(), "this OpenCV build cannot write mp4v"
    for frame in frames:
        writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    writer.release()


def imagenet_p_tree(root: Path) -> dict[str, list[Path]]:
    """brightness: 3 videos of 6 frames and one of 4 (a short one); gaussian_noise: 2 videos and one folder of 12
    PNG frames (img0 ... img11: natural order matters); speckle_noise (validation): 2 videos. Returns the sequences
    of each perturbation in the order the layout lists them."""
    sequences = {
        "brightness": [
            root / "brightness" / WNIDS[0] / "a.mp4",
            root / "brightness" / WNIDS[0] / "b.mp4",
            root / "brightness" / WNIDS[1] / "c.mp4",
            root / "brightness" / WNIDS[2] / "short.mp4",
        ],
        "gaussian_noise": [
            root / "gaussian_noise" / WNIDS[0] / "a.mp4",
            root / "gaussian_noise" / WNIDS[1] / "b.mp4",
            root / "gaussian_noise" / WNIDS[1] / "frames",
        ],
        "speckle_noise": [root / "speckle_noise" / WNIDS[2] / "a.mp4", root / "speckle_noise" / WNIDS[2] / "b.mp4"],
    }
    for p, (_perturbation, paths) in enumerate(sequences.items()):
        for s, path in enumerate(paths):
            frames = frames_of(10 * p + s, 4 if path.stem == "short" else 12 if path.name == "frames" else 6)
            if path.name == "frames":
                path.mkdir(parents=True)
                for i, frame in enumerate(frames):
                    Image.fromarray(frame).save(path / f"img{i}.png")
            else:
                write_video(path, frames)
    return sequences
