"""What the reduced decode of large training JPEGs changes in the crops and what it saves per image.

    python benchmarks/decode_scale.py
    python benchmarks/decode_scale.py --size 2000 --boxes 16

With ``data.augment_on device`` (and ``data.full_resolution_decode`` off) a worker decodes a JPEG larger than
the canvas (512 px for 224 crops) at 1/2, 1/4 or 1/8 scale through libjpeg's DCT scaling (transforms.
CanvasDecode) and the device crops the box drawn on the original size out of that reduced image. The official
pipeline decodes at full resolution and crops with PIL (torchvision's RandomResizedCrop). Per image this
script times, single-threaded:

* ``full``: full decode + PIL bicubic resized crop (the official pipeline; ``data.full_resolution_decode``);
* ``reduced``: CanvasDecode into the 512-px canvas (the worker's whole work on the device path); the crop of
  the reduced image (robust_lightning.data.crop.resized_crop) runs on the accelerator and is not counted;

and compares, on the same boxes (RandomResizedCrop's, scale 0.08-1), the 224-px crops of the two paths:
mean, 99th percentile and max absolute difference per pixel and the worst crop's mean, on the 0..1 scale. ``crop only``
repeats the comparison with the device crop applied to the full-resolution image, which separates the crop
implementation's share from the decode's.

No ImageNet here: the JPEGs (quality 90) are made from the photographs that ship with scikit-image,
scikit-learn and matplotlib, in two sets: ``upscaled`` (each photo resized with Lanczos to a longer side of
--size px: smooth, little detail at the pixel scale, a lower bound of the difference) and ``mosaic`` (3 x 3
tiles of photos at their own resolution, 640 x 427 each: native detail at the pixel scale). The last line
printed is a JSON object with every figure.
"""

import argparse
import importlib.util
import io
import json
import statistics
import time
from pathlib import Path

import torch
import torchvision.transforms.functional as TF
from PIL import Image

from robust_lightning.data.crop import resized_crop, sample_crop_boxes
from robust_lightning.data.transforms import CanvasDecode, default_canvas_size


def photographs() -> dict[str, Image.Image]:
    """RGB photographs bundled with installed packages (no download)."""
    import matplotlib
    import skimage

    skimage_data = Path(skimage.__file__).parent / "data"
    # scikit-learn's two sample photos when it is installed (the test extra has it); never imported
    sklearn = importlib.util.find_spec("sklearn")
    sklearn_images = Path(sklearn.origin).parent / "datasets/images" if sklearn else Path("/nonexistent")
    files = {
        **{name: skimage_data / f"{name}.png" for name in ("astronaut", "coffee", "chelsea", "motorcycle_left")},
        "rocket": skimage_data / "rocket.jpg",
        "hubble_deep_field": skimage_data / "hubble_deep_field.jpg",
        "china": sklearn_images / "china.jpg",
        "flower": sklearn_images / "flower.jpg",
        "grace_hopper": Path(matplotlib.get_data_path()) / "sample_data/grace_hopper.jpg",
    }
    return {name: Image.open(path).convert("RGB") for name, path in files.items() if path.exists()}


