"""AutoAttack as a Lightning callback: ``robust-lightning test --config configs/eval/autoattack.yaml``.

Each test batch is attacked in every threat model as it arrives (model in eval mode, gradients on, fp32 by
default), and its per-point outcome is appended to ``<results_dir>/<threat model>/rank<r>.jsonl`` (flushed
and fsynced) before the next batch. A re-run with the same results_dir skips the images (by key) that
already have an outcome, so an interrupted evaluation resumes without redoing or double-counting points.
At the end the outcomes of all ranks are gathered exactly (every image once), summarised per threat model
(clean and robust accuracy, robust accuracy after each attack, time per attack) and written to
results.json, the loggers (``autoattack/...`` metrics) and, with W&B, a table.

With ``fit_images`` set, the callback also evaluates the final model of a ``fit`` run on the first images
of the validation data (the quickstart reports AutoAttack this way). Those outcomes go to a folder named after
the weights (``<run dir>/autoattack/weights-<sha256 prefix>/<threat model>/``): a fit resumed with
``--ckpt_path last`` that ends with the same weights (killed during the evaluation) resumes it, and one that
ends with other weights (trained for more epochs) evaluates them afresh beside the earlier weights' outcomes,
which are kept, never mixed in, and do not stop the run at its end.
"""

import difflib
import hashlib
import json
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from robust_lightning.atomic import atomic_write_json
from robust_lightning.attacks import checks as reference_checks
from robust_lightning.attacks.checks import Check, adaptive_plan
from robust_lightning.attacks.ensemble import (
    ATTACKS,
    ENGINES,
    L1_MIN_ITER,
    PRECISIONS,
    VERSIONS,
    AutoAttack,
    EvaluationStopped,
    precision_note,
)
from robust_lightning.attacks.projections import NORMS
from robust_lightning.attacks.reference_engine import REFERENCE_ATTACKS
from robust_lightning.attacks.sanity import sanity_checks
from robust_lightning.attacks.stand_ins import folded_batchnorm, folds_batchnorm, uses_channels_last
from robust_lightning.data.contract import evaluation_data
from robust_lightning.errors import UserError
from robust_lightning.evaluation.base import (
    Evaluation,
    barrier,
    data_image_size,
    evaluating,
    evaluation_source,
    gather_objects,
    outcomes_parent,
    sum_over_ranks,
)
from robust_lightning.evaluation.outcomes import (
    append_record,
    claim_directory,
    read_outcomes,
    summarise,
)
from robust_lightning.evaluation.results import weights_sha256
from robust_lightning.job_signals import stop_requested
from robust_lightning.models.weights import load_model


@dataclass(frozen=True)
class ThreatModel:
    norm: str
    eps: float

    @property
    def name(self) -> str:
        # Linf radii are quoted in 1/255 steps, as in the papers
        return f"Linf-{self.eps * 255:g}_255" if self.norm == "Linf" else f"{self.norm}-{self.eps:g}"


# plain dicts, as a config writes them: the saved config.yaml of a run can then be run again as it is
DEFAULT_THREAT_MODELS = ({"norm": "Linf", "eps": 4 / 255}, {"norm": "L2", "eps": 2.0}, {"norm": "L1", "eps": 75.0})


def summary_line(name: str, section: dict[str, Any]) -> str:
    """One threat model's figures for the console: standard AutoAttack's, and where adaptive attacks ran, the
    lowest per image beside each of theirs."""
    line = (
        f"AutoAttack {name}: clean {section['clean_accuracy']:.2%}, robust {section['robust_accuracy']:.2%} "
        f"on {section['num_points']} images"
    )
    if "adaptive" in section:
        each = ", ".join(f"{name} {figures['robust_accuracy']:.2%}" for name, figures in section["adaptive"].items())
        line += f"; reported {section['reported_robust_accuracy']:.2%}, the lowest per image with {each}"
    return line


def batch_state_name(rank: int, keys: list[str]) -> str:
    """The state file of the AutoAttack run on one batch of a rank (its images' keys, in order), kept while the
    batch is attacked (``AutoAttack.evaluate(state_path=...)``)."""
    return f".rank{rank}-{hashlib.sha256(json.dumps(keys).encode()).hexdigest()[:16]}.state.json"


