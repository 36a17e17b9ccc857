"""Memory of a rank: bytes it really holds in local shards of parameters, gradients and
optimizer state (what ``hybridtrain plan`` predicts); host-memory measurements (resident pages
from ``/proc/self/status``; bytes glibc's malloc handed out) and the random bf16 Hub checkpoints
they load: the layer pattern of a hybrid MoE model at a chosen width, written one tensor at a
time (the writer never holds the model).

Resident memory (``VmHWM``) counts pages, so it moves with the machine: transparent huge pages
(``always`` rounds sparse regions up to 2 MiB), file pages mapped in (page cache), freed memory
an allocator keeps. :func:`malloc_mmap_peak` counts what the run asked for: with glibc's mmap
threshold fixed (``MALLOC_MMAP_THRESHOLD_=65536``) every block of 64 KiB or more -- all tensor
storage and read buffers of a model -- is its own mapping, and glibc keeps the largest sum of
those alive at once. The activation measures (:func:`activations_at_peak`) lower the threshold
to a page (:func:`count_every_block`): a tiny model's per-expert and per-document tensors are
smaller than 64 KiB."""

from __future__ import annotations

import functools
import os

import torch

from hybridtrain.distributed.utils import local_tensor


def _nbytes(t: torch.Tensor) -> int:
    t = local_tensor(t)
    if type(t) not in (torch.Tensor, torch.nn.Parameter):  # a packed subclass (NF4): its parts
        return sum(_nbytes(getattr(t, n)) for n in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """{"params", "grads", "optimizer"}: summed local tensor bytes on this rank."""
    params = list({id(p): p for p in model.parameters()}.values())
    return {
        "params": sum(_nbytes(p) for p in params),
        "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(_nbytes(v) for state in optimizer.state.values()
                         for v in state.values() if torch.is_tensor(v)),
    }


class _Held:
    """A saved tensor in the graph: the storage's count drops when autograd frees it."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor, key, owner):
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self):
        self.owner._release(self.key)


class SavedActivations:
    """Bytes autograd holds for backward while the context is open (what an estimate's kept
    part counts; the plan's whole activation figure is a peak: :func:`activations_at_peak`): the unique storages of
    the tensors saved through ``torch.autograd.graph.saved_tensors_hooks`` (the parameters of
    ``modules`` excluded, also while FSDP2 has them gathered), each counted from its saving
    until the backward that uses it frees it; ``peak``: the most held at once. (Under
    activation checkpointing the checkpoint's own hooks hide the block inputs from it.)"""

    def __init__(self, *modules: torch.nn.Module):
        self.modules = modules
        self.live = self.peak = 0
        self._count: dict[int, int] = {}
        self._size: dict[int, int] = {}

    def _params(self) -> set[int]:
        return {local_tensor(p).untyped_storage().data_ptr()
                for m in self.modules for p in m.parameters()}

    def _pack(self, t):
        if t.is_meta or t.device.type != "cpu":
            return t
        s = t.untyped_storage()
        key = s.data_ptr()
        if s.nbytes() == 0 or key in self._params():
            return t
        if self._count.get(key, 0) == 0:
            self._size[key] = s.nbytes()
            self.live += s.nbytes()
            self.peak = max(self.peak, self.live)
        self._count[key] = self._count.get(key, 0) + 1
        return _Held(t, key, self)

    def _release(self, key: int) -> None:
        self._count[key] -= 1
        if self._count[key] == 0:
            self.live -= self._size.pop(key)

    @staticmethod
    def _unpack(x):
        return x.tensor if isinstance(x, _Held) else x

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def planned_bytes(plan, rank: int) -> dict[str, float]:
    r = plan.ranks[rank]
    return {"params": r.params, "grads": r.grads, "optimizer": r.optimizer}


def assert_close_10pct(got: dict, want: dict, what: str) -> None:
    for k in ("params", "grads", "optimizer"):
        assert got[k] > 0, (what, k, got)
        assert abs(want[k] - got[k]) <= 0.10 * got[k], (what, k, got, want)


def held_at_optimizer_step(b, trainer, steps: int = 2) -> dict[str, int]:
    """:func:`held_bytes` just before the optimizer step of the last of ``steps`` training steps
    (the trainer drops the gradients after each step; the state exists from the second on)."""
    from tests.helpers import parity as pu

    seen = []
    handle = b.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append(held_bytes(b.model, opt)))
    try:
        pu.train(b, trainer, steps=steps)
    finally:
        handle.remove()
    return seen[-1]


PATTERN = "MEE" * 8 + "*EE" * 2  # 30 layers: 8 Mamba, 2 attention, 20 MoE of 16 experts


def status(key: str) -> int:
    """``VmHWM`` (peak resident), ``VmRSS`` ... of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


@functools.cache
def _glibc():
    """This process's C library when it is glibc >= 2.33 (``mallinfo2``), else None."""
    import ctypes

    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _Mallinfo2
    return libc


def _mallinfo2_struct():
    import ctypes

    names = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
             "fordblks", "keepcost")
    return type("Mallinfo2", (ctypes.Structure,), {"_fields_": [(n, ctypes.c_size_t) for n in names]})


