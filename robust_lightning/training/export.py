"""``robust-lightning export``: the raw or EMA weights of a training checkpoint, for use outside training.

Two forms:

- a weights file (``OUT.safetensors``, ``.pt``, ``.pth``): the timm net's state dict, the input normaliser in
  the safetensors metadata. Loads with ``--model.init_from FILE`` and in timm with ``pretrained_cfg_overlay``.
- a timm model folder (any other OUT): ``config.json`` and ``model.safetensors`` as timm's ``save_for_hf``
  writes them, which ``timm.create_model("local-dir:OUT", pretrained=True)`` loads. The folder's
  ``pretrained_cfg`` holds the preprocessing: the model's normaliser as mean/std (0 and 1 for a model that
  takes raw [0, 1] images), the training resolution, and the project's evaluation resize (bicubic, crop 0.875).
  Its ``README.md`` is a model card: the architecture, the input convention, the training recipe, and the
  numbers of the results.json files that name this checkpoint (by its sha256), with their conditions.
"""

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import safetensors
from timm.models import model_entrypoint, save_for_hf

from robust_lightning.argument_parsing import run_tool
from robust_lightning.atomic import atomic_folder_files, give_ordinary_permissions
from robust_lightning.errors import UserError
from robust_lightning.models.checkpoints import read_checkpoint, save_net_weights
from robust_lightning.models.classifier import InputNormalization, RobustClassifier

WEIGHT_FILE_SUFFIXES = (".safetensors", ".pt", ".pth")
# the evaluation preprocessing of robust_lightning.data.transforms.eval_transform at its default
EVAL_CROP_PCT = 0.875
EVAL_INTERPOLATION = "bicubic"
RELEASE_FIELDS = ("tag", "license", "hf_hub_id", "url", "paper_ids", "paper_name", "origin_url", "notes")


def _restore(checkpoint: str | Path, ema: bool) -> tuple[RobustClassifier, dict[str, Any]]:
    """The classifier of a training checkpoint (its EMA weights with ``ema``) and the checkpoint's hparams."""
    from robust_lightning.training.lightning_module import ImageClassifier

    ckpt = read_checkpoint(checkpoint, prefer_ema=ema)
    hparams = ckpt.hyper_parameters
    if not hparams or "arch" not in hparams:
        raise UserError(f"{checkpoint} is not a robust-lightning training checkpoint (no hyper_parameters)")
    if ema and not ckpt.has_ema:
        raise UserError(f"{checkpoint} holds no EMA weights (it was trained with model.ema_decay null)")
    keep = ("arch", "num_classes", "image_size", "mean", "std", "arch_kwargs", "small_input")
    module = ImageClassifier(**{k: hparams[k] for k in keep if k in hparams})
    module.model.net.load_state_dict(ckpt.state_dict)
    if ckpt.normalize:
        module.model.normalize.load_state_dict(ckpt.normalize)
    return module.model, hparams


def export_weights(checkpoint: str | Path, out: str | Path, ema: bool = False) -> Path:
    """Write the net of ``checkpoint`` (its EMA copy with ``ema``) to ``out`` (.safetensors, .pt or .pth)."""
    if Path(out).suffix not in WEIGHT_FILE_SUFFIXES:
        raise UserError(f"export to .safetensors, .pt or .pth, not {Path(out).name}")
    model, _ = _restore(checkpoint, ema)
    return save_net_weights(model, out)  # atomic: the umask's permissions, never half-written


def needs_robust_lightning(arch: str) -> bool:
    """Whether ``arch`` is one of this project's architectures, which timm knows only after
    ``import robust_lightning`` registered them."""
    return model_entrypoint(arch.split(".", 1)[0]).__module__.startswith("robust_lightning.")


