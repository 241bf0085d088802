"""The residual blocks of each model family, for analyses that remove, read or mask them.

``find_blocks(net)`` maps a timm network (``RobustClassifier.net``) to a ``BlockMap``: its residual units in
forward order, the parts of each unit that can be removed on their own (the attention and MLP branches of a
transformer block; the large-kernel block and the FFN of a RepLKNet block pair), and whether its features are
token sequences (ViTs, with a CLS token) or (B, C, H, W) maps (ConvNets).

Families:

- ``vit``: timm VisionTransformer (and the ConvStem ViTs): units ``blocks.i``; parts ``attention`` / ``mlp``.
- ``convnext``: timm ConvNeXt (and ConvStem ConvNeXts): units ``stages.s.blocks.j``; one branch, no parts.
- ``isotropic_convnext``: our IsotropicConvNeXt: units ``blocks.j``.
- ``resnet``: timm ResNet: units ``layerS.j`` (blocks with a projection shortcut keep the projection).
- ``replknet``: ``stages.s.blocks.j`` holding RepLK blocks each followed by a ConvFFN: one unit per pair (as
  Chen et al. count RepLKNet blocks), parts ``large_kernel`` / ``mlp``.
- ``alternet`` and other staged nets: ``stages.s.blocks.j``; blocks with ``.attn`` and ``.mlp`` have the parts
  ``attention`` / ``mlp``; an MSA block with ``.attn`` only (AlterNet) has the part ``attention``, the block.

Removing a unit ("lesion") removes its residual branch so information flows through the skip: the block becomes
nn.Identity (or its projection shortcut when it has one). Removing a part zeroes that branch's output (or, for
a part that is itself a residual block, skips it). ``lesioned`` swaps the modules for the duration of a
``with`` block and always puts them back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from timm.models.convnext import ConvNeXt, ConvNeXtBlock
from timm.models.resnet import BasicBlock, Bottleneck, ResNet
from timm.models.vision_transformer import Block as VitBlock
from timm.models.vision_transformer import VisionTransformer
from torch import nn
from torch.utils.hooks import RemovableHandle

from robust_lightning.errors import UserError
from robust_lightning.models.alternet import PreActBottleneck
from robust_lightning.models.isotropic_convnext import IsotropicConvNeXt

__all__ = [
    "BlockMap",
    "FeatureTap",
    "Unit",
    "ZeroOutput",
    "as_map",
    "attention_probabilities",
    "find_blocks",
    "lesioned",
    "replace_module",
    "token_grid",
]

ZERO, SKIP = "zero", "skip"  # how a part is removed: zero its output (a branch), or skip it (a residual block)


@dataclass
class Unit:
    """One residual unit: a block, or a block pair (RepLKNet) counted as one."""

    name: str  # e.g. "blocks.3", "stages.2.blocks.4+5"
    stage: int  # stage index (0 for isotropic models)
    paths: tuple[str, ...]  # module path(s) of its residual block(s) in the net
    parts: dict[str, tuple[str, str]] = field(default_factory=dict)  # part -> (module path, ZERO | SKIP)
    attention: str | None = None  # path of a timm-style attention module (q/k/v), if any


@dataclass
class BlockMap:
    family: str
    units: list[Unit]
    tokens: bool  # features are (B, N, C) token sequences (else (B, C, H, W) maps)
    num_prefix_tokens: int = 0  # CLS (+ register) tokens in front of the patch tokens
    has_cls: bool = False

    def part_names(self) -> list[str]:
        """Every part some unit has, in first-seen order."""
        return list(dict.fromkeys(p for u in self.units for p in u.parts))

    def require_cls(self, who: str) -> None:
        if not (self.tokens and self.has_cls):
            raise UserError(
                f"{who} needs a model with a CLS token (a ViT); this is a {self.family} model, which "
                "has none, so the analysis does not apply to it"
            )

    def require_attention(self, who: str) -> None:
        """Masks and attention maps need token sequences and timm-style attention modules (q, k, v)."""
        if not self.tokens or not all(u.attention for u in self.units):
            raise UserError(
                f"{who} needs a Vision Transformer (token sequences with self-attention in every block); "
                f"this is a {self.family} model, so the analysis does not apply to it"
            )


# ------------------------------------------------------------------------------------------- discovery
def find_blocks(net: nn.Module) -> BlockMap:
    """The residual units of ``net`` (a timm network); UserError for an architecture with no known layout."""
    if isinstance(net, VisionTransformer):
        units = []
        for i, block in enumerate(net.blocks):
            parts = {}
            if hasattr(block, "attn") and hasattr(block, "mlp"):
                parts = {"attention": (f"blocks.{i}.attn", ZERO), "mlp": (f"blocks.{i}.mlp", ZERO)}
            attention = f"blocks.{i}.attn" if _is_qkv_attention(getattr(block, "attn", None)) else None
            units.append(Unit(f"blocks.{i}", 0, (f"blocks.{i}",), parts, attention))
        return BlockMap(
            "vit",
            units,
            tokens=True,
            num_prefix_tokens=int(net.num_prefix_tokens),
            has_cls=getattr(net, "cls_token", None) is not None,
        )
    if isinstance(net, ConvNeXt):
        return BlockMap("convnext", _staged_units(net, plain=True), tokens=False)
    if isinstance(net, IsotropicConvNeXt):
        return BlockMap(
            "isotropic_convnext",
            [Unit(f"blocks.{j}", 0, (f"blocks.{j}",)) for j in range(len(net.blocks))],
            tokens=False,
        )
    if isinstance(net, ResNet):
        units = [
            Unit(f"layer{s}.{j}", s - 1, (f"layer{s}.{j}",))
            for s in range(1, 5)
            for j in range(len(getattr(net, f"layer{s}")))
        ]
        return BlockMap("resnet", units, tokens=False)
    stages = getattr(net, "stages", None)
    if isinstance(stages, (nn.Sequential, nn.ModuleList)) and all(hasattr(s, "blocks") for s in stages):
        units = _staged_units(net, plain=False)
        names = " ".join(type(m).__name__ for m in net.modules()).lower()
        family = (
            "replknet"
            if "replk" in names
            else "alternet"
            if any(u.parts.get("attention") for u in units)
            else type(net).__name__.lower()
        )
        return BlockMap(family, units, tokens=False)
    raise UserError(
        f"cannot find the residual blocks of a {type(net).__name__}: the analyses know timm ViTs (blocks), ConvNeXts "
        "(stages.i.blocks), ResNets (layer1-4), the isotropic ConvNeXt and staged nets with stages.i.blocks "
        "(RepLKNet, AlterNet)"
    )


def _staged_units(net: nn.Module, plain: bool) -> list[Unit]:
    units = []
    for s, stage in enumerate(cast(Iterable[nn.Module], net.stages)):
        blocks, j = list(cast(Iterable[nn.Module], stage.blocks)), 0
        while j < len(blocks):
            path = f"stages.{s}.blocks.{j}"
            block = blocks[j]
            follower = blocks[j + 1] if j + 1 < len(blocks) else None
            if (
                not plain
                and "replk" in type(block).__name__.lower()
                and follower is not None
                and "ffn" in type(follower).__name__.lower()
            ):
                # RepLKNet: a large-kernel block and its ConvFFN form one "block" (Chen et al.; Ding et al.)
                nxt = f"stages.{s}.blocks.{j + 1}"
                units.append(
                    Unit(f"{path}+{j + 1}", s, (path, nxt), {"large_kernel": (path, SKIP), "mlp": (nxt, SKIP)})
                )
                j += 2
                continue
            parts = {}
            if not plain and hasattr(block, "attn") and hasattr(block, "mlp"):
                parts = {"attention": (f"{path}.attn", ZERO), "mlp": (f"{path}.mlp", ZERO)}
            elif not plain and hasattr(block, "attn"):
                # an MSA block whose one residual branch is the attention (AlterNet): removing the attention
                # removes the block; the Conv block before it plays the MLP's part (Park & Kim)
                parts = {"attention": (path, SKIP)}
            units.append(Unit(path, s, (path,), parts))
            j += 1
    return units


def _is_qkv_attention(module: nn.Module | None) -> bool:
    return module is not None and all(hasattr(module, a) for a in ("qkv", "num_heads", "head_dim", "scale"))


# --------------------------------------------------------------------------------------------- lesions
class ZeroOutput(nn.Module):
    """A branch whose output is zero (shape and dtype of the original branch's output)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        return torch.zeros_like(self.inner(*args, **kwargs))


def skip_of(block: nn.Module) -> nn.Module:
    """What is left of a residual block without its residual branch: its shortcut."""
    if isinstance(block, (BasicBlock, Bottleneck)):
        # out = act(branch + shortcut): without the branch, act(shortcut); the input is post-ReLU already, so an
        # identity shortcut gives back the input itself.
        act = block.act3 if isinstance(block, Bottleneck) else block.act2
        return nn.Sequential(block.downsample if block.downsample is not None else nn.Identity(), act)
    if isinstance(block, ConvNeXtBlock):
        return block.shortcut  # nn.Identity unless the block changes width or stride
    if isinstance(block, PreActBottleneck) and block.shortcut is not None:
        return _PreActShortcut(block)
    return nn.Identity()


class _PreActShortcut(nn.Module):
    """The projection shortcut of a pre-activation bottleneck (AlterNet): it sees the pre-activated input."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        block: Any = self.block  # a PreActBottleneck (shortcut, act, bn1)
        shortcut: torch.Tensor = block.shortcut(block.act(block.bn1(x)))
        return shortcut


def replace_module(net: nn.Module, path: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at ``path`` (dotted, e.g. "blocks.3.attn"); returns the module that was there."""
    parent_path, _, name = path.rpartition(".")
    parent = net.get_submodule(parent_path) if parent_path else net
    old: nn.Module = getattr(parent, name)
    setattr(parent, name, new)
    return old


@contextmanager
def lesioned(net: nn.Module, units: Sequence[Unit], part: str = "block") -> Iterator[nn.Module]:
    """``net`` with ``part`` ("block" = the whole unit, or a part name) of each unit removed, restored on exit."""
    swaps: list[tuple[str, nn.Module]] = []
    for unit in units:
        if part == "block":
            swaps += [(path, skip_of(net.get_submodule(path))) for path in unit.paths]
        else:
            if part not in unit.parts:
                raise UserError(f"unit {unit.name} has no part {part!r} (it has: {', '.join(unit.parts) or 'none'})")
            path, how = unit.parts[part]
            module = net.get_submodule(path)
            swaps.append((path, ZeroOutput(module) if how == ZERO else skip_of(module)))
    done: list[tuple[str, nn.Module]] = []
    try:
        for path, new in swaps:
            done.append((path, replace_module(net, path, new)))
        yield net
    finally:
        for path, old in reversed(done):
            replace_module(net, path, old)


# -------------------------------------------------------------------------------------------- features
def token_grid(num_patches: int, image_hw: tuple[int, int]) -> tuple[int, int]:
    """(h, w) of the patch grid holding ``num_patches`` tokens for an image of size ``image_hw``."""
    height, width = image_hw
    h = max(1, round(math.sqrt(num_patches * height / width)))
    w = num_patches // h
    if h * w != num_patches:
        raise UserError(f"cannot lay {num_patches} patch tokens out on a grid for {height}x{width} images")
    return h, w


def as_map(feature: torch.Tensor, bmap: BlockMap, image_hw: tuple[int, int]) -> torch.Tensor:
    """A feature as a (B, C, h, w) map: token sequences lose their prefix (CLS) tokens and go onto the patch grid."""
    if feature.dim() == 4:
        return feature
    if feature.dim() == 3 and bmap.tokens:
        patches = feature[:, bmap.num_prefix_tokens :]
        h, w = token_grid(patches.shape[1], image_hw)
        return patches.transpose(1, 2).reshape(feature.shape[0], feature.shape[2], h, w)
    raise UserError(
        f"a {bmap.family} block gave a feature of shape {tuple(feature.shape)}; expected (B, C, H, W) maps "
        "or (B, N, C) tokens"
    )


class FeatureTap:
    """Records the hidden states of a forward pass: the input of the first unit ("stem"), then the output of each
    unit, or with ``sublayers`` of each residual branch (the attention and the MLP half of a transformer block as
    Park & Kim plot them; each block of a RepLKNet pair). Use as a context manager around forward passes;
    ``features`` holds the last pass's tensors in the order of ``points``.

    ``layers`` also taps the layers between the residual units one by one, as Chen et al.'s feature-variance script
    lists RepLKNet's (github.com/Lauch1ng/LKRobust, feature_map_variance/main.py: ``*model.stem`` and
    ``*model.transitions[i]`` between the stages' blocks): each layer of a sequential ``stem`` in place of the one
    "stem" point, and after the last unit of stage i each layer of ``transitions[i]``."""

    def __init__(
        self, net: nn.Module, bmap: BlockMap, sublayers: bool = False, stem: bool = False, layers: bool = False
    ):
        self.net, self.bmap = net, bmap
        self.points: list[tuple[str, str]] = []  # (label, kind): kind "attention", "mlp", "block", "stem", ...
        self.features: dict[str, torch.Tensor] = {}
        self._plan: list[tuple[str, str, nn.Module, str]] = []  # (label, kind, module, how)
        first = net.get_submodule(bmap.units[0].paths[0])
        stem_layers = _layer_list(getattr(net, "stem", None)) if layers else []
        transitions = list(getattr(net, "transitions", None) or []) if layers else []
        if stem_layers:
            for i, layer in enumerate(stem_layers):
                self._add(f"stem.{i}", "stem", layer, "output")
        elif stem:
            self._add("stem", "stem", first, "input")
        for index, unit in enumerate(bmap.units):
            block = net.get_submodule(unit.paths[0])
            if sublayers and isinstance(block, VitBlock) and len(unit.paths) == 1:
                self._add(f"{unit.name}.attention", "attention", block, "attention_residual")
                self._add(f"{unit.name}.mlp", "mlp", block, "output")
            elif sublayers and len(unit.paths) > 1:
                for part, (path, _) in unit.parts.items():
                    self._add(f"{unit.name}.{part}", part, net.get_submodule(path), "output")
            else:
                kind = "attention" if unit.parts.get("attention") else "block"
                self._add(unit.name, kind, net.get_submodule(unit.paths[-1]), "output")
            last_of_stage = index + 1 == len(bmap.units) or bmap.units[index + 1].stage != unit.stage
            if last_of_stage and unit.stage < len(transitions):
                for i, layer in enumerate(_layer_list(transitions[unit.stage])):
                    self._add(f"transitions.{unit.stage}.{i}", "transition", layer, "output")
        self._handles: list[RemovableHandle] = []

    def _add(self, label: str, kind: str, module: nn.Module, how: str) -> None:
        self.points.append((label, kind))
        self._plan.append((label, kind, module, how))

    def __enter__(self) -> FeatureTap:
        for label, _, module, how in self._plan:
            if how == "input":
                self._handles.append(module.register_forward_pre_hook(self._store_input(label)))
            elif how == "output":
                self._handles.append(module.register_forward_hook(self._store_output(label)))
            else:  # the residual stream after the attention branch of a timm Block: input + drop_path1(...)
                inputs: dict[str, torch.Tensor] = {}
                self._handles.append(
                    module.register_forward_pre_hook(lambda m, args, _i=inputs: _i.__setitem__("x", args[0]))
                )
                self._handles.append(
                    cast(nn.Module, module.drop_path1).register_forward_hook(
                        lambda m, args, out, _i=inputs, _l=label: self.features.__setitem__(_l, _i["x"] + out)
                    )
                )
        return self

    def _store_input(self, label: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        return lambda module, args: self.features.__setitem__(label, args[0])

    def _store_output(self, label: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...], torch.Tensor], None]:
        return lambda module, args, out: self.features.__setitem__(label, out)

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def ordered(self) -> list[torch.Tensor]:
        return [self.features[label] for label, _ in self.points]