_Mallinfo2 = _mallinfo2_struct()


def malloc_mmapped() -> int:
    """Bytes in glibc's mmapped blocks now (``mallinfo2().hblkhd``)."""
    return _glibc().mallinfo2().hblkhd


def malloc_mmap_peak() -> int:
    """The most bytes this process has held in glibc's mmapped blocks at once, so far (the
    ``max mmap bytes`` of ``malloc_stats()``, which prints it on stderr: read from there)."""
    import tempfile

    libc = _glibc()
    with tempfile.TemporaryFile() as f:
        libc.fflush(None)
        saved = os.dup(2)
        try:
            os.dup2(f.fileno(), 2)
            libc.malloc_stats()
            libc.fflush(None)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        text = f.read().decode()
    return int(text.split("max mmap bytes")[1].split("=")[1].split()[0])


_M_MMAP_THRESHOLD = -3
PAGE = 4096


def count_every_block(smallest: int = PAGE) -> None:
    """From now on glibc serves every block of ``smallest`` bytes (a page, 4 KiB) or more with
    its own mapping and keeps that threshold fixed (``mallopt(M_MMAP_THRESHOLD)``, as
    ``MALLOC_MMAP_THRESHOLD_=4096`` at start), so that :func:`malloc_mmapped` and
    :func:`malloc_mmap_peak` count every tensor but the tiniest, the small per-expert and
    per-document ones of a tiny model included (64 KiB leaves them in malloc's arenas). Needs
    ``training.cpu_allocator: system`` (``heap`` turns mmaps off)."""
    assert _glibc().mallopt(_M_MMAP_THRESHOLD, smallest) == 1


def no_blas_buffers(monkeypatch) -> None:
    """Ranks started from now on (``run_distributed``: MKL reads its instruction set at its
    first call, in the rank) run Intel MKL so that it allocates nothing of its own in a GEMM, on every
    CPU, so :func:`step_peak` counts the run's tensors and not the BLAS's working memory
    (no activation, and not the plan's to predict):

    * its memory manager off (``MKL_DISABLE_FAST_MM``, read when torch loads MKL: the suite
      sets it for all its processes, tests/conftest.py): no pool of freed buffers kept (on an
      AVX-512 Xeon, 2026-11-28, the tiny VLM's first step left ~7 MiB in it; 2.8 MB after a
      few GEMMs with the SSE4.2 kernels, 2026-12-06);
    * its SSE4.2 kernels (``MKL_ENABLE_INSTRUCTIONS=SSE4_2``, on every x86-64 CPU): MKL's AVX2 and
      AVX-512 kernels malloc packing buffers for the length of a GEMM call, and choose them by
      CPU vendor (on an AMD EPYC MKL takes kernels without them): 1.6 MiB at the peak of the VLM's
      last pipeline stage on an Intel Xeon (Sapphire Rapids, 2026-12-06), none on an AMD EPYC or
      with SSE4.2 (7.01 / 7.05 MiB against 8.69 MiB)."""
    monkeypatch.setenv("MKL_DISABLE_FAST_MM", "1")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "SSE4_2")


