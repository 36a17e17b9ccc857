"""The Mamba2 kernel dispatch calls mamba_ssm and causal_conv1d as each installed release wants.

Fake ``mamba_ssm`` / ``causal_conv1d`` modules stand in ``sys.modules``. Each fake binds its
arguments to the signature of one release (copied from state-spaces/mamba v2.2.2, v2.3.2.post1
and Dao-AILab/causal-conv1d v1.4.0, v1.6.1.post4), repeats that release's checks -- including
the ``.stride()`` it reads unconditionally (``selective_state_update``: ``dt_bias`` and ``D``),
so a None there fails as it does on the GPU -- and computes the release's reference math. The
outputs must equal the PyTorch path's.
"""

from __future__ import annotations

import inspect
import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from hybridtrain.models.nemotron_h import kernels
from hybridtrain.models.nemotron_h.ssd import causal_conv1d_torch, ssd_reference
from hybridtrain.ops import backend
from tests.helpers.models import tiny_mamba_mixer


# -- the releases' signatures -------------------------------------------------------------------
def ssu_2_2(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False): ...


def ssu_2_3(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
            state_batch_indices=None): ...


# the two calls of mamba_ssm's own MambaChunkScanCombinedFn (what the custom op makes)
def scan_fwd_2_2_to_2_3(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                        seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf"))): ...


def scan_bwd_2_2_to_2_3(dout, x, dt, A, B, C, out, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                        dfinal_states=None, seq_idx=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                        dx=None, ddt=None, dB=None, dC=None, dz=None, recompute_output=False): ...


def conv_fn_1_4_to_1_6(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                       final_states_out=None, activation=None): ...


def conv_update_1_4(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None): ...


def conv_update_1_5(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                    conv_state_indices=None): ...


# causal_conv1d_cuda's entry points before 1.5.1 (pybind: positional)
def conv_fwd_cpp_1_4(x, weight, bias, seq_idx, initial_states, final_states_out, silu_activation): ...


def conv_bwd_cpp_1_4(x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx, return_dinitial_states,
                     silu_activation): ...


SCAN = (scan_fwd_2_2_to_2_3, scan_bwd_2_2_to_2_3)
MAMBA = {"mamba_ssm 2.2.2": (ssu_2_2, SCAN), "mamba_ssm 2.3.2": (ssu_2_3, SCAN)}
# (fn, update, registers torch.library ops of its own: 1.5.1 and later)
CONV = {"causal_conv1d 1.4.0": (conv_fn_1_4_to_1_6, conv_update_1_4, False),
        "causal_conv1d 1.6.1": (conv_fn_1_4_to_1_6, conv_update_1_5, True)}


def _bind(signature_of, args, kwargs) -> dict:
    bound = inspect.signature(signature_of).bind(*args, **kwargs)  # TypeError: not this release's
    bound.apply_defaults()
    return dict(bound.arguments)


def _strides(*s):
    return s


# -- the fakes: each release's checks, then its reference math ------------------------------------
def fake_selective_state_update(signature_of, calls):
    def selective_state_update(*args, **kwargs):
        a = _bind(signature_of, args, kwargs)
        calls.append("selective_state_update")
        state, x, dt, A, B, C, D, z, dt_bias = (a[k] for k in ("state", "x", "dt", "A", "B", "C", "D", "z",
                                                               "dt_bias"))
        assert state.dim() == 4 and x.dim() == 3, "called with heads, as Nemotron-H is"
        _, nheads, dim, dstate = state.shape
        batch, ngroups = x.shape[0], B.shape[1]
        assert x.shape == (batch, nheads, dim) and dt.shape == x.shape
        assert A.shape == (nheads, dim, dstate) and nheads % ngroups == 0
        assert B.shape == (batch, ngroups, dstate) and C.shape == B.shape
        if D is not None:
            assert D.shape == (nheads, dim)
        if dt_bias is not None:
            assert dt_bias.shape == (nheads, dim)
        # as the release: tie_hdim reads dt_bias.stride when A and dt are broadcast over head_dim,
        # and the launch unpacks D's and dt_bias's strides whether or not they are None
        _ = A.stride(-1) == 0 and A.stride(-2) == 0 and dt.stride(-1) == 0 and dt_bias.stride(-1) == 0
        _strides(*(dt_bias.stride(0), dt_bias.stride(1)) if dt_bias is not None else 0,
                 *(D.stride(0), D.stride(1)) if D is not None else 0)
        # selective_state_update_ref
        if dt_bias is not None:
            dt = dt + dt_bias
        dt = F.softplus(dt) if a["dt_softplus"] else dt
        dA = torch.exp(dt[..., None] * A)
        B = B.repeat_interleave(nheads // ngroups, dim=1)
        C = C.repeat_interleave(nheads // ngroups, dim=1)
        state.copy_(state * dA + (dt[..., None] * B[:, :, None, :]) * x[..., None])
        out = torch.einsum("bhdn,bhn->bhd", state.to(C.dtype), C)
        if D is not None:
            out = out + (x * D).to(out.dtype)
        out = out if z is None else out * F.silu(z)
        return out.to(x.dtype)
    return selective_state_update


def _scan_reference(a):
    """The release's math for the bound arguments ``a``: dt (+ bias), softplus, clamp to
    dt_limit, then the scan -> (out, final state)."""
    x, dt, A, B, C, D, dt_bias, seq_idx = (a[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias", "seq_idx"))

    def scan(x, dt, A, B, C, D, dt_bias, initial_states):
        dt = dt.float() + (dt_bias.float() if dt_bias is not None else 0)
        dt = (F.softplus(dt) if a["dt_softplus"] else dt).clamp(*a["dt_limit"])
        # (the plain recurrence: torch.func.vjp differentiates it, not ssd_chunked's Functions)
        out, final = ssd_reference(x.float(), dt, A, B.float(), C.float(), D=D, seq_idx=seq_idx,
                                   initial_state=initial_states, return_final_state=True)
        return out.to(x.dtype), final
    return scan, (x, dt, A, B, C, D, dt_bias, a["initial_states"])


def _check_scan_args(a):
    x, dt, A, B, C, D, dt_bias, seq_idx = (a[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias", "seq_idx"))
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2:]
    assert nheads % ngroups == 0 and B.shape == (batch, seqlen, ngroups, dstate) and C.shape == B.shape
    assert dt.shape == (batch, seqlen, nheads) and A.shape == (nheads,)
    assert a["z"] is None or a["z"].shape == x.shape
    if D is not None:
        assert D.shape in ((nheads, headdim), (nheads,))
    if dt_bias is not None:
        assert dt_bias.shape == (nheads,)
    if seq_idx is not None:
        assert seq_idx.shape == (batch, seqlen) and seq_idx.dtype == torch.int32
    if a["initial_states"] is not None:
        assert a["initial_states"].shape == (batch, nheads, headdim, dstate)


def fake_mamba_chunk_scan_combined(signatures, calls):
    """(``_mamba_chunk_scan_combined_fwd``, ``_bwd``) of a release (``signatures``)."""
    def fwd(*args, **kwargs):
        a = _bind(signatures[0], args, kwargs)
        calls.append("mamba_chunk_scan_combined")
        _check_scan_args(a)
        assert a["cu_seqlens"] is None
        scan, inputs = _scan_reference(a)
        out, final = scan(*inputs)
        return out, None, None, None, None, final  # (out, out_x, dt, dA_cumsum, states, final_states)

    def bwd(*args, **kwargs):
        a = _bind(signatures[1], args, kwargs)
        calls.append("mamba_chunk_scan_combined_bwd")
        _check_scan_args(a)
        assert a["out"].shape == a["x"].shape and a["dout"].shape == a["x"].shape
        scan, inputs = _scan_reference(a)
        with_init = inputs[-1] is not None
        (out, final), vjp = torch.func.vjp(lambda *t: scan(*t, *([] if with_init else [None])),
                                           *inputs[:8 if with_init else 7])
        dfinal = a["dfinal_states"] if a["dfinal_states"] is not None else torch.zeros_like(final)
        grads = vjp((a["dout"], dfinal))
        dx, ddt, dA, dB, dC, dD, ddt_bias = grads[:7]
        return dx, ddt, dA, dB, dC, dD, None, ddt_bias, grads[7] if with_init else None
    return fwd, bwd


def _conv_reference(x, weight, bias, seq_idx):
    """SiLU(causal depthwise conv) of x [b, d, L] in plain operators (for torch.func.vjp): tap
    ``i`` of the kernel reads token ``t - (k - 1 - i)`` of the same document."""
    k, L = weight.shape[-1], x.shape[-1]
    xp = F.pad(x, (k - 1, 0))
    same = None if seq_idx is None else F.pad(seq_idx, (k - 1, 0), value=-1)
    out = 0
    for i in range(k):
        tap = xp[..., i:i + L] * weight[:, i, None]
        if same is not None:
            tap = tap * (same[:, i:i + L] == seq_idx)[:, None].to(x.dtype)
        out = out + tap
    return F.silu(out if bias is None else out + bias[:, None])


def fake_causal_conv1d_cuda(calls):
    """causal_conv1d_cuda's ``causal_conv1d_fwd`` / ``_bwd`` before 1.5.1."""
    def fwd(*args):
        a = _bind(conv_fwd_cpp_1_4, args, {})
        calls.append("causal_conv1d_fwd")
        assert a["initial_states"] is None and a["final_states_out"] is None and a["silu_activation"] is True
        return causal_conv1d_torch(a["x"], a["weight"], a["bias"], a["seq_idx"], activation="silu")

    def bwd(*args):
        a = _bind(conv_bwd_cpp_1_4, args, {})
        calls.append("causal_conv1d_bwd")
        assert a["dx"] is None and a["return_dinitial_states"] is False and a["silu_activation"] is True
        bias = a["bias"]
        f = lambda x, w, *b: _conv_reference(x, w, b[0] if b else None, a["seq_idx"])  # noqa: E731
        _, vjp = torch.func.vjp(f, a["x"], a["weight"], *([bias] if bias is not None else []))
        grads = vjp(a["dout"])
        return grads[0], grads[1], grads[2] if bias is not None else None, None
    return fwd, bwd


def fake_causal_conv1d_fn(signature_of, calls):
    def causal_conv1d_fn(*args, **kwargs):
        a = _bind(signature_of, args, kwargs)
        calls.append("causal_conv1d_fn")
        x, weight, bias, seq_idx = a["x"], a["weight"], a["bias"], a["seq_idx"]
        assert a["activation"] in (None, "silu", "swish")
        batch, dim, seqlen = x.shape
        width = weight.shape[-1]
        assert weight.shape == (dim, width) and 2 <= width <= 4
        assert x.stride(2) == 1 or x.stride(1) == 1
        channel_last = x.stride(1) == 1 and x.stride(2) > 1
        if channel_last:
            assert dim % 8 == 0 and x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0
        if bias is not None:
            assert bias.dtype == weight.dtype and bias.stride(-1) == 1 and bias.shape == (dim,)
        if seq_idx is not None:
            assert channel_last, "seq_idx is only supported for channel last layout"
            assert seq_idx.dtype == torch.int32 and seq_idx.is_contiguous() and seq_idx.shape == (batch, seqlen)
            assert a["initial_states"] is None and not a["return_final_states"]
        return causal_conv1d_torch(x, weight, bias, seq_idx, activation="silu" if a["activation"] else None)
    return causal_conv1d_fn


def fake_causal_conv1d_update(signature_of, calls):
    def causal_conv1d_update(*args, **kwargs):
        a = _bind(signature_of, args, kwargs)
        calls.append("causal_conv1d_update")
        x, conv_state, weight, bias = a["x"], a["conv_state"], a["weight"], a["bias"]
        assert a["activation"] in (None, "silu", "swish")
        squeeze = x.dim() == 2
        x = x.unsqueeze(-1) if squeeze else x
        batch, dim, seqlen = x.shape
        width, state_len = weight.shape[-1], conv_state.shape[-1]
        assert conv_state.dtype == x.dtype, "conv_state must have x's dtype"
        assert conv_state.shape == (batch, dim, state_len) and state_len >= width - 1
        assert weight.shape == (dim, width) and 2 <= width <= 4
        if bias is not None:
            assert bias.dtype == weight.dtype and bias.stride(-1) == 1 and bias.shape == (dim,)
        # causal_conv1d_update_ref
        x_new = torch.cat([conv_state, x], dim=-1).to(weight.dtype)
        conv_state.copy_(x_new[:, :, -state_len:])
        out = F.conv1d(x_new, weight.unsqueeze(1), bias, padding=0, groups=dim)[:, :, -seqlen:]
        out = (F.silu(out) if a["activation"] else out).to(x.dtype)
        return out.squeeze(-1) if squeeze else out
    return causal_conv1d_update


@pytest.fixture(params=[(m, c) for m in MAMBA for c in CONV], ids=lambda p: f"{p[0]}+{p[1]}")
def releases(request, monkeypatch):
    """The fake modules of one mamba_ssm and one causal_conv1d release in ``sys.modules``;
    yields the list of kernel calls."""
    calls: list[str] = []
    ssu, scan = MAMBA[request.param[0]]
    conv_fn, conv_update, own_ops = CONV[request.param[1]]
    scan_fwd, scan_bwd = fake_mamba_chunk_scan_combined(scan, calls)
    conv_fwd, conv_bwd = fake_causal_conv1d_cuda(calls)
    mods = {
        "causal_conv1d": dict(causal_conv1d_fn=fake_causal_conv1d_fn(conv_fn, calls),
                              causal_conv1d_update=fake_causal_conv1d_update(conv_update, calls)),
        "causal_conv1d_cuda": dict(causal_conv1d_fwd=conv_fwd, causal_conv1d_bwd=conv_bwd),
        "mamba_ssm": {}, "mamba_ssm.ops": {}, "mamba_ssm.ops.triton": {},
        "mamba_ssm.ops.triton.ssd_combined": dict(_mamba_chunk_scan_combined_fwd=scan_fwd,
                                                  _mamba_chunk_scan_combined_bwd=scan_bwd),
        "mamba_ssm.ops.triton.selective_state_update": dict(
            selective_state_update=fake_selective_state_update(ssu, calls)),
    }
    for name, attrs in mods.items():
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(__name__=name, **attrs))
    monkeypatch.setattr(kernels, "conv_has_own_ops", lambda: own_ops)
    kernels.forget_kernels()
    yield calls
    kernels.forget_kernels()


def _mamba_mixer(seed=0):
    # 4 heads of 4, 1 group of state 8: conv channels 32 (the kernel's channel-last layout needs
    # a multiple of 8), in_proj width 52 (its rows are not: the dispatch copies to a good layout)
    return tiny_mamba_mixer(4, 1, seed)


def _with_kernels(mode, fn, *args, **kwargs):
    with backend.using(backend.BackendSettings(mamba_kernels=mode)):
        return fn(*args, **kwargs)


@pytest.mark.parametrize("packed", [False, True], ids=["one_doc", "packed"])
def test_training_forward_and_backward_through_the_kernels(releases, packed):
    m = _mamba_mixer()
    x = torch.randn(2, 10, 16)
    seq_idx = torch.tensor([[0] * 4 + [1] * 6, [0] * 10]) if packed else None
    outs = []
    for mode in (True, False):
        m.zero_grad()
        xi = x.clone().requires_grad_()
        y = _with_kernels(mode, m, xi, seq_idx=seq_idx)
        y.square().sum().backward()
        outs.append((y.detach(), xi.grad, m.in_proj.weight.grad, m.dt_bias.grad))
    conv = {"causal_conv1d_fn"} if kernels.conv_has_own_ops() else {"causal_conv1d_fwd", "causal_conv1d_bwd"}
    assert set(releases) == {"mamba_chunk_scan_combined", "mamba_chunk_scan_combined_bwd"} | conv
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_through_the_kernels(releases, dtype):
    b, h, p, n, g, d, k = 3, 4, 4, 8, 2, 32, 4
    torch.manual_seed(0)
    x, dt = torch.randn(b, h, p).to(dtype), torch.randn(b, h).to(dtype)
    A, D, dt_bias = -torch.rand(h) - 0.5, torch.randn(h), torch.randn(h)
    B, C = torch.randn(b, g, n).to(dtype), torch.randn(b, g, n).to(dtype)
    ssm0 = torch.randn(b, h, p, n)
    xc, conv0 = torch.randn(b, d).to(dtype), torch.randn(b, d, k - 1).to(dtype)
    w, bias = torch.randn(d, k), torch.randn(d)
    results = []
    for mode in (True, False):
        ssm, conv = ssm0.clone(), conv0.clone()
        y = _with_kernels(mode, kernels.ssd_step, ssm, x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_limit=(0.0, 10.0))
        yc = _with_kernels(mode, kernels.conv_step, xc, conv, w, bias)
        results.append((y, ssm, yc, conv))
    assert sorted(set(releases)) == ["causal_conv1d_update", "selective_state_update"]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for got, want in zip(*results):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, **tol)


def test_the_fakes_reject_what_the_releases_reject():
    """The checks above bite: ``dt_bias=None`` (the call that crashed ``generate`` on CUDA with
    mamba_ssm 2.3.2) and ``D=None`` fail in every release, an argument a release lacks too."""
    h, p, n = 2, 3, 4
    args = (torch.zeros(1, h, p, n), torch.zeros(1, h, p), torch.zeros(1, h, 1).expand(1, h, p),
            torch.zeros(h, 1, 1).expand(h, p, n), torch.zeros(1, 1, n), torch.zeros(1, 1, n))
    for ssu, _ in MAMBA.values():
        fake = fake_selective_state_update(ssu, [])
        with pytest.raises(AttributeError, match="stride"):
            fake(*args, D=torch.zeros(h, p), dt_bias=None)
        with pytest.raises(TypeError):
            fake(*args, D=None, dt_bias=torch.zeros(h, 1).expand(h, p))
    with pytest.raises(TypeError):  # 2.2.x has no state_batch_indices
        fake_selective_state_update(ssu_2_2, [])(*args, D=torch.zeros(h, p), dt_bias=torch.zeros(h, p),
                                                 state_batch_indices=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(AssertionError, match="dtype"):
        fake_causal_conv1d_update(conv_update_1_5, [])(torch.zeros(1, 8), torch.zeros(1, 8, 3, dtype=torch.bfloat16),
                                                      torch.zeros(8, 4))


def test_autotune_is_announced_once(releases, caplog):
    m = _mamba_mixer()
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        for _ in range(2):
            _with_kernels(True, m, torch.randn(1, 6, 16))
    notes = [r.getMessage() for r in caplog.records if "autotune" in r.getMessage()]
    assert len(notes) == 1 and "first use" in notes[0], notes


def test_auto_keeps_cpu_tensors_on_the_torch_path(releases):
    m = _mamba_mixer()
    _with_kernels("auto", m, torch.randn(1, 6, 16))
    assert releases == []


def test_required_kernels_that_do_not_import_are_named(monkeypatch):
    """``true``: a Triton kernel that does not import refuses, naming the package and the floor;
    causal_conv1d (CUDA C++) leaves CPU tensors on the PyTorch path."""
    monkeypatch.setitem(sys.modules, "mamba_ssm.ops.triton.ssd_combined", None)  # import fails
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)
    kernels.forget_kernels()
    try:
        with pytest.raises(ValueError, match="training.mamba_kernels is true.*ssd_combined.*mamba-ssm>=2.2.5"):
            _with_kernels(True, _mamba_mixer(), torch.randn(1, 6, 16))
    finally:
        kernels.forget_kernels()


def test_paths_refuse_under_true_and_warn_under_auto_on_cuda(monkeypatch, caplog):
    """What a run's first log lines say: on a CUDA device a missing kernel refuses ``true`` and
    is a WARNING under ``auto`` (package, reason, fix); CPU tensors under ``auto`` are PyTorch."""
    monkeypatch.setitem(sys.modules, "mamba_ssm.ops.triton.ssd_combined", None)
    monkeypatch.setitem(sys.modules, "mamba_ssm.ops.triton.selective_state_update", None)
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)
    kernels.forget_kernels()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    try:
        with pytest.raises(ValueError, match="mamba_kernels is true.*mamba-ssm"):
            _with_kernels(True, kernels.paths, cuda)
        with caplog.at_level(logging.WARNING, logger=kernels.__name__):
            paths = _with_kernels("auto", kernels.paths, cuda)
        assert paths == {"ssd": "PyTorch (mamba-ssm does not import)",
                         "state_update": "PyTorch (mamba-ssm does not import)",
                         "conv": "PyTorch (causal-conv1d does not import)"}
        warned = " ".join(r.getMessage() for r in caplog.records)
        assert "ModuleNotFoundError" in warned and "pip install mamba-ssm>=2.2.5" in warned
        assert "pip install causal-conv1d" in warned
        assert set(_with_kernels("auto", kernels.paths, cpu).values()) == {"PyTorch (auto: kernels for CUDA tensors)"}
        assert set(_with_kernels(False, kernels.paths, cuda).values()) == {"PyTorch (training.mamba_kernels=false)"}
    finally:
        kernels.forget_kernels()


def test_paths_name_the_release_and_the_op(releases):
    paths = _with_kernels(True, kernels.paths, torch.device("cuda"))
    assert paths["ssd"].endswith("_mamba_chunk_scan_combined_fwd via hybridtrain::ssd_scan"), paths
    assert paths["state_update"].endswith("selective_state_update via hybridtrain::ssd_state_update"), paths
    own = kernels.conv_has_own_ops()
    assert paths["conv"].endswith("causal_conv1d_fn" if own else "via hybridtrain::causal_conv1d"), paths


@pytest.mark.parametrize("version, warns", [("2.2.2", True), ("2.2.4", True), ("2.2.5", False),
                                            ("2.3.2.post1", False), ("2.2.6.post3", False)])
def test_mamba_ssm_before_2_2_5_is_named_with_the_nan_risk(version, warns):
    problem = kernels.mamba_ssm_floor_problem(version)
    assert (problem is not None) == warns
    if warns:
        assert version in problem and "NaN" in problem and "#713" in problem and ">=2.2.5" in problem
