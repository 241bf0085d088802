"""The reference AutoAttack's checks through the command users run, `robust-lightning test` with the AutoAttack
callback: one model per check raises exactly it in results.json, a plain model raises none, and a raised check is
warned of once. tests/test_reference_checks.py holds the same models' checks through `robust_lightning.evaluate`
and against pyautoattack's own."""

import json

import pytest
import torch
import yaml
from timm.models import register_model
from torch import nn

from helpers import eval_config
from robust_lightning.cli import main
from robust_lightning.data.datamodule import ImageNetDataModule
from robust_lightning.data.sources import SyntheticSource

CLASSES = 10  # more than APGD-T's 3 target classes + 1: the class count raises no check of its own
SCALE = 0.05


TEMPLATES: list[torch.Tensor] = []  # the test images' class means, set before each model is built


class Plain(nn.Module):
    """Nearest class mean: -|x - m_k|^2 up to a constant, so that the test images are mostly classified right (a
    check that looks at the correctly classified points, zero_gradients, then has points to look at); scaled so
    that the logits are a few units apart, where a softmax does not saturate."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))
        means = TEMPLATES[-1].flatten(1)
        with torch.no_grad():
            self.net[1].weight.copy_(SCALE * 2 * means)
            self.net[1].bias.copy_(-SCALE * (means**2).sum(1))

    def forward(self, x):
        return self.net(x)


class Randomized(Plain):
    def forward(self, x):
        logits = self.net(x)
        return logits + 0.1 * logits.detach().std() * torch.randn_like(logits)


class Probabilities(Plain):
    def forward(self, x):
        return self.net(x).softmax(1)


class Quantized(Plain):
    """Input quantization: rounding has a zero gradient everywhere."""

    def forward(self, x):
        return self.net(torch.round(x * 4) / 4)


class OptimisesAtInference(Plain):
    """One gradient step on its input inside the forward pass (a dynamic defence)."""

    def forward(self, x):
        with torch.enable_grad():
            x_ = x.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(self.net(x_).logsumexp(1).sum(), x_)
        return self.net((x - 0.01 * grad.sign()).clamp(0, 1))


MODELS = {
    "plain": Plain,
    "randomized": Randomized,
    "range_output": Probabilities,
    "zero_gradients": Quantized,
    "dynamic": OptimisesAtInference,
}


def _registered(kind: str, cls: type) -> str:
    """The model as a timm architecture, so that a config names it as `model.arch`."""

    def create(pretrained: bool = False, num_classes: int = CLASSES, **kwargs) -> nn.Module:
        return cls(num_classes)

    create.__name__ = f"checks_{kind}"
    register_model(create)
    return create.__name__


ARCHS = {kind: _registered(kind, cls) for kind, cls in MODELS.items()}


def class_means(synthetic: dict) -> torch.Tensor:
    data = ImageNetDataModule(source=SyntheticSource(**synthetic), image_size=32, eval_batch_size=100, num_workers=0)
    data.setup("test")
    batch = next(iter(data.test_dataloader()))
    images, labels = batch["image"].float() / 255, batch["label"]
    return torch.stack([images[labels == k].mean(0) for k in range(CLASSES)])


@pytest.mark.parametrize("kind", MODELS)
def test_robust_lightning_test_records_and_warns_of_the_checks_a_model_raises(kind, tmp_path, recwarn):
    # eval_config keeps the progress display and logger a user has; its loaders run in the main process, since
    # the checks see the batch the callback attacks whichever process decoded it (loader workers under `test` are
    # run by tests/test_ddp_commands.py); the sanity checks are off here (tests/test_sanity_checks.py has them);
    # the adaptive attacks a raised check calls for run, on a small budget (Square from scratch: 20 queries)
    config_path = eval_config(
        tmp_path, tmp_path / "synthetic", version="apgd-t", n_iter=2, n_queries=20, sanity_points=0
    )
    config = yaml.safe_load(config_path.read_text())
    config["model"]["arch"] = ARCHS[kind]
    config["data"]["source"]["init_args"].update(num_classes=CLASSES, val_per_class=2, train_per_class=2)
    config_path.write_text(yaml.safe_dump(config))
    TEMPLATES.append(class_means(config["data"]["source"]["init_args"]))
    assert main(["test", "--config", str(config_path)]) == 0

    results = json.loads(next((tmp_path / "runs" / "aa").glob("version_*/results.json")).read_text())
    found = results["autoattack"]["threat_models"]["Linf-4_255"]["checks"]
    assert set(found) == {"randomized", "range_output", "dynamic", "n_classes", "zero_gradients", "square_sr"}
    raised = {name for name, check in found.items() if check["raised"]}
    if kind == "randomized":  # one draw may also make the DLR loss constant at a point: its own check is required
        assert "randomized" in raised
    else:
        assert raised == (set() if kind == "plain" else {kind})
    for name in raised:  # once, whatever the number of batches (recwarn records repeats too)
        assert sum(f"the check {name} was raised" in str(w.message) for w in recwarn) == 1
