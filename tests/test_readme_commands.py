"""Every command in the shell code blocks of README.md and docs/*.md (called "the README" below) goes through
the real command line, so a renamed option, a moved config or a path that no command writes fails here instead
of in a user's shell.

How each command is checked (in-process, through robust_lightning.cli.main, in a sandbox directory that links
the repository's files but has an empty runs/):

- ``robust-lightning fit|validate|test|predict ...``: parsed with ``--print_config`` appended, which reads every
  config file and option it names; a ``--ckpt_path`` (given, or set in a config) and a ``model.init_from`` under
  runs/ must be a file that a README command writes (a fit's fixed ``checkpoint.dirpath``: its ``last.ckpt`` and
  its ``<filename>.ckpt``); shard folders a config reads must be ones the README's ``shards`` commands write;
  ``RL_<COMMAND>__<KEY>=value`` prefixes must reach their key.
- ``robust-lightning shards|export|report ...``: ``--print_config`` (parses positionals and options);
  ``robust-lightning sweep ...``: ``--dry_run`` (expands the cells), then every cell's command as above.
- Comment lines that give options for the command above (``# EMA weights: --trainer.callbacks.init_args.weights
  ema``) are checked as that command plus those options.
- Other programs: only those of OTHER_COMMANDS, each with its own check.

Words of a command that look like paths must be a file of the repository, a placeholder of PLACEHOLDERS
(replaced by a file the test makes), an output of the command itself, or a path a README command writes;
anything else fails, so a new command with a new placeholder is never silently skipped.
"""

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from helpers import REPO
from robust_lightning.cli import LIGHTNING_CKPT_NAMES, TOOL_COMMANDS, TRAINER_COMMANDS, main

README = REPO / "README.md"
DOCUMENTS = [README, *sorted((REPO / "docs").glob("*.md"))]
MAKEFILE = REPO / "Makefile"

# Programs other than robust-lightning that README code blocks may run, why, and what is checked of them.
OTHER_COMMANDS = {
    "make": "the set-up targets of the Makefile: the target must exist; the robust-lightning commands of its "
    "recipe are checked like README commands",
    "source": "activates the virtual environment that `make env` creates: the path must be in the Makefile's VENV",
    "sbatch": 'submits a slurm/ template that runs `python -m robust_lightning COMMAND --config "$VAR" "$@"`: '
    "the template must exist, and that command with the arguments after the template is checked",
    "pip": "installs packages: nothing of this project to parse",
    "git": "fetches the repository: nothing of this project to parse",
    "cd": "changes into the repository: nothing to parse",
    "torchrun": "starts `-m robust_lightning COMMAND ...` on every GPU of a node: that command is checked like the "
    "README's robust-lightning commands",
    "bash": "runs a shell script of benchmarks/: the script must exist (gpu_packages.sh installs from the package "
    "index; tests/test_gpu_suite.py checks the versions it installs)",
    "python3": "runs a script of benchmarks/ (on a GPU machine): the script must exist and its --help must list every "
    "option the command gives (tests/test_gpu_suite.py runs the GPU suite itself, with --smoke)",
}

# Placeholders in README commands: what each stands for, and the file the test puts in its place
# (``--print_config`` never reads a checkpoint or an image; the files exist so that every substitute is real).
PLACEHOLDERS = {
    "CKPT": ("a checkpoint of yours", "an empty file"),
    "/datasets/imagenet": ("your ImageNet copy (ROOT/train/<wnid>/, ROOT/val/<wnid>/)", "an image tree"),
    "/datasets/imagenet-wds": ("where the README's shards commands write", "an empty folder"),
    "my_overrides.yaml": ("a config of your own, composed after another", "a config setting one option"),
    "my.yaml": ("a whole config of your own", "a config that leaves trainer.max_epochs to the environment"),
    "ckpts.txt": ("the evaluation array's checkpoints, one path per line", "a list naming CKPT's substitute"),
    "RUN_DIR": ("the run directory of an evaluation, holding its results.json", "a folder with a results.json"),
    "runs/slurm/rl-train-1234": ("the run folder of a stopped training job, which a new job continues", "a folder"),
}
# Model files a user supplies (README: the recipes warm-start from local copies of clean ImageNet weights).
USER_SUPPLIED_PREFIXES = ("weights/",)
PATH_SUFFIXES = {
    ".yaml",
    ".yml",
    ".ckpt",
    ".safetensors",
    ".pt",
    ".pth",
    ".txt",
    ".json",
    ".jsonl",
    ".tar",
    ".csv",
    ".md",
    ".sbatch",
}
SHELL_OPERATORS = {"|", "||", "&&", ";", "<", ">>", "&", "2>"}


