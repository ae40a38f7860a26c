"""Errors memfit raises on purpose, each with the exit code the command line uses.

A `UsageError` is the user's to fix (bad flag, missing file): the CLI prints its
message as one line and exits with 2, without a traceback. A `DoesNotFitError` says
that the requested run cannot fit in the memory available, even after every
recovery memfit knows: exit code 3.
"""

from __future__ import annotations


class MemfitError(Exception):
    """Base class of the errors the CLI turns into a one-line message."""

    exit_code = 1


class UsageError(MemfitError):
    """Bad input: a flag, a file, a value. The message says what to do instead."""

    exit_code = 2


class DoesNotFitError(MemfitError):
    """The run does not fit in the memory available, even after recovery."""

    exit_code = 3
