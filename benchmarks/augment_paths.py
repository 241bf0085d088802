"""Time the heavy augmentation's two dispatch paths on one batch: grouped (samples sorted by the op they drew, each
op on its slice; the sizes are read back, which on a GPU waits for the device) and masked (every op on the whole
batch, torch.where keeps each sample's own result; nothing read back, the path GPUs take).

    python benchmarks/augment_paths.py                         # 32 images, 224 px, CPU
    python benchmarks/augment_paths.py --batch 174 --device cuda

Both paths give the same images bit for bit (tests/test_augment.py). The last line printed is a JSON object with
the median seconds of each and ``masked_over_grouped``.
"""

import argparse
import json
import statistics
import time

import torch

import robust_lightning.data.augment as augment
from robust_lightning.data.augment import BatchAugment


def timed(run, device) -> float:
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    device = torch.device(args.device)
    images = torch.randint(0, 256, (args.batch, 3, args.resolution, args.resolution), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 1000, (args.batch,), device=device)
    heavy = BatchAugment("heavy", 1000, augmentation_fill="official")
    generator = torch.Generator(device=device)
    cheap = augment.host_reads_are_cheap

    def run(path: str):
        augment.host_reads_are_cheap = cheap if path == "grouped" else (lambda t: False)
        generator.manual_seed(0)
        heavy(images, labels, generator=generator)

    times = {"grouped": [], "masked": []}
    for repeat in range(args.warmup + args.repeats):
        for path in times:  # alternating, so drifts in machine speed hit both alike
            seconds = timed(lambda path=path: run(path), device)
            if repeat >= args.warmup:
                times[path].append(seconds)
    augment.host_reads_are_cheap = cheap
    median = {path: statistics.median(values) for path, values in times.items()}
    for path, seconds in median.items():
        print(f"{path:8s} median {seconds * 1000:8.1f} ms  {args.batch / seconds:8.1f} images/s")
    print(
        json.dumps(
            {
                "batch": args.batch,
                "resolution": args.resolution,
                "device": str(device),
                "threads": torch.get_num_threads(),
                "grouped_s": round(median["grouped"], 4),
                "masked_s": round(median["masked"], 4),
                "masked_over_grouped": round(median["masked"] / median["grouped"], 2),
            }
        )
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--resolution", type=int, default=224)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    main()
