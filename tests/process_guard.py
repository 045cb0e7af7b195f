"""The guard against processes a test run leaves behind, and the run's peak memory.

Every process this run starts carries PD_TEST_RUN=<the pytest process's id> in its environment
(tests/conftest.py sets it before any test; children inherit it, through `ip netns exec` and a
double fork too). When the session finishes — after the session's fixtures are torn down — any
process still alive that descends from pytest or carries the run's mark is a survivor: the
guard kills it and fails the run, naming each. A pytest plugin: tests/conftest.py takes its
hooks; `pytest -p process_guard` loads it alone (tests/unit/test_process_guard.py).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import psutil
import pytest

MARKER = "PD_TEST_RUN"
# the interpreter's own helpers: they exit with the process that started them
HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "multiprocessing.semaphore_tracker")
SAMPLE_S = 2.0


@dataclass(frozen=True)
class Proc:
    """What the guard needs to know of one process."""
    pid: int
    ppid: int
    cmdline: str
    marker: str | None      # its PD_TEST_RUN (None: none, or its environment unreadable)
    alive: bool = True      # False: a zombie, already dead


def survivors(procs: Iterable[Proc], run: str, me: int) -> list[Proc]:
    """The processes of run `run` (pytest's id `me`) still alive: `me`'s descendants and the
    processes marked with `run`, without `me` itself and the interpreter's helpers."""
    procs = list(procs)
    children: dict[int, list[int]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p.pid)
    tree, todo = set(), [me]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in tree:
                tree.add(child)
                todo.append(child)
    return [p for p in procs if p.pid != me and p.alive and (p.pid in tree or p.marker == run)
            and not any(h in p.cmdline for h in HELPERS)]


def snapshot() -> list[Proc]:
    """Every process on the machine this user can see."""
    found = []
    for p in psutil.process_iter(["pid", "ppid", "cmdline", "environ", "status"], ad_value=None):
        info = p.info
        found.append(Proc(info["pid"], info["ppid"] or 0, " ".join(info["cmdline"] or []),
                          (info["environ"] or {}).get(MARKER), info["status"] != psutil.STATUS_ZOMBIE))
    return found


def end(procs: Iterable[Proc], grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL for those still alive after `grace_s`."""
    handles = []
    for p in procs:
        try:
            handles.append(psutil.Process(p.pid))
            handles[-1].terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(handles, timeout=grace_s)
    for h in alive:
        try:
            h.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


class PeakMemory:
    """The largest memory of pytest's process tree, sampled every SAMPLE_S seconds by a daemon
    thread: its processes' PSS summed (each shared page split among the processes that map it,
    so the libraries every worker loads count once), and the machine's memory in use then
    (total less available: what the kernel's OOM killer would go by)."""

    def __init__(self) -> None:
        self.peak, self.peak_processes, self.machine = 0, 0, 0
        self.test, self.peak_test = "", ""   # the test running now, and the one running at the peak
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def sample(self) -> None:
        me = psutil.Process()
        total, count = 0, 0
        for p in [me, *me.children(recursive=True)]:
            try:
                total += p.memory_full_info().pss
                count += 1
            except (psutil.Error, AttributeError):   # (gone meanwhile; PSS unreadable)
                pass
        if total > self.peak:
            vm = psutil.virtual_memory()
            self.peak, self.peak_processes, self.machine = total, count, vm.total - vm.available
            self.peak_test = self.test

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sample()


_found: list[Proc] = []
_memory = PeakMemory()


def pytest_configure(config: pytest.Config) -> None:
    os.environ[MARKER] = str(os.getpid())
    _memory.start()


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    _memory.test = nodeid


@pytest.hookimpl(trylast=True)   # after the runner's own: the session's fixtures are torn down by then
def pytest_sessionfinish(session: pytest.Session) -> None:
    _memory.stop()
    _memory.sample()
    left = survivors(snapshot(), str(os.getpid()), os.getpid())
    if left:
        end(left)
        time.sleep(0.1)
        _found.extend(left)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _found:
        terminalreporter.section("processes left behind", sep="!", red=True, bold=True)
        for p in _found:
            terminalreporter.write_line(f"pid {p.pid} (parent {p.ppid}): {p.cmdline[:200]}", red=True)
        terminalreporter.write_line(f"{len(_found)} process(es) outlived the tests that started them: killed now, "
                                    "and the run fails", red=True, bold=True)
    terminalreporter.write_line(f"peak memory of the test run's processes: {_memory.peak / 2**30:.1f} GiB "
                                f"(PSS summed over {_memory.peak_processes} processes, sampled every {SAMPLE_S:g} s; "
                                f"the machine's memory in use then: {_memory.machine / 2**30:.1f} GiB; "
                                f"during {_memory.peak_test or 'no test'})")