@dataclass(frozen=True)
class Command:
    where: str  # FILE:LINE (README.md or docs/PAGE.md), or the Makefile line that `make TARGET` runs
    text: str  # the command (continuation lines joined, trailing comment dropped, words re-quoted)
    words: tuple[str, ...]  # shell words: VAR=value prefixes, the program and its arguments
    stdout_to: str | None = None  # `> FILE`

    @property
    def env(self) -> dict[str, str]:
        return dict(w.split("=", 1) for w in self.words[: self._program_index])

    @property
    def program(self) -> tuple[str, ...]:
        return self.words[self._program_index :]

    @property
    def _program_index(self) -> int:
        return next((i for i, w in enumerate(self.words) if not re.fullmatch(r"[A-Za-z_]\w*=.*", w)), len(self.words))

    def robust_lightning_args(self) -> list[str] | None:
        program = list(self.program)
        if program[:1] == ["robust-lightning"]:
            return program[1:]
        if program[:3] == ["python", "-m", "robust_lightning"]:
            return program[3:]
        return None


def code_blocks() -> list[tuple[str, str, int, list[str]]]:
    """(file, language, line number of the first line inside, lines) of every fenced block of the documents."""
    blocks = []
    for document in DOCUMENTS:
        lines, start, name = document.read_text().splitlines(), None, str(document.relative_to(REPO))
        for number, line in enumerate(lines, 1):
            fence = re.fullmatch(r"\s*```(\S*)\s*", line)
            if fence and start is None:
                language, start = fence.group(1), number + 1
            elif fence:
                blocks.append((name, language, start, lines[start - 1 : number - 1]))
                start = None
    return blocks


def comment_options(line: str) -> list[str]:
    """The `--key value` options a comment line gives for the command above (dotted config keys only)."""
    options = []
    for key, value in re.findall(r"(--[A-Za-z]\w*\.[\w.]+)(?:[ =](?!-)(\S+))?", line):
        options += [key, value] if value else [key]
    return options


def readme_commands() -> list[Command]:
    commands = []
    for document, language, start, lines in code_blocks():
        if language not in ("bash", "sh", "shell"):
            continue
        previous, pending, first = None, "", None
        for number, line in enumerate(lines, start):
            if not pending and line.lstrip().startswith("#"):
                options = comment_options(line)
                if options and previous is not None and previous.robust_lightning_args() is not None:
                    shown = "# " + " ".join(options) + " (on the command above)"
                    commands.append(Command(f"{document}:{number}", shown, previous.words + tuple(options)))
                continue
            first = first or number
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            text, pending = (pending + line).strip(), ""
            words = shlex.split(text, comments=True)
            if words:
                stdout_to = None
                if ">" in words:
                    index = words.index(">")
                    stdout_to, words = words[index + 1], words[:index] + words[index + 2 :]
                shown = shlex.join(words) + (f" > {stdout_to}" if stdout_to else "")
                previous = Command(f"{document}:{first}", shown, tuple(words), stdout_to)
                commands.append(previous)
            first = None
    return commands


def make_recipe(target: str) -> list[tuple[int, str]] | None:
    """The recipe lines of a Makefile target (None: no such target)."""
    lines = MAKEFILE.read_text().splitlines()
    for index, line in enumerate(lines):
        if re.match(rf"{re.escape(target)}\s*:(?!=)", line):
            recipe = []
            for number, body in enumerate(lines[index + 1 :], index + 2):
                if not body.startswith("\t"):
                    break
                recipe.append((number, body.strip()))
            return recipe
    return None


def all_commands() -> list[Command]:
    """The README's commands, and after each `make TARGET` the robust-lightning commands its recipe runs."""
    commands = []
    for command in readme_commands():
        commands.append(command)
        if command.program[:1] == ("make",):
            for target in command.program[1:]:
                for number, line in make_recipe(target) or []:
                    line = re.sub(r"^\$\(BIN\)/robust-lightning\b", "robust-lightning", line)
                    if line.startswith("robust-lightning "):
                        commands.append(Command(f"Makefile:{number} (make {target})", line, tuple(shlex.split(line))))
    return commands


