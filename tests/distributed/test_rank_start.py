"""How the suite's ranks start (tests/helpers/distributed.py): forked from the preloaded server,
a rank still runs the CPU kernel libraries (ATen, oneDNN, Intel MKL) as the test's environment
says, so the tests that pin their kernels (the memory tests' ``no_blas_buffers``, the emulated
kinds of CPU of tests/helpers/cpu_kind.py) need no fresh interpreter per rank."""

import os
import tempfile
import warnings

import pytest
import torch

from tests.helpers.distributed import run_distributed


def _kernels_report(rank, world):
    """(ATen's vector ISA, what MKL and oneDNN print (to file descriptor 1) at this rank's first
    fp32 and bf16 GEMM)."""
    with tempfile.TemporaryFile() as out:
        saved = os.dup(1)
        os.dup2(out.fileno(), 1)
        try:
            a = torch.randn(64, 64)
            (a @ a).sum()
            torch.nn.functional.linear(a[:8].bfloat16(), a[:16].bfloat16())
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        out.seek(0)
        return torch.backends.cpu.get_cpu_capability(), out.read().decode(errors="replace")


@pytest.mark.distributed
def test_forked_ranks_run_the_kernel_libraries_as_their_environment_says(monkeypatch):
    mkl = torch.backends.mkl.is_available()
    onednn_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    for name, value in {"ATEN_CPU_CAPABILITY": "avx2", "MKL_VERBOSE": "1", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                        "ONEDNN_VERBOSE": "1",
                        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}.items():
        monkeypatch.setenv(name, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "ranks spawned, not forked from the server" fails
        reports = run_distributed(_kernels_report, 2)
    for rank, (capability, text) in enumerate(reports):
        assert capability == "AVX2", (rank, capability)
        if mkl:  # (and no pool of MKL's own: the suite sets MKL_DISABLE_FAST_MM, tests/conftest.py)
            assert "Intel(R) SSE4.2" in text and "FastMM:0" in text, (rank, text)
        if onednn_bf16:  # (a CPU with avx512_bf16: torch runs bf16 GEMMs in oneDNN)
            assert "isa:Intel AVX-512 with Intel DL Boost and bfloat16 support" in text, (rank, text[:800])


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
