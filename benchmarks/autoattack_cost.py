"""What the default three-threat-model AutoAttack costs per checkpoint: ConvNeXt-B at 224 px on 5000 images.

    python benchmarks/autoattack_cost.py                       # derived: FLOPs counted here, GPU speed assumed
    python benchmarks/autoattack_cost.py --utilization 0.3 0.5

A derivation, not a measurement: no GPU was available. Three inputs:

1. FLOPs of one pass, counted with torch.utils.flop_counter on timm's convnext_base at 224 px (batch 1, CPU):
   a forward, and a forward plus the input's gradient (what every attack iteration takes).
2. The passes per image of standard AutoAttack (the ensemble of robust_lightning.attacks.ensemble): APGD-CE
   100 iterations (L1: 5 restarts) on every clean-correct point, counted in full (an upper bound: most broken
   points leave early); on every robust point APGD-T 100 iterations x 9 targets (L1: 5), FAB-T 100 iterations x
   9 targets (a forward-backward and a checking forward each) and Square's 5000 forwards. The clean and robust
   accuracies are Singh et al.'s for ConvNeXt-B + ConvStem, 50 epochs (Table 2, data/paper_results.csv).
3. An H100 SXM's dense peak (NVIDIA's datasheet: 989 TFLOP/s bf16, 495 tf32, 67 fp32) times an assumed share
   of it that the passes reach (``--utilization``).

bf16 and tf32 add an fp32 checking forward for each point an attack claims (both precisions verify every success
in fp32); refuted claims, which would be attacked again in fp32, are taken as none.
"""

import argparse
import csv
import json
from pathlib import Path

import timm
import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
IMAGES = 5000
PEAK_TFLOPS = {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4}  # H100 SXM5, dense
THREATS = {
    "Linf 4/255": ("autoattack_linf_4_255", 1, 9),
    "L2 2.0": ("autoattack_l2_2", 1, 9),
    "L1 75": ("autoattack_l1_75", 5, 5),
}  # (paper column, APGD-CE restarts, APGD-T targets)


def flops(model: torch.nn.Module, gradient: bool, size: int) -> int:
    x = torch.rand(1, 3, size, size, requires_grad=gradient)
    with FlopCounterMode(display=False) as counter:
        if gradient:  # the input's gradient only, as the attacks take it (the weights need none)
            model(x).logsumexp(1).sum().backward()
        else:
            with torch.no_grad():
                model(x)
    return counter.get_total_flops()


def paper_accuracies() -> dict[str, float]:
    with open(ROOT / "data" / "paper_results.csv") as f:
        row = next(r for r in csv.DictReader(f) if r["arch"] == "convnext_base_convstem" and r["epochs"] == "50")
    return {key: float(value) / 100 for key, value in row.items() if key == "clean" or key.startswith("autoattack_")}


def passes_per_image(clean: float, robust: float, restarts: int, targets: int) -> tuple[float, float]:
    """(forward-backward passes, forward passes) per evaluated image, averaged over the images."""
    backward = clean * 100 * restarts + robust * (100 * targets + 100 * 9)
    forward = 1 + robust * (100 * 9 + 5000)
    return backward, forward


def passes_per_checkpoint() -> dict[str, tuple[float, float]]:
    """(forward-backward passes, forward passes) of the default evaluation of one checkpoint on IMAGES images, per
    threat model, with the paper's ConvNeXt-B + ConvStem accuracies."""
    accuracies = paper_accuracies()
    passes = {}
    for name, (column, restarts, targets) in THREATS.items():
        n_backward, n_forward = passes_per_image(accuracies["clean"], accuracies[column], restarts, targets)
        passes[name] = (IMAGES * n_backward, IMAGES * n_forward)
    return passes


def fp32_check_forwards() -> float:
    """bf16 and tf32 add an fp32 forward for each point an attack claims: at most every clean-correct point of the
    three threat models (refuted claims, attacked again in fp32, taken as none)."""
    return IMAGES * len(THREATS) * paper_accuracies()["clean"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--utilization",
        type=float,
        nargs="+",
        default=[0.3, 0.5],
        help="assumed shares of the GPU's dense peak the passes reach",
    )
    args = parser.parse_args()
    model = timm.create_model("convnext_base", num_classes=1000).eval().requires_grad_(False)
    forward, backward = flops(model, False, 224), flops(model, True, 224)
    accuracies = paper_accuracies()
    print(
        f"convnext_base, 224 px: forward {forward / 1e9:.1f} GFLOP, forward + input gradient "
        f"{backward / 1e9:.1f} GFLOP (torch.utils.flop_counter)"
    )
    total = 0.0
    for name, (n_backward, n_forward) in passes_per_checkpoint().items():
        threat_flops = n_backward * backward + n_forward * forward
        total += threat_flops
        column = THREATS[name][0]
        print(
            f"{name}: clean {accuracies['clean']:.2%}, robust {accuracies[column]:.2%}: per image "
            f"{n_backward / IMAGES:.0f} forward-backward + {n_forward / IMAGES:.0f} forward passes, "
            f"{threat_flops / 1e15:.1f} PFLOP"
        )
    checks = fp32_check_forwards() * forward
    hours = {}
    for precision, peak in PEAK_TFLOPS.items():
        for share in args.utilization:
            seconds = total / (peak * 1e12 * share)
            if precision != "fp32":  # the claimed successes verified in fp32
                seconds += checks / (PEAK_TFLOPS["fp32"] * 1e12 * share)
            hours[f"{precision}@{share:.0%}"] = round(seconds / 3600, 2)
    print(f"all three threat models: {total / 1e15:.1f} PFLOP; hours on one H100 SXM (derived, not measured):")
    for key, value in hours.items():
        print(f"  {key} of peak: {value:.2f} h")
    print(
        json.dumps(
            {
                "forward_gflop": forward / 1e9,
                "forward_input_grad_gflop": backward / 1e9,
                "total_pflop": total / 1e15,
                "hours": hours,
            }
        )
    )


if __name__ == "__main__":
    main()
