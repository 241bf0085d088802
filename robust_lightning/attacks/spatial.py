"""The spatial grid attack (Engstrom et al. 2019, as run by Bhojanapalli et al. 2021): every combination of
x-shifts, y-shifts and rotations on a grid, zero fill outside the image; a point is robust only if every
transformed copy is classified correctly.

The default grid is the papers': 9 x-shifts and 9 y-shifts in [-16, 16] px and 31 rotations in [-30, 30] deg,
2511 transforms. All of them are applied with a batched ``grid_sample`` (bilinear, zero padding,
``align_corners=False``: pixel centres at half-pixel offsets), as kornia's ``warp_affine`` applies them; each
forward pass holds at most ``batch_size`` transformed images, whatever the number of images and transforms, so
memory stays bounded.
Conventions: a positive shift moves the content right (x) or down (y), a positive angle rotates it
counter-clockwise on screen, about the image centre; the rotation is applied first, then the shift.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .apgd import Model, StopPoint


@dataclass
class SpatialResult:
    """Outcome of :func:`spatial_grid_attack` for B images and T transforms.

    transforms: (T, 3) the grid, rows (dx px, dy px, angle deg).
    correct: (B, T) bool, image b classified correctly under transform t.
    margins: (B, T) true-class logit minus the largest other logit (negative = misclassified).
    robust: (B,) bool, correct under every transform.
    worst: (B,) index of each image's worst transform (lowest margin; a misclassifying one when there is one).
    clean_correct: (B,) bool, correct on the untransformed image.
    """

    transforms: Tensor
    correct: Tensor
    margins: Tensor
    robust: Tensor
    worst: Tensor
    clean_correct: Tensor

    @property
    def worst_transform(self) -> Tensor:
        """(B, 3) the worst (dx, dy, angle) of each image."""
        return self.transforms[self.worst]

    def robust_under(self, keep: Tensor) -> Tensor:
        """(B,) robust against the subset of transforms selected by the (T,) bool mask ``keep``."""
        return self.correct[:, keep].all(1)


def _axis(count: int, limit: float) -> Tensor:
    """``count`` evenly spaced values in [-limit, limit]; a single value is 0 (no transform on that axis)."""
    if count < 1:
        raise ValueError(f"grid sizes must be >= 1, got {count}")
    if count == 1:
        return torch.zeros(1, dtype=torch.float64)
    values = torch.linspace(-limit, limit, count, dtype=torch.float64)
    return values.where(values.abs() > 1e-9 * limit, 0.0)  # the middle value is exactly 0 (the identity)


def spatial_grid(
    translations: int = 9, max_shift: float = 16.0, rotations: int = 31, max_angle: float = 30.0
) -> Tensor:
    """(T, 3) float64 rows (dx, dy, angle): every combination, T = translations^2 * rotations (2511 by default)."""
    shifts, angles = _axis(translations, max_shift), _axis(rotations, max_angle)
    dx, dy, angle = torch.meshgrid(shifts, shifts, angles, indexing="ij")
    return torch.stack([dx.flatten(), dy.flatten(), angle.flatten()], 1)


def affine_matrices(transforms: Tensor, height: int, width: int) -> Tensor:
    """(T, 2, 3) float64 pixel matrices, source -> destination, for rows (dx px, dy px, angle deg): rotate by
    angle about the image centre (cx, cy) = ((W - 1) / 2, (H - 1) / 2), counter-clockwise on screen, then shift
    by (dx, dy). The rotation is OpenCV's ``getRotationMatrix2D`` (kornia's ``get_rotation_matrix2d`` too):
    [[cos, sin, (1 - cos) cx - sin cy], [-sin, cos, sin cx + (1 - cos) cy]]."""
    t = transforms.to(torch.float64)
    angle = torch.deg2rad(t[:, 2])
    cos, sin = angle.cos(), angle.sin()
    cx, cy = (width - 1) / 2, (height - 1) / 2
    rows = [cos, sin, (1 - cos) * cx - sin * cy + t[:, 0], -sin, cos, sin * cx + (1 - cos) * cy + t[:, 1]]
    return torch.stack(rows, 1).view(-1, 2, 3)


def sampling_matrices(matrices: Tensor, height: int, width: int) -> Tensor:
    """(T, 2, 3) float64 matrices for ``affine_grid``: each maps an output pixel to the source point it reads, in
    the normalised coordinates of ``grid_sample`` with ``align_corners=False`` (x_n = (2 x + 1) / W - 1), as
    kornia's ``warp_affine`` builds them: the inverse of the pixel matrix, conjugated by that normalisation."""
    bottom = matrices.new_tensor([0.0, 0.0, 1.0]).expand(len(matrices), 1, 3)
    inverse = torch.linalg.inv(torch.cat([matrices, bottom], 1))
    to_normal = matrices.new_tensor([[2 / width, 0, 1 / width - 1], [0, 2 / height, 1 / height - 1], [0, 0, 1]])
    sampling: Tensor = to_normal @ inverse @ torch.linalg.inv(to_normal)
    return sampling[:, :2]


