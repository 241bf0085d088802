"""The spatial attack's warp against a direct bilinear resampling written here: each output pixel centre p is looked
up at R(-angle) (p - c - t) + c in the source (c the image centre, t the shift), bilinear between the four
neighbouring pixel centres, zero outside; and against kornia's ``warp_affine`` and ``get_rotation_matrix2d``, which
it replaced (kornia is installed for the tests alone)."""

import math

import pytest
import torch
from kornia.geometry.transform import get_rotation_matrix2d, warp_affine

from robust_lightning.attacks.spatial import affine_matrices, spatial_grid, transform_images


def resample(image: torch.Tensor, dx: float, dy: float, angle: float) -> torch.Tensor:
    """(C, H, W) float64 image -> the transformed image, by inverse mapping in pixel units."""
    _, height, width = image.shape
    cy, cx = (height - 1) / 2, (width - 1) / 2
    rows, cols = torch.meshgrid(
        torch.arange(height, dtype=torch.float64), torch.arange(width, dtype=torch.float64), indexing="ij"
    )
    u, v = cols - cx - dx, rows - cy - dy
    a = math.radians(angle)  # counter-clockwise on screen (y down): undo it by turning the other way
    src_x = math.cos(a) * u - math.sin(a) * v + cx
    src_y = math.sin(a) * u + math.cos(a) * v + cy
    x0, y0 = src_x.floor(), src_y.floor()
    out = torch.zeros_like(image)
    for ox, oy in ((0, 0), (1, 0), (0, 1), (1, 1)):
        xi, yi = x0 + ox, y0 + oy
        weight = (1 - (src_x - xi).abs()) * (1 - (src_y - yi).abs())
        inside = (xi >= 0) & (xi < width) & (yi >= 0) & (yi < height)
        values = image[:, yi.clamp(0, height - 1).long(), xi.clamp(0, width - 1).long()]
        out += torch.where(inside, weight, 0.0) * values
    return out


def test_the_warp_is_the_stated_bilinear_rotation_and_shift():
    torch.manual_seed(0)
    grid = spatial_grid(translations=3, max_shift=5.0, rotations=5, max_angle=30.0)
    for height, width in ((16, 16), (20, 28)):  # non-square: rotations must not shear
        image = torch.rand(1, 3, height, width)
        warped = transform_images(image.expand(len(grid), -1, -1, -1), grid)
        expected = torch.stack([resample(image[0].double(), *row.tolist()) for row in grid]).float()
        assert (warped - expected).abs().max() < 1e-5  # float32 rounding of the sampling grid only


@pytest.mark.parametrize("height, width", [(16, 16), (20, 28), (96, 64)])
def test_the_spatial_warp_is_kornias(height, width):
    """The matrices are kornia's ``get_rotation_matrix2d`` plus the shift, to float64 rounding; the warped images
    are kornia's ``warp_affine`` (bilinear, zero fill, align_corners=False), to the float32 rounding of the
    sampling grid, which kornia builds from float32 matrices and ours from float64 ones."""
    torch.manual_seed(0)
    grid = spatial_grid(translations=3, max_shift=5.0, rotations=7, max_angle=30.0)
    centre = torch.tensor([(width - 1) / 2, (height - 1) / 2], dtype=torch.float64).expand(len(grid), 2)
    rotation = get_rotation_matrix2d(centre, grid[:, 2].clone(), torch.ones_like(centre))
    kornias = torch.cat([rotation[..., :2], rotation[..., 2:] + grid[:, :2, None]], -1)
    assert (affine_matrices(grid, height, width) - kornias).abs().max() < 1e-12
    images = torch.rand(len(grid), 3, height, width)
    expected = warp_affine(images, kornias.float(), (height, width), padding_mode="zeros", align_corners=False)
    identity = (grid == 0).all(1)[:, None, None, None]
    assert (transform_images(images, grid) - torch.where(identity, images, expected)).abs().max() < 3e-5
