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

A shell block without a marker is an error, so a new command cannot slip in unchecked. Python
blocks are compiled (syntax). Blocks run in reading order (README first, then the nav's pages)
in one scratch copy, so a later command reads an earlier one's run folder (the README's order:
`make demo`, then evaluate / generate / convert on its output); a block identical to one already
run is not run again. Each block's line gives its wall time and the CPU time of its processes
(user + system: on a busy machine the steadier figure); the last line, the total and the load
average before and after.

    python scripts/run_doc_commands.py                    # everything (CI: .ci/run)
    python scripts/run_doc_commands.py --list             # the blocks and their markers
    python scripts/run_doc_commands.py --only README.md --venv /path/to/.venv
"""

from __future__ import annotations

import argparse
import os
import resource
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
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
    """README.md, then every page of mkdocs.yml's nav in its order."""
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
    return ["README.md", *pages]


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
    return out


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


def children_cpu() -> float:
    """User + system seconds of this process's finished children (the blocks' processes)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_block(b: Block, work: Path, log_dir: Path, timeout: int,
              venv: Path | None = None) -> tuple[bool, str]:
    """Run one block in ``work`` with ``venv`` (default: work/.venv) activated; (passed, why)."""
    script = b.text if b.mode == "run" else check_form(b.text)
    venv = venv or work / ".venv"
    env = dict(os.environ)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(work / "src")  # this copy's code, whatever the venv's install
    env["VIRTUAL_ENV"] = str(venv)
    log = log_dir / (b.where.replace("/", "_").replace(":", "_") + ".log")
    try:
        proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=work, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
        output, rc = proc.stdout.decode(errors="replace"), proc.returncode
    except subprocess.TimeoutExpired as e:
        output, rc = (e.stdout or b"").decode(errors="replace") + "\n[timed out]", None
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
        return False, "; ".join(errors) + f" (log {log})\n{tail}"
    return True, ""


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

    scratch = Path(tempfile.mkdtemp(prefix="doc-commands-"))
    work = args.keep or scratch / "checkout"
    work.mkdir(parents=True, exist_ok=True)
    if args.keep is None and (ROOT.parent / "shared").is_dir():  # the data some pages read
        (scratch / "shared").symlink_to((ROOT.parent / "shared").resolve())
    if not (work / "README.md").exists():
        scratch_copy(work, args.venv)
    log_dir = work / "doc-test-logs"
    log_dir.mkdir(exist_ok=True)
    seen: dict[str, str] = {}
    failed, start, cpu0, load0 = [], time.monotonic(), children_cpu(), os.getloadavg()[0]
    for b in chosen:
        key = b.mode + "\0" + b.text
        if key in seen:
            print(f"same   {b.where} (as {seen[key]})", flush=True)
            continue
        seen[key] = b.where
        t0, c0 = time.monotonic(), children_cpu()
        ok, why = run_block(b, work, log_dir, args.timeout)
        print(f"{'ok    ' if ok else 'FAILED'} {b.where} {b.mode} {time.monotonic() - t0:.0f}s "
              f"(cpu {children_cpu() - c0:.0f}s)" + ("" if ok else "\n    " + why), flush=True)
        if not ok:
            failed.append(b.where)
    total, cpu = time.monotonic() - start, children_cpu() - cpu0
    print(f"{len(seen)} blocks in {total:.0f}s (cpu {cpu:.0f}s; load average {load0:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after); failed: {', '.join(failed) or 'none'}")
    if args.keep is None and not failed:
        shutil.rmtree(scratch, ignore_errors=True)
    elif args.keep is not None:
        shutil.rmtree(scratch, ignore_errors=True)
    elif failed:
        print(f"logs: {log_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
