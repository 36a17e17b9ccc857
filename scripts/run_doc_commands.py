#!/usr/bin/env python3
"""Run every shell command of the README and the docs site, as written, in a scratch copy.

Each fenced shell block (```bash / sh / shell / console) of README.md and of the pages in
mkdocs.yml's nav carries a marker comment on the line above it:

    <!-- doc-test: run expect="exact match" files="outputs/squad_tiny/final/hf/config.json" -->
        the block runs as one bash script (set -e) in the scratch copy, with .venv/bin on PATH
        (as after `source .venv/bin/activate`); it must exit 0 (or rc="N"), print each
        `expect` text somewhere in its output and leave each of `files` behind. A block that
        skips itself (exit status 77, or pytest reporting skipped tests) fails: a block
        marked run must run.
    <!-- doc-test: run append="--training.max_steps=3" -->
        a cheaper form of a longer run: the `append` arguments are added to each `hybridtrain
        finetune|dpo|grpo|benchmark|evaluate` line (also `torchrun ... -m hybridtrain ...`),
        before its comment. A line that starts several processes (`--nproc-per-node N`,
        torchrun) and trains must run at most 3 steps (`--training.max_steps=K`, K <= 3, in
        the line or in `append`): the marker is refused otherwise.
    <!-- doc-test: skip reason="..." -->
        not run here: only what truly cannot run on a CPU machine (GPUs, Slurm, a real
        checkpoint); the reason says why and where it is run instead. The output lists these
        blocks and counts them. The quickstart, distributed, RL and VLM pages take none.

    after="make demo" (with run)
        the block reads what an earlier block (the one whose command is exactly "make demo")
        left behind: it runs after that block, in the same scratch copy.

A shell block without a marker is an error, so a new command cannot slip in unchecked. Python
blocks are compiled (syntax). Blocks run in two lanes at once, in scratch copies of their own:
the first runs the blocks marked after="CMD" with the block running CMD, in reading order
(README first, then the nav's pages; the README's order: `make demo`, then evaluate / generate /
convert on its output); the second takes the others in reading order, and once the first is
done it takes them from the end, in a third, fresh copy (so the lanes finish together). A block
that reads the after-chain's output without saying so fails in the other copies, never by
chance; a block must not read another's output at all without saying so. With two lanes every process gets one thread
(OMP_NUM_THREADS=1, unless set): two at a time fill the 2 cores of a small machine without the
oversubscription that makes spinning OpenMP threads crawl. A block identical to one already run
is not run again. The results are printed in reading order; each block's line gives its wall
time and the CPU time of its processes (user + system: on a busy machine the steadier figure);
the last line, the total, the blocks skipped by their markers and the load average before and
after. The exit status is 1 when a block failed (a block marked run that skipped itself
included).

    python scripts/run_doc_commands.py                    # everything (make test, so CI)
    python scripts/run_doc_commands.py --list             # the blocks and their markers
    python scripts/run_doc_commands.py --only README.md --venv /path/to/.venv
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*(\w+)(.*?)-->\s*$")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
RECIPE_COMMANDS = ("finetune", "dpo", "grpo", "benchmark", "evaluate")
TRAINING_COMMANDS = ("finetune", "dpo", "grpo")
MODES = ("run", "skip")
MAX_PARALLEL_STEPS = 3  # a multi-process training command in the docs runs at most this many
# pages whose every command runs on the tiny examples: a skip marker there is refused
RUN_EVERY_BLOCK = ("docs/getting-started.md", "docs/distributed.md", "docs/rl.md", "docs/vlm.md")
SKIPPED_EXIT = 77  # a block that exits so says it skipped itself (automake's convention)
PYTEST_SKIPPED = re.compile(r"(?m)^=*\s*(?:\d+ \w+, )*\d+ skipped\b.* in [\d.]+s")


@dataclass
class Block:
    path: str            # relative to the repository root
    line: int            # 1-based line of the opening fence
    lang: str
    text: str
    mode: str | None = None
    attrs: dict[str, list[str]] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files(root: Path = ROOT) -> list[str]:
    """README.md, then every page of mkdocs.yml's nav in its order (those written in docs/)."""
    nav = yaml.safe_load((root / "mkdocs.yml").read_text())["nav"]
    pages: list[str] = []

    def walk(item):
        if isinstance(item, str):
            pages.append("docs/" + item)
        elif isinstance(item, list):
            for x in item:
                walk(x)
        elif isinstance(item, dict):
            for x in item.values():
                walk(x)

    walk(nav)
    # a page the site generates when it builds (recipes/reference.md) has no file, nor commands
    return ["README.md", *(p for p in pages if (root / p).exists())]


