"""One table of ``benchmarks/gpu_check.sh``'s results: per run the kernel path that ran, the
warm-up (first step, torch.compile and Triton autotuning seconds; of the latter, the seconds of
the kernels whose configs carry a ``pre_hook``, which every part tunes again, apart) apart from the
steady tokens/s, and the compiled blocks' graph count; a run stopped by its limit shows what it
reached.
Usage: python table.py OUT_DIR"""

import json
import os
import re
import sys

TRAIN = ("nano8", "nano8_torch_eager", "dense2b")


def text(out: str, name: str) -> str:
    path = os.path.join(out, name + ".log")
    return open(path, errors="replace").read() if os.path.isfile(path) else ""


def tagged(log: str, tag: str) -> list[dict]:
    """The ``TAG {json}`` lines of a log."""
    return [json.loads(line.split(tag + " ", 1)[1]) for line in log.splitlines() if line.startswith(tag + " ")]


def kernel_paths(log: str) -> str:
    """The ``kernel paths:`` line of a log, each part's source up to its first detail; unknown
    when the run printed none."""
    line = next((ln for ln in log.splitlines() if "kernel paths:" in ln), None)
    if line is None:
        return "unknown"
    parts = line.split("kernel paths:", 1)[1].strip().split("; ")
    return "; ".join(p.split(" (")[0].split(", ")[0] for p in parts)


def autotune_s(log: str, only: set[str] | None = None) -> float:
    """Seconds Triton spent autotuning (its ``TRITON_PRINT_AUTOTUNING`` lines), of the kernels
    named in ``only`` where given."""
    found = re.findall(r"Triton autotuning for function (\w+),.*?finished after ([0-9.]+)s", log, re.S)
    return sum(float(s) for name, s in found if only is None or name in only)


def autotune_text(log: str, part: dict) -> str:
    """``autotune X s`` and, where kernels with a ``pre_hook`` were tuned, their share: tuned
    again in every part (Triton caches no result of theirs)."""
    text = f"autotune {autotune_s(log):.1f} s"
    pre = set(part.get("pre_hook_kernels") or ())
    if pre and autotune_s(log, pre):
        text += f", {autotune_s(log, pre):.1f} s of it pre_hook kernels tuned again in every part"
    return text


def status(out: str, name: str, log: str) -> str:
    """ok, or why not: the exit status, and for a run stopped by its limit the last thing it
    reached."""
    p = os.path.join(out, name + ".rc")
    fields = dict(f.split("=", 1) for f in open(p).read().split()) if os.path.isfile(p) else {}
    rc = fields.get("rc", "?")
    if rc == "0":
        return "ok"
    reached = [ln.split("REACHED ", 1)[1] for ln in log.splitlines() if ln.startswith("REACHED ")]
    last = f"; reached: {reached[-1]}" if reached else "; reached nothing"
    if rc in ("124", "137"):
        return f"out of time (limit {fields.get('limit', '?')} s){last}"
    return f"failed (rc {rc}; see {name}.log){last}"


def _f(x, spec: str, unit: str = "") -> str:
    return "n/a" if x is None else format(x, spec) + unit


def train_row(out: str, name: str) -> str:
    log = text(out, name)
    part = (tagged(log, "PART") or [{}])[-1]
    path = os.path.join(out, name + ".json")
    bench = json.load(open(path)) if os.path.isfile(path) else None
    run = bench["runs"][0] if bench else {}
    steps = part.get("step_s") or []
    n_warm = bench["options"]["warmup_steps"] if bench else len(steps)
    warm = (f"{sum(steps[:n_warm]):.1f} s (first step {steps[0]:.1f} s; compile {part.get('compile_s', 0):.1f} s; "
            f"{autotune_text(log, part)})" if steps else "n/a")
    graphs = ("not compiled" if not part.get("unique_graphs")
              else f"{part['unique_graphs']} graphs, {part.get('graph_breaks', 0)} breaks")
    steady = _f(run.get("tokens_per_s"), ",.0f", " tok/s")
    tflops = f"{_f(run.get('tflops_per_device'), '.1f')} TFLOP/s, MFU {_f(run.get('mfu'), '.3f')}"
    mem = _f(run.get("peak_memory_gb"), ".1f", " GB")
    device = bench.get("device_name", bench["device"]) if bench else ""
    return (f"| {name} | {kernel_paths(log)} | {warm} | {steady} | {tflops} | {mem} | {graphs} | "
            f"{status(out, name, log)} | {device} |")


def main(out: str) -> None:
    print("| run | kernel paths | warm-up | steady | TFLOP/s, MFU | peak memory | compiled blocks | status | device |\n"
          "|---|---|---|---:|---:|---:|---|---|---|")
    for name in TRAIN:
        print(train_row(out, name))
    log = text(out, "hf_nano8")
    hf = tagged(log, "RESULT")
    if hf:
        h = hf[-1]
        print(f"| hf_nano8 (transformers) | transformers | {h['warmup_s']:.1f} s | {h['tokens_per_s']:,.0f} tok/s "
              f"| | {_f(h['peak_gb'], '.1f', ' GB')} | | {status(out, 'hf_nano8', log)} | |")
    else:
        print(f"| hf_nano8 (transformers) | | | | | | | {status(out, 'hf_nano8', log)} | |")
    log = text(out, "decode_nano8")
    dec = tagged(log, "RESULT")
    by = {(d["side"], d["batch"]): d for d in dec}
    for b in sorted({d["batch"] for d in dec}):
        ht, hf_ = by.get(("hybridtrain", b)), by.get(("transformers", b))
        ratio = f" ({ht['new_tokens_per_s'] / hf_['new_tokens_per_s']:.2f}x transformers)" if ht and hf_ else ""
        same = ("same first tokens" if ht and hf_ and ht["first_new"] == hf_["first_new"]
                else "tokens differ" if ht and hf_ else "")
        warm = f"{ht['warmup_s']:.1f} s" if ht else "n/a"
        their = f"; transformers {hf_['new_tokens_per_s']:.1f} tok/s" if hf_ else ""
        print(f"| decode batch {b} | {kernel_paths(log)} | {warm} | "
              f"{ht['new_tokens_per_s'] if ht else float('nan'):.1f} tok/s{ratio} | {same}{their} | | | "
              f"{status(out, 'decode_nano8', log)} | |")
    if not dec:
        print(f"| decode | | | | | | | {status(out, 'decode_nano8', log)} | |")
    log = text(out, "nano8_torch_eager")
    i = log.find("top ")
    end = log.find("benchmark results:", i)
    print("\nnano8 step profile (eager PyTorch path), " + (log[i:end if end > 0 else None].rstrip()
                                                           if i >= 0 else "not found in nano8_torch_eager.log"))


if __name__ == "__main__":
    main(sys.argv[1:][0])