def step_peak(b, trainer, step: int = 0) -> int:
    """The most bytes allocated at once during training step ``step`` (glibc's mmapped blocks,
    :func:`count_every_block` called before the build) above those alive before it, its
    micro-batches loaded before. glibc keeps one peak for the process's life: the step's must
    be above every earlier one (asserted). Ranks started under :func:`no_blas_buffers`
    count no MKL buffer in it."""
    import gc

    from tests.helpers import parity as pu

    batches = pu.micro_batches(b, step)
    gc.collect()
    before, earlier = malloc_mmapped(), malloc_mmap_peak()
    trainer.train_one_step(batches)
    peak = malloc_mmap_peak()
    assert peak > earlier, ("the step's peak is not above an earlier one", peak, earlier)
    return peak - before


def activations_at_peak(b, trainer, planned) -> int:
    """What a training step's peak holds above the rank's gradients and buffers as ``planned``
    (the plan's :class:`~hybridtrain.training.memory_plan.RankMemory` of the rank; they equal the run's:
    tests/distributed/test_plan_layouts.py): the activations, as the plan means them. The first
    step (no optimizer state yet; all gradients counted though fewer exist at the peak)."""
    return step_peak(b, trainer) - planned.grads - sum(planned.buffers.values())


def long_rows_recipe(layout: dict, pack_size: int = 1024, **sections) -> dict:
    """The parity recipe (:mod:`tests.helpers.parity`: the tiny mixed Nemotron-H, width 64)
    under ``layout`` on packed rows of ``pack_size`` tokens of documents of 256-512 tokens, the
    system allocator: activations far above parameters, gradients and optimizer state."""
    from tests.helpers import parity as pu

    training = {"cpu_allocator": "system", **sections.pop("training", {})}
    recipe = pu.recipe(layout, True, training=training, **sections)
    recipe["packing"]["pack_size"] = pack_size
    recipe["dataset"].update(n=pu.STEPS * pu.GBS * pack_size // 256, min_len=256, max_len=512)
    return recipe


def build_long_rows(layout: dict, world: int, **sections):
    """(``Built``, trainer for 2 steps) of :func:`long_rows_recipe`, with every block counted
    (:func:`count_every_block`)."""
    import torch.distributed as dist

    from hybridtrain.training.builder import build

    count_every_block()
    rank = dist.get_rank() if dist.is_initialized() else 0
    b = build(long_rows_recipe(layout, **sections), "cpu", is_main=rank == 0, world_size=world)
    return b, trainer(b, 2)


def glibc_malloc() -> bool:
    """Whether this process's malloc is glibc's (the ``malloc_*`` measures need it)."""
    return _glibc() is not None


def reset_peak() -> None:
    """``VmHWM`` := ``VmRSS`` (Linux ``clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def config_overrides(hidden: int | None, pattern: str = PATTERN, vocab: int = 32000) -> dict:
    """``tiny_config("moe", **overrides)`` of :func:`config`."""
    if hidden is None:
        return dict(hybrid_override_pattern=pattern, n_routed_experts=16)
    return dict(hybrid_override_pattern=pattern, vocab_size=vocab,
                hidden_size=hidden, num_attention_heads=8, num_key_value_heads=2,
                head_dim=hidden // 8, intermediate_size=2 * hidden,
                mamba_num_heads=hidden // 32, mamba_head_dim=64, n_groups=2,
                ssm_state_size=64, chunk_size=16, n_routed_experts=16,
                moe_intermediate_size=hidden, moe_shared_expert_intermediate_size=hidden)


def config(hidden: int | None, pattern: str = PATTERN, vocab: int = 32000):
    """The pattern at width ``hidden`` (1024: ~1.7 GB in bf16, 512: ~0.45 GB; None: tiny)."""
    from hybridtrain.models.nemotron_h import tiny_config

    return tiny_config("moe", **config_overrides(hidden, pattern, vocab))


def checkpoint_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.endswith(".safetensors"))


def write_checkpoint(out: str, cfg, max_shard_size: str = "200MB") -> int:
    """A random bf16 Hub checkpoint of ``cfg`` in ``out`` (several files and an index),
    written one tensor at a time; returns its size in bytes."""
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM
    from hybridtrain.models.spec import model_spec_for

    with torch.device("meta"):
        model = NemotronHForCausalLM(cfg)
    layout = model.state_dict()
    g = torch.Generator().manual_seed(0)
    tensors = ((n, (torch.randn(t.shape, generator=g) * 0.02).to(torch.bfloat16))
               for n, t in layout.items())
    model_spec_for(model).hf.save(layout, cfg, out, max_shard_size=max_shard_size,
                                  dtype=torch.bfloat16, tensors=tensors)
    return checkpoint_bytes(out)


def lora_recipe(layout: dict, ckpt: str, allocator: str = "system", packed: bool = False,
                **training) -> dict:
    """The parity recipe (tests.helpers.parity) with LoRA on all linear layers and experts over
    the bf16 Hub checkpoint ``ckpt`` as a bf16 frozen base, computing in bf16 (``packed``: rows
    of one length, so the CPU GEMMs see one shape per layer)."""
    from tests.helpers import parity as pu

    recipe = pu.recipe(layout, packed=packed, peft={"dim": 8, "alpha": 16, "match_all_linear": True},
                       training={"dtype": "bfloat16", "cpu_allocator": allocator, **training})
    recipe["model"] = {
        "_target_": "hybridtrain.models.nemotron_h.NemotronHForCausalLM.from_pretrained",
        "local_dir": ckpt, "dtype": "bfloat16"}
    return recipe


def trainer(b, steps: int):
    """The recipe's trainer of the built recipe ``b`` for ``steps`` steps."""
    from hybridtrain.training.builder import make_trainer
    from hybridtrain.training.lr_schedule import LRScheduler
    from hybridtrain.training.step_scheduler import StepScheduler

    t = b.cfg.training
    sched = StepScheduler(t.global_batch_size, t.micro_batch_size, dp_size=b.plan.dims.dp,
                          max_steps=steps, num_train_samples=len(b.data.train), seed=t.seed)
    lr = LRScheduler(b.optimizer, **b.cfg.lr_scheduler.to_dict(), total_steps=steps,
                     total_samples=steps * sched.global_batch_size)
    return make_trainer(b, sched, lr)


def train(b, steps: int) -> tuple[list[float], list[float]]:
    """``steps`` training steps of the built recipe ``b`` (the recipe's trainer, the parity
    micro-batches): (losses, gradient norms)."""
    from tests.helpers import parity as pu

    return pu.train(b, trainer(b, steps), steps=steps)


class RssAnonSampler:
    """The peak of this process's anonymous resident memory (``RssAnon`` of
    ``/proc/self/status``), sampled every ``interval`` seconds by a thread while the run goes
    (``with RssAnonSampler() as s: ...; s.peak``); :meth:`reset` starts a new peak."""

    def __init__(self, interval: float = 0.005):
        import threading

        self.interval, self.peak = interval, status("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, status("RssAnon"))
            self._stop.wait(self.interval)

    def reset(self) -> int:
        """The peak so far (sampled once more now); the next peak starts from now."""
        peak, self.peak = max(self.peak, status("RssAnon")), status("RssAnon")
        return peak

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, status("RssAnon"))
