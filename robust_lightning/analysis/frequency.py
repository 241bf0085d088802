"""Frequency-noise robustness (Park & Kim 2022, Fig. 2b; Chen et al. 2024): the accuracy drop under random
noise restricted to one band of spatial frequencies, x_noise = x + F^-1(F(delta) * M_f).

Two protocols (``protocol``):

- ``code`` (the default): Park & Kim's code, github.com/xxxnell/how-do-vits-work ops/adversarial.py,
  ``FreqAttack(Random(eps), f=f, s=s)``. delta = eps * sign(N(0, 1)) per pixel and channel (``Random``), added to
  the inputs their datasets give: images normalised by ImageNet's std (0.229, 0.224, 0.225). So here delta is
  eps * that std in [0, 1] pixels, whatever normaliser the model has: every model gets the same noise. The mask
  (``_fourier_mask``) is the difference of two squares centred on frequency 0 of the rolled spectrum, of sides
  int((f +- s) n / 2 pi) * 2 (clipped to [0, n]): a square of side 2m covers the DFT
  bins -m .. m - 1 along each axis; the filtered noise is the real part of the inverse FFT. Bands are centred
  on f = 0, width, 2 width, ..., pi with s = width / 2 (the paper's window of 0.1 pi). Square, even-sized images
  only, as their code.
- ``paper``: the paper's text: delta ~ N(0, noise_std^2) in [0, 1] pixel space, M_f the DFT bins whose
  normalised frequency max(|w_y|, |w_x|) / pi lies in [f, f + width) (the last band includes pi), so the bands
  tile the spectrum and the noise of all bands adds up to delta.

One delta per image and repeat is shared by every band, so the bands differ only in the frequencies they let
through. Reported: accuracy per band and its drop from the clean accuracy.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from lightning import Trainer
from timm.data import IMAGENET_DEFAULT_STD

from robust_lightning.analysis.core import (
    AnalysedModule,
    Analysis,
    AnalysisResult,
    Section,
    family_style,
    model_label,
    new_figure,
    pi_axis,
)
from robust_lightning.console import tqdm
from robust_lightning.errors import UserError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "FrequencyNoise",
    "band_edges",
    "band_mask",
    "band_noise",
    "code_band_mask",
    "code_bands",
    "normalised_frequency",
    "sign_noise",
]

PROTOCOLS = ("code", "paper")
# the sign noise's size in Park's code for frequency-based noise (github.com/xxxnell/how-do-vits-work/issues/44)
PARK_ISSUE_44_EPS = 0.7


def normalised_frequency(height: int, width: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(H, W) max(|w_y|, |w_x|) / pi of each DFT bin (unshifted layout), in [0, 1]."""
    fy = (2 * torch.fft.fftfreq(height, device=device)).abs()
    fx = (2 * torch.fft.fftfreq(width, device=device)).abs()
    return torch.maximum(fy[:, None], fx[None, :])


def band_mask(
    height: int, width: int, low: float, high: float, closed: bool = False, device: torch.device | str | None = None
) -> torch.Tensor:
    """(H, W) float mask of the bins with low <= frequency < high (<= high when ``closed``), frequencies in pi."""
    freq = normalised_frequency(height, width, device)
    upper = freq <= high + 1e-9 if closed else freq < high - 1e-9
    return ((freq >= low - 1e-9) & upper).float()


def band_edges(width: float) -> list[tuple[float, float]]:
    """[(low, high)] covering [0, 1] (units of pi) in steps of ``width``; the last band may be narrower."""
    count = math.ceil(1 / width - 1e-9)
    return [(round(i * width, 10), round(min((i + 1) * width, 1.0), 10)) for i in range(count)]


