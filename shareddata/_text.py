"""Sizes, counts and plurals as the command line prints and parses them."""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_size", "plural"]

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes in ``text``, a number with an optional binary unit (``512MiB``, ``1.5g``).

    Raises:
        ValueError: ``text`` is not a size.

    Example:
        >>> parse_size("512MiB"), parse_size("1.5g"), parse_size("100")
        (536870912, 1610612736, 100)
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not match:
        raise ValueError(f"not a size: {text!r} (try 512MiB or 2GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def format_bytes(nbytes: float) -> str:
    """A size in binary units with one decimal.

    Example:
        >>> format_bytes(512), format_bytes(3 << 20), format_bytes(1.5 * (1 << 30))
        ('512 B', '3.0 MiB', '1.5 GiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


def plural(count: int, noun: str, plural_form: str = "") -> str:
    """``count`` and ``noun``, in the plural unless ``count`` is 1.

    Example:
        >>> plural(1, "column"), plural(3, "column"), plural(2, "process", "processes")
        ('1 column', '3 columns', '2 processes')
    """
    if count == 1:
        return f"{count:,} {noun}"
    return f"{count:,} {plural_form or noun + 's'}"
