"""The GPU suite: every figure this project needs from a GPU, measured in one command within a hard time budget.

    python benchmarks/gpu_suite.py --out $OUT/gpu_suite.json          # on one H100 or H200: 8 minutes at most
    python benchmarks/gpu_suite.py --smoke --out /tmp/gpu_suite.json  # the same code paths on the CPU, tiny sizes
    python benchmarks/gpu_suite.py --sections compile max_batch      # some sections only (a rerun)

GPU time comes rarely and in 15-minute windows, so this script is prepared and tested on the CPU (``--smoke``, which
tests/test_gpu_suite.py runs) and needs nothing from outside the machine: it writes its own shards and trains its
own small model. A GPU machine that lacks some of the project's packages gets them from ``.gpu_packages/``, which
``bash benchmarks/gpu_packages.sh`` fills on a machine with network (its header gives the whole command).

Each section runs in a process of its own, under a time limit taken from the budget (``--budget``, 480 s), so
that a hung compilation or an out-of-memory error costs that section only. A section writes its figures to its
result file as it goes, so that a section stopped at its limit still reports what it measured. The sections, in
the order they run:

- ``steps``: the APGD-AT step (2-step APGD, as the recipes) and a clean step of ConvNeXt-T + ConvStem and ViT-S +
  ConvStem, 224 px, bf16, eager, at the recipes' 174 images per forward pass; images/s, the AT/clean ratio, the
  FLOPs of a step (torch.utils.flop_counter) against a measured bf16 matrix-product ceiling; for ConvNeXt also
  with ``torch.backends.cudnn.benchmark`` on.
- ``fit``: a real ``robust-lightning fit`` of configs/recipes/convnext_tiny_convstem.yaml (heavy augmentation on
  the device, EMA, gradient accumulation to 1392 images, loader workers, progress bar, CSV logging, checkpoints)
  from WebDataset shards of ImageNet-sized JPEGs written here, for 45 s; images/s and the share of step
  time spent waiting for data (results.json's fit section). One optimiser step is run with host-device
  synchronisations recorded (benchmarks/sync_probe.py).
- ``autoattack``: the cost of one forward and one forward + input gradient of ConvNeXt-B at 224 px per precision,
  which turns benchmarks/autoattack_cost.py's pass counts into measured hours; a small model adversarially
  trained here on the synthetic data at 224 px; each attack (APGD-CE, APGD-T, FAB-T, Square) on one batch with
  synchronisations recorded; then standard AutoAttack on the same points, the reference (pyautoattack) against
  the fast engine at fp32, tf32 and bf16 with fp32 re-checks: time, robust accuracy, per-point agreement.
- ``max_batch``: the largest ``data.max_device_batch_size`` of each model's bf16 APGD-AT step that fits in the
  GPU's memory, and its peak memory. The search starts from the batch that two measured peaks predict.
- ``compile``: the same steps with ``model.compile``, timed against eager in alternation, with the compile
  warm-up timed apart.

Host-device synchronisations are recorded with ``torch.cuda.set_sync_debug_mode("warn")``, every warning with
the line of code that caused it, rather than with ``"error"``, which would stop at the first: a check passes when
none was recorded. The last thing printed is one table; the JSON file holds every figure.
"""

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent
RECIPE = ROOT / "configs" / "recipes" / "convnext_tiny_convstem.yaml"
# the packages the sections import; the device machine's image lacks some (benchmarks/gpu_packages.sh)
REQUIRED = ("torch", "timm", "lightning", "jsonargparse", "kornia", "webdataset", "braceexpand", "pyautoattack")

# name -> (seconds on a GPU, seconds in --smoke), in the order the sections run: each section's share of the budget
# (480 s on a GPU, 170 s with --smoke), scaled to --budget. On an H200 (2026-11-27, benchmarks/RESULTS.md) steps
# took 50 s, fit 130 s (with a minute of training) and compile 156 s (ConvNeXt-T's warm-up 44 s, ViT-S's 81 s);
# autoattack and max_batch did not finish in 143 and 51 s. 480 s cannot hold them all on that GPU: compile comes
# last, ConvNeXt-T (whose compiled step has a target) first, so that a cut costs ViT-S's compiled figures.
SECTIONS = {
    "steps": (50, 20),
    "fit": (110, 35),
    "autoattack": (185, 35),
    "max_batch": (55, 15),
    "compile": (80, 50),
}

# Targets per H100, bf16 (issue "Measured where users run it"): what the table compares the figures with.
TARGETS = {
    "at_compiled_images_per_s": 1000.0,  # ConvNeXt-T + ConvStem APGD-AT step, compiled
    "compile_seconds": 180.0,  # its compile warm-up
    "autoattack_speedup": 5.0,  # fast engine over the reference, same robust accuracy
    "data_wait_share": 0.05,  # in the recipe's fit with augment_on: device
}


