"""The ``robust-lightning`` command: LightningCLI for fit/validate/test/predict plus the project's own tools.

Trainer subcommands go to LightningCLI unchanged (configs compose left to right, ``--print_config``,
``RL_FIT__TRAINER__MAX_EPOCHS``-style environment variables). Commands that do not drive a Trainer
(``shards``, ``export``, ``sweep``, ``report``, ``cell``) are typed functions dispatched before LightningCLI sees
the arguments; they parse their options with the same parser (robust_lightning.argument_parsing).
"""

import inspect
import netrc
import os
import re
import signal
import sys
import traceback
from argparse import ArgumentError
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any, TypedDict

from robust_lightning.startup import (
    collector_paused,
    leave_imported_objects_out_of_collections,
    third_party_notices_silenced,
)

with collector_paused():  # Lightning imports sooner (robust_lightning/startup.py)
    import lightning
    import yaml
    from jsonargparse import Namespace
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.callbacks import ProgressBar
    from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
    from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

    import robust_lightning
    from robust_lightning.argument_parsing import (
        ArgumentParser,
        ArgumentParserWithBases,
        did_you_mean,
        int_before_float,
        what_to_write,
    )
    from robust_lightning.data.corrupt_report import CorruptImageReport
    from robust_lightning.data.datamodule import ImageNetDataModule
    from robust_lightning.data.sources import FolderSource, ShardSource, SyntheticSource
    from robust_lightning.errors import UserError, print_error, print_rank_error
    from robust_lightning.evaluation.results import PredictionWriter, RunResults
    from robust_lightning.job_signals import (
        EXIT_CTRL_C,
        JobSignals,
        JobStopped,
        ToolStopped,
        requeue_this_job,
        shield_forked_children,
        tool_stops_on_job_signals,
    )
    from robust_lightning.loggers import (
        SaveConfigToWandb,
        WandbLogger,
        finish_wandb_run,
        open_wandb_run,
        use_project_loggers,
    )
    from robust_lightning.models.checkpoints import require_weights
    from robust_lightning.rank_exit import RankFailureWatch, failed_here, leave_together, stopped_by_other_rank
    from robust_lightning.scale.requeue import continue_slurm_restart, slurm_restart_note
    from robust_lightning.scale.torchrun import join_process_group, restart_count
    from robust_lightning.training.checkpoint_io import AtomicCheckpointIO, LatestCheckpoint
    from robust_lightning.training.checkpoint_policy import model_settings_over_checkpoint
    from robust_lightning.training.interruption import EXIT_SIGTERM, Interruption
    from robust_lightning.training.lightning_module import ImageClassifier
    from robust_lightning.training.progress import default_progress_bar
    from robust_lightning.training.run_directory import (
        FitRunDirectory,
        continue_in_latest_run_directory,
        discard_refused_run,
        note_resumed_checkpoint,
    )
    from robust_lightning.training.throughput import Throughput
leave_imported_objects_out_of_collections()  # later collections and the exit skip them
# the sources by the names data.source gave them before it named a class, for the line that answers an old option
ArgumentParser.source_classes = {cls.kind: cls for cls in (FolderSource, ShardSource, SyntheticSource)}

TRAINER_COMMANDS = {
    "fit": "train a model (optionally warm-started), validating every epoch",
    "validate": "evaluate a checkpoint on the validation split",
    "test": "run the evaluation callbacks of a config on a checkpoint",
    "predict": "predict the evaluation split with a checkpoint",
}


def _shards(argv: list[str]) -> int:
    from robust_lightning.data.shards import shards_main

    return shards_main(argv)


def _export(argv: list[str]) -> int:
    from robust_lightning.training.export import export_main

    return export_main(argv)


def _sweep(argv: list[str]) -> int:
    from robust_lightning.scale.sweep import sweep_main

    return sweep_main(argv, command_check=command_line_check)


def _report(argv: list[str]) -> int:
    from robust_lightning.scale.report import report_main

    return report_main(argv)


