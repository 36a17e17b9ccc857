"""The two kinds of CPU the suite runs on, emulated on any x86-64 CPU with AVX-512: the
switches that make torch's three kernel libraries take the code paths of a smaller CPU.

* ``ATEN_CPU_CAPABILITY``: ATen's vectorised kernels (``torch.backends.cpu.get_cpu_capability()``);
* ``ONEDNN_MAX_CPU_ISA``: oneDNN's kernels (bf16/fp16 GEMMs: ``ONEDNN_VERBOSE=1`` names the
  ISA); below AVX-512 torch sends no bf16 GEMM to oneDNN at all (it asks oneDNN whether the CPU
  has bf16 support), as on a CPU without AVX-512;
* ``MKL_ENABLE_INSTRUCTIONS``: Intel MKL's (fp32 GEMMs: ``MKL_VERBOSE=1`` names the ISA).

``no-avx512`` is an AMD EPYC of the Zen 2/3 kind (AVX2 only); ``avx512-bf16`` one of the Zen 4
kind (AVX-512 with avx512_bf16, no AMX). MKL picks its kernels by the CPU's vendor as well:
those it runs on an AMD CPU cannot be chosen on an Intel one, which is why the tests that
measure a run's allocations pin MKL to kernels that allocate nothing of their own
(``tests.helpers.memory.no_blas_buffers``).

inductor's compiled kernels follow ``ATEN_CPU_CAPABILITY`` too, but its cache does not tell
them apart: a CPU loss compiled under AVX-512 and loaded from the cache under ``avx2`` returned
134.14 for 154.06 (torch 2.13.0, tests/unit/test_fused_loss.py, 2026-12-06). Each kind gets an
inductor cache of its own (``TORCHINDUCTOR_CACHE_DIR``, :func:`environ`), as a cluster whose nodes
differ needs one per kind of node.

``python -m tests.helpers.cpu_kind KIND COMMAND...`` runs COMMAND under KIND's switches
(``make test-cpu-kinds``); ``python -m tests.helpers.cpu_kind KIND --show`` prints what each
library then reports."""

from __future__ import annotations

import os
import subprocess
import sys

KINDS = {
    "no-avx512": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                  "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512-bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
}

# an fp32 GEMM (MKL), a bf16 one (oneDNN where the ISA allows): each library's verbose lines
# name the kernels it took
_SHOW = """
import torch
print("ATen:", torch.backends.cpu.get_cpu_capability())
torch.randn(64, 64) @ torch.randn(64, 64)
torch.nn.functional.linear(torch.randn(8, 64, dtype=torch.bfloat16),
                           torch.randn(16, 64, dtype=torch.bfloat16))
"""


def has_avx512() -> bool:
    """Whether torch's ATen runs its AVX-512 kernels in this process (a CPU with AVX-512 and no
    switch holding it back)."""
    import torch

    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def environ(kind: str) -> dict[str, str]:
    """``kind``'s switches and an inductor cache of its own (unless one is set already)."""
    import getpass
    import tempfile

    cache = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{kind}")
    return {"TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", cache),
            **KINDS[kind]}


def emulate(monkeypatch, kind: str) -> None:
    """Processes started from now on (a test's ranks: each applies the switches before its
    first kernel) run ``kind``'s code paths."""
    for name, value in environ(kind).items():
        monkeypatch.setenv(name, value)


def show(kind: str) -> str:
    """What ATen, MKL and oneDNN report under ``kind``: one line each (no oneDNN line: torch
    sent the bf16 GEMM elsewhere)."""
    return "\n".join(fresh_report({**os.environ, **environ(kind)}))


def fresh_report(env: dict[str, str]) -> list[str]:
    """:func:`libraries_taken` for a fresh interpreter started with ``env`` that runs one fp32
    and one bf16 GEMM."""
    env = {**env, "MKL_VERBOSE": "1", "ONEDNN_VERBOSE": "1"}
    return libraries_taken(subprocess.run([sys.executable, "-c", _SHOW], env=env, capture_output=True,
                                          text=True, check=True).stdout)


def libraries_taken(verbose: str) -> list[str]:
    """The lines of ATen's, MKL's and oneDNN's verbose output (``MKL_VERBOSE=1``,
    ``ONEDNN_VERBOSE=1``) that name the code paths they took, less what varies from run to run
    (addresses, times)."""
    keep = ("ATen:", "MKL_VERBOSE oneMKL", "MKL_VERBOSE Intel", "onednn_verbose,v1,info,cpu,isa",
            "onednn_verbose,v1,primitive,exec")
    return [",".join(line.split(",")[:7]) if line.startswith("onednn_verbose,v1,primitive") else line
            for line in verbose.splitlines() if line.startswith(keep)]


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in KINDS:
        print(f"usage: python -m tests.helpers.cpu_kind {{{','.join(KINDS)}}} COMMAND... | --show",
              file=sys.stderr)
        return 2
    kind, command = argv[0], argv[1:]
    if command == ["--show"]:
        print(show(kind))
        return 0
    env = environ(kind)
    print(f"{kind}: {' '.join(f'{k}={v}' for k, v in env.items())}", flush=True)
    return subprocess.call(command, env={**os.environ, **env})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