def parse_blocks(path: str, root: Path = ROOT) -> list[Block]:
    """The fenced code blocks of one Markdown file, each with the marker above it (if any)."""
    lines = (root / path).read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        if j == len(lines):
            raise ValueError(f"{path}:{i + 1}: code fence {fence} never closed")
        body = "\n".join(x[len(indent):] if x.startswith(indent) else x.lstrip()
                         for x in lines[i + 1:j])
        block = Block(path, i + 1, lang, body + "\n")
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mm = MARKER.match(lines[k]) if k >= 0 else None
        if mm:
            block.mode = mm.group(1)
            for token in shlex.split(mm.group(2)):
                key, _, value = token.partition("=")
                block.attrs.setdefault(key, []).append(value)
        blocks.append(block)
        i = j + 1
    return blocks


def problems(blocks: list[Block]) -> list[str]:
    """Markers missing or malformed: what makes the docs drift unnoticed."""
    out = []
    for b in blocks:
        if b.lang in SHELL_LANGS:
            if b.mode is None:
                out.append(f"{b.where}: shell block without a <!-- doc-test: run|skip --> "
                           "marker on the line above")
            elif b.mode not in MODES:
                out.append(f"{b.where}: unknown doc-test mode {b.mode!r}: mark it run (with "
                           "append=\"...\" for a cheaper form) or skip reason=\"...\"")
            elif b.mode == "skip" and not b.attrs.get("reason"):
                out.append(f"{b.where}: doc-test skip needs reason=\"...\"")
            elif b.mode == "skip" and b.path in RUN_EVERY_BLOCK:
                out.append(f"{b.where}: every command of {b.path} runs on the tiny examples; "
                           "run this one (append=\"...\" for a cheaper form) or move it to "
                           "a page of real-model commands")
            elif b.mode == "run":
                out += [f"{b.where}: {line.strip()!r} starts several processes and trains more "
                        f"than {MAX_PARALLEL_STEPS} steps here; add --training.max_steps="
                        f"{MAX_PARALLEL_STEPS} to it or append=\"--training.max_steps="
                        f"{MAX_PARALLEL_STEPS}\" to the marker"
                        for line in logical_lines(run_form(b)) if too_long_parallel(line)]
    for i, b in enumerate(blocks):
        for cmd in b.attrs.get("after", []):
            if not any(a.lang in SHELL_LANGS and a.text.strip() == cmd for a in blocks[:i]):
                out.append(f"{b.where}: after={cmd!r} names no earlier shell block (the whole "
                           "text of the block whose output this one reads)")
    return out


def lanes(blocks: list[Block]) -> tuple[list[Block], list[Block]]:
    """(the after-chain: the blocks marked after="CMD" and the blocks running a CMD; the
    others), each in reading order (see the module docstring for how they run)."""
    anchors = {cmd for b in blocks for cmd in b.attrs.get("after", [])}
    first = [b for b in blocks if b.attrs.get("after") or b.text.strip() in anchors]
    return first, [b for b in blocks if b not in first]


def lane_threads(chain: list[Block], rest: list[Block], copies: list[Path], run
                 ) -> list[threading.Thread]:
    """The two lanes (not started): the first runs ``chain`` in ``copies[0]``, then takes
    ``rest`` from its end into ``copies[2]``; the second takes ``rest`` in reading order into
    ``copies[1]``. ``run(block, copy)`` runs one block."""
    queue, lock = collections.deque(rest), threading.Lock()

    def take(from_end: bool) -> Block | None:
        with lock:
            return None if not queue else queue.pop() if from_end else queue.popleft()

    def first() -> None:
        for b in chain:
            run(b, copies[0])
        while (b := take(from_end=True)) is not None:
            run(b, copies[2])

    def second() -> None:
        while (b := take(from_end=False)) is not None:
            run(b, copies[1])

    return [threading.Thread(target=first, daemon=True),
            threading.Thread(target=second, daemon=True)]


def logical_lines(text: str) -> list[str]:
    """Shell lines with backslash continuations joined."""
    out, cur = [], ""
    for line in text.splitlines():
        line = line.lstrip() if cur else line
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1].rstrip() + " "
            continue
        out.append(cur + line)
        cur = ""
    if cur:
        out.append(cur)
    return out


def _command(words: list[str]) -> str | None:
    """The hybridtrain command a line runs (``hybridtrain X``, ``torchrun ... -m hybridtrain X``)."""
    for w, nxt in zip(words, words[1:]):
        if w.endswith("hybridtrain"):
            return nxt
    return None


