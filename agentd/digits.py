"""Decimal numbers written as text, read without ``str.isdigit()`` then ``int()``.

That pair misreads what an operator, an API client or a file may hold: ``isdigit()`` takes
"²", which ``int()`` then refuses (a ValueError where a clear error was meant), and "٣",
which ``int()`` reads as 3; and ``int()`` refuses a string of over 4300 digits.  Imports
nothing: agentd-cni loads it too.
"""

from __future__ import annotations

__all__ = ["ascii_digits", "whole_number"]


def ascii_digits(text: str) -> bool:
    """Whether ``text`` is one or more of the ASCII digits 0-9, and nothing else."""
    return bool(text) and text.isascii() and text.isdigit()


def whole_number(text: str, digits: int, *, zeros: bool = False) -> int | None:
    """``text`` as a number when it is one to ``digits`` ASCII digits 0-9, else None.

    With ``zeros`` the leading zeros do not count toward ``digits`` (Kubernetes reads
    ``"0080"`` as 80, however many zeros lead); without, every digit counts, so the text
    itself stays short enough for any later ``int()`` of it.
    """
    if not ascii_digits(text):
        return None
    if zeros:
        text = text.lstrip("0") or "0"
    return int(text) if len(text) <= digits else None
