"""What the checks cost against the AutoAttack run they qualify, on the same model and points.

    make quickstart && python benchmarks/checks_cost.py        # the quickstart's AT model, CPU, Linf 4/255, 100 points
    python benchmarks/checks_cost.py --ckpt CKPT --n 500 --device cuda

Standard AutoAttack (fast engine) runs on the first ``--n`` evaluation images with the reference's checks on (their
time is in its report, ``checks``), then the sanity checks of Carlini et al. on the first ``--sanity-points`` of
them, as the AutoAttack evaluation runs them. The last line is a JSON object: each time, and each group's share of
the AutoAttack run (the checks' share of its whole time; the sanity checks' time over the AutoAttack run's).
"""

import argparse
import json
import time

from autoattack import first_images  # benchmarks/autoattack.py

from robust_lightning.attacks.ensemble import AutoAttack
from robust_lightning.attacks.sanity import sanity_checks
from robust_lightning.training.lightning_module import ImageClassifier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", default="runs/quickstart/checkpoints/last.ckpt")
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--sanity-points", type=int, default=200)
    parser.add_argument("--norm", default="Linf", choices=["Linf", "L2", "L1"])
    parser.add_argument("--eps", type=float, default=4 / 255)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    module = ImageClassifier.load_from_checkpoint(args.ckpt, map_location="cpu", weights_only=True, init_from=None)
    module = module.to(args.device).eval()
    x, y = first_images(module, args.n, args.data_root)
    adversary = AutoAttack(module, norm=args.norm, eps=args.eps, seed=0, device=args.device, verbose=False)
    report = adversary.evaluate(x, y, bs=len(x))
    autoattack_s = sum(report.seconds.values())
    started = time.perf_counter()
    sane = sanity_checks(
        module, x[: args.sanity_points].to(args.device), y[: args.sanity_points].to(args.device), args.norm, args.eps
    )
    sanity_s = time.perf_counter() - started
    print(f"AutoAttack {autoattack_s:.1f} s, of it the reference's checks {report.seconds['checks']:.2f} s")
    print(f"sanity checks on {min(args.n, args.sanity_points)} points: {sanity_s:.1f} s")
    for check in [*report.checks, *sane]:
        print(f"  {check.name}: {'RAISED' if check.raised else 'ok'} {check.figures}")
    print(
        json.dumps(
            {
                "ckpt": args.ckpt,
                "n": len(x),
                "norm": args.norm,
                "eps": args.eps,
                "device": args.device,
                "autoattack_seconds": round(autoattack_s, 2),
                "reference_checks_seconds": round(report.seconds["checks"], 3),
                "reference_checks_share": round(report.seconds["checks"] / autoattack_s, 4),
                "sanity_points": min(args.n, args.sanity_points),
                "sanity_seconds": round(sanity_s, 2),
                "sanity_over_autoattack": round(sanity_s / autoattack_s, 4),
                "raised": [check.name for check in [*report.checks, *sane] if check.raised],
            }
        )
    )


if __name__ == "__main__":
    main()
