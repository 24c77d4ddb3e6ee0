"""Plain-text tables for the command lines (``agentd status``, ``agentd lab status``)."""

from __future__ import annotations


def render_table(headers: list[str], rows: list[list[str]]) -> str:
    """A bordered table, like ``calicoctl node status``: centred headers, left-aligned cells."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    sep = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    lines = [sep, "| " + " | ".join(h.center(w) for h, w in zip(headers, widths)) + " |", sep]
    for r in rows:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    lines.append(sep)
    return "\n".join(lines)
