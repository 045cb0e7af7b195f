"""pdserve/shared/progress.py: a bar on a terminal, nothing in a log or a pipe."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import termios

from pdserve.shared.progress import progress

SCRIPT = "from pdserve.shared.progress import progress\nfor _ in progress(range(3), 'loading weights'): pass"


def run_with_stderr(stderr) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT], stderr=stderr, stdout=subprocess.PIPE, timeout=60)


def test_the_items_pass_through_unchanged():
    assert list(progress(iter("abc"), "x")) == ["a", "b", "c"]


def test_a_bar_on_a_terminal_none_in_a_pipe():
    assert b"loading weights" not in run_with_stderr(subprocess.PIPE).stderr
    main, sub = pty.openpty()
    termios.tcsetwinsize(sub, (24, 80))  # (a new pty has no columns: the bar would be empty)
    try:
        assert run_with_stderr(sub).returncode == 0
        assert select.select([main], [], [], 10)[0], "nothing on the terminal"
        assert b"loading weights" in os.read(main, 65536)
    finally:
        os.close(main)
        os.close(sub)