def run_form(b: Block) -> str:
    """The script a run block runs: its text with the marker's ``append`` arguments added to
    each hybridtrain recipe command (see the module docstring)."""
    extra = " ".join(b.attrs.get("append", []))
    if not extra:
        return b.text
    out = []
    for line in logical_lines(b.text):
        code, sep, comment = line.partition("  #")
        if _command(code.split()) in RECIPE_COMMANDS:
            line = f"{code.rstrip()} {extra}" + (f"  #{comment}" if sep else "")
        out.append(line)
    return "\n".join(out) + "\n"


def too_long_parallel(line: str) -> bool:
    """Whether ``line`` starts several processes that train more than MAX_PARALLEL_STEPS
    steps (or as many as its recipe says)."""
    words = line.partition("  #")[0].replace("=", " ").split()
    if _command(words) not in TRAINING_COMMANDS:
        return False
    procs = [int(n) for flag, n in zip(words, words[1:])
             if flag in ("--nproc-per-node", "--nproc_per_node") and n.isdigit()]
    if not (any(w.endswith("torchrun") for w in words) or any(n > 1 for n in procs)):
        return False
    steps = [n for flag, n in zip(words, words[1:]) if flag == "--training.max_steps"]
    return not steps or not steps[-1].isdigit() or int(steps[-1]) > MAX_PARALLEL_STEPS


