"""Small models with known evaluation pitfalls (Athalye et al., 2018; Carlini et al., 2019), each the same trained
network (tests/helpers.py's train_small_cnn) behind one masking or randomizing part, named so that BPDA can name it:

- ``Quantised``: the input rounded to 16 levels (``quantise``), whose gradient is zero everywhere;
- ``Shattered``: a fine high-frequency ripple added to the input (``shatter``), a near-identity whose gradient
  oscillates wildly;
- ``Noisy``: Gaussian noise added to the input at every call (a randomized defence);
- ``Scaled``: the logits times 1e4 (a saturated softmax: the cross-entropy's gradient is zero in fp32, DLR's is
  not), which a sound evaluation does not take for masking.

``Plain`` is the network itself, the reference each pitfall is compared with."""

import torch
from torch import Tensor, nn


class Quantise(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.round(16 * x) / 16


class Shatter(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return (x + 0.004 * torch.sin(2000 * x)).clamp(0, 1)


class _Behind(nn.Module):
    """``net`` behind ``part`` (an attribute of the given name)."""

    def __init__(self, net: nn.Module, name: str, part: nn.Module) -> None:
        super().__init__()
        self.net, self.name = net, name
        self.add_module(name, part)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(getattr(self, self.name)(x))


def quantised(net: nn.Module) -> nn.Module:
    return _Behind(net, "quantise", Quantise()).eval()


def shattered(net: nn.Module) -> nn.Module:
    return _Behind(net, "shatter", Shatter()).eval()


class Noisy(nn.Module):
    def __init__(self, net: nn.Module, sigma: float = 0.08) -> None:
        super().__init__()
        self.net, self.sigma = net, sigma

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x + self.sigma * torch.randn_like(x))


class Scaled(nn.Module):
    def __init__(self, net: nn.Module, scale: float = 1e4) -> None:
        super().__init__()
        self.net, self.scale = net, scale

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x) * self.scale