def _claim(argv: list[str]) -> int:
    from robust_lightning.evaluation.claim import claim_main

    return claim_main(argv)


def _workspace(argv: list[str]) -> int:
    from robust_lightning.scale.workspace import workspace_main

    return workspace_main(argv)


def _cell(argv: list[str]) -> int:
    from robust_lightning.scale.task import cell_main

    # The cell runs its command in this process, which exits after it where `cell` came from the command line.
    return cell_main(argv, run=partial(main, process_exits=_command_state["process_exits"]))


TOOL_COMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "shards": ("convert an ImageFolder tree into WebDataset shards (parallel, resumable)", _shards),
    "export": ("write the raw or EMA weights of a checkpoint to a .safetensors file or a timm model folder", _export),
    "sweep": ("submit a grid of runs (configs/sweeps/*.yaml) as one SLURM array job, skipping done cells", _sweep),
    "report": ("merge the results.json of a sweep's cells into one table (markdown, CSV, JSON)", _report),
    "claim": (
        "write RobustBench's model-info JSON for a leaderboard claim from a standard AutoAttack evaluation",
        _claim,
    ),
    "cell": ("run one cell of a sweep's array job (what the sweep's array script runs under srun)", _cell),
    "workspace": ("save the project's W&B workspace: training, validation, throughput, evaluation tables", _workspace),
}


LIGHTNING_CKPT_NAMES = ("last", "best", "hpc", "registry")  # resolved by the Trainer, not paths


class RobustLightningCLI(LightningCLI):
    model_overrides: dict[str, Any] = {}  # noqa: RUF012 (a default none; each run sets its own)

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        """Check --ckpt_path before LightningCLI reads it, and keep the model settings that apply over it."""
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        config = self.config.get(subcommand) if subcommand else None
        ckpt_path = config.get("ckpt_path") if config is not None else None
        if not ckpt_path or str(ckpt_path) in LIGHTNING_CKPT_NAMES:
            return
        assert config is not None  # it named the checkpoint
        argv = sys.argv[1:] if args is None else args if isinstance(args, list) else []
        named = {m.group(1) for token in argv if (m := re.match(r"--model\.(\w+)", str(token)))}
        self.model_overrides = model_settings_over_checkpoint(subcommand, str(ckpt_path), config.model.as_dict(), named)

    def apply_model_settings(self, config: Namespace) -> None:
        """Settings over the checkpoint's (LightningCLI has parsed its hyper-parameters in by now); without a
        checkpoint, a missing or empty model.init_from is reported before any data is read."""
        for key, value in self.model_overrides.items():
            config.model[key] = value
        init_from = config.model.get("init_from")
        if init_from and not config.get("ckpt_path"):
            try:
                require_weights(init_from)
            except UserError as e:
                raise UserError(f"model.init_from: {e}") from e

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> LightningArgumentParser:
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        # --ckpt_path loads with torch.load(weights_only=True): a checkpoint can never run code on load
        parser.set_defaults(weights_only=True)
        return parser

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand)
        self.apply_model_settings(config)
        use_project_loggers(config)  # one log across a run's attempts (robust_lightning.loggers)
        restarts = restart_count()
        if self.subcommand == "fit" and not config.get("ckpt_path") and restarts:
            rank_zero_info(f"torchrun restarted this fit ({restarts} restarts so far): it goes on as --ckpt_path last")
            config.ckpt_path = "last"
        assert self.subcommand is not None  # before_instantiate_classes runs for a subcommand
        continue_slurm_restart(self.subcommand, config)  # a SLURM restart: the same (scale/requeue.py)
        if self.subcommand == "fit" and config.get("ckpt_path") == "last":
            continue_in_latest_run_directory(config)
        ckpt_path = config.get("ckpt_path")
        note_resumed_checkpoint(None if str(ckpt_path) in LIGHTNING_CKPT_NAMES else ckpt_path)

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        """The project's progress display unless the config names one or turns it off: Lightning's own bar reads
        the logged values after every step, a wait for the GPU each (robust_lightning.training.progress). A W&B
        logger keeps its run in the run directory of the first logger, so every attempt of a fit logs to one run."""
        configured = [*(config.get("callbacks") or []), *callbacks]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in configured):
            callbacks = [*callbacks, default_progress_bar()]
        try:
            trainer = super()._instantiate_trainer(config, callbacks)
        except (MisconfigurationException, ValueError, RuntimeError) as e:  # Lightning's refusals of its options
            if not _raised_by_lightning(e):
                raise
            raise UserError(_trainer_options_error(config, e)) from None
        _command_state["trainer"] = trainer  # errors from here on may be a rank's own (main)
        strategy = trainer.strategy
        if isinstance(strategy, DDPStrategy) and trainer.world_size > 1:  # under torchrun: see scale/torchrun.py
            default = "nccl" if strategy.root_device.type == "cuda" else "gloo"  # Lightning's choice
            join_process_group(strategy.process_group_backend or default)
        first = trainer.loggers[0] if trainer.loggers else None
        rank = rank_zero_only.rank  # type: ignore[attr-defined]  # what Lightning sets on the function
        if rank == 0 and isinstance(first, (CSVLogger, TensorBoardLogger)):  # W&B logs on rank 0
            for logger in trainer.loggers:
                if isinstance(logger, WandbLogger):
                    logger.keep_run_in(first.log_dir)
        return trainer

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        int_before_float(parser)  # --trainer.limit_train_batches 1 is one batch (argument_parsing.BATCH_LIMITS)
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        parser.link_arguments("data.image_size", "model.image_size")
        parser.link_arguments("model.label_smoothing", "data.label_smoothing")
        # Always present and configurable as checkpoint.*: the last and the best checkpoint of every run.
        parser.add_lightning_class_args(LatestCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                # clean top-1, or robust accuracy when model.select_attack_steps > 0 (see ImageClassifier)
                "checkpoint.monitor": "val/select_acc",
                "checkpoint.mode": "max",
                "checkpoint.save_last": True,
                "checkpoint.filename": "epoch{epoch:03d}-select{val/select_acc:.4f}",
                "checkpoint.auto_insert_metric_name": False,
            }
        )