COMMANDS = all_commands()


def path_like(word: str) -> bool:
    """Whether a word names a file or a placeholder for one (a metric name like val/acc1 does not)."""
    if re.fullmatch(r"[A-Z][A-Z_]{2,}[A-Z0-9_]*", word) or Path(word).suffix in PATH_SUFFIXES:
        return True
    first = word.split("/")[0]
    return "/" in word and (
        word.startswith(("/", "./", "../")) or first in ("runs", "weights") or (REPO / first).exists()
    )


def value_words(words: list[str] | tuple[str, ...]) -> list[str]:
    """The values among shell words: `--key=value` and `VAR=value` give their value, `--key` nothing."""
    values = []
    for word in words:
        if word.startswith("-"):
            if "=" in word:
                values.append(word.split("=", 1)[1])
        elif re.fullmatch(r"[A-Za-z_]\w*=.*", word):
            values.append(word.split("=", 1)[1])
        else:
            values.append(word)
    return values


class Sandbox:
    """A working directory linking the repository's files (runs/ left out and empty), the placeholders'
    substitutes, and a memo of in-process command-line runs."""

    def __init__(self, root: Path):
        from helpers import WNIDS, make_image_tree

        self.work = root / "work"
        self.work.mkdir()
        for entry in REPO.iterdir():
            if entry.name != "runs" and not entry.name.startswith("."):
                (self.work / entry.name).symlink_to(entry)
        made = root / "placeholders"
        self.substitutes = {
            "CKPT": made / "checkpoint.ckpt",
            "/datasets/imagenet": made / "imagenet",
            "/datasets/imagenet-wds": made / "imagenet-wds",
            "my_overrides.yaml": made / "my_overrides.yaml",
            "my.yaml": made / "my.yaml",
            "ckpts.txt": made / "ckpts.txt",
            "RUN_DIR": made / "run",
            "runs/slurm/rl-train-1234": made / "stopped-job",
        }
        assert self.substitutes.keys() == PLACEHOLDERS.keys()
        made.mkdir()
        self.substitutes["CKPT"].touch()
        for split in ("train", "val"):
            make_image_tree(self.substitutes["/datasets/imagenet"] / split, {w: 1 for w in WNIDS})
        self.substitutes["/datasets/imagenet-wds"].mkdir()
        self.substitutes["my_overrides.yaml"].write_text("trainer: {enable_progress_bar: false}\n")
        self.substitutes["my.yaml"].write_text(
            "model: {arch: resnet18}\ndata: {source: SyntheticSource, image_size: 32}\n"
        )
        self.substitutes["ckpts.txt"].write_text(f"{self.substitutes['CKPT']}\n")
        self.substitutes["RUN_DIR"].mkdir()
        (self.substitutes["RUN_DIR"] / "results.json").write_text("{}\n")
        self.substitutes["runs/slurm/rl-train-1234"].mkdir()
        self.runs: dict[tuple, tuple[int, str, str]] = {}

    def resolve(self, word: str) -> str:
        """A word with its placeholder (the whole word, or a leading /datasets/... folder) replaced."""
        if word.startswith("--") and "=" in word:
            key, value = word.split("=", 1)
            return f"{key}={self.resolve(value)}"
        if re.fullmatch(r"[A-Za-z_]\w*=.*", word):
            name, value = word.split("=", 1)
            return f"{name}={self.resolve(value)}"
        for placeholder, path in self.substitutes.items():
            if word == placeholder or (placeholder.startswith("/") and word.startswith(placeholder + "/")):
                return str(path) + word[len(placeholder) :]
        return word

    def unresolve(self, path: str) -> str:
        for placeholder, substitute in self.substitutes.items():
            if path == str(substitute) or path.startswith(f"{substitute}/"):
                return placeholder + path[len(str(substitute)) :]
        return path

    def is_substitute(self, path: str) -> bool:
        return self.unresolve(path) != path

    def run(self, args: list[str], env: dict[str, str] | None = None) -> tuple[int, str, str]:
        """robust-lightning ARGS in-process (exit status, stdout, stderr), once per distinct command."""
        key = (tuple(args), tuple(sorted((env or {}).items())))
        if key not in self.runs:
            out, err = io.StringIO(), io.StringIO()
            with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                mp.chdir(self.work)
                mp.setattr(sys, "argv", ["robust-lightning"])  # the arguments are given: LightningCLI warns otherwise
                for name, value in (env or {}).items():
                    mp.setenv(name, value)
                try:
                    code = main(list(args))
                except SystemExit as e:
                    code = e.code
            self.runs[key] = (code or 0, out.getvalue(), err.getvalue())
        return self.runs[key]

    def printed_config(self, args: list[str], env: dict[str, str] | None = None, shown: str = "") -> dict:
        """The config ``--print_config`` prints for ARGS (appended when missing)."""
        args = [a for a in args if a not in ("--dry_run", "--local")]
        if "--print_config" not in args:
            args = args + ["--print_config"]
        code, out, err = self.run(args, env)
        assert code == 0, f"{shown or shlex.join(args)}\nexit status {code}:\n{err}"
        return yaml.safe_load(out)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Sandbox:
    return Sandbox(tmp_path_factory.mktemp("readme"))