def jpeg(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def test_images(size: int) -> dict[str, list[bytes]]:
    photos = list(photographs().values())
    upscaled = []
    for photo in photos:
        scale = size / max(photo.size)
        upscaled.append(jpeg(photo.resize((round(photo.width * scale), round(photo.height * scale)), Image.LANCZOS)))
    tile_w, tile_h = 640, 427
    mosaics = []
    for start in range(len(photos)):
        mosaic = Image.new("RGB", (3 * tile_w, 3 * tile_h))
        for k in range(9):
            tile = photos[(start + k) % len(photos)]
            # a 640 x 427 window at the photo's own resolution (resized only when the photo is smaller)
            if tile.width < tile_w or tile.height < tile_h:
                factor = max(tile_w / tile.width, tile_h / tile.height)
                tile = tile.resize((round(tile.width * factor + 0.5), round(tile.height * factor + 0.5)), Image.LANCZOS)
            mosaic.paste(tile.crop((0, 0, tile_w, tile_h)), ((k % 3) * tile_w, (k // 3) * tile_h))
        mosaics.append(jpeg(mosaic))
    return {"upscaled": upscaled, "mosaic": mosaics}


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def measure(encoded: list[bytes], crop_size: int, canvas_size: int, boxes_per_image: int, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    full_ms, reduced_ms, decode_ms, diffs, crop_only, scales = [], [], [], [], [], []
    for data in encoded:
        width, height = Image.open(io.BytesIO(data)).size
        boxes = sample_crop_boxes(torch.tensor([[height, width]] * boxes_per_image), generator=generator)

        def official(box=boxes[0], data=data):
            image = Image.open(io.BytesIO(data)).convert("RGB")
            top, left, h, w = (int(v) for v in box)
            return TF.resized_crop(image, top, left, h, w, [crop_size, crop_size], TF.InterpolationMode.BICUBIC)

        full_ms.append(median_ms(official, repeats))
        decode_ms.append(median_ms(lambda data=data: Image.open(io.BytesIO(data)).convert("RGB"), repeats))
        reduced_ms.append(median_ms(lambda data=data: CanvasDecode(canvas_size)(Image.open(io.BytesIO(data))), repeats))

        sample = CanvasDecode(canvas_size)(Image.open(io.BytesIO(data)))
        geometry = sample["geometry"].float()
        scales.append(round(float(geometry[0] / geometry[2]), 2))
        reduction = (geometry[2:] / geometry[:2]).repeat(2)
        canvas = sample["image"][None].expand(boxes_per_image, -1, -1, -1)
        reduced = resized_crop(canvas, boxes * reduction, crop_size).float() / 255
        full_image = TF.pil_to_tensor(Image.open(io.BytesIO(data)).convert("RGB"))
        device_on_full = (
            torch.cat([resized_crop(full_image[None], box[None], crop_size) for box in boxes]).float() / 255
        )
        pil = torch.stack([TF.pil_to_tensor(official(box)) for box in boxes]).float() / 255
        diffs.append((reduced - pil).abs())
        crop_only.append((device_on_full - pil).abs())
    diffs, crop_only = torch.stack(diffs), torch.stack(crop_only)
    return {
        "images": len(encoded),
        "reduction_factors": sorted(set(scales)),
        "full_decode_ms": round(statistics.mean(decode_ms), 2),
        "full_decode_and_pil_crop_ms": round(statistics.mean(full_ms), 2),
        "reduced_canvas_decode_ms": round(statistics.mean(reduced_ms), 2),
        "saved_ms": round(statistics.mean(full_ms) - statistics.mean(reduced_ms), 2),
        "crop_mean_abs_diff": round(diffs.mean().item(), 4),
        "crop_p99_abs_diff": round(diffs.flatten().kthvalue(int(0.99 * diffs.numel())).values.item(), 4),
        "crop_max_abs_diff": round(diffs.max().item(), 4),
        "worst_crop_mean_abs_diff": round(diffs.mean(dim=(2, 3, 4)).max().item(), 4),
        "crop_only_mean_abs_diff": round(crop_only.mean().item(), 4),
        "crop_only_max_abs_diff": round(crop_only.max().item(), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=2000, help="longer side of the upscaled photographs")
    parser.add_argument("--crop", type=int, default=224)
    parser.add_argument("--boxes", type=int, default=8, help="RandomResizedCrop boxes compared per image")
    parser.add_argument("--repeats", type=int, default=5, help="timings per image (median)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one loader worker's view
    canvas_size = default_canvas_size(args.crop)
    print(
        f"photographs: {', '.join(photographs())}; canvas {canvas_size} px, {args.crop}-px crops, "
        f"{args.boxes} boxes per image, JPEG quality 90"
    )
    results = {}
    for name, encoded in test_images(args.size).items():
        results[name] = figures = measure(encoded, args.crop, canvas_size, args.boxes, args.repeats)
        print(
            f"{name}: {figures['images']} JPEGs, reduced by {figures['reduction_factors']} | ms per image: full "
            f"decode {figures['full_decode_ms']}, + PIL crop {figures['full_decode_and_pil_crop_ms']}, reduced "
            f"canvas decode {figures['reduced_canvas_decode_ms']} (saves {figures['saved_ms']}) | crops vs the "
            f"official: mean |diff| {figures['crop_mean_abs_diff']}, p99 {figures['crop_p99_abs_diff']}, max "
            f"{figures['crop_max_abs_diff']}, worst crop's mean {figures['worst_crop_mean_abs_diff']} (crop "
            f"implementation alone: mean {figures['crop_only_mean_abs_diff']}, "
            f"max {figures['crop_only_max_abs_diff']})"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
