"""bench-scale's cores: the control plane on one half, the stand-ins on the other."""

import os
import subprocess
import sys

from bench.scale.pin import CORES, pin, split


def test_halves():
    assert split([0]) is None
    assert split([0, 1]) == ({0}, {1})
    assert split([0, 1, 2, 3, 4]) == ({0, 1}, {2, 3, 4})


def test_every_thread_of_a_process_is_pinned_to_its_half():
    child = subprocess.Popen([sys.executable, "-c", "import threading, time\n"
                              "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
                              "time.sleep(30)"])
    try:
        placed = pin({"router": child.pid})
        if len(CORES) < 2:
            assert placed == {}
            return
        tids = os.listdir(f"/proc/{child.pid}/task")
        assert placed == {"router": sorted(split(CORES)[0])}
        assert all(os.sched_getaffinity(int(t)) == split(CORES)[0] for t in tids)
    finally:
        child.kill()
