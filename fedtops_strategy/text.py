"""Client text made safe to show: one line, bounded, with every control and format character escaped.

Text from another host (a metric key, an error message) reaches the stream, ``status.json``,
``rounds.jsonl`` and ``client-errors.log``. Shown raw, a newline forges a log line, an ANSI escape
paints it, a bidirectional override (U+202E) reverses what a reader sees, a lone surrogate cannot
be encoded as UTF-8. :func:`escape` writes every such character as a visible escape
(``\\n``, ``\\x1b``, ``\\u202e``), so the text stays readable and stays one line, and cuts it to
``limit`` characters.

Escaped: Unicode categories Cc (controls, C0 and C1: newline, ESC, DEL, ...), Cf (format:
bidirectional overrides and isolates, zero-width joiners, the BOM), Cs (lone surrogates),
Zl and Zp (line and paragraph separators), and the backslash itself (so an escape in the output
always means an escaped character, never one the client typed).
"""

from __future__ import annotations

import unicodedata

ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
ELLIPSIS = "…"


def _escape_char(ch: str) -> str:
    if ch == "\\":
        return "\\\\"
    if unicodedata.category(ch) not in ESCAPED_CATEGORIES:
        return ch
    if ch == "\n":
        return "\\n"
    if ch == "\r":
        return "\\r"
    if ch == "\t":
        return "\\t"
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else (f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")


def escape(text: object, limit: int = 500) -> str:
    """``text`` (``str()`` of anything else) as one printable line of at most ``limit`` characters
    (``limit`` >= 1); a longer one is cut and ends in "…". Never raises on the text; reads at most
    ``limit`` + 1 characters of it."""
    try:
        raw = text if isinstance(text, str) else str(text)
    except Exception:  # noqa: BLE001 - a __str__ that raises is still a value to show
        raw = f"<{type(text).__name__}>"
    limit = max(1, int(limit))
    pieces: list[str] = []
    size = 0
    for ch in raw[: limit + 1]:  # every character escapes to >= 1 character
        piece = _escape_char(ch)
        if size + len(piece) > limit:
            break
        pieces.append(piece)
        size += len(piece)
    else:
        if len(raw) <= limit:
            return "".join(pieces)
    while pieces and size + len(ELLIPSIS) > limit:  # room for the ellipsis
        size -= len(pieces.pop())
    return "".join(pieces) + ELLIPSIS


def is_safe(line: str) -> bool:
    """Whether ``line`` holds no character that :func:`escape` would escape (the backslash aside)."""
    return not any(unicodedata.category(ch) in ESCAPED_CATEGORIES for ch in line)
