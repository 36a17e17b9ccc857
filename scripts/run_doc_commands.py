#!/usr/bin/env python3
"""Run every shell command of the README and the docs site, as written, in a scratch copy.

Each fenced shell block (```bash / sh / shell / console) of README.md and of the pages in
mkdocs.yml's nav carries a marker comment on the line above it:

    <!-- doc-test: run expect="exact match" files="outputs/squad_tiny/final/hf/config.json" -->
        the block runs as one bash script (set -e) in the scratch copy, with .venv/bin on PATH
        (as after `source .venv/bin/activate`); it must exit 0 (or rc="N"), print each
        `expect` text somewhere in its output and leave each of `files` behind.
    <!-- doc-test: check -->
        real-model commands (8 GPUs, Slurm, a 30B checkpoint), and tests the suite runs anyway:
        each line runs in a cheaper form that still resolves what it names: `hybridtrain
        finetune|dpo|grpo|benchmark|evaluate ...` gets --print-config (the recipe, its overrides
        and ${env:} resolve), `sbatch F` becomes `bash -n F`, `pytest ...` gets --collect-only
        (the named tests exist and import; `make test` runs them); other lines (export, plan)
        run as written.
    <!-- doc-test: skip reason="..." -->
        not run here (the reason says where it is run instead).

    after="make demo" (with run or check)
        the block reads what an earlier block (the one whose command is exactly "make demo")
        left behind: it runs after that block, in the same scratch copy.

A shell block without a marker is an error, so a new command cannot slip in unchecked. Python
blocks are compiled (syntax). Blocks run in two lanes at once, each in reading order (README
first, then the nav's pages) and in a scratch copy of its own: the blocks marked after="CMD"
with the block running CMD (the README's order: `make demo`, then evaluate / generate / convert
on its output), and all the others. A block that reads another's output without saying so
fails in the other copy, never by chance. With two lanes every process gets one thread
(OMP_NUM_THREADS=1, unless set): two at a time fill the 2 cores of a small machine without the
oversubscription that makes spinning OpenMP threads crawl. A block identical to one already run
is not run again. The results are printed in reading order; each block's line gives its wall
time and the CPU time of its processes (user + system: on a busy machine the steadier figure);
the last line, the total and the load average before and after.

    python scripts/run_doc_commands.py                    # everything (CI: .ci/run)
    python scripts/run_doc_commands.py --list             # the blocks and their markers
    python scripts/run_doc_commands.py --only README.md --venv /path/to/.venv
"""

from __future__ import annotations

import argparse
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
                out.append(f"{b.where}: shell block without a <!-- doc-test: run|check|skip --> "
                           "marker on the line above")
            elif b.mode not in ("run", "check", "skip"):
                out.append(f"{b.where}: unknown doc-test mode {b.mode!r}")
            elif b.mode == "skip" and not b.attrs.get("reason"):
                out.append(f"{b.where}: doc-test skip needs reason=\"...\"")
    for i, b in enumerate(blocks):
        for cmd in b.attrs.get("after", []):
            if not any(a.lang in SHELL_LANGS and a.text.strip() == cmd for a in blocks[:i]):
                out.append(f"{b.where}: after={cmd!r} names no earlier shell block (the whole "
                           "text of the block whose output this one reads)")
    return out


def lanes(blocks: list[Block]) -> tuple[list[Block], list[Block]]:
    """(the blocks marked after="CMD" and the blocks running a CMD, the others), each in reading
    order: the two lanes that run at once, in scratch copies of their own."""
    anchors = {cmd for b in blocks for cmd in b.attrs.get("after", [])}
    first = [b for b in blocks if b.attrs.get("after") or b.text.strip() in anchors]
    return first, [b for b in blocks if b not in first]


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


