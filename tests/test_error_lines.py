"""A client's error in ``status.json``, ``rounds.jsonl`` and the log lines is the root cause's own
line; the run folder's ``client-errors.log`` keeps the full text (server_app/error_lines.py).

The inputs are real: exceptions raised in nested functions and formatted by ``traceback``;
Flower's simulation reason is built by Flower's own code (``VirtualClientEngineActor.run`` wraps
the ClientApp's exception in ``ClientAppException``; the Virtual Client Engine's ``worker`` turns
what the Ray backend raises into the reply's ``Error``), with the exception that ``ray.get``
raises made by Ray's own ``RayTaskError`` as Ray's worker makes it. The expected lines are
written out.
"""

from __future__ import annotations

import logging
import random
import threading
import traceback
from queue import Queue

import pytest
from flwr.app import ConfigRecord, Error, Message, RecordDict

from server_app.error_lines import MAX_CHARS, reason_line, root_cause
from server_app.inprocess import FIRST_NODE_ID, InProcessGrid

pytestmark = pytest.mark.usefixtures("task_identity")  # messages take their sender from it

VLLM = (
    "ValueError: User-specified max_model_len (2176) is greater than the derived max_model_len "
    "(max_position_embeddings=512 or model_max_length=None in model's config.json)."
)


def _derive_max_model_len(max_model_len: int, max_position_embeddings: int = 512) -> int:
    if max_model_len > max_position_embeddings:
        raise ValueError(
            f"User-specified max_model_len ({max_model_len}) is greater than the derived max_model_len "
            f"(max_position_embeddings={max_position_embeddings} or model_max_length=None in model's config.json)."
        )
    return max_model_len


def _model_config(max_model_len: int) -> int:
    return _derive_max_model_len(max_model_len)


def _start_engine() -> None:
    try:
        _model_config(2176)
    except ValueError as err:
        raise RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}") from err


def _engine_during_cleanup() -> None:
    try:
        _model_config(2176)
    except ValueError:
        raise KeyError("engine_core")  # implicitly chained: During handling of the above exception


class ValidationError(ValueError):
    """An exception with a multi-line message, as pydantic's."""


ValidationError.__module__ = "pydantic_core._pydantic_core"


def _validate() -> None:
    raise ValidationError(
        "1 validation error for ModelConfig\n"
        "  Value error, User-specified max_model_len (2176) is greater than the derived max_model_len. "
        "[type=value_error, input_value=ArgsKwargs((), {'model': 'tiny'}), input_type=ArgsKwargs]\n"
        "    For further information visit https://errors.pydantic.dev/2.11/v/value_error"
    )


def formatted(fn) -> str:
    """``traceback.format_exc()`` of what ``fn()`` raises."""
    try:
        fn()
    except Exception:  # noqa: BLE001
        return traceback.format_exc()
    raise AssertionError("did not raise")


