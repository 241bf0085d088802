"""What resuming in the middle of an epoch costs: the time to a resumed epoch's first batch against a fresh epoch's.

    python benchmarks/resume_cost.py                       # 1536 JPEGs of ImageNet's typical sizes, 2 workers
    python benchmarks/resume_cost.py --images 4096 --workers 8

A fit resumed mid-epoch replays the batches its interrupted attempt had trained in that epoch: the loader workers
read those images' headers and make their crops' random draws, without decoding (robust_lightning.data.loaders).
Here the training loader of an image folder (and of the same images as shards) is started at an epoch's first
batch, then at the last of its steps, resumed from a position as a checkpoint holds it; both with the crop in the
workers (data.full_resolution_decode, the recipes') and on the device (canvases), alternating, medians of
``--repeats``. The last line is a JSON object; ``replay_over_decode``
is the time per replayed image over the time per loaded one (the fresh epoch's batches after its first).
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from loader_cpu import encoded_images

from robust_lightning.data.classes import class_map
from robust_lightning.data.datamodule import ImageNetDataModule
from robust_lightning.data.shards import shard_name, write_manifest, write_shard
from robust_lightning.data.sources import FolderSource, ShardSource


def write_data(root: Path, images: list[bytes]) -> tuple[Path, Path]:
    """The images as an ImageFolder tree (10 ImageNet classes) and as shards of 256."""
    wnids = list(class_map("imagenet"))[:10]
    for i, data in enumerate(images):
        path = root / "folder" / "train" / wnids[i % 10] / f"{wnids[i % 10]}_{i}.JPEG"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (root / "folder" / "val" / wnids[0]).mkdir(parents=True)
    (root / "folder" / "val" / wnids[0] / "v.JPEG").write_bytes(images[0])
    shards = root / "shards"
    shards.mkdir()
    stats = []
    for index, first in enumerate(range(0, len(images), 256)):
        samples = (
            {"__key__": f"s{i}", "jpg": images[i], "cls": i % 10, "wnid": wnids[i % 10]}
            for i in range(first, min(len(images), first + 256))
        )
        stats.append(write_shard(shards / shard_name("train", index), samples))
    write_manifest(shards, stats, class_map="imagenet", labels=class_map("imagenet"), source="resume_cost.py")
    return root / "folder", shards


def epoch_start(data: ImageNetDataModule, replay_steps: int, batches: int) -> list[float]:
    """Seconds from the start of an epoch (its loader iterated afresh, workers started) to each of its first
    ``batches`` batches; ``replay_steps``: resumed after that many steps, as from a checkpoint's position."""
    loader = data.train_dataloader()
    if replay_steps:
        loader.load_state_dict({"epoch": 0, "micro_batches": replay_steps})
    start, times = time.perf_counter(), []
    for _, _ in zip(range(batches), loader):
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=1536)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = args.images // args.batch
    with tempfile.TemporaryDirectory() as tmp:
        folder, shards = write_data(Path(tmp), encoded_images(args.images))
        sources = {
            "folder": dict(source=FolderSource(str(folder))),
            "shards": dict(source=ShardSource(train_shards=str(shards), val_shards=str(shards))),
        }
        modules = {}
        for name, source in sources.items():
            for crop in ("workers", "device"):
                data = ImageNetDataModule(
                    **source,
                    image_size=224,
                    batch_size=args.batch,
                    num_workers=args.workers,
                    full_resolution_decode=crop == "workers",
                    shuffle_buffer=0,
                )
                data.setup("fit")
                modules[f"{name}, crop in the {crop}"] = data
        times: dict[str, dict[str, list[float]]] = {
            name: {"first": [], "decode": [], "resumed": []} for name in modules
        }
        for _ in range(args.repeats):
            for name, data in modules.items():
                fresh = epoch_start(data, 0, steps)
                times[name]["first"].append(fresh[0])
                times[name]["decode"].append((fresh[-1] - fresh[0]) / ((steps - 1) * args.batch))
                times[name]["resumed"].append(epoch_start(data, steps - 1, 1)[0])
    result = {"images": args.images, "batch": args.batch, "workers": args.workers, "replayed_steps": steps - 1}
    print(
        f"{args.images} JPEGs, batches of {args.batch}, {args.workers} workers; resumed at step {steps - 1} of {steps}"
    )
    for name, measured in times.items():
        first, decode, resumed = (statistics.median(measured[k]) for k in ("first", "decode", "resumed"))
        # the resumed epoch's first batch: the replay of steps - 1 batches, then a batch decoded like a fresh one's
        replay = max(resumed - first, 0.0) / ((steps - 1) * args.batch)
        print(
            f"  {name:26s} first batch: fresh {first * 1000:7.1f} ms, resumed {resumed * 1000:7.1f} ms; per image: "
            f"replayed {replay * 1000:.3f} ms, loaded {decode * 1000:.3f} ms"
        )
        result[name] = {
            "fresh_first_batch_s": round(first, 4),
            "resumed_first_batch_s": round(resumed, 4),
            "replay_ms_per_image": round(replay * 1000, 4),
            "load_ms_per_image": round(decode * 1000, 4),
            "replay_over_decode": round(replay / decode, 4),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
