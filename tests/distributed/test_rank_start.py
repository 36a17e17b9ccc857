"""How the suite's ranks start (tests/helpers/distributed.py): forked from the preloaded server,
a rank still runs Intel MKL as the test's environment says, so the memory tests that pin MKL's
kernels (tests/helpers/memory.py, ``no_blas_buffers``) need no fresh interpreter per rank."""

import os
import tempfile
import warnings

import pytest
import torch

from tests.helpers.distributed import run_distributed


def _mkl_banner(rank, world):
    """MKL_VERBOSE's lines of this rank's first fp32 GEMM (MKL writes them to file descriptor 1)."""
    with tempfile.TemporaryFile() as out:
        saved = os.dup(1)
        os.dup2(out.fileno(), 1)
        try:
            a = torch.randn(64, 64)
            (a @ a).sum()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        out.seek(0)
        return out.read().decode(errors="replace")


@pytest.mark.distributed
def test_forked_ranks_run_mkl_as_their_environment_says(monkeypatch):
    if not torch.backends.mkl.is_available():
        pytest.skip("this torch build has no Intel MKL")
    monkeypatch.setenv("MKL_VERBOSE", "1")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "SSE4_2")
    monkeypatch.setenv("MKL_DISABLE_FAST_MM", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "ranks spawned, not forked from the server" fails
        banners = run_distributed(_mkl_banner, 2)
    for rank, text in enumerate(banners):
        assert "SSE4.2" in text and "FastMM:0" in text, (rank, text[:600])