class Sizes:
    """What each section measures: the real sizes on a GPU, tiny ones with --smoke (the same code paths)."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.models = ("convnext_atto_convstem", "test_vit") if smoke else SUITE_MODELS
        self.compile_models = ("test_vit",) if smoke else SUITE_MODELS  # compiling takes a minute a model on a CPU
        self.resolution = 32 if smoke else 224
        self.batch = 4 if smoke else 174  # the recipes' data.max_device_batch_size
        self.warmup, self.repeats = (1, 2) if smoke else (3, 10)
        self.ceiling_size = 256 if smoke else 8192  # side of the square bf16 matrix product
        self.batch_limit = 16 if smoke else 4096  # the largest batch max_batch tries
        self.batch_granularity = 4 if smoke else 8
        # fit
        self.fit_images, self.fit_val_images, self.fit_distinct_jpegs = (96, 32, 16) if smoke else (24000, 1000, 512)
        self.fit_shard_size = 32 if smoke else 1000  # the holdout takes whole shards: at least two
        # autoattack
        self.cost_model = "test_convnext" if smoke else "convnext_base"
        self.cost_batch = 2 if smoke else 64
        self.aa_arch = "test_resnet" if smoke else "resnet18"
        self.aa_points = 8 if smoke else 64
        # smoke: enough steps for some points to be classified right, so that the attacks have points to attack
        self.aa_train = {"max_steps": 150} if smoke else {"max_time": "00:00:00:45"}
        # smoke: the code paths at a CPU-sized budget, without bf16 (this CPU runs it tens of times slower)
        self.aa_budget = {"n_iter": 10, "n_queries": 100} if smoke else {}
        # the radius of the evaluation: the training's 4/255 on a GPU; with --smoke, a radius at which points of a
        # briefly trained model survive APGD, so that every attack of the ensemble runs
        self.aa_eps = 0.5 / 255 if smoke else 4 / 255
        self.aa_fab_iterations = 10 if smoke else 100
        self.precisions = ("fp32", "tf32") if smoke else ("fp32", "tf32", "bf16")
        self.aa_runs = [("reference", "fp32"), *(("fast", precision) for precision in self.precisions)]


SUITE_MODELS = ("convnext_tiny_convstem", "vit_small_patch16_224_convstem")


# ------------------------------------------------------------------------------------------------ the sections
# Each section is a function (sizes, device, workdir, record) run in a process of its own; ``record(key, value)``
# saves a figure at once.


def bf16_ceiling(device, side: int) -> float:
    """TFLOP/s of a square bf16 matrix product on random data: the arithmetic ceiling a step's FLOPs are set
    against (measured, not the datasheet's)."""
    import torch

    a, b = (torch.randn(side, side, device=device, dtype=torch.bfloat16) for _ in range(2))
    seconds = median_seconds(lambda: a @ b, device, warmup=3, repeats=10)
    return 2 * side**3 / seconds / 1e12


def median_seconds(call: Callable[[], object], device, warmup: int, repeats: int) -> float:
    """The median wall time of ``call``, the device waited for after each call."""
    import torch

    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def forward_flops(arch: str, sizes: Sizes, device) -> int:
    """FLOPs of one forward pass of the model on the suite's batch (torch.utils.flop_counter)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from robust_lightning.training.lightning_module import ImageClassifier

    module = ImageClassifier(arch=arch, num_classes=1000, image_size=sizes.resolution).to(device)
    images = torch.rand(sizes.batch, 3, sizes.resolution, sizes.resolution, device=device)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        module(images)
    return counter.get_total_flops()


def training_steps(
    arch: str, sizes: Sizes, device, variants: dict[str, dict]
) -> tuple[dict[str, Callable[[], None]], dict[str, bool]]:
    """A step per variant (ImageClassifier options) on one random batch, as benchmarks/at_step.py times them, and
    whether each reuses the attack's last forward for the update."""
    import torch
    from at_step import make_step

    from robust_lightning.training.lightning_module import ImageClassifier, soft_targets

    torch.manual_seed(0)
    images = torch.rand(sizes.batch, 3, sizes.resolution, sizes.resolution, device=device)
    targets = soft_targets(torch.randint(0, 1000, (sizes.batch,), device=device), 1000, 0.1)
    steps, reused = {}, {}
    for name, options in variants.items():
        module = ImageClassifier(
            arch=arch, num_classes=1000, image_size=sizes.resolution, channels_last=device.type == "cuda", **options
        ).to(device)
        module.train()
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        steps[name] = make_step(module, optimizer, images, targets, bf16=True)
        reused[name] = module.reuse_forward
    return steps, reused


AT = {"attack": "apgd", "attack_steps": 2}  # the recipes' training attack
CLEAN = {"attack": "none"}


def with_cudnn_benchmark(step: Callable[[], None], on: bool) -> Callable[[], None]:
    import torch

    def run():
        torch.backends.cudnn.benchmark = on
        step()

    return run


def steps_section(sizes: Sizes, device, workdir: Path, record) -> None:
    from at_step import alternating_times

    ceiling = bf16_ceiling(device, sizes.ceiling_size)
    # three significant figures: a CPU without bf16 units (the smoke run) reaches a few hundredths of a TFLOP/s
    record("bf16_ceiling_tflops", float(f"{ceiling:.3g}"))
    for arch in sizes.models:
        steps, reused = training_steps(arch, sizes, device, {"clean": CLEAN, "at": AT})
        if "convnext" in arch:  # does letting cuDNN pick its algorithms per shape help the convolutions?
            steps = {
                **{name: with_cudnn_benchmark(step, False) for name, step in steps.items()},
                **{f"{name}_cudnn_benchmark": with_cudnn_benchmark(step, True) for name, step in steps.items()},
            }
        times = alternating_times(steps, sizes.warmup, sizes.repeats)
        median = {name: statistics.median(values) for name, values in times.items()}
        figures = {
            "batch": sizes.batch,
            "resolution": sizes.resolution,
            **{f"{name}_step_s": round(seconds, 4) for name, seconds in median.items()},
            **{f"{name}_images_per_s": round(sizes.batch / seconds, 1) for name, seconds in median.items()},
            "at_over_clean": round(median["at"] / median["clean"], 3),
        }
        if "at_cudnn_benchmark" in median:
            figures["at_cudnn_benchmark_over_at"] = round(median["at_cudnn_benchmark"] / median["at"], 3)
        # A step's work in forward passes, a backward counted as two (FlopCounterMode's count of the backward of
        # depthwise convolutions' weights is far above that): clean 3; AT 3 attack forwards, 2 input-only
        # backwards and the update's 3 (2 when the attack's last forward is reused, on the CPU only by default).
        forward = forward_flops(arch, sizes, device)
        passes = {"clean": 3, "at": 7 if reused["at"] else 8}
        figures["forward_gflop"] = round(forward / 1e9, 2)
        for name in ("clean", "at"):
            figures[f"{name}_passes"] = passes[name]
            figures[f"{name}_gflop_per_step"] = round(passes[name] * forward / 1e9, 1)
            figures[f"{name}_share_of_ceiling"] = round(passes[name] * forward / median[name] / 1e12 / ceiling, 3)
        record(arch, figures)


def compile_section(sizes: Sizes, device, workdir: Path, record) -> None:
    """Per model: the compiled steps' first calls, timed one by one until two in a row agree within 25% (the
    compile warm-up: its time beyond that many steady steps), then eager and compiled steps in alternation."""
    from at_step import alternating_times, timed

    variants = {
        "at": AT,
        "at_compiled": {**AT, "compile": True},
        "clean": CLEAN,
        "clean_compiled": {**CLEAN, "compile": True},
    }
    for arch in sizes.compile_models:
        steps, _ = training_steps(arch, sizes, device, variants)
        figures = {"batch": sizes.batch, "resolution": sizes.resolution}
        for name in ("at_compiled", "clean_compiled"):
            calls = figures[f"{name}_warmup_calls_s"] = []
            while len(calls) < 3 or (len(calls) < 8 and not 0.8 < calls[-1] / calls[-2] < 1.25):
                calls.append(round(timed(steps[name]), 3))
                record(arch, figures)  # a compilation stopped at the section's limit still shows how far it got
        times = alternating_times(steps, 0, sizes.repeats)
        median = {name: statistics.median(values) for name, values in times.items()}
        for name in ("at_compiled", "clean_compiled"):
            calls = figures[f"{name}_warmup_calls_s"]
            figures[f"{name}_compile_s"] = round(sum(calls) - len(calls) * median[name], 1)
        figures.update(
            {
                **{f"{name}_images_per_s": round(sizes.batch / seconds, 1) for name, seconds in median.items()},
                "at_compiled_over_at": round(median["at_compiled"] / median["at"], 3),
                "clean_compiled_over_clean": round(median["clean_compiled"] / median["clean"], 3),
            }
        )
        record(arch, figures)


def largest_batch(
    fits: Callable[[int], bool], start: int, limit: int, granularity: int, growth: float = 2.0
) -> tuple[int, int | None]:
    """(the largest batch that fits, the smallest tried that did not, or None). From ``start``, the batch grows by
    ``growth`` while it fits, up to ``limit``, or shrinks by it until one fits; then the interval is halved down
    to ``granularity``. ``fits`` is taken to be monotone."""
    fitting, failing = 0, None
    if fits(start):
        fitting = start
        while (batch := max(int(fitting * growth), fitting + granularity)) <= limit:
            if not fits(batch):
                failing = batch
                break
            fitting = batch
    else:
        failing = start
        while (batch := min(int(failing / growth), failing - granularity)) > 0:
            if fits(batch):
                fitting = batch
                break
            failing = batch
    if failing is None:
        return fitting, None
    while failing - fitting > granularity:
        middle = max((fitting + failing) // 2 // granularity * granularity, fitting + granularity)
        if fits(middle):
            fitting = middle
        else:
            failing = middle
    return fitting, failing


def predicted_largest_batch(peaks: dict[int, float], total_gib: float, share: float = 0.97) -> int | None:
    """The batch whose peak memory reaches ``share`` of the GPU's, on the line through the two largest measured
    (batch, peak GiB) points; None without two. A step's peak memory grows linearly with its batch (11.9, 23.8,
    47.2 and 93.8 GiB at 174, 348, 696 and 1392 images on an H200, benchmarks/RESULTS.md), so the search starts
    near its end instead of doubling up to it."""
    measured = sorted((batch, peak) for batch, peak in peaks.items() if isinstance(peak, float))
    if len(measured) < 2:
        return None
    (b0, p0), (b1, p1) = measured[-2:]
    per_image = (p1 - p0) / (b1 - b0)
    if per_image <= 0:
        return None
    return int(b1 + (share * total_gib - p1) / per_image)


def max_batch_section(sizes: Sizes, device, workdir: Path, record) -> None:
    import gc

    import torch
    from at_step import make_step

    from robust_lightning.training.lightning_module import ImageClassifier, soft_targets

    total_gib = None  # the CPU measures no peak memory (and nothing there runs out of it)
    if device.type == "cuda":
        total_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
        record("memory_total_gib", round(total_gib, 1))
    for arch in sizes.models:
        module = ImageClassifier(arch=arch, image_size=sizes.resolution, channels_last=device.type == "cuda", **AT)
        module = module.to(device).train()
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        figures = {"tried": {}}

        def fits(batch: int, module=module, optimizer=optimizer, figures=figures, arch=arch) -> bool:
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            images = torch.rand(batch, 3, sizes.resolution, sizes.resolution, device=device)
            targets = soft_targets(torch.randint(0, 1000, (batch,), device=device), 1000, 0.1)
            try:
                make_step(module, optimizer, images, targets, bf16=True)()
                # GiB at the step's peak; the CPU has no such measure (and nothing there runs out of memory)
                peak = round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None
                figures["tried"][batch] = peak if peak is not None else "fits"
                return True
            except torch.OutOfMemoryError:
                figures["tried"][batch] = "out of memory"
                return False
            finally:
                del images, targets
                optimizer.zero_grad(set_to_none=True)
                gc.collect()
                record(arch, figures)

        start, growth = sizes.batch, 2.0
        if total_gib is not None and fits(sizes.batch) and fits(2 * sizes.batch):
            # the search starts where the line through these two peaks meets the GPU's memory, in steps of 5 %
            guess = predicted_largest_batch(figures["tried"], total_gib)
            if guess:
                start, growth = min(guess, sizes.batch_limit), 1.05
        fitting, failing = largest_batch(fits, start, sizes.batch_limit, sizes.batch_granularity, growth)
        peak = figures["tried"].get(fitting)
        figures.update(largest=fitting, smallest_failing=failing, peak_gib_at_largest=peak if peak != "fits" else None)
        record(arch, figures)
        del module, optimizer
        gc.collect()


# ------------------------------------------------------------------------------------------------ fit section


def write_fit_shards(workdir: Path, sizes: Sizes) -> tuple[Path, Path]:
    """Train and validation shards of ImageNet-sized JPEGs (benchmarks/loader_cpu.py's sizes), labelled over the
    1000 ImageNet classes; a few distinct images repeat under distinct keys (decoding costs the same)."""
    from loader_cpu import encoded_images

    from robust_lightning.data.classes import class_map
    from robust_lightning.data.shards import shard_name, write_manifest, write_shard

    labels = class_map("imagenet")
    wnids = list(labels)
    jpegs = encoded_images(sizes.fit_distinct_jpegs)
    roots = {}
    for split, count in (("train", sizes.fit_images), ("val", sizes.fit_val_images)):
        out = workdir / "shards" / split
        out.mkdir(parents=True, exist_ok=True)
        stats = []
        per_shard = sizes.fit_shard_size
        for index, first in enumerate(range(0, count, per_shard)):
            samples = (
                {"__key__": f"{split}_{i:07d}", "jpg": jpegs[i % len(jpegs)], "cls": i % 1000, "wnid": wnids[i % 1000]}
                for i in range(first, min(count, first + per_shard))
            )
            stats.append(write_shard(out / shard_name(split, index), samples))
        write_manifest(out, stats, class_map="imagenet", labels=labels, source="benchmarks/gpu_suite.py")
        roots[split] = out
    return roots["train"], roots["val"]


def fit_overrides(workdir: Path, sizes: Sizes, train: Path, val: Path) -> dict:
    """What the suite changes in the recipe: where its data and outputs go, one GPU, 45 s of training with a log
    interval short enough to give several throughput windows (a step took 2.1 s on an H200), a holdout and a
    validation set sized for that time, no warm start (the clean checkpoint is not there), and the
    synchronisation probe."""
    run = workdir / "fit"
    trainer = {
        "devices": 1,
        "strategy": "auto",
        "default_root_dir": str(run),
        "logger": {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(run), "name": "convnext_tiny_convstem"},
        },
        "log_every_n_steps": 1 if sizes.smoke else 5,
        "callbacks": [{"class_path": "sync_probe.SyncProbe", "init_args": {"record": str(workdir / "sync.json")}}],
    }
    shards = {"class_path": "ShardSource", "init_args": {"train_shards": str(train), "val_shards": str(val)}}
    data = {"source": shards, "holdout": 16 if sizes.smoke else 512}
    if sizes.smoke:  # tiny sizes on the CPU, the rest as the recipe
        trainer.update(accelerator="cpu", max_steps=3)
        data.update(
            image_size=32,
            global_batch_size=16,
            max_device_batch_size=8,
            eval_batch_size=16,
            num_workers=2,
            shuffle_buffer=64,
        )
        model = {"init_from": None, "arch": "convnext_atto_convstem"}
    else:
        trainer["max_time"] = "00:00:00:45"
        model = {"init_from": None}
    return {"trainer": trainer, "checkpoint": {"dirpath": str(run / "checkpoints")}, "model": model, "data": data}


def fit_section(sizes: Sizes, device, workdir: Path, record) -> None:
    import yaml

    start = time.perf_counter()
    train, val = write_fit_shards(workdir, sizes)
    record("shards_written_s", round(time.perf_counter() - start, 1))
    overrides = workdir / "fit_overrides.yaml"
    overrides.write_text(yaml.safe_dump(fit_overrides(workdir, sizes, train, val)))
    command = [sys.executable, "-m", "robust_lightning", "fit", "--config", str(RECIPE), "--config", str(overrides)]
    record("command", " ".join(command))
    start = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT, env=child_environment())
    record("fit_s", round(time.perf_counter() - start, 1))
    results = json.loads(next((workdir / "fit").glob("convnext_tiny_convstem/version_*/results.json")).read_text())
    record("throughput", results["fit"].get("throughput"))
    probe = workdir / "sync.json"
    record("step_synchronisations", json.loads(probe.read_text())["synchronisations"] if probe.exists() else None)


