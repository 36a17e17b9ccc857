"""Files that every rank writes at once (the demo data, the demo tokenizer, any atomic_write)
never fail and always leave a whole, correct file. Several processes start each write together
behind a barrier; they start as test ranks do (tests.helpers.distributed): fresh processes forked
from a server that imported the package once."""

import json
import os
from threading import BrokenBarrierError

from hybridtrain.data.synthetic import synthetic_squad, write_synthetic_squad
from hybridtrain.fileio import atomic_write
from tests.helpers.distributed import process_context

NPROC = 4
ROUNDS = 25


def _run(target, args_per_proc):
    """Runs ``target(barrier, errors, *args)`` in one process per ``args``; a process that fails
    puts its error on ``errors`` and breaks the barrier, so the others stop too."""
    ctx = process_context()
    barrier = ctx.Barrier(len(args_per_proc), timeout=120)
    errors = ctx.Queue()
    procs = [ctx.Process(target=target, args=(barrier, errors, *a)) for a in args_per_proc]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        if p.is_alive():
            p.kill()
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, found
    assert [p.exitcode for p in procs] == [0] * len(procs)


def _report(barrier, errors, e: BaseException) -> None:
    if not isinstance(e, BrokenBarrierError):  # (the failing process's own error is enough)
        errors.put(f"{type(e).__name__}: {e}")
    barrier.abort()


def _squad_writer(barrier, errors, path):
    try:
        for seed in range(ROUNDS):  # a new document each round: every round really writes
            barrier.wait()
            write_synthetic_squad(path, num_questions=40, seed=seed)
            with open(path) as f:
                json.load(f)  # never a partial file
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        _report(barrier, errors, e)


def test_ranks_write_the_demo_data_at_once(tmp_path):
    path = str(tmp_path / "data" / "train.json")
    _run(_squad_writer, [(path,)] * NPROC)
    with open(path) as f:
        assert json.load(f) == synthetic_squad(40, ROUNDS - 1)
    assert os.listdir(tmp_path / "data") == ["train.json"]  # no temporary file left


def _text_writer(barrier, errors, path, rank):
    try:
        for i in range(ROUNDS):
            barrier.wait()
            atomic_write(path, f"round {i} rank {rank}\n" * (1000 + rank))
            with open(path) as f:
                text = f.read()
            lines = set(text.splitlines())
            assert len(lines) == 1 and text.count("\n") == 1000 + int(text.split()[-1]), text[:40]
    except BaseException as e:  # noqa: BLE001
        _report(barrier, errors, e)


def test_atomic_write_from_several_processes_keeps_one_whole_file(tmp_path):
    path = str(tmp_path / "f.txt")
    _run(_text_writer, [(path, r) for r in range(NPROC)])
    text = open(path).read()
    rank = int(text.split()[-1])
    assert text == f"round {ROUNDS - 1} rank {rank}\n" * (1000 + rank)
    assert os.listdir(tmp_path) == ["f.txt"]


def test_atomic_write_skips_identical_content(tmp_path):
    path = tmp_path / "a.json"
    assert atomic_write(path, "{}")
    mtime = os.stat(path).st_mtime_ns
    assert not atomic_write(path, b"{}")  # same bytes: not rewritten, mtime kept
    assert os.stat(path).st_mtime_ns == mtime
    assert atomic_write(path, "[]") and path.read_text() == "[]"


def _tokenizer_builder(barrier, errors, out_dir):
    try:
        from hybridtrain.data.synthetic import synthetic_texts
        from hybridtrain.data.tokenizer import build_bpe_tokenizer

        texts = synthetic_texts(200, seed=0)
        barrier.wait()
        tok = build_bpe_tokenizer(texts, out_dir, vocab_size=300)
        assert tok("The capital")["input_ids"]
    except BaseException as e:  # noqa: BLE001
        _report(barrier, errors, e)


def test_ranks_build_the_demo_tokenizer_at_once(tmp_path):
    from hybridtrain.data.tokenizer import load_tokenizer

    out = str(tmp_path / "tokenizer")
    _run(_tokenizer_builder, [(out,)] * 3)
    assert len(load_tokenizer(out)) == 300
    assert sorted(os.listdir(tmp_path)) == ["tokenizer"]  # no temporary folder left
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]
