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


class CheckpointWriteError(MemfitError):
    """A checkpoint could not be written (the disk is full, a file-size limit): the previous one is intact."""

    exit_code = 74  # EX_IOERR of sysexits.h


class PreemptedError(MemfitError):
    """The run was asked to stop (SIGTERM, SIGUSR1, ...) and saved a checkpoint: resume it with --resume auto."""

    exit_code = 75  # EX_TEMPFAIL of sysexits.h: "try again later", what a requeue wants to see