def check_form(text: str) -> str:
    """The cheaper form of a real-model block (see the module docstring)."""
    out = []
    for line in logical_lines(text):
        code, _, _comment = line.partition("  #")
        words = code.split()
        if words and words[0] == "sbatch":
            out.append("bash -n " + " ".join(words[1:]))
        elif any(w.endswith("hybridtrain") and nxt in RECIPE_COMMANDS
                 for w, nxt in zip(words, words[1:])):  # also `torchrun ... -m hybridtrain ...`
            out.append(code.rstrip() + " --print-config > /dev/null")
        elif any(w.endswith("pytest") for w in words):  # also `python -m pytest ...`
            out.append(code.rstrip() + " --collect-only")
        else:
            out.append(line)
    return "\n".join(out) + "\n"


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
    # if pyproject.toml were newer than the venv's stamp; nanoseconds, as a float can round up
    stamp = venv / ".installed"
    if stamp.exists() and (dest / "pyproject.toml").stat().st_mtime_ns > stamp.stat().st_mtime_ns:
        t = stamp.stat().st_mtime_ns
        os.utime(dest / "pyproject.toml", ns=(t, t))


RUNNING: set[int] = set()  # the process groups of the blocks running now (stopped on Ctrl-C)


def run_block(b: Block, work: Path, log_dir: Path, timeout: int, venv: Path | None = None,
              env_extra: dict[str, str] | None = None) -> tuple[bool, str, float, float]:
    """Run one block in ``work`` with ``venv`` (default: work/.venv) activated; (passed, why,
    wall seconds, CPU seconds of its processes)."""
    script = b.text if b.mode == "run" else check_form(b.text)
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
    if rc != want_rc:
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
            print(f"{b.mode:5s} {b.where:32s} {first}")
        return 0
    chosen = [b for b in shell if b.mode != "skip" and (not args.only or b.path in args.only)]
    if not (args.venv / "bin" / "python").exists():
        print(f"no virtual environment at {args.venv}: run `make setup` first", file=sys.stderr)
        return 2

    seen: dict[str, str] = {}
    unique = []
    for b in chosen:
        key = b.mode + "\0" + b.text
        if key not in seen:
            seen[key] = b.where
            unique.append(b)
    both = [lane for lane in lanes(unique) if lane]
    env_extra = {} if len(both) < 2 or "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": "1"}

    scratch = None if args.keep else Path(tempfile.mkdtemp(prefix="doc-commands-"))
    work = args.keep or scratch / "checkout"
    if scratch is not None and (ROOT.parent / "shared").is_dir():  # the data some pages read
        (scratch / "shared").symlink_to((ROOT.parent / "shared").resolve())
    results: dict[int, Future] = {id(b): Future() for b in unique}

    def run_lane(blocks: list[Block], copy: Path) -> None:
        """Runs ``blocks`` in order in ``copy``; every block gets a result, also when the
        runner itself fails (reported as the block's failure)."""
        try:
            copy.mkdir(parents=True, exist_ok=True)
            if not (copy / "README.md").exists():
                scratch_copy(copy, args.venv)
            log_dir = copy / "doc-test-logs"
            log_dir.mkdir(exist_ok=True)
        except Exception as e:
            for b in blocks:
                results[id(b)].set_result((False, f"scratch copy {copy}: {e!r}", 0.0, 0.0))
            return
        for b in blocks:
            try:
                results[id(b)].set_result(
                    run_block(b, copy, log_dir, args.timeout, env_extra=env_extra))
            except Exception as e:
                results[id(b)].set_result((False, f"runner error: {e!r}", 0.0, 0.0))

    failed, start, load0 = [], time.monotonic(), os.getloadavg()[0]
    copies = [work] + [work.with_name(f"{work.name}-{i + 1}") for i in range(1, len(both))]
    threads = [threading.Thread(target=run_lane, args=(lane, copy), daemon=True)
               for lane, copy in zip(both, copies)]
    for t in threads:
        t.start()
    cpu = 0.0
    try:
        for b in chosen:  # in reading order, each as soon as it and those before it are done
            first = seen[b.mode + "\0" + b.text]
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
    print(f"{len(unique)} blocks in {total:.0f}s, {len(both)} at a time (cpu {cpu:.0f}s; load "
          f"average {load0:.1f} before, {os.getloadavg()[0]:.1f} after); failed: "
          f"{', '.join(failed) or 'none'}")
    if scratch is not None and not failed:
        shutil.rmtree(scratch, ignore_errors=True)
    elif failed:
        print(f"logs: {', '.join(str(c / 'doc-test-logs') for c in copies)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
