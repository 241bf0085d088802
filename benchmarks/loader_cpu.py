"""CPU cost per training image in the loader workers: device-side augmentation vs CPU-side.

    python benchmarks/loader_cpu.py                        # 256 JPEGs of ImageNet's typical sizes
    python benchmarks/loader_cpu.py --images 1024 --device cuda

With ``data.augment_on device`` a worker only decodes (CanvasDecode); with ``cpu`` it decodes, crops
(torchvision RandomResizedCrop on PIL) and, for the heavy recipe, runs flip/RandAugment/erasing on the batch.
Both are timed on the same encoded images in one process, single-threaded (one worker's view). The device
work the first path moves off the CPU (crop + heavy augmentation) is timed on ``--device`` for reference.
The last line printed is a JSON object with the per-image milliseconds and ``cpu_work_ratio`` = CPU-side
per-image time / device-side per-image time.
"""

import argparse
import io
import json
import statistics
import time

import numpy as np
import torch
from PIL import Image

from robust_lightning.data.augment import BatchAugment
from robust_lightning.data.crop import random_resized_crop
from robust_lightning.data.datasets import transform_bytes
from robust_lightning.data.loaders import collate
from robust_lightning.data.transforms import CanvasDecode, train_transform

# ImageNet train is mostly 500 x 375 / 375 x 500 with a tail of larger photos
SIZES = [(500, 375)] * 6 + [(375, 500)] * 2 + [(500, 333), (1024, 768)]


def encoded_images(n: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    images = []
    for i in range(n):
        w, h = SIZES[i % len(SIZES)]
        coarse = Image.fromarray(rng.integers(0, 256, (h // 16, w // 16, 3), dtype=np.uint8)).resize((w, h))
        pixels = np.clip(np.asarray(coarse, dtype=np.int16) + rng.integers(-12, 13, (h, w, 3)), 0, 255)
        buffer = io.BytesIO()
        Image.fromarray(pixels.astype(np.uint8)).save(buffer, format="JPEG", quality=90)
        images.append(buffer.getvalue())
    return images


def per_image_ms(images: list[bytes], transform, batch_augment=None, batch_size: int = 64) -> float:
    """Median over three passes (after a warm-up pass) of the worker time per image, batching included."""
    times = []
    for _ in range(4):
        start = time.perf_counter()
        for first in range(0, len(images), batch_size):
            items = [
                {**transform_bytes(transform, data), "label": 0, "key": str(i)}
                for i, data in enumerate(images[first : first + batch_size])
            ]
            collate(items, batch_augment)
        times.append((time.perf_counter() - start) * 1000 / len(images))
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--resolution", type=int, default=224)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one loader worker's view
    images = encoded_images(args.images)
    r = args.resolution
    canvas = CanvasDecode(round(r * 16 / 7))

    device_side = per_image_ms(images, canvas)
    cpu_basic = per_image_ms(images, train_transform(r))
    cpu_heavy = per_image_ms(images, train_transform(r), BatchAugment("heavy", 1000, mix=False))

    # what the device does instead, for the same images (timed on --device)
    device = torch.device(args.device)
    samples = [transform_bytes(canvas, data) for data in images[:64]]
    batch = torch.stack([s["image"] for s in samples]).to(device)
    geometry = torch.stack([s["geometry"] for s in samples]).to(device)
    heavy = BatchAugment("heavy", 1000)
    labels = torch.zeros(len(samples), dtype=torch.long, device=device)

    def on_device():
        heavy(random_resized_crop(batch, geometry, r), labels)
        if device.type == "cuda":
            torch.cuda.synchronize()

    on_device()  # warm-up
    start = time.perf_counter()
    on_device()
    device_ms = (time.perf_counter() - start) * 1000 / len(samples)

    print(f"{args.images} JPEGs, {r} px crops, one CPU thread per worker")
    print(f"  worker, augment_on=device (decode to canvas):        {device_side:7.2f} ms/image")
    print(f"  worker, augment_on=cpu, basic (decode + crop):       {cpu_basic:7.2f} ms/image")
    print(f"  worker, augment_on=cpu, heavy (+ flip/RA/erasing):   {cpu_heavy:7.2f} ms/image")
    print(f"  {args.device}: crop + heavy augmentation moved there:     {device_ms:7.2f} ms/image")
    print(
        json.dumps(
            {
                "images": args.images,
                "resolution": r,
                "device_side_worker_ms": round(device_side, 3),
                "cpu_basic_worker_ms": round(cpu_basic, 3),
                "cpu_heavy_worker_ms": round(cpu_heavy, 3),
                "device_work_ms": round(device_ms, 3),
                "device": args.device,
                "cpu_work_ratio": round(cpu_heavy / device_side, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
