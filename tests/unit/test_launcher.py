"""The ``--nproc-per-node`` launcher (``hybridtrain.launch``) with stand-in workers (no torch):
it runs on the oldest Python the package declares, prefixes every line with its rank, hands the
listening rendezvous socket to rank 0, returns the workers' status and bounds its wait after a
forwarded signal. (Training through it: tests/distributed/test_launch.py,
test_preemption_launch.py.)"""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# a worker: says where it is on stdout and stderr, checks rank 0's socket, exits with $CODE_<rank>
WORKER = textwrap.dedent("""\
    import os, socket, sys
    rank = os.environ["RANK"]
    print(f"hello from {rank} of {os.environ['WORLD_SIZE']}")
    print(f"to stderr {rank}", file=sys.stderr)
    fd = os.environ.get("HYBRIDTRAIN_STORE_FD")
    if fd is not None:  # rank 0: the launcher's socket, listening on MASTER_PORT
        s = socket.socket(fileno=int(fd))
        assert s.getsockname()[1] == int(os.environ["MASTER_PORT"])
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        print("store socket ok")
    sys.stdout.write("no newline at the end")
    sys.exit(int(os.environ.get(f"CODE_{rank}", "0")))
""")


def _declared_floor() -> tuple[int, int]:
    text = (ROOT / "pyproject.toml").read_text()
    major, minor = re.search(r'requires-python\s*=\s*">=\s*(\d+)\.(\d+)"', text).groups()
    return int(major), int(minor)


def _python(version: tuple[int, int]) -> str | None:
    """An interpreter of ``version`` on this machine (PATH, pyenv), else None."""
    name = f"python{version[0]}.{version[1]}"
    found = [shutil.which(name)] + sorted(glob.glob(os.path.expanduser(
        f"~/.pyenv/versions/{version[0]}.{version[1]}.*/bin/python")))
    for exe in filter(None, found):
        try:
            out = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.strip() == str(version):
            return exe
    return None


def _launch(python: str, nproc: int, env: dict | None = None, **popen) -> subprocess.Popen:
    """``python`` running ``run_workers`` of :data:`WORKER` (the launcher imported from this
    checkout's src/ with nothing else)."""
    code = ("import sys; from hybridtrain.launch import run_workers; "
            f"sys.exit(run_workers([sys.executable, '-c', {WORKER!r}], {nproc}))")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})}
    return subprocess.Popen([python, "-S", "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


@pytest.mark.parametrize("which", ["this", "oldest declared"])
def test_runs_on_every_declared_python_and_prefixes_each_rank(which):
    python = sys.executable if which == "this" else _python(_declared_floor())
    if python is None:
        pytest.skip(f"no Python {'.'.join(map(str, _declared_floor()))} on this machine")
    p = _launch(python, 3)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert sorted(out.splitlines()) == sorted(
        [f"[rank {r}] hello from {r} of 3" for r in range(3)]
        + [f"[rank {r}] no newline at the end" for r in range(3)] + ["[rank 0] store socket ok"])
    assert sorted(err.splitlines()) == [f"[rank {r}] to stderr {r}" for r in range(3)]


def test_exit_status_is_the_first_failure():
    p = _launch(sys.executable, 2, {"CODE_1": "2"})
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2, err


def test_wait_after_a_forwarded_signal_is_bounded():
    """Workers that ignore SIGTERM are killed ``HYBRIDTRAIN_SHUTDOWN_TIMEOUT`` seconds after
    the launcher passed it on; the launcher says so and exits 128 + SIGKILL."""
    worker = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "print('ready', flush=True); time.sleep(120)")
    code = ("import sys; from hybridtrain.launch import run_workers; "
            f"sys.exit(run_workers([sys.executable, '-c', {worker!r}], 2))")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HYBRIDTRAIN_SHUTDOWN_TIMEOUT": "1"}
    p = subprocess.Popen([sys.executable, "-S", "-c", code], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        ready = sorted(p.stdout.readline() for _ in range(2))  # both ignore SIGTERM now
        assert ready == ["[rank 0] ready\n", "[rank 1] ready\n"], ready
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
        assert time.monotonic() - t0 < 30
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGKILL, err
    assert "did not end within 1 s of SIGTERM (HYBRIDTRAIN_SHUTDOWN_TIMEOUT)" in err, err


def test_a_bad_shutdown_timeout_is_refused():
    from hybridtrain.launch import shutdown_timeout

    assert shutdown_timeout({}) > 600  # longer than a sharded checkpoint save
    assert shutdown_timeout({"HYBRIDTRAIN_SHUTDOWN_TIMEOUT": "30"}) == 30
    for bad in ("0", "-5", "soon"):
        with pytest.raises(ValueError, match="HYBRIDTRAIN_SHUTDOWN_TIMEOUT=.*positive number"):
            shutdown_timeout({"HYBRIDTRAIN_SHUTDOWN_TIMEOUT": bad})