def export_timm_folder(checkpoint: str | Path, out_dir: str | Path, ema: bool = False) -> Path:
    """Write the net of ``checkpoint`` as a timm model folder (config.json + model.safetensors)."""
    model, hparams = _restore(checkpoint, ema)
    if hparams.get("small_input"):
        # the strides are changed after timm built the net (use_small_input_strides); config.json cannot say so
        raise UserError(
            f"{checkpoint} was trained with model.small_input: timm would rebuild it with the standard "
            "strides; export a .safetensors file instead and load it with robust-lightning"
        )
    net: Any = model.net  # a timm model (pretrained_cfg)
    channels = net.pretrained_cfg.get("input_size", (3,))[0]
    if hasattr(model.normalize, "mean"):
        normalize = cast(InputNormalization, model.normalize)
        mean, std = normalize.mean.flatten().tolist(), normalize.std.flatten().tolist()
    else:  # the net takes [0, 1] images: timm's normalisation must be the identity
        mean, std = [0.0] * channels, [1.0] * channels
    size = hparams.get("image_size") or net.pretrained_cfg["input_size"][-1]
    data_config = {
        "input_size": (channels, size, size),
        "mean": tuple(mean),
        "std": tuple(std),
        "interpolation": EVAL_INTERPOLATION,
        "crop_pct": EVAL_CROP_PCT,
        "crop_mode": "center",
    }
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir} exists and is not a directory")
    card = model_card(Path(checkpoint), hparams, ema, data_config, results_naming(Path(checkpoint)))
    # The files go into the folder together when all are written: a kill or a full disk part-way leaves an earlier
    # export there as it was, never weights that are half-written or from another export than its config.json.
    with atomic_folder_files(out_dir) as staging:
        try:
            save_for_hf(net, str(staging), safe_serialization=True, data_config=data_config)
        except safetensors.SafetensorError as e:
            raise UserError(f"cannot write the timm model folder {out_dir}: {e}") from e
        give_ordinary_permissions(staging / "model.safetensors")  # created 0600 by safetensors' save_file
        # timm copies the fields of its own release of the architecture (tag, license, ...): not these weights'
        config = json.loads((staging / "config.json").read_text())
        for key in RELEASE_FIELDS:
            config["pretrained_cfg"].pop(key, None)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (staging / "README.md").write_text(card)
    return out_dir


