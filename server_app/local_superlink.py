"""The local SuperLink that ``flwr run .`` starts: see it, and stop it, without starting anything.

    python -m server_app.local_superlink            # status: the one this project started, if any
    python -m server_app.local_superlink stop       # end it and everything it started (make stop)

``flwr run .`` on the local federation starts ``flower-superlink`` in the background the first time
and leaves it running for later runs (Flower 1.41, 1.42: ``flwr.cli.local_superlink``); it keeps the
environment of that first ``flwr run`` (tracking variables set later never reach it) and the runs it
serves start ServerApps, simulations and Ray under it. Any ``flwr`` command would start it again, so
this one talks to no SuperLink: it reads the process table.

"This project's" local SuperLink is a process of this user whose command line runs
``flower-superlink`` from this interpreter's environment (``sys.prefix/bin``, where ``make run``
puts it on PATH) with Flower's managed log file of this Flower home
(``$FLWR_HOME/local-superlink/superlink.log``, default ``~/.flwr``). A SuperLink of another
environment, of another Flower home, another user's, or one started by hand (no managed log file) is
not touched. ``stop`` sends SIGTERM to it and to every process under it (ServerApps, simulations,
Ray), waits up to ``--wait`` seconds, then SIGKILLs what is left.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import psutil

from fedopd.core.procinfo import terminate_then_kill

EXECUTABLE = "flower-superlink"


def flwr_home() -> Path:
    """Flower's home folder exactly as ``flwr`` resolves it (``flwr.supercore.utils.get_flwr_home``):
    ``$FLWR_HOME`` as written, else ``~/.flwr``."""
    return Path(os.environ["FLWR_HOME"]) if os.environ.get("FLWR_HOME") else Path.home() / ".flwr"


def managed_log_file(home: Path) -> Path:
    """The log file Flower gives the local SuperLink it starts (``flwr.cli.local_superlink``)."""
    return home / "local-superlink" / "superlink.log"


def is_project_superlink(cmdline: Sequence[str], prefix: Path, home: Path, cwd: str | None = None) -> bool:
    """Whether a process's command line is the local SuperLink that ``flwr run`` started from the
    environment at ``prefix`` with Flower home ``home`` (relative paths: against the process's own
    working directory ``cwd``, and ``home`` against this one's, as each was started)."""
    args = list(cmdline)
    executable = os.path.realpath(Path(prefix) / "bin" / EXECUTABLE)
    runs_it = any(os.path.realpath(a) == executable for a in args[:2])  # the script itself, or the interpreter running it
    log = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--log-file"] + [a.split("=", 1)[1] for a in args if a.startswith("--log-file=")]
    want = os.path.realpath(managed_log_file(home))
    return runs_it and any(os.path.realpath(os.path.join(cwd or os.getcwd(), value)) == want for value in log)


def project_superlinks(prefix: Path | None = None, home: Path | None = None) -> list[psutil.Process]:
    """This user's local SuperLinks of this environment and Flower home (normally none or one)."""
    prefix, home = Path(prefix or sys.prefix), home or flwr_home()
    uid = os.getuid()
    found = []
    for proc in psutil.process_iter(["cmdline", "uids"]):
        try:
            mine = proc.info["uids"] and proc.info["uids"].real == uid and EXECUTABLE in " ".join(proc.info["cmdline"] or ())
            if mine and is_project_superlink(proc.info["cmdline"] or (), prefix, home, proc.cwd()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def stop(superlinks: Sequence[psutil.Process], wait: float = 10.0) -> list[int]:
    """End each SuperLink and every process under it: SIGTERM, then SIGKILL after ``wait`` seconds;
    the pids that were ended."""
    procs: list[psutil.Process] = []
    for link in superlinks:
        try:
            procs += [*link.children(recursive=True), link]
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(terminate_then_kill(procs, wait), timeout=wait)
    return [p.pid for p in procs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m server_app.local_superlink", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("action", nargs="?", choices=("status", "stop"), default="status")
    p.add_argument("--wait", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL (default 10)")
    args = p.parse_args(argv)
    home = flwr_home()
    links = project_superlinks(home=home)
    where = f"environment {sys.prefix}, Flower home {home}"
    if not links:
        print(f"no local SuperLink of this project is running ({where})")
        return 0
    for link in links:
        try:
            under = len(link.children(recursive=True))
            print(f"local SuperLink pid {link.pid} ({where}), {under} process(es) under it; log {managed_log_file(home)}")
        except psutil.NoSuchProcess:
            continue
    if args.action == "stop":
        ended = stop(links, args.wait)
        print(f"stopped: {len(ended)} process(es) ended; the next `flwr run .` starts a fresh local SuperLink")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
