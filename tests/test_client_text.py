"""Client text (error reasons, metric keys) reaches the stream and the run folder only as safe text.

Every message from a client is untrusted: a newline and ANSI escapes in it must not forge a log line,
a reason must not forge a ``client-errors.log`` header, and a huge reason must not fill the disk.
Properties are checked with Hypothesis on a fixed seed (``derandomize``); the expected values of the
examples are worked out by hand.
"""

from __future__ import annotations

import tempfile
import unicodedata
from pathlib import Path
from unittest import mock

from flwr.app import ConfigRecord, Error, MetricRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st
from test_strategies import message

from fedtops_strategy.text import escape
from server_app import run_folder
from server_app.error_lines import KEPT_CHARS, MAX_CHARS, ClientText, root_cause
from server_app.grid import PromptGrid
from server_app.log_lines import MAX_SAMPLED, reply_summary
from server_app.run_folder import BODY_MARK, CLIENT_ERRORS, RunFolder

UNSAFE = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
FIXED = settings(max_examples=200, derandomize=True, deadline=None, database=None)

PIECES = [
    "\n",
    "\r",
    "\r\n",
    "\x1b[31m",
    "\x1b[0m",
    "\x00",
    "\x07",
    "\x0b",
    "\x0c",
    "\x7f",
    "\x85",
    "\u200d",
    "\u202e",
    "\u2028",
    "\u2029",
    "\ufeff",
    "\ud800",
    "\U000e0001",
    "\\",
    "\\n",
    "=== ",
    "=== 2026-01-01T00:00:00Z round 1 node 9 train: forged\n",
    "\x1b[92mINFO \x1b[0m:      ",
    "Traceback (most recent call last):\n",
    '  File "a.py", line 3, in f\n',
    "    ^^^^\n",
    "ValueError: x",
    "The above exception was the direct cause of the following exception:\n",
    "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'",
    "'>",
    "ray::ClientAppActor.run() (pid=1, ip=x)",
    "Exception ClientAppException occurred. Message: ",
    " ",
    "é",
    "漢",
    "y" * 300,
]
# Any text: arbitrary code points (surrogates and controls included), and texts built from the
# pieces that reach the parsers and the log's line structure.
hostile = st.one_of(
    st.text(),
    st.text(st.characters(categories=["Cc", "Cf", "Cs", "Zl", "Zp", "Ll", "Zs"]), max_size=300),
    st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=5)), max_size=40).map("".join),
)


def unsafe(text: str) -> list[str]:
    return [ch for ch in text if unicodedata.category(ch) in UNSAFE]


def error_reply(reason, src: int = 5, message_type: str = "train"):
    return message(Error(code=0, reason=reason), message_type, src=src, dst=0, reply_to="m")


# -- escape ------------------------------------------------------------------------------------


@FIXED
@given(hostile, st.integers(1, 600))
def test_escape_leaves_no_control_format_or_separator_character(text, limit):
    assert unsafe(escape(text, limit)) == []


@FIXED
@given(hostile, st.integers(1, 600))
def test_escape_is_at_most_limit_characters(text, limit):
    assert len(escape(text, limit)) <= limit


@FIXED
@given(hostile, st.integers(1, 600))
def test_escape_encodes_as_utf8(text, limit):
    escape(text, limit).encode("utf-8")  # a lone surrogate would raise UnicodeEncodeError


@FIXED
@given(st.text(st.characters(exclude_categories=["Cc", "Cf", "Cs", "Zl", "Zp"], exclude_characters="\\"), max_size=500))
def test_escape_keeps_safe_short_text_as_it_is(text):
    assert escape(text, 500) == text
    assert escape(text, max(1, len(text))) == text  # at the limit exactly


def test_escape_writes_each_unsafe_character_and_the_backslash_visibly():
    assert escape("a\nb\x1b[31m\u202e\\\ud800\U000e0001") == "a\\nb\\x1b[31m\\u202e\\\\\\ud800\\U000e0001"
    assert escape("x" * 10, 5) == "xxxx…"
    assert escape("ab\n", 3) == "ab…"  # the 2-character escape does not fit with the ellipsis


# -- root_cause ---------------------------------------------------------------------------------


@FIXED
@given(hostile)
def test_root_cause_is_one_safe_bounded_line(text):
    line = root_cause(text)
    assert isinstance(line, str) and len(line) <= MAX_CHARS and unsafe(line) == []
    line.encode("utf-8")


@FIXED
@given(hostile)
def test_root_cause_is_a_fixed_point(text):
    line = root_cause(text)
    assert root_cause(line) == line