def scratch_copy(dest: Path, venv: Path) -> None:
    """The repository's files (tracked and untracked, not ignored) with modification times,
    and .venv as a link to ``venv`` (so `make` sees it set up and installs nothing)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    (dest / ".venv").symlink_to(venv.resolve())
    # `make` would reinstall (pip install -e: the venv's package then points at this scratch copy)
    # if the stamp's inputs (the Makefile's $(VENV)/.installed rule) were newer than the venv's
    # stamp; nanoseconds, as a float can round up
    stamp = venv / ".installed"
    for name in STAMP_INPUTS:
        if stamp.exists() and (dest / name).stat().st_mtime_ns > stamp.stat().st_mtime_ns:
            t = stamp.stat().st_mtime_ns
            os.utime(dest / name, ns=(t, t))


STAMP_INPUTS = ("pyproject.toml", "requirements/lock.txt")


RUNNING: set[int] = set()  # the process groups of the blocks running now (stopped on Ctrl-C)


def run_block(b: Block, work: Path, log_dir: Path, timeout: int, venv: Path | None = None,
              env_extra: dict[str, str] | None = None) -> tuple[bool, str, float, float]:
    """Run one block in ``work`` with ``venv`` (default: work/.venv) activated; (passed, why,
    wall seconds, CPU seconds of its processes)."""
    script = run_form(b)
    venv = venv or work / ".venv"
    env = dict(os.environ)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(work / "src")  # this copy's code, whatever the venv's install
    env["VIRTUAL_ENV"] = str(venv)
    env.update(env_extra or {})
    log = log_dir / (b.where.replace("/", "_").replace(":", "_") + ".log")
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", script], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    RUNNING.add(proc.pid)
    timer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
    timer.start()
    output = proc.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)  # (its usage: the block's processes, all reaped)
    RUNNING.discard(proc.pid)
    proc.returncode = rc = os.waitstatus_to_exitcode(status)
    timed_out = not timer.is_alive()
    timer.cancel()
    proc.stdout.close()
    if timed_out:
        output, rc = output + "\n[timed out]", None
    seconds, cpu = time.monotonic() - t0, usage.ru_utime + usage.ru_stime
    log.write_text(script + "\n----\n" + output)
    want_rc = int(b.attrs.get("rc", ["0"])[0])
    errors = []
    if rc == SKIPPED_EXIT or PYTEST_SKIPPED.search(output):
        errors.append("marked run, but it skipped (all or part of) itself")
    elif rc != want_rc:
        errors.append(f"exit status {rc}, expected {want_rc}")
    errors += [f"output lacks {text!r}" for text in b.attrs.get("expect", [])
               if text not in output]
    for names in b.attrs.get("files", []):
        errors += [f"missing {name}" for name in names.split() if not (work / name).exists()]
    if errors:
        tail = "\n".join("      " + x for x in output.rstrip().splitlines()[-15:])
        return False, "; ".join(errors) + f" (log {log})\n{tail}", seconds, cpu
    return True, "", seconds, cpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--venv", type=Path, default=ROOT / ".venv",
                    help="the set-up virtual environment (default: .venv of this checkout)")
    ap.add_argument("--only", action="append", default=[], metavar="FILE",
                    help="run only the blocks of these files (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the blocks and exit")
    ap.add_argument("--keep", type=Path, default=None, metavar="DIR",
                    help="scratch folder to use and keep (default: a temporary one, removed)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per block")
    args = ap.parse_args(argv)

    blocks = [b for path in doc_files() for b in parse_blocks(path)]
    bad = problems(blocks)
    for b in blocks:
        if b.lang == "python":
            try:
                compile(b.text, b.where, "exec")
            except SyntaxError as e:
                bad.append(f"{b.where}: python block does not compile: {e}")
    if bad:
        print("\n".join(bad), file=sys.stderr)
        return 2
    shell = [b for b in blocks if b.lang in SHELL_LANGS]
    if args.list:
        for b in shell:
            first = b.text.strip().splitlines()[0] if b.text.strip() else ""
            print(f"{b.mode:5s} {b.where:32s} {first}"
                  + (f"  [append {' '.join(b.attrs['append'])}]" if b.attrs.get("append") else ""))
        return 0
    listed = [b for b in shell if not args.only or b.path in args.only]
    chosen = [b for b in listed if b.mode == "run"]
    skipped = [b for b in listed if b.mode == "skip"]
    if not (args.venv / "bin" / "python").exists():
        print(f"no virtual environment at {args.venv}: run `make setup` first", file=sys.stderr)
        return 2

    seen: dict[str, str] = {}
    unique = []
    for b in chosen:
        key = run_form(b)
        if key not in seen:
            seen[key] = b.where
            unique.append(b)
    env_extra = ({} if len(unique) < 2 or "OMP_NUM_THREADS" in os.environ
                 else {"OMP_NUM_THREADS": "1"})
    scratch = None if args.keep else Path(tempfile.mkdtemp(prefix="doc-commands-"))
    work = args.keep or scratch / "checkout"
    if scratch is not None and (ROOT.parent / "shared").is_dir():  # the data some pages read
        (scratch / "shared").symlink_to((ROOT.parent / "shared").resolve())
    results: dict[int, Future] = {id(b): Future() for b in unique}
    copies = [work] + [work.with_name(f"{work.name}-{i}") for i in (2, 3)]
    log_dirs: dict[Path, Path] = {}

    def run(b: Block, copy: Path) -> None:
        """``b`` in ``copy`` (made at its first block); ``b`` gets a result, also when the
        runner itself fails (reported as the block's failure)."""
        try:
            if copy not in log_dirs:
                copy.mkdir(parents=True, exist_ok=True)
                if not (copy / "README.md").exists():
                    scratch_copy(copy, args.venv)
                log_dirs[copy] = copy / "doc-test-logs"
                log_dirs[copy].mkdir(exist_ok=True)
            results[id(b)].set_result(
                run_block(b, copy, log_dirs[copy], args.timeout, env_extra=env_extra))
        except Exception as e:
            results[id(b)].set_result((False, f"runner error in {copy}: {e!r}", 0.0, 0.0))

    failed, start, load0 = [], time.monotonic(), os.getloadavg()[0]
    threads = lane_threads(*lanes(unique), copies, run)
    for t in threads:
        t.start()
    cpu = 0.0
    try:
        for b in listed:  # in reading order, each as soon as it and those before it are done
            if b.mode == "skip":
                print(f"skip   {b.where} ({' '.join(b.attrs['reason'])})", flush=True)
                continue
            first = seen[run_form(b)]
            if first != b.where:
                print(f"same   {b.where} (as {first})", flush=True)
                continue
            ok, why, seconds, block_cpu = results[id(b)].result()
            cpu += block_cpu
            print(f"{'ok    ' if ok else 'FAILED'} {b.where} {b.mode} {seconds:.0f}s "
                  f"(cpu {block_cpu:.0f}s)" + ("" if ok else "\n    " + why), flush=True)
            if not ok:
                failed.append(b.where)
    except KeyboardInterrupt:  # the blocks run in process groups of their own: stop them too
        for pgid in list(RUNNING):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        raise
    for t in threads:
        t.join()
    total = time.monotonic() - start
    print(f"{len(unique)} blocks in {total:.0f}s, 2 at a time (cpu {cpu:.0f}s; load "
          f"average {load0:.1f} before, {os.getloadavg()[0]:.1f} after); {len(skipped)} "
          f"skipped by their markers; failed: {', '.join(failed) or 'none'}")
    if scratch is not None and not failed:
        shutil.rmtree(scratch, ignore_errors=True)
    elif failed:
        print(f"logs: {', '.join(str(c / 'doc-test-logs') for c in copies if c.exists())}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
