"""Frequency-noise robustness (Park & Kim 2022, Fig. 2b; Chen et al. 2024): the accuracy drop under Gaussian
noise restricted to one band of spatial frequencies.

x_noise = x + F^-1(F(delta) * M_f), delta ~ N(0, noise_std^2) per pixel and channel in [0, 1] pixel space
(before the model's normaliser), M_f the band of normalised frequencies [f, f + width) (in units of pi; the
last band includes pi). The normalised frequency of a 2-D DFT bin is max(|w_y|, |w_x|) / pi with w in [-pi,
pi), so the bands of width 0.1 tile the spectrum [0, pi] exactly: the noise of all bands adds up to delta.
One delta per image and repeat is shared by every band, so the bands differ only in the frequencies they let
through. Reported: accuracy per band and its drop from the clean accuracy.
"""

from __future__ import annotations

import math

import torch
from tqdm import tqdm

from robust_lightning.analysis.base import Analysis, new_figure
from robust_lightning.errors import UserError

__all__ = ["FrequencyNoise", "band_edges", "band_mask", "band_noise", "normalised_frequency"]


def normalised_frequency(height: int, width: int, device=None) -> torch.Tensor:
    """(H, W) max(|w_y|, |w_x|) / pi of each DFT bin (unshifted layout), in [0, 1]."""
    fy = (2 * torch.fft.fftfreq(height, device=device)).abs()
    fx = (2 * torch.fft.fftfreq(width, device=device)).abs()
    return torch.maximum(fy[:, None], fx[None, :])


def band_mask(height: int, width: int, low: float, high: float, closed: bool = False, device=None) -> torch.Tensor:
    """(H, W) float mask of the bins with low <= frequency < high (<= high when ``closed``), frequencies in pi."""
    freq = normalised_frequency(height, width, device)
    upper = freq <= high + 1e-9 if closed else freq < high - 1e-9
    return ((freq >= low - 1e-9) & upper).float()


def band_edges(width: float) -> list[tuple[float, float]]:
    """[(low, high)] covering [0, 1] (units of pi) in steps of ``width``; the last band may be narrower."""
    count = math.ceil(1 / width - 1e-9)
    return [(round(i * width, 10), round(min((i + 1) * width, 1.0), 10)) for i in range(count)]


def band_noise(delta: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """F^-1(F(delta) * mask) over the last two dimensions (real: the mask is symmetric under w -> -w)."""
    return torch.fft.ifft2(torch.fft.fft2(delta) * mask).real


class FrequencyNoise(Analysis):
    """Accuracy under band-limited Gaussian noise, one band at a time.

    Args:
        width: band width in units of pi (0.1 as the papers).
        noise_std: standard deviation of delta in [0, 1] pixel units.
        repeats: noise draws per image (accuracies averaged).
        clamp: clip the noisy image to [0, 1] (the papers do not).
        seed: seed of the noise.
        max_images, batch_size, weights, plot: see Analysis.
    """

    name = "frequency_noise"

    def __init__(self, width: float = 0.1, noise_std: float = 0.1, repeats: int = 1, clamp: bool = False,
                 seed: int = 0, max_images: int = 256, batch_size: int = 64, weights: str = "raw", plot: bool = True):
        super().__init__(max_images=max_images, batch_size=batch_size, weights=weights, plot=plot)
        if not 0 < width <= 1 or noise_std < 0 or repeats < 1:
            raise UserError("FrequencyNoise: width must be in (0, 1], noise_std >= 0 and repeats >= 1")
        self.width, self.noise_std, self.repeats, self.clamp, self.seed = width, noise_std, repeats, clamp, seed

    def analyse(self, trainer, pl_module):
        model = self.model(pl_module)
        edges = band_edges(self.width)
        correct = torch.zeros(len(edges) + 1, dtype=torch.long)  # + 1: the unfiltered (white) noise
        clean_correct, seen = 0, 0
        generator = None
        with torch.no_grad():
            for images, labels in tqdm(self.batches(trainer, pl_module), desc="frequency noise", leave=False,
                                       disable=not trainer.is_global_zero, total=math.ceil(self.max_images / self.batch_size)):
                if generator is None:
                    generator = torch.Generator(device=images.device).manual_seed(self.seed)
                height, width = images.shape[-2:]
                masks = [band_mask(height, width, lo, hi, closed=i == len(edges) - 1, device=images.device)
                         for i, (lo, hi) in enumerate(edges)]
                clean_correct += int((model(images).argmax(-1) == labels).sum())
                seen += len(images)
                for _ in range(self.repeats):
                    delta = torch.randn(images.shape, generator=generator, device=images.device) * self.noise_std
                    for i, noise in enumerate([*(band_noise(delta, m) for m in masks), delta]):
                        noisy = images + noise
                        if self.clamp:
                            noisy = noisy.clamp(0, 1)
                        correct[i] += int((model(noisy).argmax(-1) == labels).sum())
        clean = clean_correct / seen
        accuracy = (correct.double() / (seen * self.repeats)).tolist()
        bands = [{"low": lo, "high": hi, "centre": (lo + hi) / 2, "accuracy": acc, "drop": clean - acc}
                 for (lo, hi), acc in zip(edges, accuracy)]
        section = {
            "clean_accuracy": clean, "bands": bands, "white_noise": {"accuracy": accuracy[-1], "drop": clean - accuracy[-1]},
            "conditions": {"arch": pl_module.hparams.get("arch"), "width": self.width, "noise_std": self.noise_std,
                           "repeats": self.repeats, "clamp": self.clamp, "seed": self.seed,
                           "image_size": [height, width], "space": "[0, 1] pixels, before the model's normaliser",
                           "frequency": "max(|w_y|, |w_x|) / pi of the 2-D DFT bin"},
        }
        metrics = {"clean_accuracy": clean, "white_noise_drop": clean - accuracy[-1],
                   **{f"drop_{b['low']:g}": b["drop"] for b in bands}}
        if not self.plot:
            return section, metrics, None
        fig, ax = new_figure(figsize=(6.5, 4))
        ax.plot([b["centre"] for b in bands], [100 * b["drop"] for b in bands], marker="o")
        ax.set_xlabel("noise frequency band centre (x pi)")
        ax.set_ylabel("accuracy drop (percentage points)")
        ax.set_title(f"Band-limited Gaussian noise (σ={self.noise_std:g}, width {self.width:g}π)")
        ax.set_xlim(0, 1)
        fig.tight_layout()
        return section, metrics, fig