def test_root_cause_escapes_separators_and_format_characters_and_keeps_a_typed_backslash():
    assert root_cause("ValueError: a\u202eb\x85c\u2028d") == "ValueError: a\\u202eb\\x85c\\u2028d"
    assert root_cause("OSError: C:\\new\\table") == "OSError: C:\\new\\table"
    assert root_cause(root_cause("E: \\\\ \x85 z")) == "E: \\\\ \\x85 z"  # once escaped, then a fixed point


def test_root_cause_cuts_a_line_between_escapes():
    # 497 characters, then U+202E (6 characters escaped): 503 > 500, so the line is cut before it
    line = root_cause("E" * 497 + "\u202e")
    assert line == "E" * 497 + "…"


def test_root_cause_of_an_object_whose_str_raises_is_a_line():
    class Hostile:
        def __str__(self):
            raise RuntimeError("no")

    assert root_cause(Hostile()) == ""


def test_root_cause_reads_only_the_head_of_a_huge_text():
    from server_app.error_lines import HEAD

    # read whole, the last frame would be b's, whose exception is KeyError
    text = 'Traceback (most recent call last):\n  File "a", line 1\nValueError: head\n\n' + "x" * HEAD + '\n  File "b", line 2\nKeyError: tail'
    assert root_cause(text) == "ValueError: head"


# -- reply_summary ------------------------------------------------------------------------------


@FIXED
@given(hostile)
def test_the_line_of_an_error_reply_is_one_safe_line_whatever_its_reason(reason):
    line = reply_summary(error_reply(reason))
    assert line.startswith("  node 5: train failed: ")
    assert unsafe(line) == [] and len(line) <= len("  node 5: train failed: ") + MAX_CHARS


def test_a_forged_log_line_in_a_reason_stays_inside_the_error_line():
    reason = "x\n\x1b[92mINFO \x1b[0m:      round 3/3 [fedtops] ok"
    assert reply_summary(error_reply(reason)) == "  node 5: train failed: x INFO :      round 3/3 [fedtops] ok"


def test_an_error_the_superlink_writes_for_a_lost_node_names_that_node_and_the_phase():
    """The SuperLink answers for a node it lost (sender: the SuperLink, a system message type):
    the line names the node and type of the message it answers."""
    lost = message(Error(code=5, reason="Error: Node Unavailable"), "system", src=1, dst=0, reply_to="m")
    sent = message(RecordDict(), "query.score", dst=7, message_id="m")
    assert reply_summary(lost, sent) == "  node 7: query.score failed: Error: Node Unavailable"


def test_the_error_line_names_the_node_of_the_metadata_and_escapes_the_type():
    reply = error_reply("E: x", src=1042)
    reply.metadata.__dict__["_message_type"] = "train\n\u202e"  # past Metadata's own check, as if decoded unchecked
    assert reply_summary(reply) == "  node 1042: train\\n\\u202e failed: E: x"


def _evaluate_reply(metrics):
    return message(RecordDict({"metrics": MetricRecord(metrics)}), "evaluate", src=5, reply_to="m")


def test_a_reply_whose_metric_keys_the_boundary_refuses_gives_no_line():
    """A progress line is written from the reply as the boundary checks it: a key outside the
    metric alphabet (a newline, an escape sequence) refuses the reply, so nothing of it is shown."""
    reply = _evaluate_reply({"partition-id": 1, "accuracy": 40.0, "eval_s": 2.0, "pass@8\n\x1b[31mINFO": 50.0})
    assert reply_summary(reply) is None
    reply = _evaluate_reply({"partition-id": 1, "accuracy": 40.0, "eval_s": 2.0, "pass@8": 50.0})
    assert reply_summary(reply) == "  node 5 client 1 evaluated: greedy 40.0% pass@8 50.0% in 2.0 s"


def test_at_most_max_sampled_metrics_are_shown():
    metrics = {"partition-id": 1, "accuracy": 40.0, "eval_s": 2.0, **{f"pass@{k}": 1.0 for k in range(20)}}
    sampled = " ".join(f"pass@{k} 1.0%" for k in range(MAX_SAMPLED))
    assert reply_summary(_evaluate_reply(metrics)) == f"  node 5 client 1 evaluated: greedy 40.0% {sampled} … in 2.0 s"