def sbatch_args(command: Command, sandbox: Sandbox) -> tuple[list[str], dict[str, str]]:
    """The robust-lightning arguments (placeholders replaced) that an sbatch template runs for this command."""
    words = [sandbox.resolve(w) for w in command.program[1:]]
    index = next(i for i, w in enumerate(words) if not w.startswith("-"))  # sbatch options are --name=value
    script, forwarded = words[index], words[index + 1 :]
    assert (REPO / script).is_file(), f"{command.text}: no template {script}"
    text = (REPO / script).read_text()
    call = re.search(r'-m robust_lightning (\w+) --config "\$(\w+)" "\$@"', text)
    assert call, f'{script} does not run `python -m robust_lightning COMMAND --config "$VAR" "$@"`'
    env = {name: sandbox.resolve(value) for name, value in command.env.items()}
    assert call.group(2) in env, f"{command.text}: {script} needs {call.group(2)}=CONFIG"
    args = [call.group(1), "--config", env[call.group(2)], *forwarded]
    listing = re.search(r'grep [^"]*"\$(\w+)"', text)  # the evaluation array: task 0 evaluates the first line
    if listing and "--ckpt_path=" in text:
        assert listing.group(1) in env, f"{command.text}: {script} needs {listing.group(1)}=FILE"
        first = Path(env[listing.group(1)]).read_text().split()[0]
        args.append(f"--ckpt_path={first}")
    return args, {}


def run_redirect_writers(command: Command, sandbox: Sandbox) -> None:
    """A file that another README command writes with `> FILE` is written first, by running that command."""
    for word in value_words(command.words):
        writer = next((c for c in COMMANDS if c.stdout_to == word), None)
        if writer is not None and writer is not command:
            code, out, err = sandbox.run([sandbox.resolve(w) for w in writer.robust_lightning_args()])
            assert code == 0, f"{writer.text}\nexit status {code}:\n{err}"
            (sandbox.work / word).write_text(out)


@pytest.fixture(scope="module")
def written(sandbox) -> set[str]:
    """Every path a README command writes: the fixed checkpoints of its fits, the output folders of its
    sweeps, shards and exports, and the files it redirects its output into (placeholders kept as written)."""
    paths = set()
    for command in COMMANDS:
        args = command.robust_lightning_args()
        if args is None or not args or args[0] not in ("fit", "sweep", "shards", "export"):
            if command.stdout_to:
                paths.add(command.stdout_to)
            continue
        env = {name: sandbox.resolve(value) for name, value in command.env.items()}
        try:
            run_redirect_writers(command, sandbox)
            config = sandbox.printed_config([sandbox.resolve(w) for w in args], env, shown=command.text)
        except AssertionError:
            continue  # the command's own test reports it
        if args[0] == "fit" and config["checkpoint"]["dirpath"]:
            checkpoint = config["checkpoint"]
            if checkpoint["save_last"]:
                paths.add(f"{checkpoint['dirpath']}/last.ckpt")
            if checkpoint["filename"] and "{" not in checkpoint["filename"]:
                paths.add(f"{checkpoint['dirpath']}/{checkpoint['filename']}.ckpt")
        elif args[0] == "sweep":
            files = [args[i + 1] for i, w in enumerate(args[:-1]) if w == "--config"]
            paths.add(config["output_dir"] or f"runs/sweeps/{config['name'] or Path(files[-1]).stem}")
        elif args[0] in ("shards", "export"):
            paths.add(sandbox.unresolve(config["out"]))
        if command.stdout_to:
            paths.add(command.stdout_to)
    return {os.path.normpath(p) for p in paths}


