"""The guard against processes a test run leaves behind (tests/process_guard.py): which
processes it counts as survivors, and a whole pytest run that leaks one failing with its name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
from process_guard import MARKER, Proc, survivors

TESTS = Path(__file__).resolve().parents[1]
ME = 100


def test_descendants_and_marked_processes_survive_the_rest_do_not():
    procs = [Proc(1, 0, "init", None), Proc(ME, 1, "pytest", "99"),
             Proc(101, ME, "nats-server -p 4222", str(ME)),
             Proc(102, 101, "python -m pdserve.services.decode.main", None),       # a grandchild, mark or none
             Proc(200, 1, "valkey-server --port 6379", str(ME)),           # double-forked away, marked
             Proc(300, 1, "bash", None),
             Proc(301, 1, "python -m pdserve.services.router.main", "4242"),  # another run's
             Proc(103, ME, "python -c from multiprocessing.resource_tracker import main;main(5)", str(ME)),
             Proc(104, ME, "python -m pdserve.services.prefill.main", str(ME), alive=False)]      # a zombie: dead
    assert [p.pid for p in survivors(procs, str(ME), ME)] == [101, 102, 200]


def test_nothing_left_is_nothing():
    assert survivors([Proc(1, 0, "init", None), Proc(ME, 1, "pytest", None)], str(ME), ME) == []


def test_a_run_that_leaves_a_process_fails_and_the_process_is_killed(tmp_path):
    (tmp_path / "test_leak.py").write_text(
        "import subprocess, time\n\n"
        "def test_leaks():\n"
        "    proc = subprocess.Popen(['sleep', '300'])\n"
        f"    open({str(tmp_path / 'pid')!r}, 'w').write(str(proc.pid))\n")
    (tmp_path / "test_clean.py").write_text("def test_passes():\n    assert True\n")
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    env.pop(MARKER, None)
    run = [sys.executable, "-m", "pytest", "-q", "-p", "process_guard", "-p", "no:cacheprovider",
           "--rootdir", str(tmp_path)]
    clean = subprocess.run([*run, str(tmp_path / "test_clean.py")], env=env, capture_output=True, text=True,
                           cwd=tmp_path, timeout=120)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "processes left behind" not in clean.stdout and "peak memory" in clean.stdout
    assert "during test_clean.py::test_passes" in clean.stdout or "during no test" in clean.stdout, clean.stdout
    leaky = subprocess.run([*run, str(tmp_path / "test_leak.py")], env=env, capture_output=True, text=True,
                           cwd=tmp_path, timeout=120)
    pid = int((tmp_path / "pid").read_text())
    assert leaky.returncode == 1, leaky.stdout + leaky.stderr
    assert "1 passed" in leaky.stdout and "processes left behind" in leaky.stdout, leaky.stdout
    assert f"pid {pid} " in leaky.stdout and "sleep 300" in leaky.stdout, leaky.stdout
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