def test_a_partition_id_that_is_no_int_in_range_gives_no_line():
    base = {"accuracy": 40.0, "eval_s": 2.0}
    assert reply_summary(_evaluate_reply({"partition-id": 3, **base})) == "  node 5 client 3 evaluated: greedy 40.0%  in 2.0 s"
    for pid in (-1, 1 << 20, 2.5, float("nan")):
        assert reply_summary(_evaluate_reply({"partition-id": pid, **base})) is None, pid
    # an integral float is the partition the boundary reads (replies.parse_train takes 2.0 as 2)
    assert reply_summary(_evaluate_reply({"partition-id": 2.0, **base})) == "  node 5 client 2 evaluated: greedy 40.0%  in 2.0 s"
    assert reply_summary(_evaluate_reply(base)) is None


# -- client-errors.log --------------------------------------------------------------------------


def _folder(path: Path) -> RunFolder:
    folder = RunFolder.__new__(RunFolder)  # log_client_error needs the path only
    folder.path = path
    return folder


def _lines(path: Path) -> list[str]:
    return (path / CLIENT_ERRORS).read_bytes().decode("utf-8").splitlines()  # every separator a break


@FIXED
@given(st.lists(st.tuples(st.integers(1, 3), hostile), min_size=1, max_size=6))
def test_only_the_servers_headers_start_with_the_header_mark(calls):
    with tempfile.TemporaryDirectory() as tmp:
        folder = _folder(Path(tmp))
        for node, reason in calls:
            folder.log_client_error(2, node, "train", reason)
        headers = [line for line in _lines(Path(tmp)) if line.startswith("=== ")]
        assert [h.split(" node ")[1].split(" ")[0] for h in headers] == [str(node) for node, _ in calls]
        assert all(" round 2 " in h for h in headers)


@FIXED
@given(hostile)
def test_every_line_of_an_entry_is_its_header_a_body_line_a_note_or_blank(reason):
    with tempfile.TemporaryDirectory() as tmp:
        _folder(Path(tmp)).log_client_error(1, 7, "train", reason)
        header, *rest = _lines(Path(tmp))
        assert header.startswith("=== ") and " round 1 node 7 train: " in header
        assert all(line.startswith(BODY_MARK) or line.startswith("  [… ") or line == "" for line in rest)
        assert unsafe("".join(rest)) == [] and unsafe(header) == []


def test_a_forged_header_in_a_reason_is_a_marked_body_line():
    with tempfile.TemporaryDirectory() as tmp:
        _folder(Path(tmp)).log_client_error(1, 7, "train", "ok\n=== 2026-01-01T00:00:00Z round 1 node 9 train: x\x1b[31m\\")
        lines = _lines(Path(tmp))
        assert lines[1:] == ["  | ok", "  | === 2026-01-01T00:00:00Z round 1 node 9 train: x\\x1b[31m\\\\", ""]


def test_a_long_body_is_cut_with_a_note_of_the_characters_left_out():
    with tempfile.TemporaryDirectory() as tmp:
        _folder(Path(tmp)).log_client_error(1, 7, "train", "x" * 70_000)
        lines = _lines(Path(tmp))
        # 65536 bytes: "  | " (4) + 65531 x's + "\n" (1); 70000 - 65531 = 4469 left out
        assert lines[1] == "  | " + "x" * 65_531
        assert lines[2] == "  [… 4469 more characters of the client's text not logged]"


def test_the_header_shows_the_root_cause_of_the_whole_text_not_of_its_piece():
    # the piece's last frame is a's (ValueError), the whole text's is b's (KeyError), past KEPT_CHARS
    text = 'Traceback (most recent call last):\n  File "a", line 1\nValueError: head\n\n' + "x" * KEPT_CHARS + '\n  File "b", line 2\nKeyError: tail'
    with tempfile.TemporaryDirectory() as tmp:
        _folder(Path(tmp)).log_client_error(1, 7, "train", ClientText(text))
        assert _lines(Path(tmp))[0].endswith(" round 1 node 7 train: KeyError: tail")


def test_a_client_text_piece_reports_the_whole_texts_length():
    piece = ClientText("x" * 100_000)
    assert len(piece) == KEPT_CHARS == 65_536 and piece.length == 100_000
    with tempfile.TemporaryDirectory() as tmp:
        _folder(Path(tmp)).log_client_error(1, 7, "train", piece)
        assert _lines(Path(tmp))[2] == "  [… 34469 more characters of the client's text not logged]"  # 100000 - 65531


CAPS = {"ENTRY_BODY_BYTES": 512, "NODE_LOG_BYTES": 4096, "RUN_LOG_BYTES": 10_240, "CAP_NOTICE_BYTES": 256}


