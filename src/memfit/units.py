"""Byte sizes: parsing what users type and printing what memfit measured.

GiB means 1024**3 everywhere; GB means 1000**3. Every printed size names its unit.
"""

from __future__ import annotations

import re

from memfit.errors import UsageError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    # A bare "k", "m", "g" is read the way GPU vendors and nvidia-smi print it: binary.
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
}

_SIZE_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")

GIB = 1024**3
MIB = 1024**2


def parse_size(text: str | int | float, what: str = "size") -> int:
    """Return the number of bytes in `text` ("16GiB", "24GB", "512MiB", "1048576").

    Raises:
        UsageError: the text is not a size; the message names `what` and shows examples.
    """
    if isinstance(text, bool):
        raise UsageError(f"{what}: expected a size such as 16GiB, 24GB or 512MiB, got {text!r}")
    if isinstance(text, (int, float)):
        if text <= 0:
            raise UsageError(f"{what}: a size must be positive, got {text}")
        return int(text)
    match = _SIZE_PATTERN.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise UsageError(
            f"{what}: {text!r} is not a size; write it like 16GiB, 24GB, 512MiB or a number of bytes"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise UsageError(f"{what}: a size must be positive, got {text!r}")
    return int(value)


def format_bytes(num_bytes: float, unit: str = "auto") -> str:
    """Format bytes as '1.23 GiB' (binary units), choosing the unit unless given."""
    if unit == "auto":
        magnitude = abs(num_bytes)
        unit = "GiB" if magnitude >= GIB else "MiB" if magnitude >= MIB else "KiB" if magnitude >= 1024 else "B"
    scale = {"B": 1, "KiB": 1024, "MiB": MIB, "GiB": GIB}[unit]
    if unit == "B":
        return f"{int(num_bytes)} B"
    return f"{num_bytes / scale:.2f} {unit}"
