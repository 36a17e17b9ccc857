"""Spawn a gloo process group of N CPU ranks running one function; collect per-rank results.

Ranks start from a fork server that imported torch and the package once per test session
(``forkserver`` start method with preloaded modules): a rank then starts in a fraction of a
second instead of re-importing torch (~4 CPU-seconds each on the test machine). Each rank still
is a fresh process forked from a server that ran no test code, with the parent's environment and
working directory, like a spawned one. When the environment differs from the one the server was
started with in a variable read at process start (a test's ``monkeypatch.setenv`` of a glibc or
OpenMP switch), the ranks are spawned instead.
"""

from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import socket
import tempfile
import time
import warnings
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from hybridtrain.config.dist_env import GEMM_KERNEL_CACHE_VARS

# imported once in the fork server; what every rank would otherwise import itself (the
# tokenizers' transformers, PIL and the vision model: ~2.5 CPU-seconds a rank)
_PRELOAD = ["torch", "torch.distributed", "hybridtrain.distributed.init",
            "hybridtrain.training.builder", "hybridtrain.distributed.parallel_plan",
            "hybridtrain.models.nemotron_h", "torch._dynamo", "torch.distributed.pipelining",
            "hybridtrain.distributed.materialize", "hybridtrain.distributed.tensor_parallel",
            "hybridtrain.peft", "hybridtrain.data", "hybridtrain.data.vision_chat",
            "hybridtrain.models.nemotron_vlm", "transformers.models.auto.tokenization_auto",
            "transformers.tokenization_utils_tokenizers", "tokenizers", "PIL.Image",
            "PIL.ImageDraw", "pytest"]
# the CPU kernel libraries' switches (ATen's vector ISA, oneDNN's and Intel MKL's ISA and
# verbosity), each read when its library first runs a kernel, which the server never does (it
# imports, runs no kernel): a forked rank has them from ``_entry`` before its first kernel
# (tests/distributed/test_rank_start.py checks each). (MKL_DISABLE_FAST_MM is read when torch
# loads MKL: tests/conftest.py sets it for every process of the suite.)
KERNEL_LIBRARY_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "ONEDNN_VERBOSE",
                       "MKL_ENABLE_INSTRUCTIONS", "MKL_VERBOSE")
# variables that differ between tests without changing how a process starts: the test's id,
# oneDNN's kernel cache bounds (read at a rank's first GEMM, after ``_entry`` applied them; an
# in-process ``build`` sets them, which must not turn every later launch into a spawn), the
# kernel libraries' switches, and inductor's cache folder (torch sets it to its default the
# first time a process compiles)
_PER_TEST_ENV = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", *GEMM_KERNEL_CACHE_VARS,
                 *KERNEL_LIBRARY_VARS}
_server_started = False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _PER_TEST_ENV}


# the environment each test starts in: the server starts in it, never in a test's own (a test
# that sets TRITON_INTERPRET and launches first would otherwise leave a server every later launch
# differs from, each then spawned). Under pytest, tests/conftest.py takes it again once every
# test module is imported, since imports set variables too (lm_eval's sets
# HF_XET_HIGH_PERFORMANCE): taken before them, every launch of the suite spawned.
_SUITE_ENV = _env()


def take_suite_environment() -> None:
    """The current environment becomes the one the fork server starts in and each launch is
    compared to (before the first launch only)."""
    global _SUITE_ENV
    if _server_started:
        raise RuntimeError("the fork server already runs in the environment taken before")
    _SUITE_ENV = _env()


def _start_method() -> str:
    """``forkserver`` when this process's environment is the suite's (starting the server on
    first use), else ``spawn``."""
    global _server_started
    env = _env()
    changed = sorted(k for k in env.keys() | _SUITE_ENV.keys() if env.get(k) != _SUITE_ENV.get(k))
    if not changed:
        if not _server_started:
            multiprocessing.set_forkserver_preload(_PRELOAD)
            multiprocessing.forkserver.ensure_running()
            _server_started = True
        return "forkserver"
    # each spawned rank imports torch again (~4 CPU-seconds): say why, so that a variable some
    # code sets in the test process does not silently slow every later launch
    warnings.warn(f"ranks spawned, not forked from the server: {', '.join(changed)} changed "
                  "since the suite started", stacklevel=3)
    return "spawn"


def process_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context whose processes start as the ranks do: forked from the
    preloaded server (or spawned when the environment changed since the suite started)."""
    return multiprocessing.get_context(_start_method())


def _entry(rank: int, fn: Callable, world: int, port: int, outdir: str, args: tuple,
           environ: dict[str, str]) -> None:
    # the objects forked from the server (torch's, the package's: ~0.5M) to the permanent
    # generation, which the rank's collections then skip: 3 % of the ranks' CPU time of
    # test_parity.py + test_tensor_parallel.py (56.7 -> 54.7 CPU-s, 2026-12-06)
    gc.freeze()
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    from hybridtrain.distributed.init import destroy_distributed, init_distributed

    init_distributed("cpu", timeout_minutes=2)
    try:
        result = fn(rank, world, *args)
    finally:
        destroy_distributed()
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_distributed(fn: Callable, world: int, *args: Any, timeout: float = 240) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the per-rank results.
    When another process takes the free port before rank 0 listens on it (two test runs on one
    machine), the ranks fail at the rendezvous, before ``fn``: they start again on another."""
    for attempt in range(3):
        try:
            return _run_once(fn, world, args, timeout)
        except mp.ProcessRaisedException as e:
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise


def _run_once(fn: Callable, world: int, args: tuple, timeout: float) -> list[Any]:
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _entry, args=(fn, world, free_port(), outdir, args, dict(os.environ)), nprocs=world,
            join=False, start_method=_start_method(),
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"distributed test did not finish within {timeout}s")
        out = []
        for r in range(world):
            with open(os.path.join(outdir, f"rank{r}.pkl"), "rb") as f:
                out.append(pickle.load(f))
        return out


def _cli_rank(rank: int, world: int, argv: list[str], cwd: str) -> tuple[int, str]:
    """One rank of :func:`run_cli`: the command's exit status and the end of what it wrote."""
    import contextlib
    import io

    from hybridtrain.cli import main

    os.chdir(cwd)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(argv)
    return code, out.getvalue()[-3000:]


def run_cli(argv: list[str], world: int, cwd: str | os.PathLike) -> None:
    """``hybridtrain <argv>`` on ``world`` ranks, as the workers of ``--nproc-per-node``
    run it (:func:`hybridtrain.cli.main` in each rank's process, in the directory ``cwd``), but
    forked from the preloaded server instead of started as new interpreters (~4.5 CPU-seconds of
    imports a worker). The launcher itself is tested by tests/distributed/test_launch.py and
    test_preemption_launch.py. Asserts that every rank exits 0."""
    results = run_distributed(_cli_rank, world, list(argv), str(cwd))
    assert [code for code, _ in results] == [0] * world, "\n".join(
        f"[rank {r}] exit {code}:\n{text}" for r, (code, text) in enumerate(results))
