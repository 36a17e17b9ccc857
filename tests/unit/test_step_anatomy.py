"""benchmarks/step_anatomy.py: the GPU time model of a training step from a CPU trace."""

import pytest

from benchmarks import anatomy, step_anatomy


def test_roofline_cost_of_a_gemm_a_cast_and_an_in_place_add():
    hw = anatomy.Hardware(gemm_flops=1e12, bandwidth=1e9, launch_s=1e-6)
    mm = anatomy.Kernel("aten::mm", "GEMM + attention", [([64, 128], 2), ([128, 256], 2)])
    assert mm.flops == 2 * 64 * 128 * 256
    assert (mm.read_bytes, mm.write_bytes) == ((64 * 128 + 128 * 256) * 2, 64 * 256 * 2)
    assert mm.seconds(hw) == pytest.approx(max(mm.flops / 1e12, mm.bytes / 1e9) + 1e-6)
    cast = anatomy.Kernel("aten::copy_", "casts", [([10, 10], 2), ([10, 10], 4)], cast=True)
    assert (cast.read_bytes, cast.write_bytes) == (400, 200)  # reads fp32, writes bf16
    add = anatomy.Kernel("aten::add_", "other", [([10, 10], 4), ([10, 10], 4)])
    assert (add.read_bytes, add.write_bytes) == (800, 400)
    adam = anatomy.Kernel("aten::_fused_adamw_", "optimizer", [], [[[1000], [24]]] * 4 + [[], [[], []]])
    assert (adam.read_bytes, adam.write_bytes, adam.launches) == (4 * 1024 * 4, 3 * 1024 * 4, 1)


def test_extrapolate_grows_the_dimensions_that_differ():
    small = [anatomy.Kernel("aten::mm", "GEMM + attention", [([32, 8], 2), ([8, 4], 2)])]
    large = [anatomy.Kernel("aten::mm", "GEMM + attention", [([32, 16], 2), ([16, 8], 2)])]
    real = anatomy.extrapolate(small, large, 8)[0]
    assert real.tensors == [([32, 128], 2), ([128, 64], 2)]  # 32 (a count of rows) stays
    assert real.flops == 2 * 32 * 128 * 64
    with pytest.raises(ValueError, match="different operator sequences"):
        anatomy.extrapolate(small, [anatomy.Kernel("aten::bmm", "x", [])], 8)


@pytest.fixture(scope="module")
def tiny_trace():
    """(model kwargs, batch, kernels) of one traced training step of nano8 at tiny shapes, 2 x 32 tokens."""
    kw, _, batch = step_anatomy.recipe_model(str(step_anatomy.HERE / "gpu" / "nano8.yaml"))
    kw = {**kw, **step_anatomy.SMALL}
    return kw, batch, step_anatomy.trace(kw, 32, batch, 16, "autocast")


def test_tiny_step_is_traced_by_category_with_its_casts(tiny_trace):
    _, _, kernels = tiny_trace
    rows = anatomy.by_category(kernels, anatomy.Hardware())
    for cat in ("GEMM + attention", "loss", "casts", "norms/activations", "Mamba scan + conv",
                "MoE routing/permutation", "optimizer"):
        assert rows[cat].count > 0 and rows[cat].seconds > 0, cat
    assert rows["GEMM + attention"].flops > 0 and rows["optimizer"].names["aten::_fused_adamw_"] > 0
    n, nbytes = anatomy.casts(kernels)
    casts = [k for k in kernels if k.cast]
    assert n == len(casts) > 0 and nbytes == sum(k.bytes for k in casts)
    assert all(k.name == "aten::copy_" and k.tensors[0][1] != k.tensors[1][1] for k in casts)
    # bf16 autocast over fp32 weights: the head's fp32 weight [vocab 512, hidden 64] is cast
    assert any(k.tensors[1] == ([512, 64], 4) and k.tensors[0][1] == 2 for k in casts)
    table = anatomy.table(kernels, anatomy.Hardware())
    assert all(cat in table for cat in anatomy.CATEGORIES) and "total" in table


