"""AutoAttack: our fast engine against the reference (pyautoattack 0.2.0) on the same model and points.

    make quickstart && python benchmarks/autoattack.py             # the quickstart's AT model, CPU, Linf 4/255
    python benchmarks/autoattack.py --ckpt CKPT --n 500 --norm L2 --eps 2.0 --device cuda

The points are the first ``--n`` images of the checkpoint's evaluation data (the built-in synthetic set by
default, ``--data-root`` for an ImageFolder tree with val/). Both engines run the standard ensemble
(APGD-CE, APGD-T, FAB-T, Square; or a quick mode, ``--version``) with the same seed and batch size, one after
the other. The last line printed
is a JSON object with both clean and robust accuracies, both times (in all and per attack), ``speedup`` =
reference time / fast time, ``agreement`` = the fraction of points both engines call robust or both call
broken, and ``checks_share_*`` = the time of the reference's checks over each engine's whole run.
"""

import argparse
import json

import torch

from robust_lightning.attacks.ensemble import VERSIONS, AutoAttack
from robust_lightning.data.datamodule import ImageNetDataModule
from robust_lightning.data.sources import FolderSource, SyntheticSource
from robust_lightning.training.lightning_module import ImageClassifier


def first_images(
    module: ImageClassifier, n: int, data_root: str | None, synthetic: SyntheticSource | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` evaluation images at the model's size: of the ImageFolder tree ``data_root``, else of the
    synthetic dataset ``synthetic`` (the built-in one by default)."""
    if data_root:
        source = dict(source=FolderSource(data_root))
    else:
        source = dict(source=synthetic or SyntheticSource())
    data = ImageNetDataModule(
        **source, image_size=module.hparams.image_size, eval_limit=n, eval_batch_size=n, num_workers=0
    )
    data.prepare_data()
    data.setup("test")
    batch = next(iter(data.test_dataloader()))
    return batch["image"].float() / 255, batch["label"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", default="runs/quickstart/checkpoints/last.ckpt")
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--norm", default="Linf", choices=["Linf", "L2", "L1"])
    parser.add_argument("--eps", type=float, default=None, help="default: 4/255, 2.0 or 75 by norm")
    parser.add_argument("--bs", type=int, default=250)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "bf16"])
    parser.add_argument(
        "--version",
        default="standard",
        choices=list(VERSIONS),
        help="standard, or a quick mode: apgd-t (40 iterations, 3 targets), apgd-ce (--n-iter steps)",
    )
    parser.add_argument("--n-iter", type=int, default=None, help="the quick modes' iterations")
    args = parser.parse_args()
    eps = args.eps if args.eps is not None else {"Linf": 4 / 255, "L2": 2.0, "L1": 75.0}[args.norm]

    module = ImageClassifier.load_from_checkpoint(args.ckpt, map_location="cpu", weights_only=True, init_from=None)
    module = module.to(args.device).eval()
    x, y = first_images(module, args.n, args.data_root)
    reports = {}
    for engine in ("fast", "reference"):
        adversary = AutoAttack(
            module,
            norm=args.norm,
            eps=eps,
            seed=0,
            engine=engine,
            device=args.device,
            version=args.version,
            n_iter=args.n_iter,
            precision=args.precision if engine == "fast" else "fp32",
        )
        reports[engine] = report = adversary.evaluate(x, y, bs=args.bs, progress=lambda line: print("   ", line))
        total = sum(report.seconds.values())
        print(
            f"{engine:>9}: clean {report.clean_accuracy:.2%}, robust {report.robust_accuracy:.2%}, {total:.1f} s "
            f"({', '.join(f'{k} {v:.1f} s' for k, v in report.seconds.items())})",
            flush=True,
        )
    fast, reference = reports["fast"], reports["reference"]
    fast_s, reference_s = sum(fast.seconds.values()), sum(reference.seconds.values())
    print(
        json.dumps(
            {
                "ckpt": args.ckpt,
                "n": len(x),
                "norm": args.norm,
                "eps": eps,
                "version": args.version,
                "device": args.device,
                "precision": args.precision,
                "channels_last_fast": fast.channels_last,
                "batchnorm_folded_fast": fast.batchnorm_folded,
                "clean_fast": fast.clean_accuracy,
                "clean_reference": reference.clean_accuracy,
                "robust_fast": fast.robust_accuracy,
                "robust_reference": reference.robust_accuracy,
                "time_fast": round(fast_s, 2),
                "time_reference": round(reference_s, 2),
                "speedup": round(reference_s / fast_s, 2),
                "seconds_fast": {k: round(v, 2) for k, v in fast.seconds.items()},
                "seconds_reference": {k: round(v, 2) for k, v in reference.seconds.items()},
                "agreement": (fast.robust == reference.robust).float().mean().item(),
                # the reference's checks (robust_lightning.attacks.checks) as a share of each engine's whole run
                "checks_share_fast": round(fast.seconds.get("checks", 0.0) / fast_s, 4),
                "checks_share_reference": round(reference.seconds.get("checks", 0.0) / reference_s, 4),
                "claims_refuted_in_fp32_fast": fast.refuted,
            }
        )
    )


if __name__ == "__main__":
    main()
