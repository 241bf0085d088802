"""Time one APGD-AT training step against one clean training step of the same model and batch.

    python benchmarks/at_step.py                                  # convnext_atto, batch 32, 64 px, CPU, fp32
    python benchmarks/at_step.py --model convnext_tiny_convstem --resolution 224 --batch 128 \
        --device cuda --precision bf16
    python benchmarks/at_step.py --compile                        # also both steps with model.compile

A step is what the trainer does per batch: forward(s), backward, AdamW update (ImageClassifier's own code:
attack in eval mode, update in train mode, soft targets). Clean and AT steps alternate so drifts in machine
speed hit both alike; the figures are medians. The last line printed is a JSON object with ``at_over_clean``
(the reference pass structure costs about 8/3; reusing the last attack forward brings the bound to 7/3) and the
images per second of each step. ``--compare-reuse`` adds both pass structures, each forced
(``at_reuse_over_clean``, ``at_no_reuse_over_clean``). ``--compile`` adds ``at_compiled_over_at`` (the compiled
AT step's time over the eager one's; compilation happens in the warm-up repeats).
"""

import argparse
import json
import statistics
import time

import torch

from robust_lightning.training.lightning_module import ImageClassifier, soft_targets


def make_step(module: ImageClassifier, optimizer, images, targets, bf16: bool):
    """One training step of ``module`` on the batch as the trainer runs it; on CUDA it waits for the device, so
    that a wall-clock timer around it measures the step."""
    device = images.device

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            if module.hparams.attack == "none":
                loss = torch.nn.functional.cross_entropy(module(images), targets)
            else:
                loss = module.adversarial_loss(images, targets)[1]
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()

    return step


def timed(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def alternating_times(steps: dict, warmup: int, repeats: int) -> dict[str, list[float]]:
    """Each step's times over ``repeats`` rounds after ``warmup`` untimed ones; the steps alternate within a round,
    so that drifts in the machine's speed hit them alike."""
    times = {name: [] for name in steps}
    for repeat in range(warmup + repeats):
        for name, step in steps.items():
            seconds = timed(step)
            if repeat >= warmup:
                times[name].append(seconds)
    return times


def main() -> None:
    device = torch.device(args.device)
    torch.manual_seed(0)
    images = torch.rand(args.batch, 3, args.resolution, args.resolution, device=device)
    labels = torch.randint(0, args.num_classes, (args.batch,), device=device)
    targets = soft_targets(labels, args.num_classes, 0.1)
    common = dict(
        arch=args.model, num_classes=args.num_classes, image_size=args.resolution, channels_last=device.type == "cuda"
    )
    variants = {"clean": dict(attack="none"), "at": dict(attack="apgd", attack_steps=args.attack_steps)}
    if args.compare_reuse:
        # both structures forced, whatever the default picks on this device (reuse needs a model without BatchNorm)
        variants["at_reuse"] = dict(attack="apgd", attack_steps=args.attack_steps, reuse_attack_forward=True)
        variants["at_no_reuse"] = dict(attack="apgd", attack_steps=args.attack_steps, reuse_attack_forward=False)
    if args.compile:
        variants["clean_compiled"] = dict(attack="none", compile=True)
        variants["at_compiled"] = dict(attack="apgd", attack_steps=args.attack_steps, compile=True)
    steps, reuse = {}, None
    for name, options in variants.items():
        module = ImageClassifier(**common, **options).to(device).train()
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        steps[name] = make_step(module, optimizer, images, targets, args.precision == "bf16")
        if name == "at":
            reuse = module.reuse_forward
    warmup = max(args.warmup, 3) if args.compile else args.warmup  # compiling takes the first calls
    times = alternating_times(steps, warmup, args.repeats)
    median = {name: statistics.median(values) for name, values in times.items()}
    result = {
        "model": args.model,
        "batch": args.batch,
        "resolution": args.resolution,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "precision": args.precision,
        "attack_steps": args.attack_steps,
        "reuse_attack_forward": reuse,
        "repeats": args.repeats,
        "clean_step_s": round(median["clean"], 4),
        "at_step_s": round(median["at"], 4),
        "clean_images_per_s": round(args.batch / median["clean"], 1),
        "at_images_per_s": round(args.batch / median["at"], 1),
        "at_over_clean": round(median["at"] / median["clean"], 3),
    }
    if args.compare_reuse:
        result["at_reuse_over_clean"] = round(median["at_reuse"] / median["clean"], 3)
        result["at_no_reuse_over_clean"] = round(median["at_no_reuse"] / median["clean"], 3)
    if args.compile:
        result["at_compiled_over_at"] = round(median["at_compiled"] / median["at"], 3)
        result["clean_compiled_over_clean"] = round(median["clean_compiled"] / median["clean"], 3)
        result["at_compiled_images_per_s"] = round(args.batch / median["at_compiled"], 1)
    for name, values in times.items():
        print(
            f"{name:14s} median {median[name] * 1000:8.1f} ms  {args.batch / median[name]:8.1f} images/s  "
            f"(min {min(values) * 1000:.1f}, max {max(values) * 1000:.1f})"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="convnext_atto")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--attack-steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--compare-reuse", action="store_true", help="also time AT with and without reusing the last attack forward"
    )
    parser.add_argument("--compile", action="store_true", help="also time both steps with model.compile")
    args = parser.parse_args()
    main()