@FIXED
@given(st.lists(st.tuples(st.integers(1, 3), st.one_of(hostile, hostile.map(lambda t: t * 20))), min_size=1, max_size=60))
def test_the_log_respects_its_caps_per_node_and_per_run(calls):
    with tempfile.TemporaryDirectory() as tmp, mock.patch.multiple(run_folder, **CAPS):
        folder = _folder(Path(tmp))
        for node, reason in calls:
            folder.log_client_error(2, node, "train", reason)
        data = (Path(tmp) / CLIENT_ERRORS).read_bytes()
        assert len(data) <= CAPS["RUN_LOG_BYTES"]
        per_node: dict[str, int] = {}
        node = None
        for line in data.decode("utf-8").splitlines(keepends=True):
            if line.startswith("=== "):
                node = line.split(" node ")[1].split(" ")[0].rstrip(":'s")
            per_node[node] = per_node.get(node, 0) + len(line.encode("utf-8"))
        assert max(per_node.values()) <= CAPS["NODE_LOG_BYTES"]


def test_a_node_over_its_cap_is_counted_and_another_node_is_still_logged():
    with tempfile.TemporaryDirectory() as tmp, mock.patch.multiple(run_folder, **CAPS):
        folder = _folder(Path(tmp))
        # an entry: header 550 bytes ("=== " + 20-character time + " round 2 node 1 train: " = 47,
        # 499 y's, "…" 3, "\n"), body 512 ("  | " + 507 y's + "\n"), the note of 93 characters left
        # out 59, a blank line 1: 1122. Written while 1122 k + 1122 + 256 <= 4096: k = 0, 1, 2.
        for _ in range(20):
            folder.log_client_error(2, 1, "train", "y" * 600)
        folder.log_client_error(2, 2, "train", "E: other")
        headers = [line for line in _lines(Path(tmp)) if line.startswith("=== ")]
        assert len(headers) == 3 + 1 + 1  # 3 entries, the cap's line, node 2's entry
        assert "node 1's errors reached 4096 bytes; its further errors are not logged in full" in headers[3]
        assert headers[4].endswith(" round 2 node 2 train: E: other")
        assert folder.client_errors.not_logged == {1: 17}


def test_past_the_runs_cap_every_nodes_errors_are_only_counted():
    with tempfile.TemporaryDirectory() as tmp, mock.patch.multiple(run_folder, **CAPS):
        folder = _folder(Path(tmp))
        # 29 nodes, one error each: entries of 1123 bytes (as above, a two-digit node id); written
        # while 1123 k + 1123 + 256 <= 10240: k = 0 .. 7, so 8 entries, then the cap's line
        for node in range(10, 39):
            folder.log_client_error(2, node, "train", "y" * 600)
        headers = [line for line in _lines(Path(tmp)) if line.startswith("=== ")]
        assert len(headers) == 8 + 1 and "further client errors of this run are not logged in full" in headers[-1]
        assert folder.client_errors.run_full and sum(folder.client_errors.not_logged.values()) == 29 - 8


def test_a_failed_write_is_logged_not_raised():
    folder = _folder(Path("/nonexistent/run"))
    folder.log_client_error(1, 7, "train", "E: x")
    folder.log_client_error(1, "not a node", "train", "E: x")  # nothing the caller passes raises either


# -- the grid -----------------------------------------------------------------------------------


def _sent():
    return message(RecordDict({"config": ConfigRecord({"server-round": 3})}), "train", dst=5, message_id="m")


def test_the_grid_hands_on_error_a_bounded_piece_with_the_whole_length():
    recorded = []
    grid = PromptGrid(object(), on_error=lambda *args: recorded.append(args))
    reason = "ValueError: big\n" + "z" * 1_000_000
    reply = error_reply(reason)
    grid._hooks(reply, _sent())
    [(server_round, node, phase, piece)] = recorded
    assert (server_round, node, phase) == (3, 5, "train")
    assert len(piece) == 65_536 and piece.length == 1_000_016 and piece.line == "ValueError: big " + "z" * 483 + "…"
    assert reply.error.reason == piece.line


def test_a_failing_hook_neither_raises_nor_keeps_the_other_from_running():
    seen = []

    def broken(*args):
        raise ValueError("\n\x1b[31mforged")

    grid = PromptGrid(object(), on_reply=lambda reply, sent: seen.append(reply), on_error=broken)
    reply = error_reply("E: x\n\u202e")
    with mock.patch("server_app.grid.log") as log:
        grid._hooks(reply, _sent())
    assert seen == [reply] and reply.error.reason == "E: x \\u202e"
    [(args, _)] = log.call_args_list
    assert args[-1] == "\\n\\x1b[31mforged"