def _layer_list(module: nn.Module | None) -> list[nn.Module]:
    """The layers of a sequential container (nn.Sequential, nn.ModuleList), or [] for anything else."""
    return list(module) if isinstance(module, (nn.Sequential, nn.ModuleList)) else []


# ------------------------------------------------------------------------------------------- attention
def attention_probabilities(attn: nn.Module, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention weights (B, heads, N, N) of a timm Attention module on its (normed) input tokens.

    timm computes attention with fused kernels that never return the weights, so they are recomputed here from
    the module's own q/k projections (with its q/k norms and scale)."""
    if not _is_qkv_attention(attn):
        raise UserError(
            f"cannot read attention weights from a {type(attn).__name__}: expected timm's Attention "
            "(qkv, num_heads, head_dim, scale)"
        )
    batch, n, _ = tokens.shape
    timm_attn: Any = attn  # checked above: qkv, num_heads, head_dim, q_norm, k_norm, scale
    qkv = timm_attn.qkv(tokens).reshape(batch, n, 3, timm_attn.num_heads, timm_attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k = qkv[0], qkv[1]
    q, k = timm_attn.q_norm(q), timm_attn.k_norm(k)
    scores: torch.Tensor = (q * timm_attn.scale) @ k.transpose(-2, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1)


def removable_units(net: nn.Module, bmap: BlockMap, probe: torch.Tensor) -> tuple[list[Unit], list[str]]:
    """The units whose removal leaves a working network, and the names of the others.

    Blocks of known types are replaced by their shortcut; any other block is replaced by nn.Identity, which is
    only possible when it keeps the shape of its input (a downsampling block is left in place)."""
    known = (VitBlock, BasicBlock, Bottleneck, ConvNeXtBlock, PreActBottleneck)
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    handles = []
    for unit in bmap.units:
        for path in unit.paths:
            module = net.get_submodule(path)
            if not isinstance(module, known):
                handles.append(
                    module.register_forward_hook(
                        lambda m, args, out, _p=path: shapes.__setitem__(_p, (tuple(args[0].shape), tuple(out.shape)))
                    )
                )
    try:
        if handles:
            with torch.no_grad():
                net(probe)
    finally:
        for handle in handles:
            handle.remove()
    keep: list[Unit] = []
    fixed: list[str] = []
    for unit in bmap.units:
        ok = all(path not in shapes or shapes[path][0] == shapes[path][1] for path in unit.paths)
        if ok:
            keep.append(unit)
        else:
            fixed.append(unit.name)
    return keep, fixed
