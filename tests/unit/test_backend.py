"""ops.backend: the settings configure_backend chooses, GEMM row padding, and the allocator (in
heap mode glibc serves large CPU tensors from the heap, not mmap)."""

import subprocess
import sys

import pytest
import torch

from hybridtrain.ops import backend
from hybridtrain.ops.backend import BackendSettings, configure_backend, configure_cpu_allocator, pad_rows, unpad_rows

_MMAPPED = r"""
import ctypes, sys, torch
from hybridtrain.ops.backend import configure_cpu_allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                              "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
print(configure_cpu_allocator(sys.argv[1], "cpu"))
x = torch.empty(16 << 20)  # 64 MiB, above any mmap threshold of glibc's
print(libc.mallinfo2().hblkhd)  # bytes held in mmapped blocks
"""


def _mmapped_bytes(mode):
    out = subprocess.run([sys.executable, "-c", _MMAPPED, mode], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"no glibc mallinfo2 here: {out.stderr.strip().splitlines()[-1:]}")
    effect, mmapped = out.stdout.split()
    return effect, int(mmapped)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_heap_mode_serves_large_tensors_from_the_heap():
    effect, heap = _mmapped_bytes("heap")
    if effect != "heap":
        pytest.skip(f"C library without mallopt ({effect})")
    _, system = _mmapped_bytes("system")
    assert system >= 64 << 20, system  # glibc default: the 64 MiB tensor is its own mmap
    assert heap < 64 << 20, heap


def test_modes_and_errors():
    assert configure_cpu_allocator("system", "cpu") == "system"
    assert configure_cpu_allocator("auto", "meta") == "system"  # not CPU training: untouched
    with pytest.raises(ValueError, match="training.cpu_allocator"):
        configure_cpu_allocator("jemalloc", "cpu")


@pytest.fixture
def restore_settings():
    with backend.using(backend.settings()):
        yield


def test_configure_backend_pads_only_cpu_low_precision(restore_settings):
    # nothing is tuned until the recipe configures the backend (a fresh process)
    fresh = subprocess.run([sys.executable, "-c", "from hybridtrain.ops import backend; "
                            "print(backend.settings() == backend.BackendSettings())"],
                           capture_output=True, text=True, check=True)
    assert fresh.stdout.strip() == "True" and BackendSettings().gemm_row_multiple == 1
    cases = [("cpu", torch.bfloat16, 64), ("cpu", torch.float16, 64), ("cpu", torch.float32, 1),
             ("meta", torch.bfloat16, 1)]
    for device, dtype, multiple in cases:
        got = configure_backend(device, dtype, cpu_allocator="system")
        assert got.gemm_row_multiple == multiple and backend.settings() is got, (device, dtype)
        assert got.cpu_allocator == "system" and got.grouped_mm
    assert not configure_backend("cpu", torch.float32, cpu_allocator="system", grouped_mm=False).grouped_mm
    with pytest.raises(ValueError, match="training.grouped_mm"):
        configure_backend("cpu", torch.float32, cpu_allocator="system", grouped_mm="yes")
    with pytest.raises(ValueError, match="training.cpu_allocator"):
        configure_backend("cpu", torch.float32, cpu_allocator="jemalloc")


def test_fsdp_all_gather_release_is_a_cpu_setting(restore_settings):
    # synchronous CPU collectives: free each unit's all-gather output after its copy-out; GPUs
    # keep FSDP2's overlap (the setting is what distributed.fsdp.apply_fsdp reads)
    assert not BackendSettings().fsdp_free_all_gather
    assert configure_backend("cpu", torch.float32, cpu_allocator="system").fsdp_free_all_gather
    assert configure_backend("cpu", torch.bfloat16, cpu_allocator="system").fsdp_free_all_gather
    assert not configure_backend("meta", torch.bfloat16, cpu_allocator="system").fsdp_free_all_gather


def test_pad_rows_and_unpad_rows(restore_settings):
    x, labels = torch.randn(70, 3), torch.arange(70)
    assert pad_rows(x) is x and unpad_rows(x, 70) is x  # default: nothing to do, nothing in the graph
    with backend.using(BackendSettings(gemm_row_multiple=64)):
        px, pl = pad_rows(x), pad_rows(labels, value=-100)
        assert px.shape == (128, 3) and torch.equal(px[:70], x) and torch.all(px[70:] == 0)
        assert pl.shape == (128,) and torch.all(pl[70:] == -100)
        assert pad_rows(px) is px
        assert torch.equal(unpad_rows(px, 70), x)


def test_disable_grouped_mm_warns_once(restore_settings):
    with backend.using(BackendSettings(grouped_mm=True)):
        with pytest.warns(UserWarning, match="no kernel; using the per-expert loop"):
            backend.disable_grouped_mm("no kernel")
        assert not backend.settings().grouped_mm
        backend.disable_grouped_mm("again")  # already off: silent
    assert backend.settings().grouped_mm  # using() restored the settings before it


@pytest.mark.parametrize("grouped_mm", [True, False])
def test_the_logged_experts_path_is_the_one_a_cpu_run_takes(grouped_mm):
    """The run's "kernel paths" line names torch grouped_mm for the CPU's experts exactly when
    an fp32 eager forward of the tiny models' widths takes it."""
    with backend.using(BackendSettings(grouped_mm=grouped_mm)):
        takes = backend.grouped_experts(torch.zeros(8, 96), (48,))
        named = backend.kernel_paths("cpu")["experts"]
    assert named.startswith("torch grouped_mm") == takes, named
    assert takes == (grouped_mm and hasattr(torch.nn.functional, "grouped_mm"))