def transform_images(x: Tensor, transforms: Tensor) -> Tensor:
    """Image i under transform i: x (N, C, H, W), transforms (N, 3) -> (N, C, H, W), bilinear, zero fill. Identity
    rows return their image unchanged (bit for bit), so a grid holding the identity reproduces clean predictions.
    Half-precision images are warped in float32 and returned in their own dtype."""
    height, width = x.shape[-2:]
    source = x if x.dtype in (torch.float32, torch.float64) else x.float()
    theta = sampling_matrices(affine_matrices(transforms.cpu(), height, width), height, width)
    grid = F.affine_grid(theta.to(x.device, source.dtype), [len(x), 1, height, width], align_corners=False)
    warped = F.grid_sample(source, grid, mode="bilinear", padding_mode="zeros", align_corners=False).to(x.dtype)
    identity = (transforms == 0).all(1).to(x.device)
    return torch.where(identity[:, None, None, None], x, warped)


@torch.no_grad()
def spatial_grid_attack(
    model: Model,
    x: Tensor,
    y: Tensor,
    translations: int = 9,
    max_shift: float = 16.0,
    rotations: int = 31,
    max_angle: float = 30.0,
    batch_size: int = 512,
    stop_point: StopPoint = lambda: None,
) -> SpatialResult:
    """Classify every image under every transform of :func:`spatial_grid` and keep the worst case per image.

    ``model`` maps [0, 1] images to logits (in eval mode: the attack leaves the mode alone); ``x`` (B, C, H, W)
    in [0, 1], ``y`` (B,) int64 labels. Shifts are in pixels of ``x`` (scale them for images smaller than the
    papers' 224 px). ``batch_size`` caps the transformed images per forward pass. ``stop_point()`` is called
    before each forward pass; it raises to stop the attack (a job's stop signal).
    """
    if x.dim() != 4 or y.shape != x.shape[:1]:
        raise ValueError(f"expected images (B, C, H, W) and labels (B,), got {tuple(x.shape)} and {tuple(y.shape)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    grid = spatial_grid(translations, max_shift, rotations, max_angle)
    n_images, n_transforms = x.shape[0], grid.shape[0]
    margins = torch.empty(n_images * n_transforms, device=x.device)
    correct = torch.empty(n_images * n_transforms, dtype=torch.bool, device=x.device)
    # (image, transform) pairs in image-major order, batch_size pairs per forward pass
    for start in range(0, n_images * n_transforms, batch_size):
        stop_point()
        pairs = torch.arange(start, min(start + batch_size, n_images * n_transforms))
        images, labels = x[pairs // n_transforms], y[pairs // n_transforms]
        logits = model(transform_images(images, grid[pairs % n_transforms])).float()
        true = logits.gather(1, labels[:, None]).squeeze(1)
        other = logits.scatter(1, labels[:, None], -math.inf).amax(1)
        margins[start : start + len(pairs)] = true - other
        correct[start : start + len(pairs)] = logits.argmax(1) == labels
    margins, correct = margins.view(n_images, n_transforms), correct.view(n_images, n_transforms)
    # worst = lowest margin; a misclassifying transform always counts as worse than a correct one (argmax ties)
    wrong_only = margins.masked_fill(correct, math.inf)
    worst = torch.where((~correct).any(1), wrong_only.argmin(1), margins.argmin(1))
    identity = (grid == 0).all(1).nonzero()
    if identity.numel():
        clean = correct[:, identity[0, 0]]
    else:
        clean = model(x).float().argmax(1) == y
    return SpatialResult(grid, correct, margins, correct.all(1), worst, clean)
