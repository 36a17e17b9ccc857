#!/usr/bin/env python
"""Data-layer measurements (not a test): tokenise time for N synthetic SQuAD examples, cold
(cache miss) and warm (memory-mapped cache hit), and the dropped counts on the real SQuAD v2
subset at seq_length 256 and 96 in fixed-length mode.

    python scripts/bench_data.py [--n 100000] [--num-proc 1 4] [--out /tmp/bench_data]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

from hybridtrain.data import (
    build_bpe_tokenizer,
    build_squad_dataset,
    pack_dataset,
    synthetic_texts,
    write_synthetic_squad,
)

SUBSET = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "squad-v2-dev-subset.json"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--num-proc", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_data_"))
    out.mkdir(parents=True, exist_ok=True)

    texts = synthetic_texts(2000, seed=0)
    if SUBSET.is_file():
        doc = json.loads(SUBSET.read_text())
        texts += [p["context"] for a in doc["data"] for p in a["paragraphs"]]
    tok = build_bpe_tokenizer(texts, out / "tokenizer", vocab_size=3000)

    t = time.perf_counter()
    data = write_synthetic_squad(out / "synthetic.json", args.n, seed=0)
    print(f"generate {args.n} synthetic examples: {time.perf_counter() - t:.2f}s "
          f"({data.stat().st_size / 1e6:.1f} MB)")
    for num_proc in args.num_proc:
        cache = out / f"cache_np{num_proc}"
        shutil.rmtree(cache, ignore_errors=True)
        t = time.perf_counter()
        ds = build_squad_dataset(data, tok, seq_length=args.seq_length, padding="max_length",
                                 cache_dir=cache, num_proc=num_proc)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        ds2 = build_squad_dataset(data, tok, seq_length=args.seq_length, padding="max_length",
                                  cache_dir=cache, num_proc=num_proc)
        warm = time.perf_counter() - t
        t = time.perf_counter()
        _ = [ds2[i] for i in range(0, len(ds2), max(1, len(ds2) // 10000))]
        get = (time.perf_counter() - t) / min(len(ds2), 10000) * 1e6
        print(f"tokenise {len(ds)} examples (seq_length={args.seq_length}, num_proc={num_proc}): "
              f"cold {cold:.2f}s ({len(ds) / cold:,.0f} ex/s), warm cache hit {warm:.2f}s, "
              f"__getitem__ {get:.0f} us; dropped {ds.stats['dropped']}")
    t = time.perf_counter()
    packed = pack_dataset(ds2, pack_size=1024)
    print(f"pack {len(ds2)} examples into {len(packed)} rows of 1024: "
          f"{time.perf_counter() - t:.2f}s, utilization {packed.utilization():.3f}")

    if SUBSET.is_file():
        sub_tok = build_bpe_tokenizer(texts, out / "tokenizer_sub", vocab_size=3000)
        for L in (256, 96, 64, 48):
            ds = build_squad_dataset(SUBSET, sub_tok, seq_length=L, padding="max_length",
                                     cache_dir=False)
            st = ds.stats
            print(f"real subset at seq_length={L}: read {st['read']}, skipped {st['skipped']}, "
                  f"kept {st['kept']}, dropped {sum(st['dropped'].values())} {st['dropped']}")
    else:
        print(f"(real subset not found at {SUBSET})")


if __name__ == "__main__":
    main()
