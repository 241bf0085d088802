"""Clean and adversarial training of an image classifier: the recipe of Singh, Croce & Hein (APGD-AT).

One LightningModule covers both: ``attack: none`` trains clean, ``attack: apgd`` (or pgd / fgsm / fgsm_rs)
trains on adversarial examples of the augmented, mixed batch. Validation measures clean and (with
``select_attack_steps``) APGD robust accuracy of the raw and the EMA weights, exactly across ranks, and logs the
score that ModelCheckpoint keeps the best of (``val/select_acc``).
"""

import copy
import operator
import warnings
from collections.abc import Callable
from functools import partial, reduce
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
import torch.nn.functional as F
from lightning import LightningModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.parsing import AttributeDict
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from timm.layers import DropPath
from timm.models.convnext import ConvNeXt
from timm.optim import create_optimizer_v2
from timm.utils import ModelEmaV3
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR
from torchmetrics import MeanMetric, MetricCollection, SumMetric
from torchmetrics.classification import MulticlassAccuracy

from robust_lightning.attacks import apgd, fgsm, pgd
from robust_lightning.data.batch import Batch, PredictedBatch, soft_targets
from robust_lightning.data.batching import global_batch_of
from robust_lightning.devices import host_reads_are_cheap
from robust_lightning.errors import UserError
from robust_lightning.evaluation.calibration import CalibrationError
from robust_lightning.models.classifier import (
    InputNormalization,
    RobustClassifier,
    build_classifier,
    use_small_input_strides,
)
from robust_lightning.models.isotropic_convnext import IsotropicConvNeXt
from robust_lightning.models.robustbench import is_robustbench_arch, preprocessing_mismatch, resolve_arch
from robust_lightning.models.weights import WarmStartReport, adopt_normalizer, load_pretrained
from robust_lightning.official_differences import training_differences
from robust_lightning.training.random_state import RandomStates, random_states, set_random_states
from robust_lightning.training.schedule import warmup_cosine

ATTACKS = ("none", "apgd", "pgd", "fgsm", "fgsm_rs")
# Layers whose train-mode forward differs from eval mode: with any of them active, the attack's (eval-mode)
# forward cannot double as the update's (train-mode) forward.
MODE_DEPENDENT = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd, DropPath)

# The epoch values of these stages are reduced over the ranks before they are logged (torchmetrics' compute(),
# strategy.reduce), so they are logged without sync_dist: Lightning's advice to add it does not apply to them.
warnings.filterwarnings(
    "ignore",
    message=r"It is recommended to use `self\.log\('(train|val|val_ema|test|test_ema)/",
    category=PossibleUserWarning,
)


def accuracy_metrics(num_classes: int) -> MetricCollection:
    # micro averaging = plain top-k accuracy over images (torchmetrics defaults to macro)
    return MetricCollection(
        {
            "acc1": MulticlassAccuracy(num_classes, top_k=1, average="micro"),
            "acc5": MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro"),
        }
    )


def paper_warmup_epochs(max_epochs: int) -> int:
    """Warm-up of Singh et al. (App. A): the peak lr is reached at epoch 10 in 50- and 100-epoch runs, at epoch 20
    in 250- and 300-epoch runs (their code's rule: 20 when training for more than 100 epochs)."""
    return 20 if max_epochs > 100 else 10


def official_decayed_names(net: nn.Module) -> set[str]:
    """Names of the parameters the code of Singh et al. decays (github.com/nmndeep/revisiting-at, main.py
    ``create_optimizer``): in ConvNeXts (isotropic included) every parameter but the biases, so LayerNorm
    weights and the layer scale ``gamma`` too; in every other model every tensor of two or more dimensions but
    the biases, so a ViT's pos_embed and cls_token too. (timm's rule, the default, also spares 1-D tensors in
    ConvNeXts and a model's ``no_weight_decay()`` list.)"""
    trainable = {name: p for name, p in net.named_parameters() if p.requires_grad}
    if isinstance(net, (ConvNeXt, IsotropicConvNeXt)):
        return {name for name in trainable if not name.endswith(".bias")}
    return {name for name, p in trainable.items() if p.ndim > 1 and not name.endswith(".bias")}


