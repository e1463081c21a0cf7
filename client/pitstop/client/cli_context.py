"""What every CLI command shares: the global options, the client they open, output helpers."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import grpc
import typer
from google.protobuf.descriptor import EnumDescriptor
from rich.console import Console

from pitstop.client.client import PitstopClient
from pitstop.client.enums import enum_words, lookup_enum_word


@dataclass(frozen=True)
class Settings:
    """The global options: where the scheduler is and how to talk to it."""

    server: str
    token: str | None
    timeout: float
    ca_cert: Path | None = None

    def client(self) -> PitstopClient:
        """A client for the configured scheduler (TLS when a CA certificate is given)."""
        credentials = None
        if self.ca_cert is not None:
            credentials = grpc.ssl_channel_credentials(root_certificates=self.ca_cert.read_bytes())
        return PitstopClient(self.server, self.token, self.timeout, credentials=credentials)


def settings(ctx: typer.Context) -> Settings:
    """The global options the root callback stored on the context."""
    obj = ctx.find_root().obj
    if not isinstance(obj, Settings):
        raise RuntimeError("the pitstop root callback did not run")
    return obj


def open_client(ctx: typer.Context) -> PitstopClient:
    """A client from the global options; use it in a ``with`` block."""
    return settings(ctx).client()


def console() -> Console:
    """A console on the current stdout (looked up per call so test runners can capture it)."""
    return Console(highlight=False)


def print_json(value: Any) -> None:
    """Pretty JSON for a single answer or a list of them."""
    typer.echo(json.dumps(value, indent=2, ensure_ascii=False))


def print_json_line(value: Any) -> None:
    """One compact JSON object per line, for streams."""
    typer.echo(json.dumps(value, ensure_ascii=False), nl=True)


def parse_words(enum: EnumDescriptor, words: Sequence[str] | None, option: str) -> list[int]:
    """Lowercase enum words from an option into numbers, or a usage error naming the choices."""
    numbers: list[int] = []
    for word in words or ():
        number = lookup_enum_word(enum, word)
        if number is None:
            raise typer.BadParameter(
                f"{word!r} is not one of: {', '.join(enum_words(enum))}", param_hint=option
            )
        numbers.append(number)
    return numbers


JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]
ReasonOption = Annotated[str, typer.Option("--reason", help="Why; recorded in the event log.")]