# ---------------------------------------------------------------------------------------------- autoattack


def pass_costs(sizes: Sizes, device) -> dict[str, dict[str, float]]:
    """Seconds per image of one forward and one forward + input gradient of the cost model, per precision, as the
    fast engine runs its passes (robust_lightning.attacks.ensemble.numerics)."""
    import timm
    import torch

    from robust_lightning.attacks.ensemble import numerics

    model = timm.create_model(sizes.cost_model, num_classes=1000).to(device).eval().requires_grad_(False)
    x = torch.rand(sizes.cost_batch, 3, sizes.resolution, sizes.resolution, device=device)

    def forward():
        with torch.no_grad():
            model(x)

    def forward_backward():
        x_grad = x.clone().requires_grad_(True)
        torch.autograd.grad(model(x_grad).float().logsumexp(1).sum(), x_grad)

    costs = {}
    for precision in sizes.precisions:
        with numerics(precision, device):
            costs[precision] = {
                name: median_seconds(call, device, 2, sizes.repeats) / sizes.cost_batch
                for name, call in (("forward", forward), ("forward_input_gradient", forward_backward))
            }
    return costs


def measured_hours(costs: dict[str, dict[str, float]]) -> dict[str, float]:
    """Hours of the default three-threat-model evaluation of one checkpoint on 5000 images: autoattack_cost.py's
    pass counts times the measured seconds per pass; tf32 and bf16 add fp32 checking forwards."""
    from autoattack_cost import fp32_check_forwards, passes_per_checkpoint

    hours = {}
    for precision, cost in costs.items():
        seconds = sum(
            backward * cost["forward_input_gradient"] + forward * cost["forward"]
            for backward, forward in passes_per_checkpoint().values()
        )
        if precision != "fp32":
            seconds += fp32_check_forwards() * costs["fp32"]["forward"]
        hours[precision] = round(seconds / 3600, 2)
    return hours