def test_ops_imports_only_ops():
    """ops/ sits below models/ and training/: importing every module of it (in a fresh
    interpreter) loads no other hybridtrain package."""
    import os
    from pathlib import Path

    code = ("import pkgutil, sys, importlib, hybridtrain.ops as ops\n"
            "for m in pkgutil.iter_modules(ops.__path__):\n"
            "    importlib.import_module('hybridtrain.ops.' + m.name)\n"
            "print(' '.join(sorted(n for n in sys.modules if n.startswith('hybridtrain'))))")
    src = Path(__file__).resolve().parents[2] / "src"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(src)}, timeout=120).stdout.split()
    assert "hybridtrain.ops.loss" in out
    assert [m for m in out if m != "hybridtrain" and not m.startswith("hybridtrain.ops")] == []


def test_fused_loss_is_chosen_per_device(restore_settings):
    import importlib.util

    has_liger = importlib.util.find_spec("liger_kernel") is not None
    assert backend.resolve_fused_loss("auto", "cpu") == "torch"  # bit-identical to earlier runs
    assert backend.resolve_fused_loss("auto", "cuda") == ("liger" if has_liger else "compiled")
    assert backend.resolve_fused_loss("compiled", "cpu") == "compiled"  # forced (tests)
    assert configure_backend("cpu", torch.float32, cpu_allocator="system").fused_loss == "torch"
    with pytest.raises(ValueError, match="training.fused_loss"):
        configure_backend("cpu", torch.float32, cpu_allocator="system", fused_loss="triton")
    if not has_liger:
        with pytest.raises(ValueError, match="liger-kernel"):
            backend.resolve_fused_loss("liger", "cuda")


def test_mamba_kernels_setting(restore_settings):
    for value in ("auto", False):
        assert configure_backend("cpu", torch.float32, cpu_allocator="system", mamba_kernels=value).mamba_kernels == value
    with pytest.raises(ValueError, match="training.mamba_kernels: true needs a CUDA device"):
        configure_backend("cpu", torch.float32, cpu_allocator="system", mamba_kernels=True)
    with pytest.raises(ValueError, match="training.mamba_kernels"):
        configure_backend("cpu", torch.float32, cpu_allocator="system", mamba_kernels="yes")


def test_backend_recipe_keys_reach_the_run_and_its_config_yaml(restore_settings):
    """``training.mamba_kernels`` / ``fused_loss`` are recipe keys like any other: defaults in the
    resolved config (so in config.yaml), overrides reach the backend the build configures."""
    import yaml

    from hybridtrain.config import build_config
    from hybridtrain.training.builder import build
    from tests.helpers.recipes import tiny_recipe

    cfg = build_config(tiny_recipe(), allowed_target_prefixes=["tests."])
    written = yaml.safe_load(cfg.to_yaml())["training"]
    assert written["mamba_kernels"] == "auto" and written["fused_loss"] == "auto"
    cfg = build_config(tiny_recipe(), ["--training.mamba_kernels=false", "--training.fused_loss=compiled"],
                       allowed_target_prefixes=["tests."])
    assert yaml.safe_load(cfg.to_yaml())["training"]["mamba_kernels"] is False
    build(cfg, "cpu", data=False)
    assert backend.settings().mamba_kernels is False and backend.settings().fused_loss == "compiled"


def test_the_mamba_kernels_variable_sets_the_recipe_default(monkeypatch):
    """``HYBRIDTRAIN_MAMBA_KERNELS`` only sets the default of ``training.mamba_kernels``: the
    resolved value is in config.yaml, and the recipe's own value wins."""
    import yaml

    from hybridtrain.config import build_config
    from tests.helpers.recipes import tiny_recipe

    monkeypatch.setenv("HYBRIDTRAIN_MAMBA_KERNELS", "0")
    cfg = build_config(tiny_recipe(), allowed_target_prefixes=["tests."])
    assert yaml.safe_load(cfg.to_yaml())["training"]["mamba_kernels"] is False
    cfg = build_config(tiny_recipe(), ["--training.mamba_kernels=auto"],
                       allowed_target_prefixes=["tests."])
    assert yaml.safe_load(cfg.to_yaml())["training"]["mamba_kernels"] == "auto"


def test_slow_paths_warn_at_start_and_true_refuses(monkeypatch, caplog, restore_settings):
    """A CUDA run without torch grouped_mm or flash-attn warns, naming the package and the fix;
    ``grouped_mm: true`` refuses; on a CPU nothing is reported."""
    import sys

    from hybridtrain.ops.flash_varlen import forget_flash_varlen

    assert backend.slow_paths("cpu", torch.float32) == {}
    monkeypatch.delattr(torch.nn.functional, "grouped_mm", raising=False)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` fails
    forget_flash_varlen()
    monkeypatch.setattr(backend, "_warned_slow", set())
    with caplog.at_level("WARNING"):
        found = backend.check_slow_paths("cuda", torch.bfloat16)
    assert set(found) == {"grouped_mm", "flash_attn"}
    assert "torch>=2.9" in caplog.text and "flash-attn>=" in caplog.text
    assert "hybridtrain[cuda]" in caplog.text
    with pytest.raises(ValueError, match="training.grouped_mm: true"):
        backend.check_slow_paths("cuda", torch.bfloat16, grouped_mm=True)
    assert "grouped_mm" not in backend.check_slow_paths("cuda", torch.bfloat16, grouped_mm=False)


def test_grouped_mm_in_fp32_on_cuda_is_a_slow_path():
    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this torch has no grouped_mm")
    assert "training.dtype: bf16" in backend.slow_paths("cuda", torch.float32)["grouped_mm"]
    assert "grouped_mm" not in backend.slow_paths("cuda", torch.bfloat16)
