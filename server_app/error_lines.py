"""A client's error as one line: the root cause's own ``Type: message`` line.

A ClientApp that raises reaches the ServerApp as an error reply whose ``reason`` is whatever the
runtime made of the exception. In Flower 1.41's simulation that is the whole Ray task error:
``<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'ray::ClientAppActor.run() (pid=…)``,
the original exception's traceback, ``The above exception was the direct cause of the following
exception:``, Flower's ``ClientAppException`` wrapping its message, all of it in one string
(``flwr/server/superlink/fleet/vce/vce_api.py``); on a SuperNode it is ``<class 'ValueError'>:<'…'>``
(``flwr/supernode/runtime/run_clientapp.py``). :func:`root_cause` keeps the line that says what
happened, e.g. vLLM's ``ValueError: User-specified max_model_len (2176) is greater than …``; the
run folder keeps the full text (``client-errors.log``, :meth:`server_app.run_folder.RunFolder.log_client_error`).

The text comes from other hosts: any string, possibly empty or huge. Nothing here raises on it,
only its first :data:`HEAD` characters are read, and the result is one safe line of at most
:data:`MAX_CHARS` characters that is a fixed point (``root_cause(root_cause(t)) == root_cause(t)``).

Safe: colour codes and C0 control characters are removed (Ray paints its headers), and every other
character that :func:`fedtops_strategy.text.escape` escapes (C1 controls, format characters such
as U+202E, lone surrogates, line and paragraph separators) is written as ``escape`` writes it
(``\\x85``, ``\\u202e``). The backslash is the one exception: it stays as the client typed it.
The line passes through :func:`root_cause` again downstream (the grid leaves it in the reply, the
strategies and the log line take the root cause of that), so it must be a fixed point, and a fixed
point cannot escape the backslash: escaping doubles it on every pass, and were ``\\`` written
``\\\\`` once only, ``\\\\`` (typed) would have to stay ``\\\\``, so the line could not tell a typed
backslash from an escaped one either way. The line is a summary; ``client-errors.log`` keeps the
client's full text, escaped once, every backslash doubled.
"""

from __future__ import annotations

import re
import unicodedata

from fedtops_strategy.text import ESCAPED_CATEGORIES, escape

MAX_CHARS = 500  # the longest line kept; longer ones end in "…"
WINDOW = 1 << 16  # characters split into lines around the place searched for (the rest: string searches only)
HEAD = 1 << 22  # characters of a text read at all (a traceback's first section longer than that: its cut end is read)
KEPT_CHARS = 1 << 16  # characters of a client's error text handed on whole to ``client-errors.log`` (:class:`ClientText`)

CHAINS = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)
FRAME = '  File "'  # a traceback frame's first line
TRACEBACK = "Traceback (most recent call last)"
CLIENT_APP_EXCEPTION = "Exception ClientAppException occurred. Message: "  # flwr.clientapp.client_app.ClientAppException
ERROR_REPLY = "error reply: "  # how the strategies' excluded entries quote an error reply

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")  # colours: Ray paints its 'ray::…' headers
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # other control characters (newline and tab stay)
_WRAPPER = re.compile(r"<class '([^'\n]{1,300})'>:<'")  # Flower: str(type(ex)) + ":<'" + str(ex) + "'>"
_DUAL = re.compile(r"RayTaskError\(([\w.]{1,200})\)$")  # Ray's class deriving from the cause's
_EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(: |:$|$)")  # 'ValueError: …', 'pkg.mod.Error: …', 'KeyboardInterrupt'
_RAY_HEADER = re.compile(r"^ray::[\w.]+\(\) \(pid=", re.MULTILINE)  # Ray writes it where Python wrote 'Traceback (most recent call last):'


def root_cause(text) -> str:
    """The root cause's own line of an error as Flower and Ray deliver it (see the module docstring).

    A traceback (or a chain of them, oldest first as Python prints it): the first one's exception
    line, with the message's continuation lines up to the next blank line joined into it. Flower's
    ``<class 'T'>:<'message'>``: ``T: message``. ``ClientAppException``'s wrapping of a message:
    the message. A message that is already one line: unchanged (at most :data:`MAX_CHARS`
    characters, colour codes and control characters removed). A message of several lines and no
    traceback: its lines up to the first blank one, joined. A traceback whose exception line
    cannot be told: its last line with a letter or digit in it.
    """
    try:
        if text is not None and not isinstance(text, str):
            text = str(text)
        line = _bounded(_root_cause(text if text is None or len(text) <= HEAD else text[:HEAD]))
        # A line that itself parses as something (e.g. Flower's wrapper quoted inside a message)
        # is parsed again; each step shortens it, so this ends, and quickly: it is one short line.
        for _ in range(MAX_CHARS):
            again = _bounded(_root_cause(line))
            if again == line:
                break
            line = again
        return line
    except Exception:  # noqa: BLE001 - input from another host must never stop the run
        try:
            return _bounded(_last_line(_clean(str(text)[:HEAD][-WINDOW:]).split("\n")))
        except Exception:  # noqa: BLE001
            return ""


class ClientText(str):
    """The first :data:`KEPT_CHARS` characters of a client's error text, with ``length``: how long
    the whole text was, and ``line``: its :func:`root_cause` (of the whole text, which the piece's
    own root cause need not be). What :class:`server_app.grid.PromptGrid` hands to ``on_error``."""

    length: int
    line: str

    def __new__(cls, text: str, line: str | None = None) -> ClientText:
        piece = super().__new__(cls, text[:KEPT_CHARS])
        piece.length = len(text)
        piece.line = root_cause(text) if line is None else line
        return piece


