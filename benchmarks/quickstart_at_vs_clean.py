"""Does the quickstart's adversarial training buy robustness? Stage 1 (configs/quickstart_clean.yaml) trains
the clean model once; stage 2 (configs/quickstart.yaml) then continues from it twice, with APGD-AT as
configured and without the attack (--model.attack none, everything else equal). Both final models are
measured the same way: clean and 10-step APGD-CE Linf 4/255 robust accuracy on the 1000 validation images.

    python benchmarks/quickstart_at_vs_clean.py            # about 6 minutes on 2 CPU cores

The last line printed is a JSON object with both runs' accuracies and `robust_gain` (AT minus clean, points).
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def fit(config: str, name: str, root: Path, *extra: str) -> dict:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "robust_lightning",
            "fit",
            "--config",
            str(REPO / "configs" / config),
            "--trainer.logger.init_args.save_dir",
            str(root),
            "--trainer.logger.init_args.name",
            name,
            "--trainer.default_root_dir",
            str(root / name),
            "--trainer.enable_progress_bar",
            "false",
            "--checkpoint.dirpath",
            str(root / name / "checkpoints"),
            *extra,
        ],  # not the configs' runs/quickstart/...
        check=True,
        cwd=REPO,
    )
    results = json.loads(next((root / name).glob("version_*/results.json")).read_text())["fit"]
    metrics = results["metrics"]
    return {
        "clean_acc": round(metrics["val/acc1"], 4),
        "robust_acc": round(metrics.get("val/robust_acc", -1), 4),
        "seconds": results["seconds"],
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        stage1 = root / "stage1"
        fit("quickstart_clean.yaml", "stage1", root, "--checkpoint.dirpath", str(stage1))
        warm = ("--model.init_from", str(stage1 / "last.ckpt"))
        adversarial = fit("quickstart.yaml", "apgd_at", root, *warm)
        clean = fit("quickstart.yaml", "clean", root, *warm, "--model.attack", "none")
    result = {
        "apgd_at": adversarial,
        "clean": clean,
        "robust_gain": round(100 * (adversarial["robust_acc"] - clean["robust_acc"]), 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