def results_naming(checkpoint: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The results.json files of the runs around ``checkpoint`` (its folder and the folder above, and the run
    directories in each: the recipes' runs/at/<recipe>/version_N beside best.ckpt, the quickstart's
    runs/quickstart/version_N beside checkpoints/) whose sections name this very file by its sha256: the fit that
    wrote it, and the validations, tests and evaluations run on it there."""
    from robust_lightning.evaluation.results import file_sha256  # noqa: PLC0415

    sha = file_sha256(checkpoint)
    folders = [
        folder
        for parent in (checkpoint.parent, checkpoint.parent.parent)
        for folder in (parent, *sorted(parent.glob("*/")))
    ]
    found = []
    for path in dict.fromkeys(folder / "results.json" for folder in folders):
        try:
            results = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if sha in json.dumps(results):
            found.append((path, results))
    return found


def _values(values: Iterable[float]) -> str:
    return "[" + ", ".join(f"{value:.4g}" for value in values) + "]"


def _percent(value: float) -> str:
    return f"{100 * value:.2f}"


def model_card(
    checkpoint: Path,
    hparams: dict[str, Any],
    ema: bool,
    data_config: dict[str, Any],
    results: list[tuple[Path, dict[str, Any]]],
) -> str:
    """README.md of an exported folder: what the weights are, how to feed them, how they were trained and
    what was measured on them (only numbers a results.json holds, each with where it came from)."""
    arch = hparams["arch"]
    mean, std = data_config["mean"], data_config["std"]
    raw_input = all(m == 0 for m in mean) and all(s == 1 for s in std)
    lines = [
        f"# {arch}: {'EMA' if ema else 'raw'} weights exported by robust-lightning",
        "",
        f"Exported from `{checkpoint.resolve()}`.",
        "",
        "## Loading",
        "",
        "```python",
        *(["import robust_lightning  # registers the architecture with timm"] if needs_robust_lightning(arch) else []),
        "import timm",
        'model = timm.create_model("local-dir:PATH_TO_THIS_FOLDER", pretrained=True).eval()',
        "```",
        "",
        "## Input",
        "",
        f"- RGB images of {data_config['input_size'][-1]} x {data_config['input_size'][-1]} pixels.",
        "- The model takes [0, 1] images as they are (no normalisation)."
        if raw_input
        else f"- Normalise [0, 1] images with mean {_values(mean)} and std {_values(std)} first (as timm's data config "
        "does).",
        f"- Evaluation preprocessing: resize the shorter side to floor(size / {data_config['crop_pct']}) "
        f"({data_config['interpolation']}), centre crop.",
        "",
        "## Training",
        "",
    ]
    attack = hparams.get("attack", "none")
    if attack == "none":
        lines.append("- Clean training (no attack).")
    else:
        eps, norm = hparams.get("attack_eps"), hparams.get("attack_norm")
        assert eps is not None  # an adversarial recipe records its eps
        shown_eps = f"{eps * 255:.4g}/255" if norm == "Linf" else f"{eps:.4g}"
        lines.append(f"- Adversarial training: {attack}, {norm} eps {shown_eps}, {hparams.get('attack_steps')} steps.")
    lines += [
        f"- {key}: {hparams[key]}"
        for key in ("init_from", "lr", "weight_decay", "label_smoothing", "ema_decay")
        if hparams.get(key) is not None
    ]
    lines += ["", "## Results", ""]
    if not results:
        lines.append("No results.json beside the checkpoint names it: no numbers are reported here.")
    for path, sections in results:
        lines.append(f"From `{path.resolve()}`:")
        lines.append("")
        for stage in ("fit", "validate", "test"):
            metrics = sections.get(stage, {}).get("metrics", {})
            shown = {
                key: value
                for key, value in metrics.items()
                if key.startswith(("val/", "test/")) and key.endswith(("acc1", "robust_acc"))
            }
            if shown:
                lines.append(f"- {stage}: " + ", ".join(f"{key} {_percent(value)} %" for key, value in shown.items()))
        attack_section = sections.get("autoattack", {})
        threats = attack_section.get("threat_models", {})
        if threats:
            conditions = attack_section.get("conditions", {})
            run = sections.get("test") or sections.get("fit") or {}
            data = run.get("conditions", {}).get("data") or {}
            lines += [
                "",
                f"AutoAttack ({conditions.get('version')}, {conditions.get('precision')}; data: "
                f"{data.get('source', 'see results.json')} at {data.get('image_size')} px, subset "
                f"{data.get('eval_subset') or 'none'}):",
                "",
                "| threat model | images | clean (%) | robust (%) |",
                "| --- | --- | --- | --- |",
            ]
            lines += [
                f"| {name} | {t['num_points']} | {_percent(t['clean_accuracy'])} | {_percent(t['robust_accuracy'])} |"
                for name, t in threats.items()
                if t.get("num_points")
            ]
        lines.append("")
    return "\n".join(lines) + "\n"


def export(checkpoint: str, out: str, ema: bool = False) -> int:
    """Write the raw or EMA weights of a training checkpoint to a weights file or a timm model folder.

    Args:
        checkpoint: a .ckpt written by robust-lightning fit
        out: a .safetensors (or .pt, .pth) file, or a folder that timm loads with
            timm.create_model("local-dir:OUT", pretrained=True)
        ema: export the EMA weights instead of the raw ones
    """
    kind = "EMA" if ema else "raw"
    if Path(out).suffix in WEIGHT_FILE_SUFFIXES:
        path = export_weights(checkpoint, out, ema=ema)
        print(f"wrote {kind} weights of {checkpoint} to {path}")
        return 0
    path = export_timm_folder(checkpoint, out, ema=ema)
    print(
        f"wrote {kind} weights of {checkpoint} as a timm model folder {path}: "
        f'timm.create_model("local-dir:{path}", pretrained=True)'
    )
    arch = json.loads((path / "config.json").read_text())["architecture"]
    if needs_robust_lightning(arch):
        print(
            f"note: {arch} is an architecture of robust-lightning, not of timm: a process loading this folder must "
            "`import robust_lightning` first (it registers the architecture with timm)",
            file=sys.stderr,
        )
    return 0


def export_main(argv: list[str] | None = None) -> int:
    return run_tool(
        export,
        sys.argv[1:] if argv is None else argv,
        prog="robust-lightning export",
        description="Write the raw or EMA weights of a training checkpoint, e.g.\n"
        "  robust-lightning export runs/at/version_0/checkpoints/last.ckpt model-ema.safetensors --ema\n"
        "  (then evaluate it with --model.init_from model-ema.safetensors), or\n"
        "  robust-lightning export runs/at/version_0/checkpoints/last.ckpt model-ema/ --ema\n"
        '  (a folder for timm.create_model("local-dir:model-ema/", pretrained=True)).',
    )