def band_noise(delta: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Re F^-1(F(delta) * mask) over the last two dimensions (the real part, as Park & Kim's code takes; for a
    mask symmetric under w -> -w the inverse is real anyway)."""
    real: torch.Tensor = torch.fft.ifft2(torch.fft.fft2(delta) * mask).real
    return real


def _code_half_side(size: int, edge: float) -> int:
    """Half the side of Park & Kim's centred square for a band edge ``edge`` (radians): int(edge n / 2 pi)."""
    side = int((edge * size) / (2 * math.pi)) * 2
    return min(max(side, 0), size) // 2


def code_band_mask(size: int, f: float, s: float, device: torch.device | str | None = None) -> torch.Tensor:
    """(n, n) 0/1 mask, unshifted DFT layout, of Park & Kim's ``FreqAttack._fourier_mask`` for centre ``f`` and
    half-width ``s`` (radians): the square of DFT bins -m1 .. m1 - 1 along each axis minus that of m2, with
    m = int((f +- s) n / 2 pi) (their ``_center_mask`` of side 2m padded to n in the spectrum rolled by n / 2)."""
    outer, inner = _code_half_side(size, f + s), _code_half_side(size, f - s)
    offset = torch.round(torch.fft.fftfreq(size, device=device) * size).long()  # signed bin: -n/2 .. n/2 - 1

    def square(m: int) -> torch.Tensor:
        inside = (offset >= -m) & (offset <= m - 1)
        return inside[:, None] & inside[None, :]

    return (square(outer) & ~square(inner)).float()


def code_bands(width: float) -> list[float]:
    """Band centres f (units of pi) 0, width, ..., 1 of the code protocol."""
    return [round(i * width, 10) for i in range(round(1 / width) + 1) if i * width <= 1 + 1e-9]


def scaled_to_rms(noise: torch.Tensor, rms: float) -> torch.Tensor:
    """Each image's noise (N x C x H x W) scaled to root mean square ``rms`` over its pixels and channels."""
    current = noise.pow(2).mean(dim=(1, 2, 3), keepdim=True).sqrt()
    return noise * (rms / current.clamp_min(torch.finfo(noise.dtype).tiny))


def sign_noise(
    shape: tuple[int, ...], eps: float, generator: torch.Generator, device: torch.device | str | None = None
) -> torch.Tensor:
    """eps * sign(N(0, 1)) (Park & Kim's ``Random`` attack): +-eps per entry."""
    return eps * torch.randn(shape, generator=generator, device=device).sign()


class FrequencyNoise(Analysis):
    """Accuracy under band-limited random noise, one band at a time.

    Args:
        protocol: "code" (Park & Kim's code: sign noise of size eps in ImageNet-normalised units, centred square
            bands) or "paper" (the paper's text: Gaussian noise of std noise_std in pixel space, tiling bands).
        width: band width in units of pi (0.1 as the papers).
        eps: size of the sign noise (protocol code), in units of ImageNet's normalised inputs (eps * ImageNet's std
            in [0, 1] pixels, the model's own normaliser aside). The default, 0.7, is
            the size Park posted as the code that makes the paper's frequency-based noise
            (github.com/xxxnell/how-do-vits-work/issues/44: ``Random(eps=0.7, sign=True)`` wrapped in
            ``FreqAttack``); the script that drew Fig. 2b is not in the repository (issue 23 there). The repository's
            ops/adversarial.py keeps ``Random``'s torchattacks default, 0.007, under one grey level per band.
        noise_std: standard deviation of the Gaussian delta in [0, 1] pixel units (protocol paper).
        rms_grey_levels: None (the default) keeps the protocol's draw filtered to the band, as Park's code: a band
            holds its share of the draw's energy. A number scales every band's noise (and the white noise) to that
            root mean square over each image's pixels, in grey levels (0-255), so that bands compare at one size;
            20.4 is ImageNet-C's mildest Gaussian noise (std 0.08 in [0, 1], Hendrycks & Dietterich 2019).
            benchmarks/frequency_noise.py shows the curves both give for a small ConvNet and a small ViT.
        repeats: noise draws per image (accuracies averaged).
        clamp: clip the noisy image to [0, 1] (the papers do not).
        seed: seed of the noise.
        max_images, batch_size, weights, plot: see Analysis.
    """

    name = "frequency_noise"

    def __init__(
        self,
        protocol: str = "code",
        width: float = 0.1,
        eps: float = PARK_ISSUE_44_EPS,
        noise_std: float = 0.1,
        rms_grey_levels: float | None = None,
        repeats: int = 1,
        clamp: bool = False,
        seed: int = 0,
        max_images: int = 256,
        batch_size: int = 64,
        weights: str = "raw",
        plot: bool = True,
    ):
        super().__init__(max_images=max_images, batch_size=batch_size, weights=weights, plot=plot)
        if protocol not in PROTOCOLS:
            raise UserError(f"FrequencyNoise.protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        if not 0 < width <= 1 or noise_std < 0 or eps < 0 or repeats < 1 or (rms_grey_levels or 0) < 0:
            raise UserError(
                "FrequencyNoise: width must be in (0, 1], eps, noise_std and rms_grey_levels >= 0 and repeats >= 1"
            )
        self.protocol, self.width, self.eps, self.noise_std = protocol, width, eps, noise_std
        self.rms_grey_levels = rms_grey_levels
        self.repeats, self.clamp, self.seed = repeats, clamp, seed

    def bands(
        self, height: int, width: int, device: torch.device | str | None = None
    ) -> list[tuple[dict[str, float], torch.Tensor]]:
        """[(band description, (H, W) mask)] of the protocol."""
        if self.protocol == "paper":
            edges = band_edges(self.width)
            return [
                (
                    {"low": lo, "high": hi, "centre": (lo + hi) / 2},
                    band_mask(height, width, lo, hi, closed=i == len(edges) - 1, device=device),
                )
                for i, (lo, hi) in enumerate(edges)
            ]
        if height != width or height % 2:
            raise UserError(
                f"FrequencyNoise protocol code: Park & Kim's frequency mask is defined for square, "
                f"even-sized images, got {height}x{width}; use protocol paper"
            )
        half = self.width / 2
        return [
            (
                {"low": f - half, "high": f + half, "centre": f},
                code_band_mask(height, f * math.pi, half * math.pi, device=device),
            )
            for f in code_bands(self.width)
        ]

    def delta(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """One noise draw in [0, 1] pixel units."""
        if self.protocol == "paper":
            return torch.randn(images.shape, generator=generator, device=images.device) * self.noise_std
        # the code adds eps * sign(N(0, 1)) to ImageNet-normalised inputs: ImageNet's std times it in pixel units
        std = torch.tensor(IMAGENET_DEFAULT_STD, device=images.device).view(1, 3, 1, 1)
        return sign_noise(images.shape, self.eps, generator, images.device) * std

    def analyse(self, trainer: Trainer, pl_module: AnalysedModule) -> AnalysisResult:
        model = self.model(pl_module)
        correct: torch.Tensor | None = None
        bands: Any = None
        clean_correct, seen = 0, 0
        generator = None
        with torch.no_grad():
            for images, labels in tqdm(
                self.batches(trainer, pl_module),
                desc="frequency noise",
                leave=False,
                disable=not trainer.is_global_zero,
                total=math.ceil(self.max_images / self.batch_size),
            ):
                if generator is None:
                    generator = torch.Generator(device=images.device).manual_seed(self.seed)
                height, width = images.shape[-2:]
                bands = self.bands(height, width, images.device)
                masks = [mask for _, mask in bands]
                if correct is None:
                    correct = torch.zeros(len(masks) + 1, dtype=torch.long)  # + 1: the unfiltered noise
                    squares = torch.zeros(len(masks) + 1, dtype=torch.float64)  # of the noise, in [0, 1] pixels
                clean_correct += int((model(images).argmax(-1) == labels).sum())
                seen += len(images)
                for _ in range(self.repeats):
                    delta = self.delta(images, generator)
                    for i, noise in enumerate([*(band_noise(delta, m) for m in masks), delta]):
                        if self.rms_grey_levels is not None:
                            noise = scaled_to_rms(noise, self.rms_grey_levels / 255)
                        squares[i] += noise.double().pow(2).sum().cpu()
                        noisy = images + noise
                        if self.clamp:
                            noisy = noisy.clamp(0, 1)
                        correct[i] += int((model(noisy).argmax(-1) == labels).sum())
        clean = clean_correct / seen
        assert correct is not None  # a batch was read
        accuracy = (correct.double() / (seen * self.repeats)).tolist()
        # the noise's size as a reader judges it: root mean square over every pixel and channel, in grey levels
        rms = (squares / (seen * self.repeats * images[0].numel())).sqrt().mul(255).tolist()
        bands = [
            {**band, "bins": int(mask.sum()), "accuracy": acc, "drop": clean - acc, "noise_rms_grey_levels": r}
            for (band, mask), acc, r in zip(bands, accuracy, rms)
        ]
        code = self.protocol == "code"
        section = {
            "clean_accuracy": clean,
            "bands": bands,
            "white_noise": {"accuracy": accuracy[-1], "drop": clean - accuracy[-1], "noise_rms_grey_levels": rms[-1]},
            "protocol": {
                "follows": self.protocol,
                "reference": "github.com/xxxnell/how-do-vits-work ops/adversarial.py (FreqAttack, Random)"
                if code
                else "Park & Kim 2022, Sec. 2.2 / Fig. 2b text: x + F^-1(F(delta) * M_f), delta Gaussian",
                "differences": [
                    "noise: code eps * sign(N(0, 1)) in ImageNet-normalised input space; paper text: Gaussian delta",
                    (
                        "band: code centred squares of bins -m .. m - 1 (int((f +- s) n / 2 pi)), real part of the "
                        "inverse FFT; paper text: a frequency mask M_f (here max(|w_y|, |w_x|) in [f, f + width))"
                    ),
                    (
                        "size: eps 0.7 by default, from the code Park posted for frequency-based noise "
                        "(how-do-vits-work issue 44: Random(eps=0.7, sign=True)), since the script of Fig. 2b is "
                        "not public; the repository's Random defaults to eps 0.007; s = width / 2 (the paper's "
                        "0.1 pi window), not FreqAttack's default s = 0.2"
                    ),
                ],
            },
            "conditions": {
                "arch": pl_module.hparams.get("arch"),
                "protocol": self.protocol,
                "width": self.width,
                **({"eps": self.eps} if code else {"noise_std": self.noise_std}),
                "rms_grey_levels": self.rms_grey_levels,
                "size": "each band's noise scaled to rms_grey_levels per image"
                if self.rms_grey_levels is not None
                else "the protocol's draw filtered to the band (eps or noise_std)",
                "repeats": self.repeats,
                "clamp": self.clamp,
                "seed": self.seed,
                "image_size": [height, width],
                "space": "eps in ImageNet-normalised units (Park & Kim's data), added as ImageNet's std * eps to "
                "[0, 1] pixels whatever the model's normaliser"
                if code
                else "[0, 1] pixels, before the model's normaliser",
                "frequency": "band centre f +- width / 2 in units of pi, Chebyshev squares of DFT bins"
                if code
                else "max(|w_y|, |w_x|) / pi of the 2-D DFT bin",
            },
        }
        metrics = {
            "clean_accuracy": clean,
            "white_noise_drop": clean - accuracy[-1],
            **{f"drop_{b['centre' if code else 'low']:g}": b["drop"] for b in bands},
        }
        return section, metrics, self.figure(section) if self.plot else None

    @staticmethod
    def figure(section: Section) -> Figure:
        """Park & Kim's Fig. 2b (and Chen et al.'s Fig. 8): "Δ Accuracy (%)" (noisy minus clean accuracy, so a drop
        is negative) against "Noise frequency" in units of pi, one line per model, the model in the legend."""
        conditions = section["conditions"]
        arch = conditions.get("arch")
        fig, ax = new_figure(figsize=(6.5, 4))
        marker, colour = family_style(arch)
        ax.plot(
            [b["centre"] for b in section["bands"]],
            [-100 * b["drop"] for b in section["bands"]],
            marker=marker,
            color=colour,
            label=model_label(arch),
        )
        ax.set_xlim(0, 1)
        pi_axis(ax.xaxis)
        ax.set_xlabel("Noise frequency")
        ax.set_ylabel("Δ Accuracy (%)")
        size = f"ε={conditions['eps']:g} sign" if "eps" in conditions else f"Gaussian σ={conditions['noise_std']:g}"
        if conditions["rms_grey_levels"] is not None:
            size += f", scaled to {conditions['rms_grey_levels']:g} grey levels RMS,"
        ax.set_title(f"{size} noise, window {conditions['width']:g}π (protocol {conditions['protocol']})", fontsize=9)
        ax.legend()
        fig.tight_layout()
        return fig