def _raised_by_lightning(error: BaseException) -> bool:
    """Whether Lightning raised ``error`` (its MisconfigurationException, or another error from its own code, such as
    the ValueError of an invalid combination of the Trainer's options or the RuntimeError of SLURM settings it cannot
    use), not the project's code or torch."""
    if isinstance(error, MisconfigurationException):
        return True
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and Path(frames[-1].filename).is_relative_to(Path(lightning.__file__).parent)


def _trainer_options_error(config: dict[str, Any], error: BaseException) -> str:
    """Lightning's refusal of the Trainer's options as one line, preceded by the options it names, with their values
    (``--trainer.strategy fsdp, --trainer.accelerator cpu: The strategy `fsdp` requires a GPU accelerator...``)."""
    message = " ".join(str(error).split()) or type(error).__name__
    found = {}
    for name in inspect.signature(Trainer.__init__).parameters:
        if name != "self" and (match := re.search(rf"(?<![\w.]){name}(?!\w)", message)):
            found[name] = match.start()

    def shown(value: Any) -> str:
        if value is None or isinstance(value, (str, int, float, bool)):
            return str(value).lower() if isinstance(value, bool) or value is None else str(value)
        if isinstance(value, (list, tuple)):
            return f"[{', '.join(map(shown, value))}]"
        return type(value).__name__

    named = [f"--trainer.{name} {shown(config.get(name))}" for name in sorted(found, key=lambda name: found[name])]
    return f"{', '.join(named)}: {message}" if named else message


