"""Argument types for the CLI's tools: each option is checked as it is
parsed, so a bad value is one line naming the option (argparse's own
``error: argument --requests: must be at least 1, got 0``), not a traceback
from deep in the run or a run that quietly does nothing."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def at_least(low: int) -> Callable[[str], int]:
    """An int option of ``low`` or more."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its messages
    return parse


def seconds(*, positive: bool) -> Callable[[str], float]:
    """A float option of a finite amount (above zero where ``positive``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not (value > 0 if positive else value >= 0) or value == float("inf"):  # NaN fails both
            raise argparse.ArgumentTypeError(f"must be a finite number {'above' if positive else 'of at least'} 0, got {text}")
        return value

    parse.__name__ = "float"
    return parse


POSITIVE, COUNT = at_least(1), at_least(0)