def test_each_weight_is_cast_to_bf16_once_per_micro_batch():
    # autocast's cast cache: one bf16 copy of each fp32 weight per forward (48 tokens per row
    # make no activation of a weight's shape)
    kw, _, batch = step_anatomy.recipe_model(str(step_anatomy.HERE / "gpu" / "nano8.yaml"))
    kw = {**kw, **step_anatomy.SMALL}
    kernels = step_anatomy.trace(kw, 48, batch, 16, "autocast")
    model = step_anatomy.build(kw, 16)
    shapes: dict = {}
    for p in model.parameters():
        if p.dim() >= 2:
            shapes[tuple(p.shape)] = shapes.get(tuple(p.shape), 0) + 1
    down = {}
    for k in (k for k in kernels if k.cast):
        (dst, dst_b), (src, src_b) = k.tensors[0], k.tensors[1]
        if src_b == 4 and dst_b == 2 and tuple(src) in shapes:
            down[tuple(src)] = down.get(tuple(src), 0) + 1
    assert down, "no weight was cast"
    assert all(n <= shapes[s] for s, n in down.items()), (down, shapes)


def test_a_mixed_dtype_elementwise_op_is_one_kernel_and_an_explicit_cast_is_listed():
    """``bf16 * fp32`` is one GPU kernel (the CPU's promotion temporary is no cast there);
    ``bf16.float() * fp32`` is a cast (bf16 -> fp32 copy) and the product."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    a, w = torch.randn(64, 32).bfloat16(), torch.randn(32)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as p:
        a * w
        a.float() * w
    kernels = anatomy.kernels_of(p.events())
    assert [k.name for k in kernels].count("aten::mul") == 2
    cast = [k for k in kernels if k.cast]
    assert len(cast) == 1 and cast[0].tensors[0] == ([64, 32], 4)
    assert "16->32 bit" in anatomy.cast_sites(kernels)


def test_a_reduction_into_a_wider_dtype_is_one_kernel():
    """``bf16.sum(dtype=fp32)`` is one GPU reduction (the CPU's fp32 copy of its input is no
    cast there); ``bf16.float().sum()`` is a cast and the reduction."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(64, 6, 32).bfloat16()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as p:
        a.sum(1, dtype=torch.float32)
        a.float().sum(1)
    kernels = anatomy.kernels_of(p.events())
    assert [k.name for k in kernels].count("aten::sum") == 2
    cast = [k for k in kernels if k.cast]
    assert len(cast) == 1 and cast[0].tensors[0] == ([64, 6, 32], 4)


def test_fused_runs_read_the_first_kernel_and_write_the_last():
    from benchmarks import projection

    def k(name, category, shape=(8, 8), nbytes=4):
        return anatomy.Kernel(name, category, [(list(shape), nbytes), (list(shape), nbytes)])

    kernels = [k("aten::mm", "GEMM + attention"), k("aten::add", "other"), k("aten::mul", "norms/activations"),
               k("aten::copy_", "casts", nbytes=2), k("aten::mm", "GEMM + attention"), k("aten::argsort", "other"),
               k("aten::mul", "MoE routing/permutation")]
    best, runs = projection.fused_runs(kernels, keep_intermediates=False)
    assert runs == 2  # add+mul+cast, then the mul after the (unfused) argsort
    first, last = kernels[1], kernels[3]
    assert best == first.read_bytes + last.write_bytes + kernels[6].read_bytes + kernels[6].write_bytes
    kept, _ = projection.fused_runs(kernels, keep_intermediates=True)
    assert kept == best + kernels[1].write_bytes + kernels[2].write_bytes


def test_gpu_user_step_is_projected_from_a_trace_with_its_ceiling_and_gap(tiny_trace):
    from benchmarks import projection

    m = projection.measured()  # the repository's copy of the measured H100 step
    assert m["device"].startswith("NVIDIA H100") and m["date"] == "2026-11-26"
    assert sum(v for k, v in m["profile_ms"].items() if k in ("loss", "Mamba scan + conv", "optimizer")) \
        < m["profile_step_device_ms"]
    kw, batch, kernels = tiny_trace
    hw = anatomy.Hardware()
    p = projection.project(kernels, kw, 32, batch, hw, model_tflop=1e9, m=m)
    assert p["step_ms"]["kept"] >= p["step_ms"]["fused"] > 0
    assert p["ceiling_tflops"] >= p["tflops"]["fused"] >= p["tflops"]["kept"]
    assert len(p["gap_items"]) == 3
    names = [part.name for part in p["parts"]["fused"]]
    assert any("Liger" in n for n in names) and any("mamba_ssm" in n for n in names)
    # the loss: Liger's three GEMMs over every token at the roofline's rate is its ideal
    loss = next(part for part in p["parts"]["fused"] if "Liger" in part.name)
    assert loss.ideal_ms == pytest.approx(3 * 2 * 2 * 32 * kw["hidden_size"] * kw["vocab_size"] / hw.gemm_flops * 1e3)
    text = projection.report(p, 1e9, hw, m)
    assert "predicted nano8 model TFLOP/s on an H100" in text and "roofline ceiling" in text