SQUARE_QUERIES = 5000  # AutoAttack's Square budget (the standard version's)
MISSING_KEYS_LISTED = 20  # results.json names at most this many images that were not evaluated
CHECKS_FILE = "checks.json"  # in a threat model's outcome folder: the checks of the model (its first batch)
WEIGHTS_HASH_PREFIX = 16  # hex digits of the weights' sha256 naming a fit's outcome folder (the manifest has all)


def _stop_sanity_checks() -> None:
    """The sanity checks' stop point: a job's stop signal ends them, and they run again from their start."""
    if stop_requested():
        raise EvaluationStopped("stopped inside the sanity checks; they run again from their start")


def parse_threat_models(items, owner: str, n_iter: int | None) -> list[ThreatModel]:
    """Threat models from a config list of {norm, eps} (or ThreatModel), checked; ``owner`` names the setting."""
    threats = [ThreatModel(t.norm, float(t.eps)) if isinstance(t, ThreatModel) else ThreatModel(**t) for t in items]
    if not threats:
        raise UserError(f"{owner}.threat_models is empty")
    for threat in threats:
        if threat.norm not in NORMS or threat.eps <= 0:
            raise UserError(f"{owner} threat model {threat}: norm must be one of {NORMS} and eps > 0")
    if len({t.name for t in threats}) != len(threats):
        raise UserError(f"{owner}.threat_models has duplicates: {[t.name for t in threats]}")
    if n_iter is not None and n_iter < L1_MIN_ITER and any(t.norm == "L1" for t in threats):
        raise UserError(
            f"{owner}.n_iter must be at least {L1_MIN_ITER} with an L1 threat model (its 3/2/1 x eps "
            f"schedule gives each stage at least one iteration), got {n_iter}"
        )
    return threats