def _to_cpu(state: torch.Tensor | list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
    """A torchmetrics state (a tensor, or a list of them for the states it concatenates) on the CPU."""
    return [part.detach().cpu() for part in state] if isinstance(state, list) else state.detach().cpu()


def has_mode_dependent_layers(model: nn.Module) -> bool:
    for module in model.modules():
        # dropout and drop-path at rate 0 are identities in both modes
        if isinstance(module, MODE_DEPENDENT) and getattr(module, "p", getattr(module, "drop_prob", 1)) > 0:
            return True
    return False


class ImageClassifier(LightningModule):
    """A timm model on [0, 1] images, trained clean or adversarially with the recipe of Singh et al.

    Args:
        arch: timm model name (any timm model or tag, or a registered ConvStem variant), or
            ``robustbench:<name>``: the architecture and normaliser of that RobustBench ImageNet entry. From
            Python (``robust_lightning.evaluate``), also a network of one's own: an ``nn.Module`` whose logits
            the evaluations read (behind the ``mean``/``std`` normaliser, when set).
        num_classes: size of the label space (linked from the data module by the CLI).
        image_size: input resolution, passed to architectures that need it (ViTs); linked from the data.
        mean: per-channel mean of the model's normaliser; None = the model takes [0, 1] input as is.
        std: per-channel std of the normaliser (set with mean).
        arch_kwargs: extra keyword arguments for timm.create_model (e.g. drop_path_rate).
        init_from: warm start from a local checkpoint (.ckpt, .pt/.pth state dict or .safetensors, the released
            files of Singh et al. and RobustBench included); a ConvStem model takes all non-stem weights from
            its PatchStem counterpart. An input normaliser stored in the file replaces the model's. Loaded at
            the start of fit/validate/test/predict; never read when a checkpoint is loaded (``--ckpt_path``,
            ``load_from_checkpoint``): the checkpoint holds the weights.
        init_from_ema: take the EMA weights of init_from when it has them (fine-tuning a robust model).
        new_head: start with a fresh classifier head instead of the checkpoint's (transfer to another label
            space, e.g. CIFAR-10).
        small_input: ConvNeXt on 32x32 images: stride 1 in the stem and the first downsampling (the paper's
            CIFAR transfer setting).
        lr: peak learning rate.
        min_lr: final learning rate of the cosine decay.
        warmup_epochs: linear warm-up length in epochs (may be fractional); None = the paper's rule for the
            run's trainer.max_epochs: 10 up to 100 epochs, 20 beyond (``paper_warmup_epochs``).
        weight_decay: AdamW weight decay.
        weight_decay_rule: which parameters are decayed: "timm" (timm's optimizer factory: not biases, 1-D
            tensors nor the model's no_weight_decay() list) or "official" (as the code of Singh et al.: ConvNeXt
            norm weights and layer scales, ViT pos_embed and cls_token are decayed too; ``official_decayed_names``).
        betas: AdamW betas.
        label_smoothing: label smoothing of the cross-entropy (MixUp/CutMix targets are smoothed the same way).
        channels_last: run the model in channels_last memory format (faster convolutions on GPU).
        compile: compile the network with torch.compile (off by default). An adversarial run then compiles three
            graphs, each once for every batch size (the batch dimension is dynamic from the first call): the
            attack's passes with input gradients (the parameters detached: no parameter gradient is built, compiled
            or eager), the passes without gradients (the attack's last iterate, validation) and the update's pass
            (clean training: the last two). The re-forward of the points whose best iterate is not the last takes
            one of eight batch sizes.
        attack: training attack: "none" (clean training), "apgd" (the paper), "pgd", "fgsm" or "fgsm_rs".
        attack_norm: threat model of the training attack: "Linf", "L2" or "L1".
        attack_eps: radius of the training attack (4/255 in the paper).
        attack_steps: iterations of APGD / PGD (2 in the paper).
        attack_random_start: start the attack at a random point of the ball (the paper does not).
        eps_warmup_epochs: grow eps linearly from 0 to attack_eps over this many epochs (0 = off).
        reuse_attack_forward: compute the last attack forward with the parameter graph and reuse it for the
            update (7/3 instead of 8/3 of a clean step). Only valid when train and eval mode compute the same
            function (no BatchNorm, dropout or drop-path). None = decide from the model and the device: reuse on
            the CPU only, since on an H100 it measured no faster than the plain update (benchmarks/RESULTS.md).
        ema_decay: decay of the exponential moving average of the weights (the paper: 0.9999), updated after
            every optimiser step; None = no EMA. Validation and test then report the EMA model too (val_ema/...).
        select_attack_steps: APGD-CE iterations of the robust accuracy measured at every validation (the paper
            selects checkpoints with 1 step, 10 for medium and large models); 0 = clean accuracy only.
        select_on: which weights the checkpoint score val/select_acc comes from: "raw" or "ema".
    """

    if TYPE_CHECKING:  # save_hyperparameters() stores them in an AttributeDict: hp.lr, hp.attack, ...

        @property
        def hparams(self) -> AttributeDict: ...

    def __init__(
        self,
        arch: str = "convnext_tiny_convstem",
        num_classes: int = 1000,
        image_size: int | None = None,
        mean: tuple[float, float, float] | None = None,
        std: tuple[float, float, float] | None = None,
        arch_kwargs: dict[str, Any] | None = None,
        init_from: str | None = None,
        init_from_ema: bool = False,
        new_head: bool = False,
        small_input: bool = False,
        lr: float = 1e-3,
        min_lr: float = 5e-6,
        warmup_epochs: float | None = None,
        weight_decay: float = 0.05,
        weight_decay_rule: Literal["timm", "official"] = "timm",
        betas: tuple[float, float] = (0.9, 0.95),
        label_smoothing: float = 0.1,
        channels_last: bool = False,
        compile: bool = False,
        attack: Literal["none", "apgd", "pgd", "fgsm", "fgsm_rs"] = "none",
        attack_norm: Literal["Linf", "L2", "L1"] = "Linf",
        attack_eps: float = 4 / 255,
        attack_steps: int = 2,
        attack_random_start: bool = False,
        eps_warmup_epochs: float = 0.0,
        reuse_attack_forward: bool | None = None,
        ema_decay: float | None = None,
        select_attack_steps: int = 0,
        select_on: Literal["raw", "ema"] = "raw",
    ):
        super().__init__()
        given = isinstance(arch, nn.Module)
        self.save_hyperparameters(ignore=["arch"] if given else None)  # a module is no hyper-parameter
        if given:
            self.hparams["arch"] = f"{type(arch).__name__} (a module given in Python)"
        if attack_eps <= 0 or attack_steps < 1 or select_attack_steps < 0:
            raise UserError("model.attack_eps must be > 0, attack_steps >= 1 and select_attack_steps >= 0")
        if attack in ("fgsm", "fgsm_rs") and attack_norm != "Linf":
            raise UserError(f"model.attack {attack!r} is Linf only; use apgd or pgd for {attack_norm}")
        if select_on == "ema" and ema_decay is None:
            raise UserError("model.select_on 'ema' needs model.ema_decay")
        if isinstance(arch, nn.Module):  # given
            self.model = RobustClassifier(arch, mean, std)
        else:
            timm_arch, net_mean, net_std = resolve_arch(arch, mean, std)
            self.model = build_classifier(timm_arch, num_classes, image_size, net_mean, net_std, arch_kwargs or {})
        if small_input:
            use_small_input_strides(self.model.net)
        if channels_last:
            self.model.to(memory_format=torch.channels_last)
        if compile:  # in place: the state dict keeps its keys (torch.compile(module) would prefix _orig_mod)
            # the whole classifier, so that the tensor marked by _any_batch is the compiled frame's input (the
            # normaliser would hand the network a new, unmarked one). Copies run eager (the EMA's: nn.Module's
            # __getstate__ drops the compiled call).
            self.model.compile()
        if reuse_attack_forward and has_mode_dependent_layers(self.model):
            raise UserError(
                f"model.reuse_attack_forward needs a model without BatchNorm, dropout or drop-path; {arch} has some"
            )
        self._reuse_possible = attack == "apgd" and (
            not has_mode_dependent_layers(self.model) if reuse_attack_forward is None else reuse_attack_forward
        )
        # The EMA copy never takes gradients; requires_grad False keeps DDP from expecting them.
        self.ema: ModelEmaV3 | None = None
        if ema_decay is not None:
            self.ema = ModelEmaV3(self.model, decay=ema_decay)
            self.ema.requires_grad_(False)
            self.ema.module.train()  # follow the module's mode like any submodule (timm leaves it in eval)
        self._step_nominal: int | None = None  # images the current optimiser step is meant to see (global batch)
        self._step_images: int | None = None  # images of this rank the current optimiser step saw so far
        self._step_totals: torch.Tensor | None = None  # the step's images and loss sums on this rank (device)
        # set by on_load_checkpoint, applied by on_train_start: (this rank's states, every rank's or None)
        self._resumed_random_states: tuple[RandomStates, list[RandomStates] | None] | None = None
        self._resumed_train_metrics: tuple[Any, list[Any] | None] | None = None  # the same for the accuracies
        self.warm_start_report: WarmStartReport | None = None
        self.weights_from_checkpoint = False  # set by on_load_checkpoint: init_from is then never read
        self.train_metrics = MetricCollection(
            {
                "clean_acc1": MulticlassAccuracy(num_classes, average="micro"),
                "adv_acc1": MulticlassAccuracy(num_classes, average="micro"),
            },
            prefix="train/",
        )
        self.eval_metrics = nn.ModuleDict(
            {
                weights: MetricCollection(
                    {
                        # a MetricCollection unpacks as the mapping it is (its keys() takes an option)
                        **accuracy_metrics(num_classes),  # type: ignore[dict-item]
                        "loss": MeanMetric(),
                        "robust_acc": MeanMetric(),
                        "num_images": SumMetric(),
                        "ece": CalibrationError(),
                    }
                )
                for weights in (["raw", "ema"] if self.ema is not None else ["raw"])
            }
        )

    def warm_start(self) -> None:
        """Load ``init_from`` into the model, once, unless a checkpoint's weights were (or will be) loaded.

        Runs at the start of fit / validate / test / predict, after Lightning has restored a ``ckpt_path`` (and
        ``load_from_checkpoint`` calls ``on_load_checkpoint`` first too): a checkpoint is self-contained and
        never needs its warm-start file again.
        """
        trainer = self._trainer
        if (
            not self.hparams.init_from
            or self.warm_start_report is not None
            or self.weights_from_checkpoint
            or (trainer is not None and trainer.ckpt_path is not None)
        ):
            return
        try:
            self.warm_start_report = load_pretrained(
                self.model,
                self.hparams.init_from,
                new_head=self.hparams.new_head,
                prefer_ema=self.hparams.init_from_ema,
            )
        except UserError as e:
            raise UserError(f"model.init_from: {e}") from e
        rank_zero_info(str(self.warm_start_report))
        if adopt_normalizer(self.model, self.warm_start_report.checkpoint_normalize):
            normalize = self.model.normalize
            assert isinstance(normalize, InputNormalization)  # adopt_normalizer put one there
            normalize.to(self.device)  # the model may already be on its device
            # the weights were trained behind this normaliser; recorded so a resumed run rebuilds it
            self.hparams.mean = normalize.mean.flatten().tolist()
            self.hparams.std = normalize.std.flatten().tolist()
            self.warm_start_report.notes.append(f"input normaliser taken from the checkpoint: {self.model.normalize}")
            rank_zero_info(self.warm_start_report.notes[-1])
            if self.ema is not None:
                self.ema.module.normalize = copy.deepcopy(self.model.normalize)
        if self.ema is not None:  # the average starts from the warm-start weights, not the random init
            self.ema.set(self.model)  # type: ignore[no-untyped-call]  # timm's, unannotated

    # After any checkpoint restore (Lightning restores modules before these hooks) and before the first batch.
    def on_fit_start(self) -> None:
        self.warm_start()
        batchnorms = [m for m in self.model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if self.trainer.world_size > 1 and batchnorms and not isinstance(batchnorms[0], nn.SyncBatchNorm):
            rank_zero_info(
                f"{self.hparams.arch} has BatchNorm: each rank normalises with the statistics of its own share of the "
                "batch; --trainer.sync_batchnorm true computes them over all ranks (one all-reduce per layer)"
            )

    def on_validation_start(self) -> None:
        self.warm_start()

    def on_test_start(self) -> None:
        self.warm_start()

    def on_predict_start(self) -> None:
        self.warm_start()

    def setup(self, stage: str) -> None:
        data = getattr(self.trainer, "datamodule", None)
        if is_robustbench_arch(self.hparams.arch) and data is not None and hasattr(data, "crop_pct"):
            mismatch = preprocessing_mismatch(self.hparams.arch, data.image_size, data.crop_pct)
            if mismatch:
                rank_zero_warn(mismatch)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Lightning saves no random state; a resumed fit needs it to draw the same attacks and drop paths. Nor does
        it save the training accuracies of the epoch so far (torchmetrics states), which the epoch's end logs: a
        fit resumed in the middle of an epoch logs them over the whole epoch all the same. Under DDP every rank saves
        a checkpoint together (a collective), so each rank's states are gathered into the file. Random states
        already in the checkpoint are those of the moment it stands for (robust_lightning.training.interruption)."""
        states = checkpoint.setdefault("random_states", random_states())
        checkpoint["train_metric_states"] = accuracies = self._train_metric_states()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            ranks: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(ranks, (states, accuracies))
            checkpoint["random_states_of_ranks"] = [rank[0] for rank in ranks]
            checkpoint["train_metric_states_of_ranks"] = [rank[1] for rank in ranks]

    def _train_metric_states(self) -> dict[str, dict[str, Any]]:
        """This rank's training accuracies of the epoch so far: each metric's states and update count."""
        return {
            name: {
                "states": {key: _to_cpu(value) for key, value in metric.metric_state.items()},
                "updates": metric._update_count,
            }
            for name, metric in self.train_metrics.items(keep_base=True)
        }

    def _restore_train_metrics(self, own: dict[str, Any], of_ranks: list[Any] | None) -> None:
        """Each rank takes its own accuracies' states where the checkpoint has them for this many ranks; otherwise
        rank zero takes them all, merged (the states are sums over images, which ``compute`` sums over ranks)."""
        world, rank = self.trainer.world_size, self.trainer.global_rank
        if of_ranks is not None and len(of_ranks) == world:
            parts = [of_ranks[rank]]
        else:
            parts = (of_ranks or [own]) if rank == 0 else []
        for name, metric in self.train_metrics.items(keep_base=True):
            metric.reset()
            for part in parts:
                if name in part:
                    states = part[name]["states"]
                    metric.merge_state(
                        {
                            k: [t.to(self.device) for t in v] if isinstance(v, list) else v.to(self.device)
                            for k, v in states.items()
                        }
                    )
                    metric._update_count += part[name]["updates"]

    def on_train_start(self) -> None:
        # After the sanity check and the creation of the first training iterator, which draw from the global
        # generators too: the states of the checkpoint continue from here as they did in the saved run. Each rank
        # takes its own where the checkpoint has them for this many ranks, else rank zero's.
        if self._resumed_random_states is not None:
            own, of_ranks = self._resumed_random_states
            if of_ranks is not None and len(of_ranks) == self.trainer.world_size:
                own = of_ranks[self.trainer.global_rank]
            set_random_states(own)
            self._resumed_random_states = None
        if self._resumed_train_metrics is not None:
            self._restore_train_metrics(*self._resumed_train_metrics)
            self._resumed_train_metrics = None

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint of another architecture with one clear message instead of a state_dict traceback."""
        if checkpoint.get("random_states") is not None:  # for on_train_start
            self._resumed_random_states = (checkpoint["random_states"], checkpoint.get("random_states_of_ranks"))
        if checkpoint.get("train_metric_states") is not None:  # the same; not in checkpoints of earlier versions
            self._resumed_train_metrics = (
                checkpoint["train_metric_states"],
                checkpoint.get("train_metric_states_of_ranks"),
            )
        ours = self.state_dict()
        theirs = checkpoint.get("state_dict", {})
        mismatched = sorted(
            [f"{k} (missing in checkpoint)" for k in ours.keys() - theirs.keys()]
            + [f"{k} (not in this model)" for k in theirs.keys() - ours.keys()]
            + [
                f"{k} (checkpoint {tuple(theirs[k].shape)} vs model {tuple(v.shape)})"
                for k, v in ours.items()
                if k in theirs and theirs[k].shape != v.shape
            ]
        )
        if mismatched:
            saved = checkpoint.get("hyper_parameters", {})
            listed = "\n  ".join(mismatched[:20]) + (
                f"\n  ... {len(mismatched) - 20} more" if len(mismatched) > 20 else ""
            )
            raise UserError(
                f"the checkpoint holds a {saved.get('arch', 'unknown')!r} model (num_classes "
                f"{saved.get('num_classes')}, ema_decay {saved.get('ema_decay')}), incompatible with the configured "
                f"{self.hparams.arch!r} (num_classes {self.hparams.num_classes}, ema_decay {self.hparams.ema_decay}); "
                f"mismatched keys:\n  {listed}"
            )
        self.weights_from_checkpoint = True

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.run_network(self.model, images)

    def run_network(self, model: nn.Module, images: torch.Tensor) -> torch.Tensor:
        if self.hparams.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return self._any_batch(model, model, images)

    def _any_batch(
        self, model: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor
    ) -> torch.Tensor:
        """``forward(images)``, where a compiled ``model`` compiles each kind of pass once for every batch size.

        The batch sizes of a run change (a smaller micro-batch or validation batch, the validation attack's
        shrinking batch, the re-forward's buckets); each change would compile a static graph, then a dynamic one,
        so the batch dimension is dynamic from the first call. A batch of one would still get a graph of its own
        (Dynamo specialises sizes 0 and 1): in eval mode, where each row's logits are its own, it is forwarded
        twice in a batch of two."""
        if not self.hparams.compile:
            return forward(images)
        single = len(images) == 1 and not model.training
        if single:
            images = torch.cat([images, images])
        torch._dynamo.maybe_mark_dynamic(images, 0)
        logits = forward(images)
        return logits[:1] if single else logits

    def _run_for_attack(self, model: nn.Module, images: torch.Tensor) -> torch.Tensor:
        """``model`` on ``images`` with its parameters detached: an attack needs input gradients only, so no
        parameter-gradient graph is recorded (less memory), and a compiled network gets a graph without one.

        Without gradients (the attack's last iterate) nothing is recorded to detach from: the model runs as it is,
        and a compiled one reuses validation's graph instead of compiling one for detached parameters."""
        if not torch.is_grad_enabled():
            return self.run_network(model, images)
        if self.hparams.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        detached = {name: p.detach() for name, p in model.named_parameters()}
        return self._any_batch(model, partial(torch.func.functional_call, model, detached), images)

    # ------------------------------------------------------------------------------------------- training
    @property
    def reuse_forward(self) -> bool:
        """Whether the update reuses the attack's last forward (``reuse_attack_forward``) on the module's device."""
        forced = self.hparams.reuse_attack_forward is not None
        return self._reuse_possible and (forced or host_reads_are_cheap(next(self.model.parameters())))

    def current_eps(self) -> float:
        hp = self.hparams
        eps: float = hp.attack_eps
        warmup_epochs: float = hp.eps_warmup_epochs
        if warmup_epochs <= 0 or self._trainer is None:
            return eps
        steps_per_epoch = self.trainer.estimated_stepping_batches / max(1, self.trainer.max_epochs or 1)
        return eps * min(1.0, (self.trainer.global_step + 1) / (warmup_epochs * steps_per_epoch))

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor | None:
        images, labels = batch["image"], batch["label"]
        shares_a_step = self._shares_a_step()
        if batch_idx % self._micro_batches() == 0:
            self._start_step()
        if labels.numel() == 0:  # every image of this batch was corrupt (reported by CorruptImageReport)
            # alone, the step is skipped; sharing one (other ranks, micro-batches), a zero loss over every
            # parameter keeps this rank in DDP's gradient all-reduce
            trainable = (p.sum() for p in self.model.parameters() if p.requires_grad)
            return reduce(operator.add, trainable) * 0.0 if shares_a_step else None
        hp = self.hparams
        # soft targets: MixUp/CutMix made them already (batch["target"]), else smoothed one-hot labels
        targets = batch.get("target")
        if targets is None:
            targets = soft_targets(labels, hp.num_classes, hp.label_smoothing)
        hard = targets.argmax(1)  # what "correct" means for a mixed image
        if hp.attack == "none":
            clean_logits = logits = self(images)
            loss = F.cross_entropy(logits, targets)
        else:
            logits, loss, clean_logits = self.adversarial_loss(images, targets)
            self.train_metrics["adv_acc1"].update(logits.detach(), hard)
        self.train_metrics["clean_acc1"].update(clean_logits.detach(), hard)
        clean_loss = F.cross_entropy(clean_logits.detach().float(), targets)
        # the losses are logged by on_before_optimizer_step, as means over the step's images on every rank
        assert self._step_totals is not None  # _start_step began the step
        self._step_totals[0].add_(labels.numel())
        self._step_totals[1:].add_(torch.stack([loss.detach().float(), clean_loss]) * labels.numel())
        return loss * self.global_batch_weight(labels.numel()) if shares_a_step else loss

    # An optimiser step's global batch may be split over ranks (DDP) and, on each rank, over micro-batches whose
    # gradients are accumulated (data.max_device_batch_size). Its gradient must be that of the mean loss over all
    # its images, however unevenly they are split and however many were left out as undecodable.
    def _micro_batches(self) -> int:
        """This rank's forward passes per optimiser step: the data module's global batch decides them (and sets
        Lightning's accumulate_grad_batches to match); a data module that names no global batch leaves them to the
        trainer's own accumulate_grad_batches."""
        global_batch = global_batch_of(self.trainer)
        return global_batch.micro_batches if global_batch else self.trainer.accumulate_grad_batches

    def _shares_a_step(self) -> bool:
        return self.trainer.world_size > 1 or self._micro_batches() > 1

    def _start_step(self) -> None:
        global_batch = global_batch_of(self.trainer)
        self._step_nominal = global_batch.images if global_batch else None  # images one step is meant to see
        self._step_images = 0
        # this rank's images, and their summed update and clean losses, in the step (a fill: nothing is copied)
        self._step_totals = torch.zeros(3, device=self.device)

    def global_batch_weight(self, images: int) -> float:
        """The weight of a micro-batch's mean loss (``images`` images) in a step shared by ranks or micro-batches.

        DDP averages the ranks' gradients and Lightning divides each micro-batch's loss by the number of
        micro-batches (A, ``_micro_batches``, which its accumulate_grad_batches matches): weighting the mean loss
        by images * W * A / G, with G the global batch the step is meant to see, gives the gradient of
        (1 / G) * sum_i loss_i over all the step's images. ``on_before_optimizer_step`` then rescales the gradient
        by G / (the images the step saw, summed over ranks): exactly 1 unless images were left out. A plain number:
        nothing is read back from the device, and the step's one all-reduce (the image count) comes before the
        optimiser step.
        """
        if self._step_nominal is None:  # a data module that names no global batch: the first micro-batch's
            self._step_nominal = images * self.trainer.world_size * self._micro_batches()
        assert self._step_images is not None  # _start_step began the step
        self._step_images += images
        return images * self.trainer.world_size * self._micro_batches() / self._step_nominal

    def on_before_optimizer_step(self, optimizer: Optimizer) -> None:
        """Sum the step's images and losses over the ranks (the step's one all-reduce), rescale the gradient to
        that of the mean loss over the images the step saw (see ``global_batch_weight``), and log the step's mean
        losses over all of them: the same figures on any number of ranks and micro-batches."""
        if self._step_totals is None:
            return
        totals = self._step_totals
        if self.trainer.world_size > 1:
            totals = self.trainer.strategy.reduce(totals, reduce_op="sum")
        seen = totals[0].clamp(min=1)
        if self._shares_a_step() and self._step_images is not None:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            assert self._step_nominal is not None  # set by global_batch_weight, which a shared step ran
            torch._foreach_mul_(grads, self._step_nominal / seen)  # a device scalar: no host read
        # not prog_bar: Lightning turns progress-bar values into numbers after every step (a wait for the GPU);
        # the progress display reads train/loss at logging steps only (robust_lightning.training.progress)
        loss, clean_loss = totals[1] / seen, totals[2] / seen
        self.log("train/loss", loss)
        self.log("train/clean_loss", clean_loss)
        if self.hparams.attack != "none":
            self.log("train/adv_loss", loss)  # the update's loss on the attacked images
        # Host values are logged as host tensors: Lightning copies a logged Python number to the device, and on
        # a GPU that copy from pageable memory waits for the device's queue.
        self.log("train/lr", torch.tensor(optimizer.param_groups[0]["lr"]))
        if self.hparams.attack != "none":
            self.log("train/eps", torch.tensor(self.current_eps()))
        self._step_images = self._step_totals = None

    def adversarial_loss(
        self, images: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attack the (augmented, mixed) batch in eval mode, then the loss of the update in train mode.

        Returns (logits on the adversarial batch, the update's loss, clean logits). The clean logits come free
        from the attack's first forward when it starts at the clean images (no random start).
        """
        hp = self.hparams
        eps = self.current_eps()
        self.model.eval()
        try:
            if hp.attack == "apgd":
                last_forward = None
                if self.reuse_forward:
                    # train mode = eval mode for this model; keeps the parameter graph
                    def last_forward(x: torch.Tensor) -> torch.Tensor:
                        self.model.train()
                        logits: torch.Tensor = self(x)
                        return logits

                result = apgd(
                    partial(self._run_for_attack, self.model),
                    images,
                    targets,
                    norm=hp.attack_norm,
                    eps=eps,
                    n_iter=hp.attack_steps,
                    loss="ce",
                    random_start=hp.attack_random_start,
                    last_forward=last_forward,
                )
                x_adv, start_logits = result.x_best, result.logits_start
            else:
                x_adv = self._simple_attack(images, targets, eps)
                result, start_logits = None, None
        finally:
            self.model.train()
        if start_logits is None or hp.attack_random_start:
            with torch.no_grad():
                self.model.eval()
                start_logits = self(images)
                self.model.train()

        if result is not None and self.reuse_forward:
            logits = self._with_best_iterates(result.logits_last, x_adv, result.best_is_last)
        else:
            logits = self(x_adv)
        return logits, F.cross_entropy(logits, targets), start_logits

    def _with_best_iterates(
        self, logits: torch.Tensor, x_adv: torch.Tensor, best_is_last: torch.Tensor
    ) -> torch.Tensor:
        """The update's logits: those of the attack's last forward, except for the points whose highest-loss
        iterate is an earlier one, which get a forward of their own.

        Which points those are is read back from the device: the one read of the step, cheaper than the
        fixed-shape alternative (a forward of the whole batch, an eighth of the step). A compiled network, and any
        network off the CPU, sees one of eight batch sizes (the count rounded up to a multiple of an eighth of the
        batch, the extra points forwarded and left unused) instead of a new shape at every step: on an H100 the
        first forward and backward of each new size took seconds (benchmarks/RESULTS.md)."""
        redo = (~best_is_last).nonzero().squeeze(1)
        count = redo.numel()
        if not count:
            return logits
        if self.hparams.compile or not host_reads_are_cheap(logits):
            bucket = -(-len(best_is_last) // 8)
            # at least two: a compiled model specialises a batch of one (a graph of its own)
            padded = min(len(best_is_last), max(2, -(-count // bucket) * bucket))
            redo = torch.argsort(best_is_last.to(torch.uint8), stable=True)[:padded]  # the redo points first
            return logits.index_put((redo[:count],), self(x_adv[redo])[:count].to(logits.dtype))
        return logits.index_put((redo,), self(x_adv[redo]).to(logits.dtype))

    def _simple_attack(self, images: torch.Tensor, targets: torch.Tensor, eps: float) -> torch.Tensor:
        hp = self.hparams
        forward = partial(self._run_for_attack, self.model)
        if hp.attack == "pgd":
            return pgd(
                forward,
                images,
                targets,
                norm=hp.attack_norm,
                eps=eps,
                n_iter=hp.attack_steps,
                random_start=hp.attack_random_start,
            )
        return fgsm(forward, images, targets, eps=eps, random_start=hp.attack == "fgsm_rs")

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        # Here, not in on_train_batch_end: a checkpoint written by a callback at the end of the step (ModelCheckpoint,
        # the SLURM requeue, SIGTERM) then holds the EMA of the step it records.
        if self.ema is not None:
            self.ema.update(self.model)

    def on_train_epoch_end(self) -> None:
        # adv_acc1 exists only with an attack (decided by the configuration, so every rank logs the same keys).
        # compute() gathers over the ranks here, on every rank at the same point; the values logged are then equal
        # everywhere and need no sync_dist, whose lazy all-reduce runs wherever a value is first read (rank zero's
        # progress bar reads them earlier than the other ranks: they would wait in different collectives).
        self.log_dict(
            {
                f"train/{name}": metric.compute()
                for name, metric in self.train_metrics.items(keep_base=True)
                if name != "adv_acc1" or self.hparams.attack != "none"
            }
        )
        self.train_metrics.reset()

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        hp = self.hparams
        # timm's rule: create_optimizer_v2 spares biases, 1-D tensors, no_weight_decay()
        params: nn.Module | list[dict[str, Any]] = self.model.net
        if hp.weight_decay_rule == "official":
            decayed = official_decayed_names(self.model.net)
            named = [(name, p) for name, p in self.model.net.named_parameters() if p.requires_grad]
            params = [
                group
                for group in (
                    {"params": [p for name, p in named if name in decayed], "weight_decay": hp.weight_decay},
                    {"params": [p for name, p in named if name not in decayed], "weight_decay": 0.0},
                )
                if group["params"]
            ]
        optimizer = create_optimizer_v2(params, "adamw", lr=hp.lr, weight_decay=hp.weight_decay, betas=hp.betas)
        total = self.trainer.estimated_stepping_batches
        epochs = max(1, self.trainer.max_epochs or 1)
        warmup_epochs = paper_warmup_epochs(epochs) if hp.warmup_epochs is None else hp.warmup_epochs
        warmup = round(total * warmup_epochs / epochs)
        # LambdaLR scales each group's lr by a factor, so the schedule is divided by the peak
        schedule = partial(warmup_cosine, total_steps=total, warmup_steps=warmup, peak_lr=1.0, min_lr=hp.min_lr / hp.lr)
        scheduler = LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ----------------------------------------------------------------------------------------- evaluation
    def _eval_step(self, batch: Batch) -> None:
        images, labels = batch["image"], batch["label"]
        if labels.numel() == 0:
            return
        for weights, metrics in self.eval_metrics.items():
            metrics = cast(MetricCollection, metrics)  # the ModuleDict's values (__init__)
            if weights == "raw":
                model = self.model
            else:
                assert self.ema is not None  # an "ema" entry exists with the EMA only
                model = self.ema.module
            with torch.no_grad():
                logits = self.run_network(model, images)
            metrics["loss"].update(F.cross_entropy(logits.float(), labels), weight=labels.numel())
            metrics["num_images"].update(labels.numel())
            metrics["acc1"].update(logits, labels)
            metrics["acc5"].update(logits, labels)
            metrics["ece"].update(logits, labels)
            if self.hparams.select_attack_steps:
                metrics["robust_acc"].update(self._robust(model, images, labels).float())

    def _robust(self, model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per image: still correct under APGD-CE (the selection attack of the paper, training threat model)."""
        hp = self.hparams
        with torch.enable_grad():  # Lightning evaluates under no_grad (inference_mode is off in our CLI)
            result = apgd(
                partial(self._run_for_attack, model),
                images,
                labels,
                norm=hp.attack_norm,
                eps=hp.attack_eps,
                n_iter=hp.select_attack_steps,
                loss="ce",
                exit_broken=torch.arange(len(images), device=images.device),
            )  # only the flags are used
        return result.robust

    def _eval_epoch_end(self, stage: str) -> None:
        # compute() sums the counts of all ranks before dividing: exact, unlike averaging per-rank means. The
        # results are then equal on every rank and are logged without sync_dist (see on_train_epoch_end).
        for weights, metrics in self.eval_metrics.items():
            metrics = cast(MetricCollection, metrics)  # the ModuleDict's values (__init__)
            prefix = stage if weights == "raw" else f"{stage}_ema"
            # decided by the configuration, not by update counts: every rank must log the same keys
            values = {
                f"{prefix}/{name}": metric.compute()
                for name, metric in metrics.items(keep_base=True)
                if name != "robust_acc" or self.hparams.select_attack_steps
            }
            self.log_dict(values)
            if weights == self.hparams.select_on:
                score = values.get(f"{prefix}/robust_acc", values[f"{prefix}/acc1"])
                self.log(f"{stage}/select_acc", score)
            metrics.reset()

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._eval_step(batch)

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._eval_step(batch)

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    def predict_step(self, batch: Batch, batch_idx: int) -> PredictedBatch:
        probs = self(batch["image"]).float().softmax(-1)
        top = probs.topk(min(5, probs.shape[-1]), dim=-1)
        return {"key": batch["key"], "label": batch["label"], "top5": top.indices, "top5_prob": top.values}

    # ------------------------------------------------------------------------------------------ reporting
    def differences_from_official_code(self) -> list[str]:
        """How this training recipe departs from Singh et al.'s code (robust_lightning.official_differences)."""
        trainer = self._trainer
        return training_differences(self.hparams, None if trainer is None else str(trainer.precision))

    def conditions(self) -> dict[str, Any]:
        """What results.json records about the model and the recipe."""
        hp = self.hparams
        training = {"attack": hp.attack}
        if hp.attack != "none":
            training |= {
                "norm": hp.attack_norm,
                "eps": hp.attack_eps,
                "steps": hp.attack_steps,
                "random_start": hp.attack_random_start,
                "eps_warmup_epochs": hp.eps_warmup_epochs,
                "reuse_attack_forward": self.reuse_forward,
            }
        return {
            "arch": hp.arch,
            "num_classes": hp.num_classes,
            "num_params": sum(p.numel() for p in self.model.parameters()),
            "input": "[0,1] RGB"
            + (
                f", normalised inside the model: {self.model.normalize}"
                if hasattr(self.model.normalize, "mean")
                else ""
            ),
            "init_from": hp.init_from,
            "warm_start": None if self.warm_start_report is None else str(self.warm_start_report),
            "training": training,
            "ema_decay": hp.ema_decay,
            "selection": {
                "metric": f"APGD-CE {hp.select_attack_steps} steps, {hp.attack_norm} eps {hp.attack_eps:.6g}, "
                f"{hp.select_on} weights"
                if hp.select_attack_steps
                else f"clean top-1, {hp.select_on} weights",
            },
            "differences_from_official_code": self.differences_from_official_code(),
        }
