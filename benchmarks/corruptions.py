"""CPU cost of generating ImageNet-C on the fly: milliseconds per 224-px image for each corruption.

    python benchmarks/corruptions.py                 # 8 images, severities 1-5, one thread
    python benchmarks/corruptions.py --images 32

Each corruption of robust_lightning.evaluation.corruptions runs on the same natural-looking 224 x 224 images
(smooth gradients plus texture), every severity, single-threaded (one loader worker's view); the fastest of
``--repeats`` passes counts. The JPEG-85 round trip every generated image gets is timed as well. The last line
printed is a JSON object with the per-corruption milliseconds and their mean over the 15 benchmark corruptions.
"""

import argparse
import json
import time

import numpy as np
import torch

from robust_lightning.evaluation.corruptions import CORRUPTIONS, corrupt, jpeg_round_trip
from robust_lightning.evaluation.imagenet_c import STANDARD


def images(count: int, size: int = 224) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size] / size
    out = []
    for _ in range(count):
        base = np.stack([np.sin(6 * x * rng.uniform(0.5, 2)), np.cos(5 * y * rng.uniform(0.5, 2)), x * y], -1)
        texture = rng.normal(0, 0.1, (size, size, 3))
        out.append(np.clip((base * 0.5 + 0.5 + texture) * 255, 0, 255).astype(np.uint8))
    return out


def best_ms(work, repeats: int, count: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return 1000 * min(times) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    batch = images(args.images)
    per_image = {}
    for name in CORRUPTIONS:

        def work(name=name):
            for i, image in enumerate(batch):
                for severity in range(1, 6):
                    corrupt(image, name, severity, rng=i)

        per_image[name] = round(best_ms(work, args.repeats, 5 * len(batch)), 2)
        print(f"{name:>18}: {per_image[name]:7.2f} ms per image and severity", flush=True)
    jpeg = round(best_ms(lambda: [jpeg_round_trip(image, 85) for image in batch], args.repeats, len(batch)), 2)
    print(f"{'JPEG 85 round trip':>18}: {jpeg:7.2f} ms per image")
    standard = sum(per_image[c] for c in STANDARD) / len(STANDARD)
    print(
        json.dumps(
            {
                "ms_per_image": per_image,
                "mean_standard_15_ms": round(standard, 2),
                "jpeg85_ms": jpeg,
                "images": args.images,
                "size": 224,
                "threads": 1,
            }
        )
    )


if __name__ == "__main__":
    main()
