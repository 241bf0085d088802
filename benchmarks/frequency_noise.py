"""Does FrequencyNoise separate a ConvNet from a ViT, as Park & Kim Fig. 2b and Chen et al. Fig. 8 show on ImageNet?

Two small models are trained clean on the built-in synthetic shapes (32 px) with the family quickstarts:
the ResNet-18 of configs/quickstart_clean.yaml as it is (4 epochs), and the ViT of configs/quickstart_vit.yaml
(timm's test_vit, 4-px patches) for 12 epochs at lr 5e-4 with a 1-epoch warm-up (at the config's 2e-3 it stays
at chance). configs/analysis/frequency_noise_parkkim_fig2b.yaml then measures each on the same 500 validation
images at three sizes: the default eps 0.7 (the code Park posted, how-do-vits-work issue 44), every band scaled
to 20.4 grey levels RMS (rms_grey_levels 20.4), and the repository's Random default eps 0.007.

    python benchmarks/frequency_noise.py            # about 5 minutes on 2 CPU cores

It prints each model's accuracy drop per band (points) and, as the last line, a JSON object with the curves and
the mean drop over the low (0.1-0.3 pi) and high (0.6-1.0 pi) bands.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# per family: the config and what the benchmark changes in it
FAMILIES = {
    "resnet18": ("quickstart_clean.yaml", ()),
    "vit": ("quickstart_vit.yaml", ("--trainer.max_epochs", "12", "--model.lr", "5e-4", "--model.warmup_epochs", "1")),
}
IMAGES = 500
LOW, HIGH = (0.1, 0.3), (0.6, 1.0)
# the default size (Park's issue 44 code), every band at one stated size, and the repository's Random default
CALLBACK = "--trainer.callbacks.init_args."
SIZES = {
    "eps 0.7": (),
    "20.4 grey levels": (CALLBACK + "rms_grey_levels", "20.4"),
    "eps 0.007": (CALLBACK + "eps", "0.007"),
}


def run(command: str, config: Path, name: str, root: Path, *args: str) -> dict:
    """robust-lightning COMMAND with its run directory root/name (not the config's runs/...); its results.json."""
    where = ["--trainer.logger.init_args.save_dir", str(root), "--trainer.logger.init_args.name", name]
    where += ["--trainer.default_root_dir", str(root / name), "--trainer.enable_progress_bar", "false"]
    command_line = [sys.executable, "-m", "robust_lightning", command, "--config", str(config), *where, *args]
    subprocess.run(command_line, check=True, cwd=REPO)
    return json.loads(next((root / name).glob("version_*/results.json")).read_text())


def fit(config: str, name: str, root: Path, *extra: str) -> tuple[Path, float]:
    checkpoints = ["--checkpoint.dirpath", str(root / name / "checkpoints")]
    limits = ["--trainer.limit_train_batches", "null", "--trainer.limit_val_batches", "null"]
    fitted = run("fit", REPO / "configs" / config, name, root, *checkpoints, *limits, *extra)["fit"]
    return root / name / "checkpoints" / "last.ckpt", fitted["metrics"]["val/acc1"]


def frequency_noise(checkpoint: Path, name: str, root: Path, *extra: str) -> dict:
    config = REPO / "configs" / "analysis" / "frequency_noise_parkkim_fig2b.yaml"
    images = [CALLBACK + "max_images", str(IMAGES), "--data.eval_limit", str(IMAGES)]
    return run("test", config, name, root, "--ckpt_path", str(checkpoint), *images, *extra)["frequency_noise"]


def mean_drop(section: dict, band: tuple[float, float]) -> float:
    drops = [b["drop"] for b in section["bands"] if band[0] - 1e-9 <= b["centre"] <= band[1] + 1e-9]
    return round(100 * sum(drops) / len(drops), 1)


def main() -> None:
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for family, (config, changes) in FAMILIES.items():
            checkpoint, val_acc = fit(config, family, root, *changes)
            for index, (size, extra) in enumerate(SIZES.items()):
                section = frequency_noise(checkpoint, f"{family}-{index}", root, *extra)
                curve = {f"{b['centre']:.1f}": round(100 * b["drop"], 1) for b in section["bands"]}
                rms = [round(b["noise_rms_grey_levels"], 2) for b in section["bands"] if b["bins"]]
                result.setdefault(family, {"val_acc1": round(val_acc, 4)})[size] = {
                    "clean_accuracy": round(section["clean_accuracy"], 4),
                    "drop_points_by_band_centre_pi": curve,
                    "noise_rms_grey_levels": [min(rms), max(rms)],
                    "low_band_mean_drop": mean_drop(section, LOW),
                    "high_band_mean_drop": mean_drop(section, HIGH),
                }
    for family, sizes in result.items():
        for size, numbers in sizes.items():
            if isinstance(numbers, dict):
                curve = " ".join(f"{v:+.1f}" for v in numbers["drop_points_by_band_centre_pi"].values())
                print(f"{family:>8} {size:>16}: drop (points) at 0, 0.1, ..., 1.0 pi: {curve}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