def simulation_reason(client_app) -> str:
    """The ``reason`` of the error reply that Flower 1.41's simulation sends for ``client_app``
    (a callable ``(message, context)`` that raises).

    Flower's actor code runs it (``VirtualClientEngineActor.run``: ``raise ClientAppException(str(ex))
    from ex``); Ray's worker stores the exception as ``RayTaskError(function_name, backtrace, exc, ...)``
    with ``backtrace = format_error_message(''.join(format_exception(...)), task_exception=True)``
    (``ray/_raylet.pyx``, ``store_task_errors``) and ``ray.get`` raises ``as_instanceof_cause()`` of
    it, which the Ray backend re-raises; Flower's Virtual Client Engine ``worker`` makes the reply.
    """
    from flwr.server.superlink.fleet.vce import vce_api
    from flwr.simulation.ray_transport.ray_actor import VirtualClientEngineActor
    from ray._private.utils import format_error_message
    from ray.exceptions import RayTaskError

    class RayBackend:
        def process_message(self, message, context):
            try:
                VirtualClientEngineActor.run(None, lambda: client_app, message, "0", context)
            except Exception as exc:  # noqa: BLE001
                backtrace = format_error_message("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)), task_exception=True)
                stored = RayTaskError(
                    "ClientAppActor.run",
                    backtrace,
                    exc,
                    proctitle="ray::ClientAppActor.run",
                    pid=4242,
                    ip="10.0.0.7",
                    actor_repr="<flwr.simulation.ray_transport.ray_actor.ClientAppActor object at 0x7f3a>",
                    actor_id="5c1b",
                )
                raise stored.as_instanceof_cause() from None
            raise AssertionError("the ClientApp did not raise")

    class Contexts:
        def retrieve_context(self, run_id):
            return None

    class Metrics:
        def add_clientapp_runtime(self, seconds):
            pass

    message = Message(RecordDict(), dst_node_id=7, message_type="train")
    message.metadata.__dict__["_message_id"] = "instruction"
    instructions, replies, stop = Queue(), Queue(), threading.Event()
    instructions.put(message)
    worker = threading.Thread(target=vce_api.worker, args=(instructions, replies, {7: Contexts()}, RayBackend(), stop, Metrics()), daemon=True)
    worker.start()
    try:
        reply = replies.get(timeout=60)
    finally:
        stop.set()
        worker.join(5)
    return reply.error.reason


def raising(fn):
    def client_app(message, context):
        fn()

    return client_app


def supernode_reason(fn) -> str:
    """The ``reason`` of a SuperNode's error reply (``flwr/supernode/runtime/run_clientapp.py``)."""
    try:
        fn()
    except Exception as ex:  # noqa: BLE001
        return str(type(ex)) + ":<'" + str(ex) + "'>"
    raise AssertionError("did not raise")


# -- root_cause on real tracebacks -------------------------------------------------------------


def test_a_traceback_gives_its_exception_line():
    text = formatted(lambda: _model_config(2176))
    assert text.startswith("Traceback (most recent call last):") and "_derive_max_model_len" in text
    assert root_cause(text) == VLLM


def test_a_chained_traceback_gives_the_first_ones_exception_line():
    text = formatted(_start_engine)
    assert "The above exception was the direct cause of the following exception:" in text
    assert root_cause(text) == VLLM


def test_an_exception_raised_while_handling_another_gives_the_first_ones_line():
    text = formatted(_engine_during_cleanup)
    assert "During handling of the above exception, another exception occurred:" in text
    assert root_cause(text) == VLLM


def test_a_recursion_traceback_with_repeated_frames_gives_its_exception_line():
    def down(n):
        return down(n + 1) + 1

    text = formatted(lambda: down(0))
    assert "more times]" in text
    assert root_cause(text) == "RecursionError: maximum recursion depth exceeded"


def test_flowers_simulation_reason_gives_the_client_apps_own_line():
    text = simulation_reason(raising(lambda: _model_config(2176)))
    assert text.startswith("<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'")
    assert "ray::ClientAppActor.run()" in text and "Exception ClientAppException occurred. Message: " in text
    assert root_cause(text) == VLLM
    assert reason_line("score: error reply: " + text) == "score: error reply: " + VLLM


def test_flowers_simulation_reason_of_a_chained_error_gives_the_root_causes_line():
    text = simulation_reason(raising(_start_engine))
    assert text.count("The above exception was the direct cause of the following exception:") == 2
    assert root_cause(text) == VLLM


def test_a_multi_line_message_keeps_its_lines_up_to_the_next_blank_line_in_one_line():
    expected = (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig "
        "Value error, User-specified max_model_len (2176) is greater than the derived max_model_len. "
        "[type=value_error, input_value=ArgsKwargs((), {'model': 'tiny'}), input_type=ArgsKwargs] "
        "For further information visit https://errors.pydantic.dev/2.11/v/value_error"
    )
    assert root_cause(formatted(_validate)) == expected
    assert root_cause(simulation_reason(raising(_validate))) == expected
    assert root_cause(supernode_reason(_validate)) == expected


def test_a_supernodes_reason_gives_type_and_message():
    assert supernode_reason(lambda: _model_config(2176)) == "<class 'ValueError'>:<'" + VLLM[len("ValueError: ") :] + "'>"
    assert root_cause(supernode_reason(lambda: _model_config(2176))) == VLLM

    def refuse():
        from fedopd.core.errors import ModelLoadError

        raise ModelLoadError("student 'a' and teacher 'b' must share a tokenizer")

    assert root_cause(supernode_reason(refuse)) == "fedopd.core.errors.ModelLoadError: student 'a' and teacher 'b' must share a tokenizer"


@pytest.mark.parametrize(
    "line",
    [
        "RuntimeError: disk full",
        "ModelLoadError: student 'a' and teacher 'b' must share a tokenizer: 12 token ids differ",
        "Error: Node Unavailable — The destination node failed to report a heartbeat within 2 × its expected interval.",
        "An exception was raised when attempting to load `ClientApp`",
        "no node 7",
        "train: no reply before the timeout",
        "score: error reply: RuntimeError: disk full",
        VLLM,
    ],
)
def test_a_message_that_is_already_one_line_is_unchanged(line):
    assert root_cause(line) == line
    assert reason_line(line) == line


def test_a_long_line_is_cut_to_the_bound():
    line = root_cause("ValueError: " + "x" * 5000)
    assert len(line) == MAX_CHARS and line.startswith("ValueError: xxx") and line.endswith("…")
    assert root_cause(line) == line


def test_colour_codes_and_control_characters_are_removed():
    assert root_cause("\x1b[31mValueError\x1b[0m: bad\x07 value\r\n") == "ValueError: bad value"


def test_text_that_parses_as_nothing_gives_its_last_non_empty_line():
    assert root_cause("Traceback (most recent call last):\n  something odd\n+----\n\n") == "something odd"
    assert root_cause('Traceback (most recent call last):\n  File "x.py", line 1, in f\n    g()\n') == "g()"


def _garbage(rng: random.Random) -> str:
    pieces = [
        "Traceback (most recent call last):",
        '  File "a.py", line 3, in f',
        "    ^^^^",
        "ValueError: x",
        "The above exception was the direct cause of the following exception:",
        "During handling of the above exception, another exception occurred:",
        "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'",
        "'>",
        "\x1b[36mray::ClientAppActor.run()\x1b[39m (pid=1, ip=x)",
        "Exception ClientAppException occurred. Message: ",
        "",
        " ",
        "\x00\x1b\x7f",
        "é漢\u2028\ud800",
        "y" * 700,
    ]
    return "\n".join(rng.choice(pieces) + "".join(chr(rng.randrange(0, 0x3000)) for _ in range(rng.randrange(3))) for _ in range(rng.randrange(12)))


@pytest.mark.parametrize("seed", range(300))
def test_any_input_gives_one_bounded_line_and_never_raises(seed):
    rng = random.Random(seed)
    text = _garbage(rng)
    line = root_cause(text)
    assert isinstance(line, str) and len(line) <= MAX_CHARS and "\n" not in line
    assert root_cause(line) == line
    assert len(reason_line("error reply: " + text)) <= MAX_CHARS


@pytest.mark.parametrize("text", [None, "", "\n\n", 12, b"ValueError: bytes", "<class '", "<class 'X'>:<'", "'>", "\x1b[", '  File "'])
def test_odd_inputs_never_raise(text):
    line = root_cause(text)
    assert isinstance(line, str) and len(line) <= MAX_CHARS and "\n" not in line


def test_a_huge_text_gives_its_root_cause():
    frames = '  File "/x/vllm/engine.py", line 12, in f\n    f()\n' * 60_000  # ~3 MB: the root cause within HEAD, the text past it
    text = (
        "Traceback (most recent call last):\n"
        + frames
        + VLLM
        + "\n\nThe above exception was the direct cause of the following exception:\n\n"
        + frames
        + "X: y\n"
    )
    assert root_cause(text) == VLLM


# -- where a client's error goes ---------------------------------------------------------------


def test_the_reply_line_shows_the_root_causes_line():
    from server_app.log_lines import reply_summary

    sent = Message(RecordDict(), dst_node_id=1002, message_type="train")
    sent.metadata.__dict__["_message_id"] = "m"
    reply = Message(Error(code=2, reason=simulation_reason(raising(lambda: _model_config(2176)))), reply_to=sent)
    assert reply_summary(reply) == f"  node {reply.metadata.src_node_id}: train failed: {VLLM}"


def test_the_run_failure_names_each_distinct_root_cause_once_with_its_nodes():
    from server_app.stop_rules import failure_reasons

    text = simulation_reason(raising(lambda: _model_config(2176)))
    other = text.replace("pid=4242", "pid=4243")  # another worker: another traceback, the same cause
    excluded = [
        {"node-id": 3, "reason": "error reply: " + other},
        {"node-id": 1, "reason": "error reply: " + text},
        {"node-id": 2, "reason": "train: no reply before the timeout"},
    ]
    assert failure_reasons(excluded) == f"node 1, 3: {VLLM}; node 2: train: no reply before the timeout"


class SimulationGrid(InProcessGrid):
    """:class:`InProcessGrid` whose ClientApp's exceptions reach the server as in Flower's simulation."""

    def _deliver(self, msg: Message) -> Message:
        real, raised = self.client_app, []

        def client_app(message, context):
            try:
                return real(message, context)
            except Exception as exc:
                raised.append(exc)
                raise

        self.client_app = client_app
        try:
            reply = super()._deliver(msg)
        finally:
            self.client_app = real
        if raised:

            def again(message, context):
                raise raised[0]

            reply.error = Error(code=reply.error.code, reason=simulation_reason(again))
        return reply


def test_the_grid_hands_the_full_text_on_and_the_reply_carries_the_root_causes_line():
    from server_app.grid import PromptGrid

    def client_app(message, context):
        _start_engine()

    recorded = []
    grid = PromptGrid(SimulationGrid(client_app, {}, 2), on_error=lambda *args: recorded.append(args))
    messages = [
        grid.create_message(RecordDict({"config": ConfigRecord({"server-round": 3})}), "train", node, "3")
        for node in (FIRST_NODE_ID, FIRST_NODE_ID + 1)
    ]
    replies = list(grid.send_and_receive(messages, timeout=5))
    assert [r.error.reason for r in replies] == [VLLM, VLLM]
    # replies are taken in the order the grid pulls them (a set of message ids): compare sorted
    assert sorted((r, node, phase) for r, node, phase, _ in recorded) == [(3, FIRST_NODE_ID, "train"), (3, FIRST_NODE_ID + 1, "train")]
    for *_, text in recorded:
        assert text.startswith("<class 'ray.exceptions.RayTaskError(ClientAppException)'>")
        assert "The above exception was the direct cause of the following exception:" in text and root_cause(text) == VLLM


@pytest.mark.slow
def test_a_failed_runs_status_holds_the_root_causes_line_and_the_run_folder_the_full_text(tmp_path, monkeypatch):
    from conftest import TINY

    from fedopd.config import parse_run_config
    from server_app.app import RunFailed, run_server
    from server_app.run_folder import BODY_MARK, CLIENT_ERRORS, read_rounds, read_status

    def foreign_app(message, context):  # a ClientApp not this project's: it raises, and Flower's runtime sends the whole text
        _start_engine()

    lines = []

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append((record.pathname, record.getMessage()))

    handler = Lines(level=logging.DEBUG)
    logging.getLogger("flwr").addHandler(handler)
    config = {**TINY, "num-server-rounds": 2, "strategy.name": "fedtops", "rollout.backend": "hf", "output-dir": str(tmp_path)}
    cfg = parse_run_config(config)
    expected = f"no client returned a valid update in round 1: node 1001, 1002, 1003: {VLLM}"
    try:
        with pytest.raises(RunFailed) as raised:
            run_server(SimulationGrid(foreign_app, cfg.to_run_config(), 3), cfg)
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    assert str(raised.value) == expected
    [run] = [p.parent for p in tmp_path.glob("*/config.json")]
    status = read_status(run)
    assert status["status"] == "failed" and status["error"] == expected
    [record] = read_rounds(run)
    assert sorted(record["excluded"], key=lambda e: e["node-id"]) == [{"node-id": n, "reason": "error reply: " + VLLM} for n in (1001, 1002, 1003)]

    log = (run / CLIENT_ERRORS).read_text()
    entries = [e for e in log.split("\n=== ") if e.strip()]
    assert len(entries) == 3
    nodes = []
    for entry in entries:
        header, _, body = entry.removeprefix("=== ").partition("\n")
        assert header.endswith(f" train: {VLLM}") and " round 1 node " in header
        body_lines = body.rstrip("\n").split("\n")
        assert all(line.startswith(BODY_MARK) for line in body_lines)  # the client's text, each line marked and escaped
        text = "\n".join(line.removeprefix(BODY_MARK) for line in body_lines)
        nodes.append(int(header.split(" node ")[1].split()[0]))
        assert text.startswith("<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'")
        assert text.count("The above exception was the direct cause of the following exception:") == 2
        assert "ray::ClientAppActor.run()" in text and VLLM in text and "Engine core initialization failed" in text
    assert sorted(nodes) == [1001, 1002, 1003]

    # the stream: the app's own lines (not Flower's simulation log) carry the root cause's line only
    own = [message for path, message in lines if "/flwr/" not in path]
    assert f"  node 1001: train failed: {VLLM}" in own
    assert any(message.endswith(f"run failed: {expected}") for message in own)
    assert not [m for m in own if "ray::" in m or "ClientAppException" in m or "direct cause" in m]
