"""How the suite's ranks start (tests/helpers/distributed.py): forked from the preloaded server,
a rank still runs the CPU kernel libraries (ATen, oneDNN, Intel MKL) as the test's environment
says, so the tests that pin their kernels (the memory tests' ``no_blas_buffers``, the emulated
kinds of CPU of tests/helpers/cpu_kind.py) need no fresh interpreter per rank."""

import os
import tempfile
import warnings

import pytest
import torch

from tests.helpers import cpu_kind
from tests.helpers.distributed import run_distributed


def _kernels_report(rank, world):
    """What this rank's first fp32 and bf16 GEMM print (to file descriptor 1) under
    ``MKL_VERBOSE`` and ``ONEDNN_VERBOSE``, after ATen's vector ISA."""
    with tempfile.TemporaryFile() as out:
        saved = os.dup(1)
        os.dup2(out.fileno(), 1)
        try:
            print(f"ATen: {torch.backends.cpu.get_cpu_capability()}", flush=True)
            a = torch.randn(64, 64)
            (a @ a).sum()
            torch.nn.functional.linear(a[:8].bfloat16(), a[:16].bfloat16())
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        out.seek(0)
        return out.read().decode(errors="replace")


@pytest.mark.distributed
def test_forked_ranks_run_the_kernel_libraries_as_their_environment_says(monkeypatch):
    """Each library takes in a forked rank the code path it takes in a fresh interpreter under
    the same environment (what a switch changes depends on the CPU: MKL names no ISA on an
    AMD CPU, and AVX512_CORE_BF16 is oneDNN's own choice on a CPU without AMX)."""
    for name, value in {"ATEN_CPU_CAPABILITY": "avx2", "MKL_VERBOSE": "1", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                        "ONEDNN_VERBOSE": "1",
                        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}.items():
        monkeypatch.setenv(name, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "ranks spawned, not forked from the server" fails
        reports = run_distributed(_kernels_report, 2)
    expected = cpu_kind.fresh_report(dict(os.environ))
    assert "ATen: AVX2" in expected
    for rank, text in enumerate(reports):
        assert cpu_kind.libraries_taken(text) == expected, (rank, text[:800])
        if torch.backends.mkl.is_available():  # no pool of MKL's own: tests/conftest.py
            assert "FastMM:0" in text, (rank, text[:800])


def test_the_server_starts_in_the_suites_environment_never_in_a_tests(monkeypatch):
    """A launch under a test's own environment (here TRITON_INTERPRET=1, as the real-kernel
    tests set it) spawns its ranks and leaves the server unstarted; the next launch in the
    suite's environment starts it there and forks, as every later one does."""
    from tests.helpers import distributed

    monkeypatch.setattr(distributed, "_server_started", False)
    monkeypatch.setenv("TRITON_INTERPRET", "1" if os.environ.get("TRITON_INTERPRET") != "1" else "0")
    with pytest.warns(UserWarning, match="ranks spawned.*TRITON_INTERPRET"):
        assert distributed._start_method() == "spawn"
    assert distributed._server_started is False
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert distributed._start_method() == "forkserver"