def aa_synthetic(sizes: Sizes, workdir: Path) -> dict:
    """The synthetic shapes the AutoAttack model is trained and evaluated on, at the suite's resolution."""
    return {
        "num_classes": 10,
        "train_per_class": 16 if sizes.smoke else 1000,
        "val_per_class": max(sizes.aa_points // 10 + 1, 4),
        "image_size": sizes.resolution,
        "root": str(workdir / "synthetic"),
    }


def train_robust_model(sizes: Sizes, workdir: Path) -> Path:
    """A small model adversarially trained (2-step APGD-AT, Linf 4/255) on the synthetic shapes, through the
    command line; returns its checkpoint."""
    import yaml

    from robust_lightning.cli import main as cli

    run = workdir / "aa_model"
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu" if sizes.smoke else "auto",
            "devices": 1,
            "precision": "32-true" if sizes.smoke else "bf16-mixed",
            "max_epochs": 100,
            **sizes.aa_train,
            "limit_val_batches": 0,
            "num_sanity_val_steps": 0,
            "enable_progress_bar": False,  # the suite's log would hold every refresh of the bar
            "default_root_dir": str(run),
            "logger": False,
        },
        "checkpoint": {"dirpath": str(run / "checkpoints"), "enable_version_counter": False},
        "model": {"arch": sizes.aa_arch, "num_classes": 10, "lr": 2e-3, "warmup_epochs": 0.5, **AT},
        "data": {
            "source": {"class_path": "SyntheticSource", "init_args": aa_synthetic(sizes, workdir)},
            "image_size": sizes.resolution,
            "crop_scale": [0.35, 1.0],
            "batch_size": 32 if sizes.smoke else 128,
            "num_workers": 2 if sizes.smoke else 12,
        },
    }
    path = workdir / "aa_model.yaml"
    path.write_text(yaml.safe_dump(config))
    if cli(["fit", "--config", str(path)]) != 0:
        raise RuntimeError("training the AutoAttack model failed (its log is above)")
    return run / "checkpoints" / "last.ckpt"


