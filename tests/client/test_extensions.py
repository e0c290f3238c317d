"""Commands and recipe checks come from entry points: present, absent, or broken."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import click
import pytest
from click.testing import CliRunner

from maec_client import Client, ClientConfig, ValidationFailed, extensions
from maec_client.cli import main
from tests.client.conftest import BASE


@click.command()
def hello() -> None:
    """Say hello."""
    click.echo("hello")


class Invalid(Exception):
    code = "invalid_recipe"
    message = "no good"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.details = {"key": "merge_method"}


def refuse(recipe: dict[str, object]) -> None:
    raise Invalid("no good")


def crash(recipe: dict[str, object]) -> None:
    raise RuntimeError("bug")


def points(group: str, **targets: str) -> list[EntryPoint]:
    return [EntryPoint(name, value, group) for name, value in targets.items()]


def listed(help_text: str) -> list[str]:
    lines = help_text.split("Commands:\n", 1)[1].splitlines()
    return [ln.split()[0] for ln in lines if ln.startswith("  ")]


@pytest.fixture
def installed(monkeypatch):
    """Replace what importlib.metadata reports for the client's groups."""
    groups: dict[str, list[EntryPoint]] = {}
    monkeypatch.setattr(extensions, "entry_points",
                        lambda group: groups.get(group, []))
    extensions.recipe_checks.cache_clear()
    yield groups
    extensions.recipe_checks.cache_clear()


def test_client_alone_has_jobs_only_and_leaves_recipes_to_the_service(installed, fake):
    res = CliRunner().invoke(main, ["--help"])
    assert res.exit_code == 0 and listed(res.stdout) == ["jobs"]
    assert CliRunner().invoke(main, ["merge", "--help"]).exit_code == 2  # no such command
    with Client(config=ClientConfig(url=BASE, api_key="k1"), transport=fake.transport()) as c:
        job = c.submit({"merge_method": "ties", "models": [{"model": "s3://a"}]})
    assert job.status == "queued"  # no local check: the service is the judge


def test_registered_commands_and_checks_are_used(installed, fake):
    here = __name__
    installed[extensions.COMMANDS] = points(extensions.COMMANDS, hello=f"{here}:hello",
                                            jobs=f"{here}:hello")
    installed[extensions.RECIPE_CHECKS] = points(extensions.RECIPE_CHECKS,
                                                 strict=f"{here}:refuse")
    res = CliRunner().invoke(main, ["hello"])
    assert res.exit_code == 0 and res.stdout == "hello\n"
    assert listed(CliRunner().invoke(main, ["--help"]).stdout) == ["hello", "jobs"]
    assert "Submit, watch" in CliRunner().invoke(main, ["jobs", "--help"]).stdout
    with Client(config=ClientConfig(url=BASE, api_key="k1"), transport=fake.transport()) as c:
        with pytest.raises(ValidationFailed) as info:
            c.submit({"merge_method": "linear", "models": []})
        assert (info.value.code, info.value.details) == ("invalid_recipe",
                                                         {"key": "merge_method"})
        c.submit({"merge_method": "linear", "models": []}, validate=False)
    assert len(fake.requests) == 1


def test_a_broken_plugin_does_not_break_the_rest(installed):
    installed[extensions.COMMANDS] = points(extensions.COMMANDS,
                                            gone="no_such_module_here:cmd",
                                            notcmd=f"{__name__}:refuse")
    res = CliRunner().invoke(main, ["--help"])
    assert res.exit_code == 0 and listed(res.stdout) == ["jobs"]
    assert "cannot be loaded" in res.stderr
    assert CliRunner().invoke(main, ["jobs", "--help"]).exit_code == 0
    assert "not a click command" in CliRunner().invoke(main, ["notcmd"]).stderr
    installed[extensions.RECIPE_CHECKS] = points(extensions.RECIPE_CHECKS,
                                                 bug=f"{__name__}:crash")
    with pytest.raises(RuntimeError, match="bug"):  # a bug is not a verdict on the recipe
        extensions.check_recipe({"merge_method": "linear"})
