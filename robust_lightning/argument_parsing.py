"""Argument parsing shared by every ``robust-lightning`` command.

The Trainer subcommands (LightningCLI) and the tools (``shards``, ``export``, ``sweep``, ``report``) parse
their options with the same jsonargparse parser: ``--config FILE`` (repeatable, composing left to right),
``--print_config``, ``--key value`` or ``--key=value``, environment variables, and a bad option reported in one
message with a close match and exit status 2. A tool's options are the parameters of a typed function
(:func:`run_tool`), its help the function's docstring.
"""

import argparse
import difflib
import importlib
import inspect
import json
import os
import re
import shlex
import sys
import typing
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import yaml
from jsonargparse import ActionConfigFile, DefaultHelpFormatter, get_loader
from lightning.pytorch.cli import LightningArgumentParser

from robust_lightning.errors import PROG, UserError, job_rank


class ArgumentParser(LightningArgumentParser):
    """Reports a bad option or value in one message (plus a close match for a misspelt key) instead of
    jsonargparse's full usage dump, which buries the message under every option of the Trainer. Messages name the
    command ``robust-lightning``, also where it runs as ``python -m robust_lightning`` (argparse would say
    ``__main__.py``), and under srun or torchrun the job's rank 0 alone prints them (every rank parses the same
    config: robust_lightning.errors.print_error)."""

    # The data sources by the names data.source gave them before it named a class ("folder", ...), for the line
    # that answers an old option. The command (robust_lightning.cli) sets them: this layer does not import data.
    source_classes: ClassVar[dict[str, type]] = {}

    def __init__(self, *args: Any, **kwargs: Any):
        if not args and kwargs.get("prog") is None:  # subcommands' parsers get "robust-lightning [options] fit"
            kwargs["prog"] = PROG
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Sequence[str] | None = None, *rest: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self._given_args = list(sys.argv[1:] if args is None else args)  # for error(): the options as written
        return super().parse_args(args, *rest, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        if job_rank() != 0:
            sys.exit(2)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        advice = what_to_write(message, getattr(self, "_given_args", sys.argv[1:]), self.source_classes)
        if advice:  # the line names what to write: the parser's text and the pointer to --help say no more
            lines = [f"{prog}: error: {advice}"]
        else:
            lines = [f"{prog}: error: {message}", *did_you_mean(message, parser), f"options: {prog} --help"]
        print("\n".join(lines), file=sys.stderr)
        sys.exit(2)


# Lightning 2.6 types these Trainer options ``float | int | None``: parsed in that order, the 1 a user types for one
# batch becomes 1.0, which Lightning reads as the whole epoch. Its documentation says an int is a number of batches
# and a float a fraction, and ``overfit_batches`` and ``val_check_interval`` already put int first.
BATCH_LIMITS = ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches")


def int_before_float(parser: argparse.ArgumentParser, prefix: str = "trainer.") -> None:
    """Parse the Trainer's batch limits as ``int | float | None``: 1 is one batch and 1.0 all of them, from the
    command line, a config file and the environment alike."""
    for name in BATCH_LIMITS:
        action = next((a for a in parser._actions if a.dest == prefix + name), None)
        if action is None:  # a Lightning without the option: nothing to fix
            continue
        action._typehint = int | float | None  # type: ignore[attr-defined]  # jsonargparse's ActionTypeHint


def what_to_write(message: str, args: Sequence[str], source_classes: dict[str, type]) -> str | None:
    """One line in place of a parser's error ``message`` that names the option to write, where the message is about
    the old form of data.source (given in ``args``, the options as written, or in a config file; ``source_classes``:
    the sources by their old names, ``ArgumentParser.source_classes``) or about an option that a class in a config
    does not take (jsonargparse's "Option 'x' is not accepted"); None for other messages."""
    return (_old_source_form(message, args, source_classes) if source_classes else None) or _option_not_accepted(
        message
    )


def _options(cls: type) -> list[str]:
    return [name for name in inspect.signature(cls).parameters if name not in ("args", "kwargs")]


def _old_source_form(message: str, args: Sequence[str], classes: dict[str, type]) -> str | None:
    """``--data.source folder --data.root D is now written --data.source FolderSource --data.source.root D``: the
    form data.source had before it named a class with its own options (issue 39). The options it had directly under
    data belonged to FolderSource or ShardSource; those under data.synthetic to SyntheticSource."""
    if "data." not in message:
        return None
    owner = {name: cls for cls in (classes["shards"], classes["folder"]) for name in _options(cls)}  # root: folder

    def moved(key: str) -> tuple[str, type] | None:  # an old key under data: its new name and class
        name = key.removeprefix("data.")
        if name.startswith("synthetic."):
            return f"data.source.{name.removeprefix('synthetic.')}", classes["synthetic"]
        return (f"data.source.{name}", owner[name]) if name in owner else None

    old: list[str] = []  # the old form as written, and the new
    new: list[str] = []
    tokens = list(args)
    class_named = any(token.partition("=")[0] == "--data.source" for token in tokens)
    while tokens:
        key, equals, value = tokens.pop(0).partition("=")
        if not key.startswith("--data.") or not (equals or tokens):
            continue
        key, value = key.removeprefix("--"), value if equals else tokens.pop(0)
        if key == "data.source" and value.lower() in classes:
            old += [f"--{key}", value]
            new += [f"--{key}", classes[value.lower()].__name__]
        elif (found := moved(key)) is not None:
            if not class_named:  # the class the old option belonged to
                new += ["--data.source", found[1].__name__]
                class_named = True
            old += [f"--{key}", value]
            new += [f"--{found[0]}", value]
    if old:
        return f"{shlex.join(old)} is now written {shlex.join(new)} (data.source names a class with its own options)"
    # the old form in a config file: data.source given a name, or an old key under data
    if match := re.search(r'Parser key "data\.source":.*?dot import path string: (\w+)', message, re.S):
        cls = classes.get(match.group(1).lower())
        if cls is not None:
            return (
                f"data.source {match.group(1)} is now written data.source.class_path {cls.__name__}, with its "
                f"options ({', '.join(_options(cls))}) under data.source.init_args"
            )
    for key in re.findall(r"option '(data\.[\w.]+)'", message):
        if (found := moved(key)) is not None:
            name, cls = found
            return (
                f"{key} is now written {name}: in a config, data.source.class_path {cls.__name__} and "
                f"data.source.init_args.{name.removeprefix('data.source.')}"
            )
    return None


_NOT_ACCEPTED = re.compile(
    r'Parser key "([\w.]+)":.*?Problem with given class_path \'([\w.]+)\':\s*Option \'(\w+)\' is not accepted', re.S
)


def _option_not_accepted(message: str) -> str | None:
    """``data.source FolderSource takes no option roots; did you mean root?``, for an option that a class named in a
    config (its class_path) does not take."""
    match = _NOT_ACCEPTED.search(message)
    if match is None:
        return None
    key, class_path, option = match.groups()
    try:
        module, _, name = class_path.rpartition(".")
        options = _options(getattr(importlib.import_module(module), name))
    except (ImportError, AttributeError, ValueError, TypeError):
        return None
    close = difflib.get_close_matches(option, options, n=3)
    if close:
        return f"{key} {name} takes no option {option}; did you mean {', '.join(close)}?"
    return f"{key} {name} takes no option {option}; its options: {', '.join(options)}"


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


def shell_style_values(argv: Sequence[str], parser: ArgumentParser) -> list[str]:
    """A tool's options as a shell user writes them, in the form jsonargparse reads: a flag given alone means
    true (``--dry_run`` -> ``--dry_run=true``), and a list option takes the words after it
    (``--columns a b`` -> ``--columns=["a", "b"]``)."""
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
        key, value = match.group(1), match.group(2)
        if key not in actions:
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
    options = parser.parse_args(shell_style_values(argv, parser)).as_dict()
    files = [Path(str(f)) for f in options.pop("config", None) or []]
    options.pop("__path__", None)
    return options, files


def run_tool(function: Callable[..., int], argv: Sequence[str], prog: str, description: str) -> int:
    """Parse ``argv`` into the parameters of ``function`` and call it."""
    options, _ = parse_tool_arguments(function, argv, prog, description)
    return function(**options)


# A config file may start from others: ``extends: BASE`` (or a list of them). See compose_config.
BASES_KEY = "extends"
_parsed_config_file: ContextVar[Path | None] = ContextVar("parsed_config_file", default=None)


def compose_config(path: Path, content: Any = None, _chain: tuple[Path, ...] = ()) -> Any:
    """The settings of config file ``path`` (its text already read: ``content``, a mapping) with its bases composed
    in. ``extends: BASE`` or ``extends: [BASE, ...]`` names the files, relative to the file naming them, that the
    file starts from: each base composed the same way (a base may extend others), the next base over it, the file's
    own settings last. Over what comes before, a mapping is merged key by key; any other value (a list, a scalar,
    null) replaces the earlier one, and so does a mapping naming another ``class_path``. A top-level key with dots
    (``model.arch: convnext_tiny``) stands for the nested key, as on the command line. A file without the key is
    returned as it is; a missing base, a base that is no mapping and bases extending each other are UserErrors."""
    path = Path(os.path.abspath(path))
    if path in _chain:
        cycle = " -> ".join(p.name for p in (*_chain[_chain.index(path) :], path))
        raise UserError(f"config file {_chain[0]}: its bases extend each other in a cycle: {cycle}")
    if content is None:
        try:
            content = get_loader("yaml")(path.read_text())
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read config file {path}, a base of {_chain[-1]}: {e}") from None
        except yaml.YAMLError as e:
            raise UserError(
                f"config file {path}, a base of {_chain[-1]}, is not valid YAML: {' '.join(str(e).split())}"
            ) from None
        if not isinstance(content, dict):
            raise UserError(f"config file {path}, a base of {_chain[-1]}, holds no mapping of options")
    if not isinstance(content, dict) or BASES_KEY not in content:
        return content
    bases = content[BASES_KEY]
    names = [bases] if isinstance(bases, str) else bases
    if not isinstance(names, list) or not names or not all(isinstance(name, str) and name for name in names):
        raise UserError(f"config file {path}: {BASES_KEY} names a base config file or a list of them, not {bases!r}")
    composed: dict[str, object] = {}
    for name in names:
        base = path.parent / name
        if not base.is_file():
            raise UserError(f"config file {path}: its base {name} is not a file ({base})")
        composed = _merge_settings(composed, _nest_dotted_keys(compose_config(base, None, (*_chain, path))))
    own = {key: value for key, value in content.items() if key != BASES_KEY}
    return _merge_settings(composed, _nest_dotted_keys(own))


def _nest_dotted_keys(settings: dict[str, object]) -> dict[str, object]:
    """``{"model.arch": x}`` as ``{"model": {"arch": x}}``, merged with the other keys in their order."""
    nested: dict[str, object] = {}
    for key, value in settings.items():
        for part in reversed(str(key).split(".")[1:]):
            value = {part: value}
        nested = _merge_settings(nested, {str(key).split(".")[0]: value})
    return nested


def _merge_settings(earlier: dict[str, object], later: dict[str, object]) -> dict[str, object]:
    merged = dict(earlier)
    for key, value in later.items():
        before = merged.get(key)
        if (
            isinstance(value, dict)
            and isinstance(before, dict)
            and value.get("class_path", before.get("class_path")) == before.get("class_path")
        ):
            merged[key] = _merge_settings(before, value)
        else:
            merged[key] = value
    return merged


class ArgumentParserWithBases(ArgumentParser):
    """The Trainer commands' parser: a config file that extends others is parsed as its composed settings
    (compose_config), so that ``--print_config`` shows the whole config and messages name the file given."""

    def parse_path(self, path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> Any:
        token = _parsed_config_file.set(Path(os.path.abspath(os.fspath(path))))
        try:
            return super().parse_path(path, *args, **kwargs)  # reads the file and hands its text to parse_string
        finally:
            _parsed_config_file.reset(token)

    def parse_string(self, content: str, *args: Any, **kwargs: Any) -> Any:
        file = _parsed_config_file.get()
        token = _parsed_config_file.set(None)  # the text of that file only, not what it may parse in turn
        try:
            if file is not None and BASES_KEY in content:
                try:
                    settings = get_loader("yaml")(content)
                except yaml.YAMLError:
                    settings = None  # left to the parser, which reports it
                if isinstance(settings, dict) and BASES_KEY in settings:
                    content = yaml.safe_dump(compose_config(file, settings), sort_keys=False)
            return super().parse_string(content, *args, **kwargs)
        finally:
            _parsed_config_file.reset(token)