def check_paths(shown: str, words, sandbox: Sandbox, written: set[str], outputs: set[str]) -> None:
    for word in value_words(words):
        if not path_like(word) or sandbox.is_substitute(sandbox.resolve(word)):
            continue
        if word.split("/")[0] != "runs" and (REPO / word).exists():
            continue  # a file of the repository (configs/, slurm/, ...)
        if os.path.normpath(word) in outputs or os.path.normpath(word) in written:
            continue
        pytest.fail(
            f"{shown}\n{word!r} is not a file of the repository, a placeholder of PLACEHOLDERS "
            f"({', '.join(PLACEHOLDERS)}), an output of this command, nor a path that a README command "
            f"writes ({', '.join(sorted(written))}): fix the README or add the placeholder to this test"
        )


def check_written(shown: str, what: str, path, sandbox: Sandbox, written: set[str]) -> None:
    """A path a command reads must be one a README command writes (or a placeholder's substitute)."""
    if path is None or str(path) in LIGHTNING_CKPT_NAMES or sandbox.is_substitute(str(path)):
        return
    if os.path.normpath(str(path)) not in written:
        pytest.fail(
            f"{shown}\n{what} {path} is written by no README command (they write: {', '.join(sorted(written))})"
        )


def check_trainer_command(
    shown: str, args: list[str], env: dict[str, str], sandbox: Sandbox, written: set[str]
) -> dict:
    config = sandbox.printed_config(args, env, shown)
    check_written(shown, "ckpt_path", config.get("ckpt_path"), sandbox, written)
    init_from = config["model"].get("init_from")
    if init_from and not str(init_from).startswith(USER_SUPPLIED_PREFIXES):
        check_written(shown, "model.init_from", init_from, sandbox, written)
    source = config["data"]["source"]
    if source["class_path"].endswith(".ShardSource"):
        shards = source["init_args"]
        for key in ("train_shards", "val_shards"):
            if shards.get(key) and not re.search(r"[{]|^pipe:", str(shards[key])):
                check_written(shown, f"data.source.{key}", sandbox.unresolve(str(shards[key])), sandbox, written)
    for name, value in env.items():
        prefix = f"RL_{args[0].upper()}__"
        assert name.startswith(prefix), f"{shown}\n{name}: not an environment variable of `{args[0]}` ({prefix}...)"
        node = config
        for key in name[len(prefix) :].lower().split("__"):
            node = node[key]
        assert node == yaml.safe_load(value), f"{shown}\n{name}={value} did not reach the config ({node!r})"
    return config


