"""Worker processes of fedsdk's process pools end when the process that started them is killed outright.

A ``ProcessPoolExecutor`` worker holds both ends of its call queue's pipe, so when its parent dies without a
shutdown (SIGKILL, an OOM killer) it waits for work for ever, and so does the forkserver that forked it:
every crash of a coordinator or a device left two processes and their memory behind. The process here is a
real one, killed with SIGKILL as the kernel's OOM killer would.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

SCRIPT = """
import os
import time

from fedsdk.crypto.parallel import process_pool

if __name__ == "__main__":
    pool = process_pool(1)
    print(pool.submit(os.getpid).result(), flush=True)
    time.sleep(120)
"""


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_pool_workers_end_when_their_parent_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(SCRIPT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    left: list[psutil.Process] = []
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        assert line.strip().isdigit(), f"the parent did not start its pool: {line!r}"
        worker = psutil.Process(int(line))
        server = worker.parent()  # the forkserver (the parent itself under spawn)
        left = [worker, *([server] if server is not None and server.pid != parent.pid else [])]
        time.sleep(0.5)
        assert _alive(worker), "the worker ended while its parent was alive"
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in left) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p.pid for p in left if _alive(p)], "processes left behind by a killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        for p in left:
            if _alive(p):
                p.kill()