def attack_synchronisations(model, x, y, device) -> dict[str, list[str]]:
    """Each attack of standard AutoAttack on one batch (a short budget: the code paths, not the figures), with its
    host-device synchronisations recorded after a warm-up run."""
    import torch
    from sync_probe import synchronisations

    from robust_lightning.attacks.apgd import apgd
    from robust_lightning.attacks.fab import fab_targeted
    from robust_lightning.attacks.square import square_attack

    with torch.no_grad():
        logits = model(x)
    target = torch.full_like(y, 2)  # the second most likely class: APGD-T's and FAB-T's first target
    attacks = {
        "apgd-ce": lambda: apgd(model, x, y, eps=4 / 255, n_iter=10, random_start=True, generator=0),
        "apgd-t": lambda: apgd(
            model,
            x,
            y,
            eps=4 / 255,
            n_iter=10,
            loss="dlr-targeted",
            y_target=logits.sort(1)[1][:, -2],
            random_start=True,
            generator=0,
        ),
        "fab-t": lambda: fab_targeted(model, x, y, eps=4 / 255, n_iter=10, target_rank=target, logits_clean=logits),
        "square": lambda: square_attack(model, x, y, eps=4 / 255, n_queries=100, generator=0, logits_clean=logits),
    }
    places = {}
    for name, attack in attacks.items():
        attack()  # warm-up: lazy initialisation may synchronise once
        with synchronisations(device) as found:
            attack()
        places[name] = found
    return places