class AutoAttackEvaluation(Evaluation):
    """AutoAttack on the test set, in each of ``threat_models``.

    Args:
        threat_models: list of {norm, eps}; default Linf 4/255, L2 2.0, L1 75 (the papers' ImageNet radii).
        version: "standard" (APGD-CE, APGD-T, FAB-T, Square), "rand" (APGD-CE and APGD-DLR with 20 EoT passes,
            for randomized models), "plus" (AA+: more attacks and restarts; its untargeted FAB takes a backward
            pass per class at each step), or quick "apgd-t" (40 iterations, 3 targets) or "apgd-ce" (``n_iter``
            steps), or "custom": the attacks of ``attacks_to_run``.
        attacks_to_run: with ``version: custom`` only, the attacks to run, in order: names of
            :data:`~robust_lightning.attacks.ensemble.ATTACKS` ("apgd-ce", "apgd-dlr", "apgd-t", "fab", "fab-t",
            "square"), with the budgets of the reference's constructor (5 APGD restarts, 9 target classes).
        engine: "fast" (ours) or "reference" (pyautoattack, unchanged).
        precision: "fp32" (default), "tf32" or "bf16"; successes are verified in fp32 either way.
        seed: AutoAttack's seed (reset before every attack on every batch).
        n_iter: iterations for the quick modes (default 40 for apgd-t, 100 otherwise).
        batch_size: points attacked at once (default: the loader's batch).
        weights: evaluate the raw weights or the EMA weights ("ema", when the model has them).
        channels_last: fast engine: give the model channels_last inputs (default: on the CPU only; see
            :class:`~robust_lightning.attacks.AutoAttack`); False for a model that cannot take them.
        fold_batchnorm: fast engine: attack a copy of the model with BatchNorm folded into the layers before
            it (default on; successes are verified on the model as given).
        fit_images: after ``fit``, evaluate the final model on this many validation images (split over ranks);
            None: only under ``test``.
        results_dir: where per-point outcomes go (default ``<trainer.default_root_dir>/autoattack``, or
            ``runs/autoattack`` where that is the working directory: :func:`outcomes_parent`). A re-run
            with the same directory resumes; outcomes of another checkpoint or setting there are refused. It
            must be on a filesystem all ranks share (as checkpoints are). After ``fit``, the outcomes go to its
            subfolder ``weights-<sha256 prefix>`` (default ``<run dir>/autoattack``), one per final weights.
        checks: run the reference AutoAttack's checks (:mod:`robust_lightning.attacks.checks`): those of the model
            on the first batch attacked, Square's on all outcomes; results.json records them under each threat
            model's ``checks``, and a raised one is warned of.
        sanity_points: run the sanity checks of Carlini et al. (:mod:`robust_lightning.attacks.sanity`) on this
            many points of the first batch attacked, recorded beside the reference's checks; 0: not run.
        adaptive: the adaptive attacks run on every point after standard AutoAttack (see
            :class:`~robust_lightning.attacks.AutoAttack`): "auto" those the checks raised on the first batch call
            for, "none", or a list of names ("bpda", "transfer", "square", "eot") to run always. results.json keeps
            standard AutoAttack's robust accuracy (the leaderboard's figure), each adaptive attack's, which images it
            broke, and the lowest per image (``reported_robust_accuracy``).
        bpda: the dotted names of the model's parts that mask its gradients (names of the model's own
            ``named_modules()``: its timm network's, or those of the module given to ``robust_lightning.evaluate``),
            which BPDA approximates by the identity's gradient and the transfer attack takes out of the model.
        surrogate: a checkpoint of the model to transfer attacks from (default: the model without its ``bpda``
            parts); from Python, also a module.
        eot_draws: the forward passes over which EoT scores a randomized model's adversarial examples.
        stand_ins: from Python, differentiable modules standing in for the ``bpda`` parts in BPDA's backward pass,
            by name (default: the identity).
        n_queries: Square's query budget, in the ensemble and from scratch (default: AutoAttack's 5000); with
            ``n_iter``, a smaller budget for a quick look, recorded in results.json.
    """

    name = "autoattack"

    def __init__(
        self,
        threat_models: list[dict[str, Any]] = list(DEFAULT_THREAT_MODELS),  # noqa: B006 - a default --print_config shows; read, never mutated
        version: str = "standard",
        attacks_to_run: list[str] | None = None,
        engine: str = "fast",
        precision: str = "fp32",
        seed: int = 0,
        n_iter: int | None = None,
        batch_size: int | None = None,
        weights: str = "raw",
        channels_last: bool | None = None,
        fold_batchnorm: bool | None = None,
        fit_images: int | None = None,
        results_dir: str | None = None,
        checks: bool = True,
        sanity_points: int = 200,
        adaptive: str | list[str] = "auto",
        bpda: list[str] | None = None,
        surrogate: Any = None,
        eot_draws: int = 20,
        stand_ins: dict[str, Any] | None = None,
        n_queries: int | None = None,
    ):
        if n_queries is not None and n_queries < 1:
            raise UserError(f"AutoAttackEvaluation.n_queries must be at least 1, got {n_queries}")
        self.n_queries = n_queries
        try:
            adaptive_plan((), adaptive, bool(bpda), True)
        except ValueError as e:
            raise UserError(f"AutoAttackEvaluation.{e}") from None
        self.adaptive, self.bpda, self.eot_draws = adaptive, list(bpda or []), eot_draws
        self.stand_ins: dict[str, torch.nn.Module] = dict(stand_ins or {})
        given = isinstance(surrogate, torch.nn.Module)  # from Python; a config names a checkpoint
        self.surrogate: str | None = None if given or surrogate is None else str(surrogate)
        self._surrogate_model: torch.nn.Module | None = surrogate if given else None
        self.adaptive_notes: dict[str, dict[str, str]] = {}  # per threat model: why an adaptive attack did not run
        for name, value, allowed in (
            ("version", version, (*VERSIONS, "custom")),
            ("engine", engine, ENGINES),
            ("precision", precision, PRECISIONS),
            ("weights", weights, ("raw", "ema")),
        ):
            if value not in allowed:
                raise UserError(f"AutoAttackEvaluation.{name} must be one of {allowed}, got {value!r}")
        for name, flag in (("channels_last", channels_last), ("fold_batchnorm", fold_batchnorm)):
            if engine == "reference" and flag:
                raise UserError(f"AutoAttackEvaluation.{name} applies to the fast engine only")
        self.attacks_to_run = list(attacks_to_run or [])
        self.attacks = self._attacks(version, self.attacks_to_run, engine)
        self.threat_models = parse_threat_models(threat_models, "AutoAttackEvaluation", n_iter)
        self.version, self.engine, self.precision, self.seed = version, engine, precision, seed
        self.n_iter, self.batch_size, self.weights, self.fit_images = n_iter, batch_size, weights, fit_images
        self.channels_last, self.fold_batchnorm = channels_last, fold_batchnorm
        self.outcomes_root = Path(results_dir) if results_dir else None  # as configured
        if sanity_points < 0:
            raise UserError(f"AutoAttackEvaluation.sanity_points must be 0 (off) or more, got {sanity_points}")
        self.checks, self.sanity_points = checks, sanity_points
        # per threat model, the checks of the model (the reference's but square_sr, and the sanity checks), from the
        # first batch that any session of this evaluation attacked on rank zero (kept in CHECKS_FILE beside the
        # outcomes)
        self.model_checks: dict[str, dict[str, Any]] = {}
        self.results_dir: Path | None = None  # the outcome folders' parent, once an evaluation starts
        self.weights_hash: str | None = None  # of the weights evaluated, once an evaluation starts
        self.done: dict[str, set[str]] = {}
        # this session's totals per threat model and attack (not saved per point: a resumed run counts anew)
        self.seconds: dict[str, dict[str, float]] = {}
        self.refuted: dict[str, dict[str, float]] = {}  # claims the fp32 check refuted (AutoAttackReport.refuted)
        self.locks = ExitStack()  # the outcome folders' locks, held from _start until teardown

    @staticmethod
    def _attacks(version: str, attacks_to_run: list[str], engine: str) -> tuple[str, ...]:
        """The attacks the evaluation runs, in order: the version's, or with "custom" those of ``attacks_to_run``,
        each checked."""
        if version != "custom":
            if attacks_to_run:
                raise UserError(
                    f"AutoAttackEvaluation.attacks_to_run is for version: custom; version {version} sets its attacks"
                )
            return VERSIONS[version]
        if not attacks_to_run:
            raise UserError(
                f"AutoAttackEvaluation: version custom needs attacks_to_run, a list of {', '.join(ATTACKS)}"
            )
        for attack in attacks_to_run:
            if attack not in ATTACKS:
                raise UserError(
                    f"AutoAttackEvaluation.attacks_to_run: unknown attack {attack!r}; the attacks are "
                    f"{', '.join(ATTACKS)}"
                )
            if engine == "reference" and attack not in REFERENCE_ATTACKS:
                raise UserError(f"AutoAttackEvaluation.attacks_to_run: the reference engine has no attack {attack!r}")
        if len(set(attacks_to_run)) != len(attacks_to_run):
            raise UserError(f"AutoAttackEvaluation.attacks_to_run names an attack twice: {attacks_to_run}")
        return tuple(attacks_to_run)

    # ----------------------------------------------------------------------------------------- set-up
    def _directory(self, threat: ThreatModel) -> Path:
        assert self.results_dir is not None  # set when the evaluation starts
        return self.results_dir / threat.name

    def _identity(self, trainer, weights_hash: str, threat: ThreatModel) -> dict[str, Any]:
        """What the saved outcomes must have been computed with for a re-run to resume from them: the weights
        evaluated (also after fit, where no checkpoint file names them), the images and the attack."""
        source = evaluation_source(trainer)
        data = evaluation_data(trainer)
        return {
            "weights_sha256": weights_hash,
            "weights": self.weights,
            # the images and their preprocessing (earlier manifests are read in these keys: in_todays_keys)
            "data_source": source.kind if source else None,
            "data_location": source.location if source else None,
            "data_image_size": data_image_size(trainer),
            "data_crop_pct": data.crop_pct if data is not None else None,
            # only where it is not the default, so that manifests written before the option still resume
            **(
                {"data_eval_resize": resize}
                if (resize := data.eval_resize if data is not None else "shorter_side") != "shorter_side"
                else {}
            ),
            "data_eval_subset": source.subset if source else None,
            "norm": threat.norm,
            "eps": threat.eps,
            "version": self.version,
            **({"attacks_to_run": self.attacks_to_run} if self.attacks_to_run else {}),
            "engine": self.engine,
            "precision": self.precision,
            "seed": self.seed,
            "n_iter": self.n_iter,
            # only where not the default, so that manifests written before the adaptive attacks still resume
            **({"adaptive": self.adaptive} if self.adaptive != "auto" else {}),
            **({"bpda": self.bpda} if self.bpda else {}),
            **({"surrogate": self.surrogate} if self.surrogate else {}),
            **({"eot_draws": self.eot_draws} if self.eot_draws != 20 else {}),
            **({"n_queries": self.n_queries} if self.n_queries is not None else {}),
        }

    def on_test_start(self, trainer, pl_module) -> None:
        if trainer.test_loop.inference_mode:
            raise UserError("AutoAttack needs gradients: set trainer.inference_mode: false (the CLI's default)")
        # not the versioned log dir: a re-run of the same command must find the saved outcomes
        self._start(
            trainer,
            pl_module,
            self.outcomes_root or outcomes_parent(trainer) / "autoattack",
            weights_sha256(self.network(pl_module)),
        )  # once: it reads every weight

    def _start(self, trainer, pl_module, results_dir: Path, weights_hash: str) -> None:
        self.results_dir, self.weights_hash = results_dir, weights_hash
        self.seen: set[str] = set()  # keys of this session's images
        for threat in self.threat_models:
            claim_directory(
                self._directory(threat),
                self._identity(trainer, weights_hash, threat),
                trainer.is_global_zero,
                "AutoAttackEvaluation",
                self.locks,
            )
        # every rank has judged the folders before any adds an outcome: a folder without outcomes that rank zero
        # takes over must not look, to a rank still judging it, like one holding outcomes of the earlier evaluation
        barrier(trainer)
        for threat in self.threat_models:
            self.done[threat.name] = set(read_outcomes(self._directory(threat)))
            self.seconds[threat.name], self.refuted[threat.name] = {}, {}
            saved = self._directory(threat) / CHECKS_FILE
            self.model_checks[threat.name] = json.loads(saved.read_text()) if saved.is_file() else {}
            if self.done[threat.name] and trainer.is_global_zero:
                rank_zero_info(f"AutoAttack {threat.name}: resuming, {len(self.done[threat.name])} images already done")

    def on_fit_end(self, trainer, pl_module) -> None:
        if not self.fit_images:
            return
        # A fit resumed into its run directory (--ckpt_path last) may end with other weights than the fit that
        # evaluated there before: a folder per weights resumes the same weights and keeps others' outcomes apart.
        weights_hash = weights_sha256(self.network(pl_module))
        root = self.outcomes_root or self.run_dir(trainer) / "autoattack"
        self._start(trainer, pl_module, root / f"weights-{weights_hash[:WEIGHTS_HASH_PREFIX]}", weights_hash)
        with evaluating(pl_module):
            for batch in self.eval_batches(trainer, pl_module, limit=self.fit_images, progress="autoattack"):
                self.on_test_batch_end(trainer, pl_module, None, batch, 0)
            self._finish(trainer, pl_module)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.locks.close()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.locks.close()

    # --------------------------------------------------------------------------------------- per batch
    def on_test_batch_end(
        self,
        trainer,
        pl_module,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        images, labels, keys = batch["image"], batch["label"], list(batch["key"])
        repeated = [key for key in keys if key in self.seen] or [key for key in set(keys) if keys.count(key) > 1]
        if repeated:  # outcomes are saved per key: a repeated key would silently count two images as one
            raise UserError(
                f"two test images share the key {repeated[0]!r} (the file name without extension); "
                "AutoAttack outcomes are saved per key, so every image needs its own file name"
            )
        self.seen.update(keys)
        for threat in self.threat_models:
            todo = [i for i, key in enumerate(keys) if key not in self.done[threat.name]]
            if not todo:
                continue
            if stop_requested():  # SIGTERM or SLURM's requeue: the batch boundary stops the evaluation
                return
            first = not self.model_checks[threat.name]  # no checks of the model yet: this batch gets them
            index = torch.tensor(todo, device=images.device)
            # the first batch's sanity checks come before its attacks, whose adaptive part they help decide; a later
            # batch's adaptive attacks are those the first batch's checks called for
            try:
                sane = self._sanity_checks(trainer, pl_module, threat, images[index], labels[index]) if first else []
            except EvaluationStopped:
                return
            earlier = [Check(name, **record) for name, record in self.model_checks[threat.name].items()]
            adversary = AutoAttack(
                self.network(pl_module),
                norm=threat.norm,
                eps=threat.eps,
                version=self.version,
                attacks_to_run=self.attacks_to_run,
                seed=self.seed,
                engine=self.engine,
                device=pl_module.device,
                precision=self.precision,
                n_iter=self.n_iter,
                n_queries=self.n_queries or SQUARE_QUERIES,
                channels_last=self.channels_last,
                fold_batchnorm=self.fold_batchnorm,
                checks=self.checks and first,
                adaptive=self.adaptive,
                bpda=self._bpda_parts(pl_module),
                stand_ins={f"{self._net_prefix(pl_module)}{name}": module for name, module in self.stand_ins.items()},
                surrogate=self._surrogate(pl_module),
                eot_draws=self.eot_draws,
            )
            # the attacks finished on this batch, kept should a signal stop it before its last (as the reference's
            # state_path keeps them): the same batch after a resume runs only the attacks left
            state = self._directory(threat) / batch_state_name(trainer.global_rank, [keys[i] for i in todo])
            with torch.enable_grad():
                try:
                    report = adversary.evaluate(
                        images[index],
                        labels[index],
                        bs=self.batch_size or len(todo),
                        progress_bar=trainer.is_global_zero,
                        state_path=state,
                        stop=stop_requested,
                        checked_elsewhere=[*sane, *earlier],
                    )
                except EvaluationStopped:
                    return
            record = {
                "key": [keys[i] for i in todo],
                "label": labels[index].tolist(),
                "clean": report.clean.tolist(),
                "robust": report.robust.tolist(),
                "broken_by": report.broken_by,
                "seconds": report.seconds,
            }
            if report.adaptive:  # each adaptive attack's figure per point, and the lowest of them all
                record["adaptive"] = {name: result.robust.tolist() for name, result in report.adaptive.items()}
                record["reported"] = report.reported.tolist()
            if report.adaptive_notes:
                self.adaptive_notes[threat.name] = dict(report.adaptive_notes)
            append_record(self._directory(threat) / f"rank{trainer.global_rank}.jsonl", record)
            state.unlink(missing_ok=True)
            self.done[threat.name].update(record["key"])
            if first and (self.checks or self.sanity_points):
                self._record_checks(trainer, threat, report, sane)
            elif any(
                c.raised and not self.model_checks[threat.name].get(c.name, {}).get("raised") for c in report.checks
            ):
                # a check made on every batch (zero_gradients) raised here: the batches after this one run the
                # adaptive attacks it calls for too
                self._record_checks(trainer, threat, report, [], keep=self.model_checks[threat.name])
            for totals, counts in ((self.seconds, report.seconds), (self.refuted, report.refuted)):
                for attack, value in counts.items():
                    totals[threat.name][attack] = totals[threat.name].get(attack, 0) + value

    def _net_prefix(self, pl_module) -> str:
        """Where the user's network sits in the network evaluated: a classifier keeps it as ``net`` behind its
        input normaliser, and ``bpda`` names the user's own modules."""
        return "net." if isinstance(getattr(self.network(pl_module), "net", None), torch.nn.Module) else ""

    def _bpda_parts(self, pl_module) -> list[str]:
        """``bpda``'s names within the network evaluated, each checked: a name that is not a module of the user's
        network is refused with the names closest to it."""
        prefix = self._net_prefix(pl_module)
        modules = {name for name, _ in self.network(pl_module).named_modules()}
        for name in self.bpda:
            if prefix + name not in modules:
                mine = sorted(n.removeprefix(prefix) for n in modules if n.startswith(prefix))
                close = difflib.get_close_matches(name, mine, n=3)
                raise UserError(
                    f"AutoAttackEvaluation.bpda: {name!r} is not a module of the model (a dotted name of its "
                    "named_modules())" + (f"; did you mean {', '.join(close)}?" if close else "")
                )
        return [prefix + name for name in self.bpda]

    def _raised(self, threat: ThreatModel, check: str) -> bool:
        return bool(self.model_checks[threat.name].get(check, {}).get("raised"))

    def _sanity_checks(self, trainer, pl_module, threat: ThreatModel, images, labels) -> list[Check]:
        """The sanity checks of Carlini et al. on the first ``sanity_points`` evaluation images: those of the first
        batch attacked, and in one process, where that batch is smaller, the evaluation's first images read
        again (under DDP each rank takes what its first batch holds: another read would be a collective that a
        rank whose batch suffices would not join)."""
        if not self.sanity_points:
            return []
        if len(images) < self.sanity_points and trainer.world_size == 1:
            parts = list(self.eval_batches(trainer, pl_module, limit=self.sanity_points))
            images, labels = torch.cat([b["image"] for b in parts]), torch.cat([b["label"] for b in parts])
        started = time.perf_counter()
        with torch.enable_grad():
            sane = sanity_checks(
                self.network(pl_module),
                images[: self.sanity_points].float(),
                labels[: self.sanity_points],
                threat.norm,
                threat.eps,
                seed=self.seed,
                stop_point=_stop_sanity_checks,
            )
        spent = self.seconds[threat.name]
        spent["sanity_checks"] = spent.get("sanity_checks", 0.0) + time.perf_counter() - started
        return sane

    def _record_checks(
        self, trainer, threat: ThreatModel, report, sane: list[Check], keep: dict[str, Any] | None = None
    ) -> None:
        """The checks of the model on the first batch attacked: the reference's, which the AutoAttack run made,
        and the sanity checks; later, a check made on every batch where it is first raised (over ``keep``, the
        checks so far). Each rank checks its own batches; rank zero's are the evaluation's."""
        found = dict(keep or {})
        found |= {
            name: check
            for name, check in report.summary()["checks"].items()
            if name != "square_sr" and (keep is None or check["raised"])
        }
        found |= {check.name: check.record() for check in sane}
        self.model_checks[threat.name] = found
        if trainer.is_global_zero:
            atomic_write_json(self._directory(threat) / CHECKS_FILE, found)

    def _surrogate(self, pl_module) -> torch.nn.Module | None:
        """The model a transfer attack starts from (``surrogate``: a checkpoint), loaded once; None: the model
        without its ``bpda`` parts."""
        if self._surrogate_model is None and self.surrogate is not None:
            self._surrogate_model = load_model(checkpoint=self.surrogate).eval()
        return self._surrogate_model.to(pl_module.device) if self._surrogate_model is not None else None

    # -------------------------------------------------------------------------------------------- end
    def on_test_epoch_end(self, trainer, pl_module) -> None:
        data = evaluation_data(trainer)
        expected = data.expected_eval_images() if data is not None else (None, None)
        self._finish(trainer, pl_module, *expected)

    def _finish(
        self,
        trainer,
        pl_module,
        expected: int | None = None,
        expected_keys: frozenset[str] | None = None,
    ) -> None:
        """Summarise every saved outcome into results.json and the loggers. ``expected``: the evaluation set's
        size, so that images that never arrived (missing from shards, unreadable, cut by limit_test_batches)
        are reported rather than silently left out; ``expected_keys`` names them where the set is a list."""
        barrier(trainer)  # every rank's outcomes are on disk before anyone reads them
        sections, rows, metrics = {}, [], {}
        for threat in self.threat_models:
            outcomes = read_outcomes(self._directory(threat))
            summary = summarise(outcomes, self.attacks)
            seconds = sum_over_ranks(self.seconds.get(threat.name, {}))
            summary["seconds_this_session"] = {attack: round(value, 2) for attack, value in seconds.items()}
            if self.engine == "fast":
                summary["claims_refuted_in_fp32_this_session"] = sum_over_ranks(self.refuted.get(threat.name, {}))
            if expected and summary["num_points"] < expected:
                summary["images_not_evaluated"] = expected - summary["num_points"]
                if expected_keys is not None:
                    summary["keys_not_evaluated"] = sorted(expected_keys - outcomes.keys())[:MISSING_KEYS_LISTED]
            if summary["num_points"] and (self.checks or self.sanity_points):
                summary["checks"] = dict(self.model_checks.get(threat.name, {}))
                if self.checks:
                    robust_after = {"clean": summary["clean_accuracy"], **summary["robust_accuracy_after"]}
                    summary["checks"]["square_sr"] = reference_checks.square_sr(robust_after).record()
            notes = gather_objects(self.adaptive_notes.get(threat.name, {}))
            if any(notes):  # adaptive attacks the checks called for that could not run, and why
                summary["adaptive_not_run"] = {name: note for part in notes for name, note in part.items()}
            sections[threat.name] = {"norm": threat.norm, "eps": threat.eps, **summary}
            if summary["num_points"]:
                metrics[f"autoattack/{threat.name}/clean_acc"] = summary["clean_accuracy"]
                metrics[f"autoattack/{threat.name}/robust_acc"] = summary["robust_accuracy"]
                if "reported_robust_accuracy" in summary:
                    metrics[f"autoattack/{threat.name}/reported_robust_acc"] = summary["reported_robust_accuracy"]
                rows.append(
                    [
                        threat.name,
                        summary["num_points"],
                        summary["clean_accuracy"],
                        summary["robust_accuracy"],
                        *summary["robust_accuracy_after"].values(),
                    ]
                )
        assert self.results_dir is not None  # set when the evaluation started
        conditions = {
            "version": self.version,
            "engine": self.engine,
            "precision": precision_note(self.precision),
            "channels_last": uses_channels_last(self.engine, pl_module.device, self.channels_last),
            "batchnorm_folded": folds_batchnorm(self.engine, self.fold_batchnorm)
            and folded_batchnorm(self.network(pl_module)) is not None,
            "seed": self.seed,
            # the budget where not the version's own (a quick look): iterations, Square's queries
            "budget": {"n_iter": self.n_iter, "n_queries": self.n_queries},
            "adaptive": {"adaptive": self.adaptive, "bpda": self.bpda, "surrogate": self.surrogate},
            "weights": self.weights,
            "weights_sha256": self.weights_hash,
            "attacks": list(self.attacks),
            "results_dir": str(self.results_dir.resolve()),
        }
        # the caveats first, then the numbers they qualify
        for name, section in sections.items() if trainer.is_global_zero else ():
            for check, found in section.get("checks", {}).items():
                if found["raised"]:
                    rank_zero_warn(f"AutoAttack {name}: the check {check} was raised: {found['advice']}")
            for attack, note in section.get("adaptive_not_run", {}).items():
                rank_zero_warn(f"AutoAttack {name}: the adaptive attack {attack} did not run: it {note}")
            if section.get("images_not_evaluated"):
                rank_zero_warn(
                    f"AutoAttack {name}: {section['images_not_evaluated']} of the {expected} evaluation "
                    f"images were not evaluated (missing from the data, unreadable, or cut short by a "
                    f"limit); results.json lists them under keys_not_evaluated where known"
                )
        lines = [summary_line(name, section) for name, section in sections.items() if section["num_points"]]
        columns = ["threat_model", "images", "clean", "robust", *self.attacks]
        self.publish(
            trainer,
            {"threat_models": sections, "conditions": conditions},
            metrics,
            tables={"summary": (columns, rows)},
            message=lines,
        )
