"""The tools (shards, export, sweep, report) parse options like the Trainer commands: --config files,
--print_config, --key value, one-message errors with exit status 2; their older spellings keep working."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import robust_lightning
from helpers import REPO
from robust_lightning.argument_parsing import shell_style_values, tool_parser
from robust_lightning.cli import main


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"robust-lightning {robust_lightning.__version__}"
    assert main(["--help"]) == 0
    assert "robust-lightning --version" in capsys.readouterr().out


def test_scale_never_imports_the_command_line():
    """Imports run one way, cli -> scale: the package scale/ hands work back through arguments instead."""
    for path in sorted((REPO / "robust_lightning" / "scale").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n == "robust_lightning.cli" or n.startswith("robust_lightning.cli.") for n in names), (
                f"{path.name} imports robust_lightning.cli"
            )


# per tool: the command, and options to write into a config file
def tool_cases(tmp_path: Path) -> dict[str, tuple[list[str], dict]]:
    return {
        "shards": (
            ["shards"],
            {"src": str(tmp_path / "a"), "out": str(tmp_path / "b"), "samples_per_shard": 7, "shuffle": False},
        ),
        "export": (["export"], {"checkpoint": str(tmp_path / "m.ckpt"), "out": str(tmp_path / "w"), "ema": True}),
        "sweep": (["sweep"], {"name": "demo", "grid": {"data.image_size": [32, 48]}, "dry_run": True}),
        "report": (["report"], {"directory": str(tmp_path), "columns": ["test/*"], "wandb": False}),
        "claim": (["claim"], {"results": str(tmp_path / "results.json"), "model_name": "Me2026Robust"}),
    }


@pytest.mark.parametrize("tool", ["shards", "export", "sweep", "report", "claim"])
def test_print_config_shows_the_options_of_a_config_file(tool, tmp_path, capsys):
    argv, options = tool_cases(tmp_path)[tool]
    config = tmp_path / f"{tool}.yaml"
    config.write_text(yaml.safe_dump(options))
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--config", str(config), "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert {k: printed[k] for k in options} == options
    # a later option overrides the file, as with the Trainer commands
    key, given, expected = next(
        ((k, str(not v).lower(), not v) for k, v in options.items() if isinstance(v, bool)),
        (list(options)[-1], "other", "other"),
    )  # a tool without a flag: its last option
    with pytest.raises(SystemExit):
        main([*argv, "--config", str(config), f"--{key}", given, "--print_config"])
    assert yaml.safe_load(capsys.readouterr().out)[key] == expected


@pytest.mark.parametrize(
    "argv, close",
    [
        (["shards", "a", "b", "--samples_per_shart", "3"], "samples_per_shard"),
        (["shards", "a", "b", "--samples-per-shart", "3"], "samples_per_shard"),
        (["export", "a.ckpt", "b", "--emma"], "ema"),
        (["sweep", "--dry_rn"], "dry_run"),
        (["report", "dir", "--colums", "x"], "columns"),
    ],
)
def test_misspelt_option_is_one_message_and_exit_2(argv, close, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and f"did you mean: {close}?" in err
    assert err.splitlines()[0].startswith(f"robust-lightning {argv[0]}: error: unrecognized arguments: --")


def test_misspelt_option_from_the_shell_prints_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "robust_lightning", "shards", "a", "b", "--no-shufle"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        "robust-lightning shards: error: unrecognized arguments: --no-shufle",
        "did you mean: shuffle?",
        "options: robust-lightning shards --help",
    ]


def test_shards_from_a_config_file(tmp_path, capsys):
    from helpers import WNIDS, make_image_tree

    make_image_tree(tmp_path / "val", {w: 2 for w in WNIDS})
    config = tmp_path / "shards.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "src": str(tmp_path / "val"),
                "out": str(tmp_path / "out"),
                "samples_per_shard": 4,
                "shuffle": False,
                "workers": 1,
            }
        )
    )
    assert main(["shards", "--config", str(config)]) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["num_samples"] == 6 and [s["num_samples"] for s in manifest["shards"]] == [4, 2]


def example(
    samples_per_shard: int = 1,
    shuffle: bool = True,
    wandb: bool | None = None,
    columns: list[str] | None = None,
    name: str | None = None,
) -> int:
    """A tool's options."""
    return 0


@pytest.mark.parametrize(
    "old, new",
    [
        (["--shuffle"], ["--shuffle=true"]),
        (["--shuffle", "false"], ["--shuffle", "false"]),
        (["--wandb", "--shuffle=false"], ["--wandb=true", "--shuffle=false"]),
        (["--samples-per-shard", "4"], ["--samples-per-shard", "4"]),  # no other spelling: the parser reports it
        (["--columns", "a/*", "b", "--name", "x"], ['--columns=["a/*", "b"]', "--name", "x"]),
        (["--columns", "[a, b]"], ["--columns", "[a, b]"]),
        (["--colour", "red", "--", "--no-shuffle"], ["--colour", "red", "--", "--no-shuffle"]),  # left to the parser
    ],
)
def test_bare_flags_and_listed_words_become_jsonargparse_values(old, new):
    parser = tool_parser(example, prog="robust-lightning example", description="")
    assert shell_style_values(old, parser) == new
