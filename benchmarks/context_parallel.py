"""Packed attention and context parallelism: time, peak memory and bytes sent.

    python benchmarks/context_parallel.py [--model demo|small_moe] [--packed-len 32768]
        [--cp-lens 16384,65536] [--cp-doc-len 4096] [--cp 1,2,4] [--bytes-lens 8192,32768]
        [--json out.json]
        [--skip-packed] [--skip-cp]

The model: ``demo`` (default) is the one of ``examples/squad_tiny.yaml`` (0.9M parameters,
``M*-EM*E``: 2 Mamba2, 2 attention, 1 MLP, 2 MoE layers); ``small_moe`` the ~48M-parameter
``small_moe_config()`` (``MEM*EM-E``). fp32, random weights and tokens, every token labelled. A run is one forward
+ backward of one row after a short warm-up, in child processes of its own (fresh heap) with one
thread each; its peak memory is the rise of the process's peak resident set (VmHWM, reset after
the warm-up) over its resident set before the step.

1. **Packed vs single**: one row of ``--packed-len`` tokens holding four equal documents
   against one document of the same length (one process). Goal: packed <= single in time and
   memory (attention costs the sum of the documents' causal squares, no [L, L] mask).
2. **Context parallelism**: the row of each of ``--cp-lens`` tokens (documents of
   ``--cp-doc-len`` tokens, 0: one document; CPU attention over one 64k document alone would
   take most of an hour here) over
   ``--cp`` gloo ranks (``hybridtrain.distributed.context_parallel``): per-rank peak memory,
   per-rank CPU seconds and tokens/s (wall; on this machine the ranks share its cores, so
   tokens per CPU-second per rank is the figure that carries over to one device per rank).
3. **Bytes per Mamba layer**: bytes a rank sends for the Mamba layers (conv halo + state, both
   directions) per forward+backward, per Mamba layer, at each of ``--bytes-lens`` (cp=2).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _status(key: str) -> int:
    """A /proc/self/status figure in bytes (VmHWM, VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set


def _model(name: str):
    from hybridtrain.config import instantiate, load_config
    from hybridtrain.models.nemotron_h import NemotronHForCausalLM
    from hybridtrain.models.nemotron_h.tiny import small_moe_config
    from hybridtrain.models.spec import set_train_loss
    from hybridtrain.ops.loss import LinearCrossEntropy

    torch.manual_seed(0)
    if name == "demo":
        model = instantiate(load_config(os.path.join(ROOT, "examples", "squad_tiny.yaml")).model)
    else:
        model = NemotronHForCausalLM(small_moe_config())
    set_train_loss(model, LinearCrossEntropy(chunk_size=1024, reduction="sum"))
    return model


def _batch(L: int, docs: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, L), generator=g)
    pos = (torch.arange(L) % (L // docs))[None]
    return {"input_ids": ids, "labels": torch.roll(ids, -1, 1), "position_ids": pos}


def _step(model, batch) -> dict:
    """One forward + backward: wall and CPU seconds, peak memory rise."""
    model.zero_grad(set_to_none=True)
    _reset_peak()
    rss0 = _status("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    loss = model(batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"])
    loss.backward()
    return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
            "peak_mb": (_status("VmHWM") - rss0) / 2**20}


# -- 1. packed vs single ----------------------------------------------------------------------
def _packed_child(name: str, L: int, docs: int, out: str) -> None:
    sys.path.insert(0, os.path.join(ROOT, "src"))
    torch.set_num_threads(1)
    model = _model(name)
    _step(model, _batch(512, docs, model.config.vocab_size))  # warm-up
    res = _step(model, _batch(L, docs, model.config.vocab_size))
    with open(out, "w") as f:
        json.dump(res, f)


def packed_vs_single(model: str, L: int) -> dict:
    res = {}
    for run, docs in (("single", 1), ("packed", 4)):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            p = mp.get_context("spawn").Process(target=_packed_child, args=(model, L, docs, f.name))
            p.start()
            p.join()
            assert p.exitcode == 0, f"{run} run failed"
            res[run] = json.load(open(f.name))
        print(f"  {run:7s} {L} tokens, {docs} document(s): {res[run]['wall_s']:.1f} s wall, "
              f"{res[run]['cpu_s']:.1f} CPU s, peak +{res[run]['peak_mb']:.0f} MB", flush=True)
    for k in ("wall_s", "cpu_s", "peak_mb"):
        res[f"packed/single {k}"] = res["packed"][k] / res["single"][k]
    print(f"  packed / single: time {res['packed/single cpu_s']:.2f}x (CPU s), "
          f"{res['packed/single wall_s']:.2f}x (wall), memory {res['packed/single peak_mb']:.2f}x")
    return res


