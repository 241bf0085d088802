"""The RMS calibration error of ImageNet-A/R against a direct numpy transcription of its definition in
hendrycks/natural-adv-examples (calibration_tools.calib_err, p='2', beta=100)."""

import math

import numpy as np
import pytest
import torch

from robust_lightning.evaluation.calibration import rms_calibration_error


def numpy_rms_calibration_error(confidence: np.ndarray, correct: np.ndarray, beta: int = 100) -> float:
    order = np.argsort(confidence, kind="stable")
    confidence, correct = confidence[order], correct[order].astype(float)
    starts = list(range(0, (len(confidence) // beta) * beta, beta))
    ends = starts[1:] + [len(confidence)]
    squared = 0.0
    for start, end in list(zip(starts, ends))[:-1]:  # the reference's loop leaves out the last bin
        squared += (end - start) / len(confidence) * (confidence[start:end].mean() - correct[start:end].mean()) ** 2
    return math.sqrt(squared)


@pytest.mark.parametrize("count", [200, 1000, 1234])
def test_rms_calibration_error_matches_a_direct_numpy_version(count):
    rng = np.random.default_rng(count)
    confidence = rng.uniform(0.05, 1.0, count)
    correct = rng.uniform(size=count) < confidence**3  # overconfident on purpose
    ours = rms_calibration_error(torch.tensor(confidence), torch.tensor(correct))
    assert ours == pytest.approx(numpy_rms_calibration_error(confidence, correct), abs=1e-12)
    assert ours > 0.05


def test_rms_calibration_error_leaves_out_the_most_confident_bin_as_the_reference_does():
    # 300 images: bins [0, 100), [100, 200), [200, 300); only the last bin is miscalibrated
    confidence = torch.cat(
        [
            torch.full((100,), 0.3, dtype=torch.float64),
            torch.full((100,), 0.6, dtype=torch.float64),
            torch.full((100,), 0.99, dtype=torch.float64),
        ]
    )
    correct = torch.cat([torch.arange(100) < 30, torch.arange(100) < 60, torch.zeros(100, dtype=torch.bool)])
    assert rms_calibration_error(confidence, correct) == pytest.approx(0.0, abs=1e-12)
    correct[:100] = False  # now the first bin is 0.3 off on a third of the images
    assert rms_calibration_error(confidence, correct) == pytest.approx(math.sqrt(0.3**2 / 3), abs=1e-12)


def test_rms_calibration_error_is_nan_below_two_bins():
    assert math.isnan(rms_calibration_error(torch.rand(199), torch.ones(199, dtype=torch.bool)))
