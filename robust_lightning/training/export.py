"""``robust-lightning export``: the raw or EMA weights of a training checkpoint as a standalone weights file.

The file holds the timm net's state dict (plus the input normaliser in its metadata) and loads anywhere the
project takes weights (``--model.init_from FILE``) and in timm itself.
"""

import argparse
from pathlib import Path

from robust_lightning.errors import UserError
from robust_lightning.models.weights import read_checkpoint, save_net_weights


def export_weights(checkpoint: str | Path, out: str | Path, ema: bool = False) -> Path:
    """Write the net of ``checkpoint`` (its EMA copy with ``ema``) to ``out`` (.safetensors, .pt or .pth)."""
    from robust_lightning.training.classifier import ImageClassifier

    ckpt = read_checkpoint(checkpoint, prefer_ema=ema)
    hparams = ckpt.hyper_parameters
    if not hparams or "arch" not in hparams:
        raise UserError(f"{checkpoint} is not a robust-lightning training checkpoint (no hyper_parameters)")
    if ema and not ckpt.has_ema:
        raise UserError(f"{checkpoint} holds no EMA weights (it was trained with model.ema_decay null)")
    if Path(out).suffix not in (".safetensors", ".pt", ".pth"):
        raise UserError(f"export to .safetensors, .pt or .pth, not {Path(out).name}")
    keep = ("arch", "num_classes", "image_size", "mean", "std", "arch_kwargs", "small_input")
    module = ImageClassifier(**{k: hparams[k] for k in keep if k in hparams})
    module.model.net.load_state_dict(ckpt.state_dict)
    if ckpt.normalize:
        module.model.normalize.load_state_dict(ckpt.normalize)
    return save_net_weights(module.model, out)


def export_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="robust-lightning export",
        description="Write the raw or EMA weights of a training checkpoint to a weights file, e.g.\n"
        "  robust-lightning export runs/at/version_0/checkpoints/last.ckpt model-ema.safetensors --ema\n"
        "then evaluate it with --model.init_from model-ema.safetensors.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", help="a .ckpt written by robust-lightning fit")
    parser.add_argument("out", help="output file: .safetensors (recommended), .pt or .pth")
    parser.add_argument("--ema", action="store_true", help="export the EMA weights instead of the raw ones")
    args = parser.parse_args(argv)
    path = export_weights(args.checkpoint, args.out, ema=args.ema)
    print(f"wrote {'EMA' if args.ema else 'raw'} weights of {args.checkpoint} to {path}")
    return 0
