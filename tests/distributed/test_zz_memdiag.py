import os, pytest
from tests.helpers import memory as mem
from tests.helpers.distributed import run_distributed
from tests.distributed.test_load_memory import PATTERN, LAYOUTS

def st():
    out = {}
    for line in open("/proc/self/status"):
        k = line.split(":")[0]
        if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem", "Threads"):
            out[k] = int(line.split()[1]) // 1024
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Anonymous:"):
            out["Anon"] = int(line.split()[1]) // 1024
    return out

def _worker(rank, world, layout, tiny, big):
    import gc, ctypes
    from hybridtrain.training.builder import build
    res = [("start", st())]
    for ckpt in (tiny, big):
        gc.collect()
        if ckpt == tiny:
            mem.reset_peak()
        b = build(mem.lora_recipe(layout, ckpt, max_steps=2), "cpu", is_main=rank == 0, world_size=world, data=True)
        res.append((ckpt[-4:], st()))
        if ckpt == tiny:
            del b
            gc.collect()
            res.append(("deltiny", st()))
    return res

def test_diag(tmp_path, monkeypatch):
    root = tmp_path
    tiny, big = str(root / "tiny"), str(root / "big")
    mem.write_checkpoint(tiny, mem.config(None, PATTERN))
    size = mem.write_checkpoint(big, mem.config(640, PATTERN), max_shard_size="100MB")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    res = run_distributed(_worker, 4, {"dp_shard": 4}, tiny, big, timeout=900)
    print("size MB", size // 2**20)
    for r, rows in enumerate(res):
        for name, s in rows:
            print(r, name, s)
