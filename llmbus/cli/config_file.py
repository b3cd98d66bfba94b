"""vLLM's `--config FILE.yaml`: a command's flags written as a YAML mapping, each key a
flag's long name (`max-model-len: 4096`, or `max_model_len`), `model` included. The file's
flags come first, so the command line still wins: `llmbus serve --config prod.yaml --port
9000`. A key that is no flag of the command is refused by name, as the flag would be.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def expand_config(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` with `--config FILE` (or `--config=FILE`) replaced by the flags FILE holds,
    placed right after the command's name."""
    at = next((i for i, arg in enumerate(argv) if arg == "--config" or arg.startswith("--config=")), None)
    if at is None:
        return argv
    if argv[at] == "--config":
        if at + 1 >= len(argv):
            parser.error("--config needs a file")
        path, rest = argv[at + 1], argv[:at] + argv[at + 2:]
    else:
        path, rest = argv[at].split("=", 1)[1], argv[:at] + argv[at + 1:]
    command = _command_parser(parser, rest)
    if command is None:
        parser.error("--config goes after a command: llmbus serve --config FILE")
    flags = _flags(command, _read(parser, path))
    first = rest.index(command.prog.split()[-1])  # the command's name: its own flags follow it
    return rest[: first + 1] + flags + rest[first + 1:]


def _read(parser: argparse.ArgumentParser, path: str) -> dict:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        parser.error(f"--config {path}: {exc.strerror or exc}")
    except yaml.YAMLError as exc:
        parser.error(f"--config {path} is not YAML: {exc}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        parser.error(f"--config {path} must map flag names to values")
    return data


def _command_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser | None:
    """The (sub)command's parser argv names: `serve`, `worker`, ..."""
    subparsers = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if subparsers is None:
        return None
    for arg in argv:
        if arg in subparsers.choices:
            return subparsers.choices[arg]
    return None


def _flags(command: argparse.ArgumentParser, data: dict) -> list[str]:
    """The mapping as the command line that says it: a switch given when true (its `--no-`
    form, where it has one, when false), a list as one flag's values or a repeated flag,
    as the flag takes them."""
    out: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = command._option_string_actions.get(flag)
        if action is None or flag == "--config":
            command.error(f"--config: {key!r} is not a flag of {command.prog}")
        if value is None:
            continue
        if isinstance(value, bool):
            if action.nargs == 0:  # a switch
                negative = "--no-" + flag[2:]
                if value:
                    out.append(flag)
                elif negative in command._option_string_actions:
                    out.append(negative)
                continue
            value = str(value).lower()
        if isinstance(value, dict):
            import json

            value = json.dumps(value)  # (a JSON flag: --speculative-config, --override-generation-config)
        if isinstance(value, list):
            if isinstance(action, argparse._AppendAction):
                for item in value:
                    out += [flag, str(item)]
            else:
                out += [flag, *map(str, value)]
            continue
        out += [flag, str(value)]
    return out