# -- 2./3. context parallel -------------------------------------------------------------------
def _cp_child(rank: int, name: str, cp: int, lens: list, doc_len: int, port: int, outdir: str
              ) -> None:
    sys.path.insert(0, os.path.join(ROOT, "src"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from hybridtrain.distributed.context_parallel import apply_context_parallel, shard_batch

    dist.init_process_group("gloo", rank=rank, world_size=cp)
    model = _model(name)
    ctx = apply_context_parallel(model, dist.group.WORLD) if cp > 1 else None
    n_mamba = model.config.layers_block_type.count("linear_attention")

    def local(L):
        b = _batch(L, L // doc_len if doc_len else 1, model.config.vocab_size)
        return shard_batch(b, rank, cp) if cp > 1 else b

    _step(model, local(doc_len or 256 * cp))  # warm-up: connections, kernels
    out = {}
    for L in lens:
        dist.barrier()
        if ctx is not None:
            ctx.bytes_sent.clear()
        r = _step(model, local(L))
        if ctx is not None:
            mamba = sum(v for k, v in ctx.bytes_sent.items() if k.startswith(("halo", "state")))
            r["mamba_bytes_per_layer"] = mamba / n_mamba
            r["bytes_sent"] = dict(ctx.bytes_sent)
        out[L] = r
    dist.destroy_process_group()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cp_run(name: str, cp: int, lens: list, doc_len: int = 0) -> dict:
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_cp_child, args=(name, cp, lens, doc_len, _free_port(), d), nprocs=cp,
                           start_method="spawn", join=True)
        ranks = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(cp)]
    res = {}
    for L in lens:
        per = [rk[str(L)] for rk in ranks]
        wall = max(p["wall_s"] for p in per)
        cpu = max(p["cpu_s"] for p in per)
        res[L] = {"wall_s": wall, "tokens_per_s": L / wall, "max_rank_cpu_s": cpu,
                  "tokens_per_cpu_s_per_rank": L / cpu,
                  "peak_mb_per_rank": [round(p["peak_mb"]) for p in per],
                  "mamba_bytes_per_layer": [p.get("mamba_bytes_per_layer") for p in per]}
        print(f"  cp={cp} {L:6d} tokens: {wall:6.1f} s wall ({L / wall:6.0f} tokens/s), max rank "
              f"{cpu:6.1f} CPU s ({L / cpu:6.0f} tokens per CPU-s per rank), peak per rank "
              f"{res[L]['peak_mb_per_rank']} MB", flush=True)
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("demo", "small_moe"), default="demo")
    ap.add_argument("--packed-len", type=int, default=32768)
    ap.add_argument("--cp-lens", default="16384,65536")
    ap.add_argument("--cp-doc-len", type=int, default=4096)
    ap.add_argument("--cp", default="1,2,4")
    ap.add_argument("--bytes-lens", default="8192,32768")
    ap.add_argument("--skip-packed", action="store_true")
    ap.add_argument("--skip-cp", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}, model {a.model}", flush=True)
    out = {}
    if not a.skip_packed:
        print(f"1. packed row vs one document ({a.packed_len} tokens, fp32, forward+backward)")
        out["packed_vs_single"] = packed_vs_single(a.model, a.packed_len)
    if not a.skip_cp:
        lens = [int(x) for x in a.cp_lens.split(",")]
        print(f"2. context parallel, rows of {lens} tokens, documents of "
              f"{a.cp_doc_len or 'the whole row'} tokens")
        out["cp"] = {cp: cp_run(a.model, cp, lens, a.cp_doc_len) for cp in (int(x) for x in a.cp.split(","))}
        blens = [int(x) for x in a.bytes_lens.split(",")]
        print(f"3. bytes sent per Mamba layer per forward+backward, cp=2, at {blens} tokens")
        res = cp_run(a.model, 2, blens, a.cp_doc_len)
        for L in blens:
            print(f"  {L:6d} tokens: {res[L]['mamba_bytes_per_layer']} bytes per rank")
        out["bytes"] = res
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
