"""A worker ends within seconds when its launcher is killed (the watch torchrun workers run)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time


def test_worker_ends_when_its_launcher_is_killed(tmp_path):
    pidfile = tmp_path / "worker.pid"
    worker = textwrap.dedent(f"""\
        import os, time
        from hybridtrain.distributed.parent_watch import watch_parent
        assert watch_parent(interval=0.2)
        open({str(pidfile)!r}, "w").write(str(os.getpid()))
        time.sleep(120)
        """)
    launcher = textwrap.dedent(f"""\
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", {worker!r}])
        time.sleep(120)
        """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", launcher], env=env)
    try:
        deadline = time.time() + 60
        while not (pidfile.exists() and pidfile.read_text()) and time.time() < deadline:
            time.sleep(0.1)
        pid = int(pidfile.read_text())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        t0 = time.time()
        while time.time() - t0 < 10:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError("the worker outlived its launcher by 10 s")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_only_launched_workers_watch():
    from hybridtrain.distributed.parent_watch import launched_by_launcher

    assert launched_by_launcher({"TORCHELASTIC_RUN_ID": "abc"})
    assert not launched_by_launcher({})
