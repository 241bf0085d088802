"""kornia is no longer a dependency: the spatial attack's own warp replaced its ``warp_affine`` and
``get_rotation_matrix2d``, and is checked against them here."""

import pytest
import torch
from kornia.geometry.transform import get_rotation_matrix2d, warp_affine

from robust_lightning.attacks.spatial import affine_matrices, spatial_grid, transform_images


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