def autoattack_section(sizes: Sizes, device, workdir: Path, record) -> None:
    from autoattack import first_images

    from robust_lightning.attacks.ensemble import AutoAttack
    from robust_lightning.data.sources import SyntheticSource
    from robust_lightning.training.lightning_module import ImageClassifier

    costs = pass_costs(sizes, device)
    record(
        "pass_costs_ms_per_image",
        {p: {k: round(v * 1000, 4) for k, v in c.items()} for p, c in costs.items()} | {"model": sizes.cost_model},
    )
    record("hours_per_checkpoint", measured_hours(costs))

    start = time.perf_counter()
    checkpoint = train_robust_model(sizes, workdir)
    record("training_s", round(time.perf_counter() - start, 1))
    module = ImageClassifier.load_from_checkpoint(checkpoint, map_location="cpu", weights_only=True, init_from=None)
    module = module.to(device).eval()
    x, y = first_images(module, sizes.aa_points, None, SyntheticSource(**aa_synthetic(sizes, workdir)))
    x, y = x.to(device), y.to(device)
    record("points", len(x))
    record("attack_synchronisations", attack_synchronisations(module, x, y, device))

    runs = {}
    # the reference first: without it no speedup can be computed, should the section run out of time
    for engine, precision in sizes.aa_runs:
        adversary = AutoAttack(
            module,
            norm="Linf",
            eps=sizes.aa_eps,
            seed=0,
            engine=engine,
            device=device,
            precision=precision,
            **sizes.aa_budget,
        )
        adversary.fab.n_iter = sizes.aa_fab_iterations
        report = adversary.evaluate(x, y, bs=sizes.aa_points)
        seconds = sum(report.seconds.values())
        name = f"{engine}_{precision}"
        runs[name] = report
        figures = {
            "seconds": round(seconds, 2),
            "seconds_per_attack": {k: round(v, 2) for k, v in report.seconds.items()},
            "clean_accuracy": report.clean_accuracy,
            "robust_accuracy": report.robust_accuracy,
            "robust_after": report.robust_after,
            "refuted_in_fp32": report.refuted,
        }
        if engine == "fast":
            reference = runs["reference_fp32"]
            figures["speedup"] = round(sum(reference.seconds.values()) / seconds, 2)
            figures["agreement"] = (report.robust == reference.robust).float().mean().item()
        record(name, figures)


