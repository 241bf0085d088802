"""Argument parsing shared by every ``robust-lightning`` command.

The Trainer subcommands (LightningCLI) and the tools (``shards``, ``export``, ``sweep``, ``report``) parse
their options with the same jsonargparse parser: ``--config FILE`` (repeatable, composing left to right),
``--print_config``, ``--key value`` or ``--key=value``, environment variables, and a bad option reported in one
message with a close match and exit status 2. A tool's options are the parameters of a typed function
(:func:`run_tool`), its help the function's docstring.
"""

import argparse
import difflib
import json
import re
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from jsonargparse import ActionConfigFile, DefaultHelpFormatter
from lightning.pytorch.cli import LightningArgumentParser

from robust_lightning.errors import PROG, job_rank


class ArgumentParser(LightningArgumentParser):
    """Reports a bad option or value in one message (plus a close match for a misspelt key) instead of
    jsonargparse's full usage dump, which buries the message under every option of the Trainer. Messages name the
    command ``robust-lightning``, also where it runs as ``python -m robust_lightning`` (argparse would say
    ``__main__.py``), and under srun or torchrun the job's rank 0 alone prints them (every rank parses the same
    config: robust_lightning.errors.print_error)."""

    def __init__(self, *args: Any, **kwargs: Any):
        if not args and kwargs.get("prog") is None:  # subcommands' parsers get "robust-lightning [options] fit"
            kwargs["prog"] = PROG
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        if job_rank() != 0:
            sys.exit(2)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        lines = [f"{prog}: error: {message}", *did_you_mean(message, parser), *moved_options(message)]
        lines.append(f"options: {prog} --help")
        print("\n".join(lines), file=sys.stderr)
        sys.exit(2)


# Options that moved into data.source when the data sources became classes (robust_lightning.data.sources).
_SOURCE_OPTIONS = ("root", "class_map", "val_labels", "train_shards", "val_shards", "train_size", "synthetic")
_OLD_SOURCE_OPTION = re.compile(rf"data\.(?:{'|'.join(_SOURCE_OPTIONS)})\b|Parser key \"data\.source\"")


def moved_options(message: str) -> list[str]:
    """A line saying how data.source is written now, for a message about its old form (a name such as "folder",
    or one of its options directly under data)."""
    if not _OLD_SOURCE_OPTION.search(message):
        return []
    return [
        "data.source names a class with its own options: FolderSource (root, class_map, val_labels), ShardSource "
        "(train_shards, val_shards, train_size) or SyntheticSource (the options data.synthetic held); e.g. "
        "--data.source FolderSource --data.source.root DIR, or in a config data.source.class_path and init_args"
    ]


def did_you_mean(message: str, parser: argparse.ArgumentParser) -> list[str]:
    """A "did you mean: ...?" line for each key of a parser's error message that the parser does not know and
    that is close to keys it does (difflib's close matches)."""
    lines = []
    known = [action.dest for action in parser._actions]
    for key in re.findall(r"(?:--|option ')([\w.-]+)", message):
        key = key.replace("-", "_")  # a GNU-style spelling of an existing key is matched to it too
        if key not in known and (close := difflib.get_close_matches(key, known, n=3)):
            lines.append(f"did you mean: {', '.join(close)}?")
    return lines


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultHelpFormatter):
    """jsonargparse's help, with the description's examples kept on their own lines."""


def _types(action: Any) -> set[Any]:
    hint = getattr(action, "_typehint", None)
    return {hint, *typing.get_args(hint)}


def _is_flag(action: Any) -> bool:
    return bool in _types(action)


def _is_list(action: Any) -> bool:
    return any(typing.get_origin(t) is list or t is list for t in _types(action))


def accept_gnu_spellings(argv: Sequence[str], parser: ArgumentParser) -> list[str]:
    """The tools' option spellings from before they were jsonargparse parsers, rewritten to today's:
    ``--samples-per-shard 4`` -> ``--samples_per_shard 4``, a bare flag ``--ema`` -> ``--ema=true``,
    ``--no-shuffle`` -> ``--shuffle=false``, ``--columns a b`` -> ``--columns=["a", "b"]``."""
    actions = {action.dest: action for action in parser._actions if action.option_strings}
    out: list[str] = []
    rest = list(argv)
    while rest:
        token = rest.pop(0)
        if token == "--":
            out += [token, *rest]
            break
        match = re.fullmatch(r"--([A-Za-z][\w-]*)(=.*)?", token)
        if not match:
            out.append(token)
            continue
        key, value = match.group(1).replace("-", "_"), match.group(2)
        negated = key.startswith("no_") and key not in actions and key[3:] in actions and _is_flag(actions[key[3:]])
        if negated and value is None:
            out.append(f"--{key[3:]}=false")
        elif key not in actions:
            out.append(token)  # the parser reports it
        elif value is not None:
            out.append(f"--{key}{value}")
        elif _is_flag(actions[key]) and (not rest or rest[0].lower() not in ("true", "false", "null")):
            out.append(f"--{key}=true")
        elif _is_list(actions[key]) and rest and not rest[0].startswith(("[", "-")) and rest[0] != "null":
            values = []
            while rest and not rest[0].startswith("-"):
                values.append(rest.pop(0))
            out.append(f"--{key}={json.dumps(values)}")
        else:
            out.append(f"--{key}")
    return out


def tool_parser(function: Callable[..., Any], prog: str, description: str) -> ArgumentParser:
    """A parser whose options are the parameters of ``function``: required ones positional, the others
    ``--name value``, with the help of its docstring; environment variables RL_<TOOL>_<NAME>."""
    tool = prog.split()[-1].upper()
    parser = ArgumentParser(
        prog=prog, description=description, default_env=True, env_prefix=f"RL_{tool}", formatter_class=_HelpFormatter
    )
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML file of options (repeatable: later ones win)")
    parser.add_function_arguments(function, as_group=False, as_positional=True)
    return parser


def parse_tool_arguments(
    function: Callable[..., Any], argv: Sequence[str], prog: str, description: str
) -> tuple[dict[str, Any], list[Path]]:
    """The parameters of ``function`` from ``argv`` (and the config files it names), and those files."""
    parser = tool_parser(function, prog, description)
    options = parser.parse_args(accept_gnu_spellings(argv, parser)).as_dict()
    files = [Path(str(f)) for f in options.pop("config", None) or []]
    options.pop("__path__", None)
    return options, files


def run_tool(function: Callable[..., int], argv: Sequence[str], prog: str, description: str) -> int:
    """Parse ``argv`` into the parameters of ``function`` and call it."""
    options, _ = parse_tool_arguments(function, argv, prog, description)
    return function(**options)
