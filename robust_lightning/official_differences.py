"""How a run differs from the official code of its recipe (Singh, Croce & Hein, github.com/nmndeep/revisiting-at):
every deliberate difference, in one place. results.json records both lists (``conditions.model`` and
``conditions.data``, key ``differences_from_official_code``); each recipe's YAML header names those its settings
choose.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning.fabric.utilities.data import AttributeDict


def training_differences(hp: "AttributeDict", precision: str | None) -> list[str]:
    """How a training recipe (ImageClassifier's hyper-parameters ``hp``, the trainer's ``precision``) departs
    from Singh et al.'s code (github.com/nmndeep/revisiting-at, main.py)."""
    differences = [
        "lr schedule: linear warm-up from peak / warm-up steps, then an exact cosine, both per optimiser step "
        "(official: warm-up from 1e-4 x peak, cosine values at whole epochs interpolated per iteration); "
        "same peak, warm-up length and end",
    ]
    if hp.weight_decay_rule != "official":
        differences.append(
            "weight decay: timm's rule, no decay on biases, 1-D tensors and no_weight_decay() "
            "(official: ConvNeXt norm weights and layer scales, ViT pos_embed and cls_token "
            "decayed too; model.weight_decay_rule official)"
        )
    if precision is not None and precision != "16-mixed":
        differences.append(f"precision {precision} (official: fp16 autocast with a GradScaler)")
    if hp.select_attack_steps:
        differences.append(
            "checkpoint selection during training, at every validation, on the held-out images "
            "(official: weights saved every epoch and selected afterwards)"
        )
    return differences


def data_differences(data) -> list[str]:
    """How the training data pipeline of ``data`` (an ImageNetDataModule) departs from Singh et al.'s
    (github.com/nmndeep/revisiting-at: ImageFolder, timm's create_transform with mean 0 / std 1 run per image on
    PIL, 8 GPUs)."""
    differences = list(data.source.differences_from_official_code())  # how the source reads its images
    if data.uses_canvases:
        differences.append(
            f"images larger than the {data.canvas_size}-px canvas decoded at reduced scale (JPEG DCT scaling "
            "by 2, 4 or 8) before the random-resized crop, which runs on the device (official: full-resolution "
            "decode, PIL crop; data.full_resolution_decode)"
        )
    if data.augmentation != "basic" and data.augment_on == "device":
        differences.append(
            "augmentation after the crop runs batched on the device, timm's PIL ops reproduced "
            "(colour ops exact, bilinear/bicubic geometric ops within 1/255 on rare pixels)"
        )
    if data.augmentation == "heavy" and data.augmentation_fill != "official":
        differences.append(
            "RandAugment fill = ImageNet mean colour and RandomErasing noise mean + std * N(0, 1) "
            "clamped to [0, 1] (official: black fill and unclamped N(0, 1) noise; "
            "data.augmentation_fill official)"
        )
    if data.augmentation == "heavy":  # MixUp/CutMix on
        differences.append(
            "CutMix box of timm 1.0.31, cut_h // 2 rows above the centre and (cut_h + 1) // 2 below (columns "
            "likewise): a side of odd length is 1 px longer than the official code's timm 0.8.0.dev0 box, "
            "cut_h // 2 on both sides (before clipping); the random draws are the same"
        )
    batch = data.global_batch
    if batch.configured:
        differences.append(
            "data.global_batch_size split over any device count, each rank's loss weighted so "
            "the update is that of the whole batch (official: per-GPU batch x 8 GPUs)"
        )
    if batch.micro_batches > 1:
        differences.append(
            f"each device's share of the global batch in {batch.micro_batches} micro-batches of at "
            f"most data.max_device_batch_size {batch.max_device_batch} images, gradients "
            "accumulated exactly (BatchNorm statistics and MixUp/CutMix pairs per micro-batch; "
            "official: one forward per GPU and step, no accumulation)"
        )
    return differences
