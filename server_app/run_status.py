"""How did a run end? For scripts and sweeps: an exit status, not a log to read.

    python -m server_app.run_status RUN_FOLDER
    python -m server_app.run_status run [flwr run arguments ...]

The first form reads ``RUN_FOLDER/status.json`` (written by the ServerApp as the run goes) and
exits 0 if the run completed or stopped on its privacy budget (``budget-spent``: it ran every round
that ``privacy.max-epsilon`` allows; the reason is printed), 1 if it failed (the error is printed),
3 if it is still running or stopped without a word (killed), 2 if the folder is not a run folder.

The second runs ``flwr run ARGS --stream`` (``--stream`` added if missing), passes its output
through, and exits 0 only if the run folder that the ServerApp announced is ``completed`` (or
``budget-spent``):
``flwr run --stream`` itself exits 0 even when the app failed, e.g. on an invalid run config, in
which case no run folder is announced and this exits 1 with a hint.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from server_app.run_folder import STATUS, read_status

FOLDER_LINE = re.compile(r"FedTOPS run folder: (\S+)")
RUN_ID_LINE = re.compile(r"[Ss]uccessfully started run (\d+)")
EXIT = {"completed": 0, "budget-spent": 0, "failed": 1}


def folder_status(folder: Path) -> tuple[int, str]:
    """(exit status, one line) for a run folder."""
    if not (folder / "config.json").is_file():
        return 2, f"'{folder}' is not a run folder (no config.json)"
    state = read_status(folder)
    status = state.get("status", "unknown")
    done = state.get("rounds-done", "?")
    line = f"{folder}: {status}, {done} round{'' if done == 1 else 's'} recorded"
    if "error" in state:
        line += f": {state['error']}"
    if status == "unknown":
        line += f" (no {STATUS}: a run from an older version, or one stopped before its first round)"
    return EXIT.get(status, 3), line


def run_checked(flwr_args: list[str]) -> int:
    args = list(flwr_args) if "--stream" in flwr_args else [*flwr_args, "--stream"]
    folder, run_id = None, None
    # This interpreter's environment first, for flwr and for the flower-superlink that flwr starts
    # from PATH: an environment used without activating it (.venv/bin/python -m ...) is still the one run.
    here = Path(sys.executable).parent
    flwr = str(here / "flwr") if (here / "flwr").exists() else shutil.which("flwr") or "flwr"
    env = {**os.environ, "PATH": os.pathsep.join([str(here), os.environ.get("PATH", "")])}
    with subprocess.Popen([flwr, "run", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if m := FOLDER_LINE.search(line):
                folder = Path(m.group(1))
            if m := RUN_ID_LINE.search(line):
                run_id = m.group(1)
    if proc.returncode != 0:
        print(f"run_status: flwr run exited with status {proc.returncode}", file=sys.stderr)
        return proc.returncode
    if folder is None:
        hint = f" (flwr ls --run-id {run_id} shows its status)" if run_id else ""
        print(
            f"run_status: the app failed before it created a run folder{hint}; an invalid run config is the "
            "usual cause: check it with python -m fedopd.config --run-config '...'",
            file=sys.stderr,
        )
        return 1
    code, line = folder_status(folder)
    print(f"run_status: {line}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "run":
        return run_checked(argv[1:])
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    code, line = folder_status(Path(argv[0]))
    print(line)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
