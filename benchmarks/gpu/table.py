"""One table of ``benchmarks/gpu_check.sh``'s results. Usage: python table.py OUT_DIR"""

import json
import os
import sys


def results(path: str) -> list[dict]:
    """The ``RESULT {json}`` lines of a log."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line.split("RESULT ", 1)[1]) for line in f if line.startswith("RESULT ")]


def bench(out: str, name: str) -> str:
    path = os.path.join(out, name + ".json")
    if not os.path.isfile(path):
        return f"| {name} | failed (rc {rc(out, name)}; see {name}.log) | | | |"
    d = json.load(open(path))
    r = d["runs"][0]
    f = lambda x, s: "n/a" if x is None else format(x, s)  # noqa: E731
    return (f"| {name} | {r['tokens_per_s']:,.0f} tok/s | {f(r['tflops_per_device'], '.1f')} TFLOP/s, "
            f"MFU {f(r['mfu'], '.3f')} | {r['peak_memory_gb']:.1f} GB | {d.get('device_name', d['device'])} |")


def rc(out: str, name: str) -> str:
    p = os.path.join(out, name + ".rc")
    return open(p).read().strip().removeprefix("rc=") if os.path.isfile(p) else "?"


def main(out: str) -> None:
    print("| run | throughput | TFLOP/s, MFU | peak memory | device |\n|---|---:|---:|---:|---|")
    for name in ("nano8_kernels", "nano8_torch", "dense2b_kernels", "dense2b_torch"):
        print(bench(out, name))
    hf = results(os.path.join(out, "hf_nano8.log"))
    if hf:
        h = hf[-1]
        mem = "n/a" if h["peak_gb"] is None else f"{h['peak_gb']:.1f} GB"
        print(f"| hf_nano8 (transformers) | {h['tokens_per_s']:,.0f} tok/s | | {mem} | |")
    else:
        print(f"| hf_nano8 (transformers) | failed (rc {rc(out, 'hf_nano8')}) | | | |")
    dec = results(os.path.join(out, "decode_nano8.log"))
    by = {(d["side"], d["batch"]): d for d in dec}
    for b in sorted({d["batch"] for d in dec}):
        ht, hf_ = by.get(("hybridtrain", b)), by.get(("transformers", b))
        ratio = f"{ht['new_tokens_per_s'] / hf_['new_tokens_per_s']:.2f}x" if ht and hf_ else "n/a"
        same = "same first tokens" if ht and hf_ and ht["first_new"] == hf_["first_new"] else "tokens differ"
        print(f"| decode batch {b} | {ht['new_tokens_per_s'] if ht else float('nan'):.1f} tok/s | "
              f"transformers {hf_['new_tokens_per_s'] if hf_ else float('nan'):.1f} tok/s ({ratio}) | {same} | |")
    if not dec:
        print(f"| decode | failed (rc {rc(out, 'decode_nano8')}) | | | |")
    log = os.path.join(out, "nano8_torch.log")
    if os.path.isfile(log):
        text = open(log).read()
        i = text.find("top ")
        end = text.find("benchmark results:", i)
        print("\nnano8 step profile (torch path), " + (text[i:end if end > 0 else None].rstrip()
                                                      if i >= 0 else "not found in nano8_torch.log"))


if __name__ == "__main__":
    main(sys.argv[1])
