"""Expected calibration error (ECE): one definition for every benchmark and for the test loop.

Equal-width confidence bins (lo, hi]: ECE = sum over bins of |accuracy - mean confidence| x share of images.
torchmetrics' CalibrationError bins [lo, hi), which moves confidences that sit on a bin edge, and it softmaxes
logits itself; ``CalibrationError`` here keeps our binning and sums per-bin counts across ranks, so the
distributed value is exact.

RMS calibration error: the number Hendrycks et al. publish for ImageNet-A/R (``calib_err(p='2', beta=100)`` in
the calibration_tools.py of hendrycks/natural-adv-examples): images sorted by confidence into adaptive bins of
100 (the last bin takes the remainder), sqrt of the share-weighted squared |mean confidence - accuracy| per
bin. That code's loop stops one bin early, so the most confident bin never counts; we follow the code, since
that is what the published numbers measure.
"""

import itertools
from typing import Any

import torch
from torchmetrics import Metric

ECE_BINS = 15


def calibration_bins(confidence: torch.Tensor, correct: torch.Tensor, bins: int = ECE_BINS) -> torch.Tensor:
    """Per bin: (number correct, sum of confidences, number of images), float64, shape (3, bins)."""
    confidence, correct = confidence.double(), correct.double()
    edges = torch.linspace(0, 1, bins + 1, dtype=torch.float64, device=confidence.device)
    bin_index = (torch.bucketize(confidence, edges) - 1).clamp(0, bins - 1)  # (lo, hi]; 0 joins the first bin
    sums = torch.zeros(3, bins, dtype=torch.float64, device=confidence.device)
    for row, values in enumerate((correct, confidence, torch.ones_like(confidence))):
        sums[row].index_add_(0, bin_index, values)
    return sums


def ece_from_bins(sums: torch.Tensor) -> float:
    correct, confidence, count = sums
    ece: float = ((correct - confidence).abs().sum() / count.sum()).item()
    return ece


def expected_calibration_error(confidence: torch.Tensor, correct: torch.Tensor, bins: int = ECE_BINS) -> float:
    return ece_from_bins(calibration_bins(confidence, correct, bins))


RMS_BIN_SIZE = 100


def rms_calibration_error(confidence: torch.Tensor, correct: torch.Tensor, bin_size: int = RMS_BIN_SIZE) -> float:
    """RMS calibration error over adaptive bins of ``bin_size`` images (see the module docstring); NaN with fewer
    than two bins' worth of images, where the reference code measures nothing (one bin, skipped) or fails."""
    count = len(confidence)
    if count < 2 * bin_size:
        return float("nan")
    order = torch.argsort(confidence.double(), stable=True)
    confidence, correct = confidence.double()[order], correct.double()[order]
    bins = count // bin_size
    edges = [i * bin_size for i in range(bins)] + [count]  # the last bin runs to the end
    total = 0.0
    for lo, hi in itertools.pairwise(edges[:-1]):  # every bin but the last, as the reference's loop
        gap = confidence[lo:hi].mean() - correct[lo:hi].mean()
        total += (hi - lo) / count * gap.item() ** 2
    rms: float = total**0.5
    return rms


class CalibrationError(Metric):
    """ECE of top-1 predictions from logits: confidence = max softmax, correct = argmax equals the label."""

    sums: torch.Tensor  # a state (add_state)

    full_state_update = False

    def __init__(self, bins: int = ECE_BINS, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bins = bins
        self.add_state("sums", torch.zeros(3, bins, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        confidence, prediction = logits.float().softmax(1).max(1)
        self.sums += calibration_bins(confidence, prediction == labels, self.bins)

    def compute(self) -> torch.Tensor:
        return torch.tensor(ece_from_bins(self.sums) if self.sums[2].sum() > 0 else float("nan"))
