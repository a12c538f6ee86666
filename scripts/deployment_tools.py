"""Small helpers for ``scripts/local-deployment.sh`` (ports, waiting, Ray's token, fault injection).

    python scripts/deployment_tools.py free-port [HOST]
    python scripts/deployment_tools.py ray-token PATH
    python scripts/deployment_tools.py wait-port HOST PORT TIMEOUT
    python scripts/deployment_tools.py wait-nodes N TIMEOUT -- <flwr supernode ls command>
    python scripts/deployment_tools.py kill-on LOGFILE PATTERN PGID

``ray-token`` makes the token file for Ray's token authentication (``RAY_AUTH_MODE=token
RAY_AUTH_TOKEN_PATH=PATH``): 256 random bits (``secrets``) as 64 hex digits, written with mode 0600
and never printed. A file already there is kept as it is (never overwritten) if it holds a token
and only its owner can read it; otherwise the command fails and says why.

``kill-on`` is the script's fault injection (``--kill-supernode``): it follows a SuperNode's log
and sends SIGKILL to the SuperNode's process group when ``PATTERN`` first appears, e.g. when the
SuperNode receives its first ``query.score`` message, so that tests can lose a client at an exact
phase of a round.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ray_token(path: str) -> bool:
    """Make the token file at ``path`` unless there is one; True if it was made."""
    import secrets
    import stat

    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077:
            raise SystemExit(f"error: {path} is readable by others (mode {mode:o}); a Ray token file must be 0600: chmod 600 {path}")
        with open(path) as f:
            if not f.readline().strip():
                raise SystemExit(f"error: {path} exists but holds no token (its first line is empty)")
        return False
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return True


def wait_port(host: str, port: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except OSError:
            time.sleep(0.2)
    return False


def online_nodes(command: list[str]) -> int:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    try:
        nodes = json.loads(done.stdout).get("nodes", [])
    except json.JSONDecodeError:
        return 0
    return sum(1 for n in nodes if n.get("status") == "online")


def wait_nodes(count: int, timeout: float, command: list[str]) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if online_nodes(command) >= count:
            return True
        time.sleep(0.5)
    return False


def kill_on(path: str, pattern: str, pgid: int) -> None:
    position, tail = 0, ""
    while True:
        try:
            with open(path, errors="replace") as f:
                f.seek(position)
                text = f.read()
                position = f.tell()
        except FileNotFoundError:
            text = ""
        text, tail = tail + text, (tail + text)[-len(pattern) :]
        if pattern in text:
            os.killpg(pgid, signal.SIGKILL)
            print(f"killed process group {pgid} on {pattern!r}", flush=True)
            return
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return  # it ended on its own
        time.sleep(0.05)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    cmd, args = argv[0], argv[1:]
    if cmd == "free-port":
        print(free_port(*args[:1]))
        return 0
    if cmd == "ray-token":
        made = ray_token(args[0])
        print(f"{'made' if made else 'kept'} {args[0]}", file=sys.stderr)
        return 0
    if cmd == "wait-port":
        return 0 if wait_port(args[0], int(args[1]), float(args[2])) else 1
    if cmd == "wait-nodes":
        sep = args.index("--")
        return 0 if wait_nodes(int(args[0]), float(args[1]), args[sep + 1 :]) else 1
    if cmd == "kill-on":
        kill_on(args[0], args[1], int(args[2]))
        return 0
    print(f"unknown command {cmd!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