def reason_line(reason) -> str:
    """An ``excluded`` reason with an error reply's text cut to its root cause's line:
    ``score: error reply: <Ray's traceback>`` -> ``score: error reply: ValueError: …``."""
    try:
        reason = "" if reason is None else str(reason)
        head, sep, tail = reason.partition(ERROR_REPLY)
        if not sep:
            return root_cause(reason)
        return _bounded(head + ERROR_REPLY + root_cause(tail))
    except Exception:  # noqa: BLE001
        return root_cause(reason)


def _clean(text: str) -> str:
    text = _ANSI.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))
    return _CONTROL.sub("", text).replace("\t", " ")


def _bounded(line: str) -> str:
    """``line`` as one safe line of at most :data:`MAX_CHARS` characters: its line breaks joined,
    each character that :func:`escape` escapes, the backslash aside, written as ``escape`` writes
    it; a longer line is cut between two characters' pieces and ends in "…"."""
    line = " ".join(line.split("\n")).strip()
    pieces, size = [], 0
    for ch in line:
        piece = escape(ch) if ch != "\\" and unicodedata.category(ch) in ESCAPED_CATEGORIES else ch
        if size + len(piece) > MAX_CHARS:
            break
        pieces.append(piece)
        size += len(piece)
    else:
        return "".join(pieces)
    while pieces and size + 1 > MAX_CHARS:  # room for the ellipsis
        size -= len(pieces.pop())
    return "".join(pieces).rstrip() + "…"


def _root_cause(text) -> str:
    if text is None:
        return ""
    type_name, body = _unwrap_flower(text if isinstance(text, str) else str(text))
    section = _clean(_first_section(body))
    line = _exception_line(section)
    if line is None:
        lines = section[:WINDOW].split("\n")
        start = next((i for i, l in enumerate(lines) if l.strip()), None)
        message = "" if start is None else _paragraph(lines, start)
        line = f"{type_name}: {message}" if type_name and message else (type_name or message)
    return _unwrap_client_app_exception(line)


def _unwrap_flower(text: str) -> tuple[str | None, str]:
    """(the exception's class name, its text) of Flower's ``<class 'T'>:<'text'>``; (None, text)
    for anything else."""
    stripped = text.lstrip()
    match = _WRAPPER.match(stripped)
    if match is None:
        return None, text
    name = match.group(1)
    dual = _DUAL.search(name)
    name = dual.group(1) if dual else name
    name = name.removeprefix("__main__.").removeprefix("builtins.")
    body = stripped[match.end() :].rstrip()
    return name, body[:-2] if body.endswith("'>") else body


def _first_section(body: str) -> str:
    """The text before the first 'The above exception …' / 'During handling …' line: the root
    cause's traceback (Python prints a chain oldest first)."""
    cut = len(body)
    for chain in CHAINS:
        i = 0 if body.startswith(chain) else body.find("\n" + chain)
        if 0 <= i < cut:
            cut = i
    return body[:cut]


def _exception_line(section: str) -> str | None:
    """The exception line of one traceback, with its continuation lines; None if ``section`` is no
    traceback. Only windows of the text are split into lines: a huge text costs string searches."""
    i = section.rfind("\n" + FRAME)
    start = i + 1 if i >= 0 else (0 if section.startswith(FRAME) else -1)
    if start >= 0:
        # after the last frame: its code and caret lines (indented), then the exception at column 0
        lines = section[start : start + WINDOW].split("\n")
        j = 1
        while j < len(lines) and (not lines[j].strip() or lines[j][0] == " "):
            j += 1
        return _paragraph(lines, j) if j < len(lines) else _last_line(lines)
    if section.startswith(TRACEBACK) or "\n" + TRACEBACK in section or ("ray::" in section and _RAY_HEADER.search(section)):
        # a traceback whose frames were cut: its last exception-like line
        lines = section[-WINDOW:].split("\n")
        candidates = [i for i, l in enumerate(lines) if not _is_header(l) and _EXCEPTION_LINE.match(l)]
        return _paragraph(lines, candidates[-1]) if candidates else _last_line(lines)
    return None


def _is_header(line: str) -> bool:
    return line.startswith(TRACEBACK) or _RAY_HEADER.match(line) is not None


def _paragraph(lines: list[str], start: int) -> str:
    """``lines[start]`` and the lines after it up to a blank line, a frame or a chain line, joined
    into one line (long messages are cut later: only as much as can be kept is read)."""
    out, size = [lines[start].rstrip()], len(lines[start])
    for line in lines[start + 1 :]:
        if not line.strip() or line.startswith(FRAME) or line.strip() in CHAINS or size > MAX_CHARS:
            break
        out.append(line.strip())
        size += len(line)
    return " ".join(p for p in out if p)


def _last_line(lines: list[str]) -> str:
    """The last line with a letter or digit in it (not a row of carets or dashes)."""
    return next((l.strip() for l in reversed(lines) if any(c.isalnum() for c in l)), "")


def _unwrap_client_app_exception(line: str) -> str:
    """The message inside Flower's ``ClientAppException`` (``…ClientAppException: Exception
    ClientAppException occurred. Message: <the original message>``)."""
    _, sep, message = line.rpartition(CLIENT_APP_EXCEPTION)
    return message.strip() if sep and message.strip() else line