def check_robust_lightning(
    command: Command, args: list[str], env: dict[str, str], sandbox: Sandbox, written: set[str]
) -> None:
    shown = f"{command.where}: {command.text}"
    assert args and (args[0] in TRAINER_COMMANDS or args[0] in TOOL_COMMANDS), f"{shown}\nunknown command"
    run_redirect_writers(command, sandbox)
    args = [sandbox.resolve(w) for w in args]
    outputs = {os.path.normpath(command.stdout_to)} if command.stdout_to else set()
    if args[0] in TRAINER_COMMANDS:
        check_paths(shown, command.words, sandbox, written, outputs)
        check_trainer_command(shown, args, env, sandbox, written)
    else:
        config = sandbox.printed_config(args, env, shown)
        named = {w[2:].split("=")[0].replace("-", "_") for w in args if w.startswith("--")}
        for index, word in enumerate(command.words[:-1]):
            if word == "--config" and any(c.stdout_to == command.words[index + 1] for c in COMMANDS):
                saved = yaml.safe_load((sandbox.work / command.words[index + 1]).read_text())
                kept = {k: config[k] for k in saved if k not in named}
                assert kept == {k: saved[k] for k in kept}, (
                    f"{shown}\nthe options of {command.words[index + 1]} are lost"
                )
        if config.get("out"):  # a tool's output path (claim's has a default of its own)
            outputs.add(os.path.normpath(sandbox.unresolve(config["out"])))
        if command.stdout_to and "--print_config" in args:  # what the shell would write
            (sandbox.work / command.stdout_to).write_text(sandbox.run(args, env)[1])
    if args[0] == "sweep" and "--print_config" not in args:
        dry_run = args if "--dry_run" in args else args + ["--dry_run"]
        code, out, err = sandbox.run(dry_run, env)
        assert code == 0, f"{shown}\n--dry_run: exit status {code}:\n{err}"
        # each cell: "# [i] <cell id>", then "#     robust-lightning <its arguments>"
        cells = [shlex.split(line)[1:] for line in re.findall(r"^# \[\d+\] .*\n#\s+(robust-lightning .*)$", out, re.M)]
        assert cells, f"{shown}\n--dry_run lists no cell:\n{out}"
        for cell in cells:
            cell_shown = f"{shown}\ncell: robust-lightning {shlex.join(cell)}"
            assert cell[0] in TRAINER_COMMANDS, cell_shown
            check_trainer_command(cell_shown, cell, {}, sandbox, written)
            check_paths(cell_shown, cell, sandbox, written, set())
    if args[0] in TOOL_COMMANDS:
        check_paths(shown, command.words, sandbox, written, outputs)


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.where.split()[0]} {c.text[:60]}" for c in COMMANDS])
def test_readme_command(command, sandbox, written):
    shown = f"{command.where}: {command.text}"
    assert not SHELL_OPERATORS & set(command.words), f"{shown}\nshell syntax this test does not follow"
    args = command.robust_lightning_args()
    if args is not None:
        env = {name: sandbox.resolve(value) for name, value in command.env.items()}
        check_robust_lightning(command, args, env, sandbox, written)
        return
    program = command.program[0]
    assert program in OTHER_COMMANDS, (
        f"{shown}\n{program} is neither robust-lightning nor one of the programs this test allows "
        f"({', '.join(OTHER_COMMANDS)})"
    )
    if program == "make":
        for target in command.program[1:]:
            assert make_recipe(target) is not None, f"{shown}\nthe Makefile has no target {target!r}"
    elif program == "source":
        venv = re.search(r"^VENV \?= (\S+)", MAKEFILE.read_text(), re.M).group(1)
        assert Path(command.program[1]).parts[0] == venv, f"{shown}\nthe Makefile's environment is {venv}/"
    elif program == "torchrun":
        words = list(command.program)
        start = next(i for i in range(len(words) - 1) if words[i : i + 2] == ["-m", "robust_lightning"]) + 2
        args = [sandbox.resolve(word) for word in words[start:]]
        check_paths(shown, command.words, sandbox, written, set())
        check_trainer_command(shown, args, {}, sandbox, written)
    elif program in ("bash", "python3"):
        script = Path(command.program[1])
        assert script.parent == Path("benchmarks") and (REPO / script).is_file(), f"{shown}\nno script {script}"
        if program == "python3":
            shown_help = subprocess.run(
                [sys.executable, str(REPO / script), "--help"], capture_output=True, text=True, cwd=REPO
            ).stdout
            for option in (word for word in command.program[2:] if word.startswith("--")):
                assert f"{option} " in shown_help, f"{shown}\n{script} has no option {option}"
    elif program == "sbatch":
        args, env = sbatch_args(command, sandbox)
        check_paths(shown, command.words, sandbox, written, set())
        check_trainer_command(shown, args, env, sandbox, written)


def test_every_placeholder_is_used():
    """The substitution table lists only what the README uses, so it shows what the README's placeholders are."""
    used = {
        p
        for p in PLACEHOLDERS
        for c in COMMANDS
        for w in value_words(c.words)
        if w == p or (p.startswith("/") and w.startswith(p + "/"))
    }
    assert used == PLACEHOLDERS.keys()


def test_commands_are_found_and_only_in_shell_blocks():
    """Every shell block yields commands, and no other block hides one (it would go unchecked)."""
    for document, language, start, lines in code_blocks():
        if language in ("bash", "sh", "shell"):
            assert any(c.where == f"{document}:{n}" for c in COMMANDS for n in range(start, start + len(lines))), (
                f"{document}:{start}: no command found"
            )
        else:
            for number, line in enumerate(lines, start):
                assert not re.match(r"\s*(robust-lightning|make|sbatch|python -m robust_lightning)\s", line), (
                    f"{document}:{number}: a command in a ```{language} block; mark the block ```bash"
                )