# ---------------------------------------------------------------------------------------------- orchestration

SECTION_FUNCTIONS = {
    "steps": steps_section,
    "fit": fit_section,
    "autoattack": autoattack_section,
    "compile": compile_section,
    "max_batch": max_batch_section,
}


def child_environment() -> dict[str, str]:
    """The project and this folder importable without an installation (the device machine has none), output
    unbuffered."""
    paths = [str(ROOT), str(BENCHMARKS), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


def run_section(name: str, smoke: bool, workdir: Path, result: Path) -> None:
    """In the section's own process: run it, saving its figures to ``result`` after each one."""
    import torch

    device = torch.device("cpu" if smoke else "cuda")
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke on a machine without a GPU")
    figures: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}

    def record(key: str, value) -> None:
        figures[key] = value
        write_json(result, figures)

    record("torch", torch.__version__)
    SECTION_FUNCTIONS[name](Sizes(smoke), device, workdir, record)


def write_json(path: Path, value) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(value, indent=1, default=str))
    partial.replace(path)


def section_shares(names: list[str], smoke: bool, total: float) -> dict[str, float]:
    """Each section's share of the suite's budget, in proportion to its seconds in SECTIONS."""
    seconds = {name: SECTIONS[name][1 if smoke else 0] for name in names}
    return {name: total * s / sum(seconds.values()) for name, s in seconds.items()}


def missing_packages() -> list[str]:
    return [name for name in REQUIRED if importlib.util.find_spec(name) is None]


def orchestrate(args) -> int:
    exit_on_sigterm()
    missing = missing_packages()
    if missing:
        print(
            f"missing packages: {', '.join(missing)}. Install them, or run benchmarks/gpu_packages.sh on a machine "
            "with network and put the .gpu_packages folder it fills on PYTHONPATH (its header gives the command).",
            file=sys.stderr,
        )
        return 2
    started = time.monotonic()
    names = args.sections or list(SECTIONS)
    total = args.budget if args.budget is not None else (170 if args.smoke else 480)
    shares = section_shares(names, args.smoke, total)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.with_suffix(".log")
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "smoke": args.smoke,
        "budget_s": total,
        "sections": {},
    }
    with tempfile.TemporaryDirectory(prefix="gpu_suite-") as tmp, open(log_path, "w") as log:
        for index, name in enumerate(names):
            # its share, and what the sections before it left unused; never the later sections' shares
            limit = total - (time.monotonic() - started) - sum(shares[n] for n in names[index + 1 :])
            if limit < 5:
                report["sections"][name] = {"status": "skipped: no time left in the budget"}
                continue
            workdir = Path(tmp) / name
            workdir.mkdir()
            result = workdir / "result.json"
            print(f"[{name}] running, at most {limit:.0f} s", flush=True)
            log.write(f"===== {name} =====\n")
            log.flush()
            section_start = time.monotonic()
            status = run_child(section_command(name, args.smoke, workdir, result), limit, log)
            figures = json.loads(result.read_text()) if result.exists() else {}
            seconds = round(time.monotonic() - section_start, 1)
            report["sections"][name] = {"status": status, "seconds": seconds, **figures}
            print(f"[{name}] {status} in {seconds} s", flush=True)
            write_json(out, report)
    report["seconds"] = round(time.monotonic() - started, 1)
    write_json(out, report)
    print_table(report)
    print(f"figures: {out}; the sections' output: {log_path}")
    return 0 if all(s["status"] == "ok" for s in report["sections"].values()) else 1


