"""Activation memory per rank under tensor parallelism (tp=2) with and without sequence parallelism.

Both layouts run in this invocation, each on 2 fresh gloo ranks (one thread each) built by the
recipe's builder (fp32, the mixed Nemotron-H of ``benchmarks/plan_activations.py``: layers
``M*-EM*-E``, hidden 256). Every rank takes one forward + backward of one ``L``-token row through
the chunked loss and reports:

* ``kept``: resident memory after forward minus before (VmRSS): what forward leaves for
  backward (the children run with ``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0`` so
  that freed tensors leave the resident set). Not autograd's saved-tensor hooks: sequence
  parallelism installs its own around the mixers, and the innermost hooks hide the others;
* ``peak``: the rise of the process's peak resident set (VmHWM, reset before forward) over
  forward + backward, less the parameter gradients.

The ratio sp / no-sp of each is printed. fp32 only (this machine emulates bf16).

    python benchmarks/sequence_parallel.py [--seq-len 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from plan_activations import recipe  # noqa: E402  (the same model; it puts the repository on the path)
from tests.helpers.memory import status as _status  # noqa: E402  (the memory probe)


def _rank(rank: int, world: int, port: int, sp: bool, seq_len: int, outdir: str) -> None:
    import torch
    import torch.distributed as dist

    from hybridtrain.distributed.utils import local_tensor
    from hybridtrain.training.builder import build

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = recipe("M*-EM*-E", False, 1, seq_len)
    cfg["distributed"] = {"tp": world, "sequence_parallel": sp}
    b = build(cfg, "cpu", is_main=rank == 0, world_size=world, data=False)
    model = b.model
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=g)
    model(ids[:, :64], labels=ids[:, :64]).backward()  # warm up kernels and allocator
    model.zero_grad(set_to_none=True)

    grads = sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())
    dist.barrier()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM
    loss = model(ids, labels=ids)
    kept = _status("VmRSS") - before
    loss.backward()
    peak = _status("VmHWM") - before - grads
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump({"kept": kept, "peak": peak, "loss": float(loss.detach())}, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(sp: bool, seq_len: int, world: int = 2) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_rank, args=(world, _free_port(), sp, seq_len, d), nprocs=world,
                           start_method="spawn")
        return [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(world)]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=8192)
    args = ap.parse_args(argv)
    os.environ.update(OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    mib = 2 ** 20
    res = {sp: run(sp, args.seq_len) for sp in (False, True)}
    print(f"tp=2, fp32, one row of {args.seq_len} tokens, per rank (MiB)")
    for key in ("kept", "peak"):
        off = max(r[key] for r in res[False])
        on = max(r[key] for r in res[True])
        print(f"  {key:6s} no sp {off / mib:8.1f}   sp {on / mib:8.1f}   sp/no-sp {on / off:.3f}")
    assert abs(res[True][0]["loss"] - res[False][0]["loss"]) <= 1e-5 * abs(res[False][0]["loss"])
    return res


if __name__ == "__main__":
    main()
