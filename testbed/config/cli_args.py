"""Argument actions every subcommand shares, so that a flag means the same thing everywhere."""

from __future__ import annotations

import argparse
from typing import Any, Sequence


class StoreOnce(argparse.Action):
    """A single-valued flag given twice is an error (exit 2), not the last one silently winning:
    `replay --scenario a --scenario b` used to run only b."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        seen = f"_{self.dest}_given"
        if getattr(namespace, seen, False):
            parser.error(f"{option_string or self.dest} given more than once (this command takes one)")
        setattr(namespace, seen, True)
        setattr(namespace, self.dest, values)
