"""docs/deploy.md: every command it shows is one that exists, with options that command takes."""

from __future__ import annotations

import os
import re
import shlex
import subprocess

import pytest
import typer.main
import yaml
from typer.core import TyperGroup

from reference import REPO as PROJECT_ROOT
from streams.cli import app

PAGE = (PROJECT_ROOT / "docs" / "deploy.md").read_text()
COMPOSE = yaml.safe_load((PROJECT_ROOT / "docker-compose.yml").read_text())
MAKE_TARGETS = set(re.findall(r"^([a-z][a-z-]*):", (PROJECT_ROOT / "Makefile").read_text(), re.MULTILINE))


def _commands() -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", PAGE, re.DOTALL)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    inline = re.findall(r"`((?:tangram|make|docker compose|helm) [^`]+)`", PAGE)
    return sorted({c for c in [*lines, *inline] if c})


def _tangram(words: list[str]) -> None:
    command = typer.main.get_command(app)
    rest = list(words)
    while isinstance(command, TyperGroup) and rest and rest[0] in command.commands:
        command = command.commands[rest.pop(0)]
    assert not isinstance(command, TyperGroup), f"`tangram {' '.join(words)}`: no such command"
    options = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
    for word in rest:
        if word.startswith("--"):
            assert word.split("=")[0] in options, f"`tangram {' '.join(words)}`: {word} is not an option of it"


@pytest.mark.parametrize("line", _commands())
def test_every_command_on_the_deploy_page_exists(line):
    words = shlex.split(line.replace("…", "APP").replace("$(openssl rand -hex 16)", "x"))
    if words[0] == "tangram":
        _tangram(words[1:])
    elif words[0] == "make":
        assert set(words[1:]) <= MAKE_TARGETS
    elif words[:2] == ["docker", "compose"]:
        for flag, value in zip(words, words[1:]):
            if flag == "-f":
                assert (PROJECT_ROOT / value).is_file()
            if flag == "--profile":
                assert any(value in s.get("profiles", []) for s in COMPOSE["services"].values())
            if flag == "--scale":
                assert value.split("=")[0] in COMPOSE["services"]
    elif words[0] == "helm":
        done = subprocess.run([os.environ.get("TANGRAM_HELM", "helm"), words[1], "--help"], capture_output=True,
                              timeout=60)
        assert done.returncode == 0, f"helm has no command {words[1]!r}"


def test_the_page_shows_the_commands_it_is_about():
    commands = _commands()
    for expected in ("tangram deploy k8s", "tangram plan", "tangram apply", "helm upgrade", "docker compose up"):
        assert any(c.startswith(expected) for c in commands), expected