def section_command(name: str, smoke: bool, workdir: Path, result: Path) -> list[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--workdir", str(workdir)]
    return command + ["--result", str(result), *(["--smoke"] if smoke else [])]


def run_child(command: list[str], limit: float, log) -> str:
    """Runs a section's command in a process group of its own. At its limit, and if this process is stopped itself,
    the whole group is killed (a fit's loader workers too), so that nothing outlives the suite."""
    process = subprocess.Popen(
        command, cwd=ROOT, env=child_environment(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        code = process.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        return f"stopped at its limit of {limit:.0f} s"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return "ok" if code == 0 else f"failed (exit {code}; see the log)"


def exit_on_sigterm() -> None:
    """SIGTERM (a time limit, a test's hard limit) ends the suite through its clean-up: the running section's
    process group is killed on the way out."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def grouped(places: list[str]) -> str:
    """'file:line in name x N, ...' for a list of synchronisation places."""
    counts: dict[str, int] = {}
    for place in places:
        counts[place] = counts.get(place, 0) + 1
    return ", ".join(f"{place} x {n}" for place, n in counts.items())


def table_rows(report: dict) -> list[tuple[str, str, object, str]]:
    """(section, figure, value, what it is compared with) for the figures a reader looks at first."""
    sections = report["sections"]
    rows = [(name, "status", section["status"], f"{section.get('seconds', 0)} s") for name, section in sections.items()]
    steps = sections.get("steps", {})
    for arch, figures in models_of(steps):
        limit = f"{figures['at_gflop_per_step']} GFLOP a step, {figures['at_share_of_ceiling']:.0%} of the bf16 ceiling"
        rows.append(
            ("steps", f"{arch} AT images/s, eager, batch {figures['batch']}", figures["at_images_per_s"], limit)
        )
        rows.append(("steps", f"{arch} AT step / clean step", figures["at_over_clean"], "about 8/3 in passes"))
        if "at_cudnn_benchmark_over_at" in figures:
            rows.append(
                ("steps", f"{arch} AT, cudnn.benchmark on / off", figures["at_cudnn_benchmark_over_at"], "< 1 helps")
            )
    fit = sections.get("fit", {})
    if fit.get("throughput"):
        throughput = fit["throughput"]
        rows.append(
            ("fit", "images/s, recipe on one device", round(throughput["images_per_s"], 1), "steps: AT images/s")
        )
        rows.append(
            (
                "fit",
                "share of step time waiting for data",
                throughput["data_wait_share"],
                f"< {TARGETS['data_wait_share']}",
            )
        )
    if fit.get("step_synchronisations") is not None:
        places = fit["step_synchronisations"]
        rows.append(("fit", "synchronisations in a training step", len(places), grouped(places) or "none"))
    autoattack = sections.get("autoattack", {})
    for attack, places in (autoattack.get("attack_synchronisations") or {}).items():
        rows.append(("autoattack", f"synchronisations in {attack}", len(places), grouped(places) or "none"))
    reference = autoattack.get("reference_fp32")
    if reference:
        accuracies = f"clean {reference['clean_accuracy']:.3f}, robust {reference['robust_accuracy']:.3f}"
        rows.append(("autoattack", f"reference on {autoattack['points']} points, s", reference["seconds"], accuracies))
    for name in ("fast_fp32", "fast_tf32", "fast_bf16"):
        run = autoattack.get(name)
        if run:
            compared = f">= {TARGETS['autoattack_speedup']:.0f}; robust accuracy {run['robust_accuracy']:.3f}, "
            compared += f"agreement {run['agreement']:.3f}"
            rows.append(("autoattack", f"{name}: speedup over the reference", run["speedup"], compared))
    if "hours_per_checkpoint" in autoattack:
        model = autoattack["pass_costs_ms_per_image"]["model"]
        rows.append(
            (
                "autoattack",
                f"hours of a checkpoint's evaluation, {model}",
                autoattack["hours_per_checkpoint"],
                "derived: 16.8 / 2.3 / 1.1",
            )
        )
    for arch, figures in models_of(sections.get("compile", {})):
        if "at_compiled_images_per_s" in figures:
            compared = f">= {TARGETS['at_compiled_images_per_s']:.0f}; eager {figures['at_images_per_s']}"
            rows.append(("compile", f"{arch} AT images/s, compiled", figures["at_compiled_images_per_s"], compared))
        if "at_compiled_compile_s" in figures:
            rows.append(
                (
                    "compile",
                    f"{arch} AT compile warm-up, s",
                    figures["at_compiled_compile_s"],
                    f"< {TARGETS['compile_seconds']:.0f}",
                )
            )
    for arch, figures in models_of(sections.get("max_batch", {})):
        if "largest" in figures:
            peak = figures["peak_gib_at_largest"]
            limit = "the search's limit: larger ones untried; " if figures["smallest_failing"] is None else ""
            memory = f"peak {peak} GiB" if peak is not None else "peak memory on a GPU only"
            rows.append(("max_batch", f"{arch} largest AT batch", figures["largest"], limit + memory))
    return rows


def models_of(section: dict) -> list[tuple[str, dict]]:
    """The per-model figures of a section (the entries that are dictionaries)."""
    return [
        (name, value)
        for name, value in section.items()
        if isinstance(value, dict) and ("batch" in value or "tried" in value)
    ]


def print_table(report: dict) -> None:
    rows = [("section", "figure", "value", "compared with"), *table_rows(report)]
    widths = [max(len(str(row[i])) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_suite.json", help="the JSON file of figures (a .log file beside it)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: the code paths, not figures")
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), help="run these sections only")
    parser.add_argument("--budget", type=float, help="seconds for the whole suite (480 on a GPU, 170 with --smoke)")
    parser.add_argument("--section", choices=list(SECTIONS), help=argparse.SUPPRESS)  # a section's own process
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.section:
        run_section(args.section, args.smoke, Path(args.workdir), Path(args.result))
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