def _usage() -> str:
    width = max(map(len, [*TRAINER_COMMANDS, *TOOL_COMMANDS]))
    lines = [
        "usage: robust-lightning <command> [--config FILE ...] [--key value ...]",
        "       robust-lightning --version",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {text}" for name, text in TRAINER_COMMANDS.items()]
    lines += [f"  {name:<{width}}  {text}" for name, (text, _) in TOOL_COMMANDS.items()]
    lines += [
        "",
        "Run 'robust-lightning <command> --help' for the options of a command. Every command takes",
        "--config FILE (repeatable) and --print_config.",
        "Example: robust-lightning fit --config configs/quickstart.yaml --trainer.max_epochs 2",
    ]
    return "\n".join(lines)


def _wandb_offline_without_credentials() -> None:
    """W&B with no credentials would fail (or hang for 90 s): log offline instead, sync later with wandb sync."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE"):
        return
    try:
        has_login = netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        has_login = False
    if not has_login:
        os.environ["WANDB_MODE"] = "offline"


def check_config_files(args: Sequence[str]) -> None:
    """An empty config file or one with a YAML syntax error, reported with its name (jsonargparse says
    "Unexpected config" or quotes "<unicode string>"); a missing one is left to the parser, which names it."""
    for index, token in enumerate(args):
        name = (
            token.partition("=")[2]
            if token.startswith("--config=")
            else (args[index + 1] if token == "--config" and index + 1 < len(args) else None)
        )
        if not name or not Path(name).is_file():
            continue
        try:
            content = yaml.safe_load(Path(name).read_text())
        except yaml.YAMLError as e:
            raise UserError(f"config file {name} is not valid YAML: {' '.join(str(e).split())}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read config file {name}: {e}") from None
        if content is None:
            raise UserError(
                f"config file {name} is empty; expected a YAML mapping of options, e.g. 'trainer: {{max_epochs: 2}}'"
            )


def describe_os_error(e: OSError) -> str:
    """An operating-system error as one line that names the path and what is wrong with it."""
    if not e.filename:
        return str(e.strerror or e)
    if isinstance(e, NotADirectoryError):
        return f"cannot create {e.filename}: a part of that path is a file, not a folder"
    if isinstance(e, FileExistsError) and Path(e.filename).is_file():
        return f"cannot create the folder {e.filename}: a file of that name is there"
    return f"cannot use {e.filename}: {e.strerror}"


def cli_arguments() -> dict[str, Any]:
    """RobustLightningCLI's arguments but ``args``: how the Trainer subcommands parse and what they always add
    (main() runs them, command_line_check() parses with the same parser)."""
    return dict(
        model_class=ImageClassifier,
        datamodule_class=ImageNetDataModule,
        parser_class=ArgumentParserWithBases,  # config files may extend others (compose_config)
        seed_everything_default=0,
        trainer_defaults={
            # RankFailureWatch first: its watchdog is then running before any other set-up waits in a collective for
            # a rank that has failed. Interruption before RunResults: an interrupted fit's results.json names the
            # checkpoint it just saved.
            "callbacks": [
                RankFailureWatch(),  # one rank's failure stops the others (robust_lightning.rank_exit)
                CorruptImageReport(),
                Interruption(),
                RunResults(),
                PredictionWriter(),
                FitRunDirectory(),
                Throughput(),
            ],
            # a kill during a save never corrupts last.ckpt
            "plugins": [{"class_path": f"{AtomicCheckpointIO.__module__}.{AtomicCheckpointIO.__name__}"}],
            # attacks in validate/test need autograd, which inference mode forbids even under enable_grad
            "inference_mode": False,
        },
        save_config_callback=SaveConfigToWandb,  # config.yaml, and the full config in W&B runs
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"default_env": True, "env_prefix": "RL"},
    )


class _ParserReady(Exception):
    """Raised by a parse-only LightningCLI once its parser is built: nothing parsed, instantiated or run."""

    def __init__(self, cli: LightningCLI):
        super().__init__()
        self.cli = cli


def command_line_check() -> Callable[[Sequence[str]], None]:
    """A check of Trainer command lines that parses them as main() does (configs, overrides, RL_* environment
    variables) and instantiates or runs nothing: ``check(args)`` raises a UserError with the parser's message and
    the close matches of a misspelt key where main() would exit with them. One parser serves every call."""

    class ParserOnly(RobustLightningCLI):
        def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:  # called once it is built
            raise _ParserReady(self)

    options = cli_arguments()
    # raise instead of printing and exiting; the subcommand parsers take it from the main parser
    options["parser_kwargs"] = {**options["parser_kwargs"], "exit_on_error": False}
    try:
        ParserOnly(**options, args=[])
        raise RuntimeError("LightningCLI did not call parse_arguments")
    except _ParserReady as ready:
        cli = ready.cli

    def check(args: Sequence[str]) -> None:
        try:
            check_config_files(args)
            cli.parser.parse_args(list(args))
        except ArgumentError as e:
            if advice := what_to_write(str(e), args, ArgumentParser.source_classes):
                raise UserError(advice) from None
            parser = cli._subcommand_parsers.get(args[0], cli.parser)  # the keys of the command, for close matches
            raise UserError("\n".join([str(e), *did_you_mean(str(e), parser)])) from None

    return check


def main(args: Sequence[str] | None = None, process_exits: bool | None = None) -> int:
    """Runs the command ``args`` (None: the command line's). ``process_exits``: whether the process exits when main
    returns (None: where main reads the command line); it then ignores SIGTERM from the command's end."""
    from_command_line = args is None
    if process_exits is None:
        process_exits = from_command_line
    _command_state["process_exits"] = process_exits
    args = list(sys.argv[1:] if args is None else args)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        print(f"robust-lightning {robust_lightning.__version__}")
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights and data come from local paths only
    shield_forked_children()  # SLURM's requeue signal is for this process, not its DataLoader workers
    _wandb_offline_without_credentials()
    already_open = open_wandb_run()  # a run of the caller's (main called from Python), not this command's
    with third_party_notices_silenced(args[0]):  # notices that say nothing to a user (robust_lightning/startup.py)
        code = _run_command(args, from_command_line, process_exits)
    # The W&B run this command started, finished from Python after the command's last message: W&B prints its
    # closing lines as plain text where the output is no terminal (left to W&B's exit, they carry colour codes). An
    # error that ends with a traceback is left to W&B's exit, which records it (and the traceback) as it did.
    finish_wandb_run(code, already_open)
    # every rank has done its writing before any exits 143 or 130 (srun --kill-on-bad-exit)
    if code in (EXIT_SIGTERM, EXIT_CTRL_C):
        leave_together(_command_state["trainer"])
        # once: a command around this one (a sweep's cell, which returns this status) finds no Trainer of its own
        _command_state["trainer"] = None
    if not process_exits:
        JobSignals.pass_on_unacted()
    return code


# main's state: the command's Trainer, once built. Until then every process of a job meets the same errors (the
# same command line, config and environment), which its rank 0 alone reports; from then on an error may be a rank's
# own (a file it reads), which print_rank_error reports once per job without losing a rank's own. And whether the
# process exits when main returns, which the command that a sweep's cell runs in the same process inherits.
class _CommandState(TypedDict):
    trainer: Trainer | None
    process_exits: bool


_command_state: _CommandState = {"trainer": None, "process_exits": False}


# A sweep passes a stop on to the cell it runs locally; a cell runs a Trainer command, which notes the signals.
TOOLS_TAKING_THEIR_OWN_SIGNALS = ("sweep", "cell")


def _tool_stopped(command: str, signum: int) -> int:
    """The line of a tool command stopped by a job's signal; on SLURM's requeue signal, the job is requeued first."""
    if signum == signal.SIGTERM:
        stopped = "stopped by SIGTERM"
    elif requeue_this_job(signum, then="the requeued job runs the same command again"):
        stopped = "stopped for SLURM's requeue; the requeued job runs the same command again"
    else:
        stopped = "stopped by SLURM's requeue signal, but the requeue failed"
    print(f"robust-lightning: {command} {stopped} (exit status {EXIT_SIGTERM})", file=sys.stderr)
    return EXIT_SIGTERM


def _report_error(message: str) -> None:
    trainer = _command_state["trainer"]
    if trainer is None:
        print_error(message)
    else:
        failed_here(trainer)  # the other ranks stop after this message (robust_lightning.rank_exit)
        print_rank_error(message, trainer.global_rank, trainer.world_size, Path(trainer.default_root_dir))


def _run_command(args: list[str], from_command_line: bool, process_exits: bool) -> int:
    _command_state["trainer"] = None
    try:
        check_config_files(args)
        if args[0] in TOOL_COMMANDS:
            try:
                tool_signals = tool_stops_on_job_signals(process_exits=process_exits)
                with nullcontext() if args[0] in TOOLS_TAKING_THEIR_OWN_SIGNALS else tool_signals:
                    try:
                        return TOOL_COMMANDS[args[0]][1](args[1:])
                    except ToolStopped as tool_stop:  # in the block: SLURM's SIGTERM after the requeue is ignored
                        return _tool_stopped(args[0], tool_stop.signum)
            except KeyboardInterrupt:  # Ctrl-C: one line, not Python's traceback from wherever it landed
                print(f"robust-lightning: {args[0]} interrupted by Ctrl-C (exit status {EXIT_CTRL_C})", file=sys.stderr)
                return EXIT_CTRL_C
        if args[0] not in TRAINER_COMMANDS:
            raise UserError(
                f"unknown command {args[0]!r}; expected one of: {', '.join([*TRAINER_COMMANDS, *TOOL_COMMANDS])}"
            )
        JobSignals.start_slurm_command()  # SLURM's requeue signal during the set-up is acted on, not fatal
        # args None: LightningCLI reads sys.argv itself
        RobustLightningCLI(**cli_arguments(), args=None if from_command_line else args)
    except SIGTERMException as e:  # a SystemExit without a code: the process would exit 0 as if the run had finished
        if rank_zero_only.rank == 0:  # type: ignore[attr-defined]  # the rank Lightning sets on the function
            stop = e if isinstance(e, JobStopped) else None  # Lightning's own has none of the stop's facts
            if stop is not None and stop.requeued:
                stopped = "stopped for SLURM's requeue"
                then = (
                    f"SLURM resumes the requeued job from {stop.checkpoint}"
                    if stop.checkpoint
                    else ("the requeued job runs it again")
                )
            else:
                stopped = "interrupted by Ctrl-C" if stop is not None and stop.ctrl_c else "interrupted by SIGTERM"
                if stop is not None and stop.requeue:
                    stopped = "stopped by SLURM's requeue signal, but the requeue failed"
                then = "the same command resumes it (fit: with --ckpt_path last)" + slurm_restart_note()
            print(f"robust-lightning: {args[0]} {stopped} (exit status {e.code}); {then}", file=sys.stderr)
        return e.code if isinstance(e.code, int) else EXIT_SIGTERM
    except OSError as e:  # a file or folder that cannot be written or read (read-only, full, not a folder)
        discard_refused_run(e)  # the run folders a refused command made
        _report_error(describe_os_error(e))
        return 2
    except UserError as e:
        discard_refused_run(e)  # the run folders a refused command made
        message = str(e)
        if "Original Traceback" in message:  # raised in a DataLoader worker: torch adds the worker's traceback
            message = message.rpartition(f"{UserError.__module__}.UserError: ")[2].strip() or message
        _report_error(message)
        return 2
    except Exception:  # its traceback, unless this rank met it because another rank failed (rank_exit)
        trainer = _command_state["trainer"]
        if stopped_by_other_rank(trainer):
            return 1
        failed_here(trainer)
        raise
    finally:
        # The handlers the command found (kept through a stopped fit's last save and a finished fit's teardown). A
        # process that exits now ignores SIGTERM and SLURM's requeue signal whatever the command's end
        # (ignored_until_exit): after a stop, a second signal would cut short what is left; after a finish, a
        # signal would leave its W&B run or a sweep's record of the cell unfinished, and a finished job needs no
        # requeue.
        JobSignals.give_back(then_ignored=process_exits)
    return 0


if __name__ == "__main__":
    sys.exit(main())
