"""server_app.local_superlink: which process is this project's local SuperLink, and stopping it with
everything under it while leaving every other process alone."""

import subprocess
import sys
import time
from pathlib import Path

import psutil

from server_app import local_superlink as ls

PREFIX = Path("/opt/proj/.venv")
HOME = Path("/home/u/.flwr")
SCRIPT = str(PREFIX / "bin" / "flower-superlink")
LOG = str(HOME / "local-superlink" / "superlink.log")


def test_the_managed_superlink_of_this_environment_and_flower_home_is_recognised():
    assert ls.is_project_superlink([str(PREFIX / "bin" / "python"), SCRIPT, "--insecure", "--log-file", LOG], PREFIX, HOME)
    assert ls.is_project_superlink([SCRIPT, f"--log-file={LOG}"], PREFIX, HOME)


def test_another_environment_another_flower_home_or_a_hand_started_superlink_is_not():
    assert not ls.is_project_superlink(["/other/.venv/bin/python", "/other/.venv/bin/flower-superlink", "--log-file", LOG], PREFIX, HOME)
    assert not ls.is_project_superlink([SCRIPT, "--log-file", "/home/v/.flwr/local-superlink/superlink.log"], PREFIX, HOME)
    assert not ls.is_project_superlink([SCRIPT, "--insecure"], PREFIX, HOME)  # started by hand: no managed log file
    assert not ls.is_project_superlink(["python", "-c", "pass", SCRIPT, "--log-file", LOG], PREFIX, HOME)  # only named as an argument
    assert not ls.is_project_superlink([], PREFIX, HOME)


def test_a_relative_log_file_is_read_against_the_superlinks_own_working_directory():
    assert ls.is_project_superlink([SCRIPT, "--log-file", "local-superlink/superlink.log"], PREFIX, HOME, cwd=str(HOME))
    assert not ls.is_project_superlink([SCRIPT, "--log-file", "local-superlink/superlink.log"], PREFIX, HOME, cwd="/tmp")


def test_flower_home_is_read_as_flower_reads_it(monkeypatch):
    monkeypatch.setenv("FLWR_HOME", "~/fl")
    assert ls.flwr_home() == Path("~/fl")  # Flower does not expand it either: the SuperLink's paths say ~/fl
    monkeypatch.delenv("FLWR_HOME")
    assert ls.flwr_home() == Path.home() / ".flwr"


def _imitation(prefix: Path, home: Path, with_child: bool) -> subprocess.Popen:
    """A process whose command line is the local SuperLink's (``python SCRIPT --log-file LOG``), optionally with a child."""
    script = prefix / "bin" / "flower-superlink"
    script.parent.mkdir(parents=True, exist_ok=True)
    child = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); " if with_child else ""
    term = f"import signal, sys; signal.signal(signal.SIGTERM, lambda *a: (open({str(prefix / 'sigterm')!r}, 'w').close(), sys.exit(0))); "
    script.write_text(f"{child}{term}import time; time.sleep(120)\n")
    return subprocess.Popen([sys.executable, str(script), "--log-file", str(ls.managed_log_file(home))])


def test_stop_ends_this_projects_superlink_and_what_it_started_and_nothing_else(tmp_path):
    mine = _imitation(tmp_path / "venv", tmp_path / "home", with_child=True)
    other_home = _imitation(tmp_path / "venv2", tmp_path / "home2", with_child=False)
    try:
        deadline = time.monotonic() + 30
        while len(psutil.Process(mine.pid).children()) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        child = psutil.Process(mine.pid).children()[0]
        found = ls.project_superlinks(prefix=tmp_path / "venv", home=tmp_path / "home")
        assert [p.pid for p in found] == [mine.pid]
        ended = ls.stop(found, wait=5)
        assert sorted(ended) == sorted([mine.pid, child.pid])
        assert mine.wait(timeout=10) is not None and not child.is_running()
        assert (tmp_path / "venv" / "sigterm").exists()  # asked to stop (SIGTERM) before any SIGKILL
        assert other_home.poll() is None  # another Flower home's SuperLink runs on
    finally:
        for p in (mine, other_home):
            p.kill()
            p.wait()


def test_stop_with_none_running_says_so_and_starts_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "home"))
    assert ls.main(["stop"]) == 0
    assert "no local SuperLink of this project is running" in capsys.readouterr().out
    assert not (tmp_path / "home").exists()  # flwr would have created its home and the SuperLink's log folder
