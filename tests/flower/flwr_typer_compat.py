"""Run Flower's ``flwr`` command line, teaching typer < 0.19 the ``Literal`` parameters flwr 1.42 uses.

flwr 1.42 declares ``typer>=0.13`` but annotates options with ``typing.Literal`` (``--format``), which typer
supports only from 0.19; with the typer 0.15.4 that amqtt 0.11.4 pins, the ``flwr`` script dies at import
("Type not yet supported: typing.Literal['default', 'json']"). This wrapper maps a ``Literal`` annotation
to ``click.Choice`` (what typer 0.19 does) and then runs ``flwr.cli.app:app`` exactly as the ``flwr`` script
would. With typer >= 0.19 it patches nothing.

Usage: ``python flwr_typer_compat.py <flwr arguments>``.
"""

from __future__ import annotations

import sys
import typing
from typing import Any

import click
import typer.main


def _teach_typer_literals() -> None:
    original = typer.main.get_click_type

    def get_click_type(*, annotation: Any, parameter_info: Any) -> click.ParamType:
        if typing.get_origin(annotation) is typing.Literal:
            choices = [str(value) for value in typing.get_args(annotation)]
            return click.Choice(choices, case_sensitive=parameter_info.case_sensitive)
        return original(annotation=annotation, parameter_info=parameter_info)

    typer.main.get_click_type = get_click_type


def typer_knows_literals() -> bool:
    try:
        typer.main.get_click_type(annotation=typing.Literal["a"], parameter_info=typer.models.OptionInfo())
    except RuntimeError:
        return False
    return True


if __name__ == "__main__":
    if not typer_knows_literals():
        _teach_typer_literals()
    from flwr.cli.app import app

    sys.exit(app())
