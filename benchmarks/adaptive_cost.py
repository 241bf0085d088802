"""What the adaptive attacks cost next to the AutoAttack run they answer, measured in one run on the same points.

    python benchmarks/adaptive_cost.py                  # the tests' small CNN, 16 x 16 images, CPU, Linf 16/255
    python benchmarks/adaptive_cost.py --n 500 --version standard

The network (tests/helpers.py's train_small_cnn) is evaluated twice: plain, where no check is raised and nothing but
AutoAttack runs, and behind an input quantisation (round(16x)/16, tests/attack_zoo.py), whose zero gradients call
for BPDA, a transfer attack and Square from scratch. For each it prints AutoAttack's seconds, the adaptive attacks'
seconds, their ratio, and the robust accuracies: AutoAttack's and the reported one. It then times the plain network
with adaptive="none" and adaptive="auto", whose ratio shows what the checks add where they raise nothing. The last
line is a JSON object of the same figures. Times are of this machine, one run: compare the ratios, not the seconds.
"""

import argparse
import json
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

from attack_zoo import quantised  # noqa: E402 (tests/ on the path first)
from helpers import synthetic_points, train_small_cnn  # noqa: E402
from robust_lightning.attacks import AutoAttack  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--eps", type=float, default=16 / 255)
    parser.add_argument("--version", default="apgd-t")
    parser.add_argument("--n-iter", type=int, default=20)
    parser.add_argument("--n-queries", type=int, default=500)
    args = parser.parse_args()

    net = train_small_cnn()
    x, y = synthetic_points(args.n, seed=5)
    figures = {}
    for name, model, parts in (("plain", net, []), ("quantised", quantised(net), ["quantise"])):
        adversary = AutoAttack(
            model,
            norm="Linf",
            eps=args.eps,
            version=args.version,
            n_iter=args.n_iter,
            n_queries=args.n_queries,
            verbose=False,
            bpda=parts,
        )
        report = adversary.evaluate(x, y, bs=len(x))
        adaptive = sum(seconds for attack, seconds in report.seconds.items() if attack.startswith("adaptive_"))
        standard = sum(seconds for attack, seconds in report.seconds.items() if not attack.startswith("adaptive_"))
        figures[name] = {
            "autoattack_seconds": round(standard, 2),
            "adaptive_seconds": round(adaptive, 2),
            "adaptive_over_autoattack": round(adaptive / standard, 3),
            "adaptive_attacks": sorted(report.adaptive),
            "robust_accuracy": report.robust_accuracy,
            "reported_robust_accuracy": report.reported_robust_accuracy,
        }
        print(
            f"{name}: AutoAttack {standard:.1f} s, adaptive attacks {adaptive:.1f} s "
            f"({adaptive / standard:.2f} x) [{', '.join(sorted(report.adaptive)) or 'none'}]; robust accuracy "
            f"{report.robust_accuracy:.1%}, reported {report.reported_robust_accuracy:.1%}"
        )
    # on the plain network, "auto" must cost no more than "none": the only addition is counting zero gradients
    # that APGD computes anyway
    for adaptive in ("none", "auto"):
        adversary = AutoAttack(
            net,
            norm="Linf",
            eps=args.eps,
            version=args.version,
            n_iter=args.n_iter,
            n_queries=args.n_queries,
            verbose=False,
            adaptive=adaptive,
        )
        start = time.perf_counter()
        adversary.evaluate(x, y, bs=len(x))
        figures[f"plain_adaptive_{adaptive}_seconds"] = round(time.perf_counter() - start, 2)
    ratio = figures["plain_adaptive_auto_seconds"] / figures["plain_adaptive_none_seconds"]
    figures["plain_auto_over_none"] = round(ratio, 3)
    print(f"plain, adaptive='auto' over adaptive='none': {ratio:.2f} x")
    print(json.dumps({"n": args.n, "eps": args.eps, "version": args.version, **figures}))


if __name__ == "__main__":
    main()
