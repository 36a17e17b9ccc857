"""The docs' command run (scripts/run_doc_commands.py): every shell block of the README and the
docs site is marked run / skip, and the markers mean what the script's docstring says."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("run_doc_commands", ROOT / "scripts" / "run_doc_commands.py")
rdc = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = rdc  # dataclasses look their module up
_spec.loader.exec_module(rdc)


def test_every_shell_block_of_the_docs_is_marked_and_every_page_is_in_the_nav():
    files = rdc.doc_files(ROOT)
    assert files[0] == "README.md"
    on_disk = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk == set(files[1:]), "a page outside mkdocs.yml's nav, or a nav entry missing"
    blocks = [b for f in files for b in rdc.parse_blocks(f, ROOT)]
    assert rdc.problems(blocks) == []
    shell = [b for b in blocks if b.lang in rdc.SHELL_LANGS]
    assert {b.mode for b in shell} == {"run", "skip"}
    for b in blocks:
        if b.lang == "python":
            compile(b.text, b.where, "exec")


def test_markers_are_parsed_and_an_unmarked_block_is_reported(tmp_path):
    (tmp_path / "page.md").write_text(
        'text\n\n<!-- doc-test: run expect="a b" expect="c" files="x y" rc="2" -->\n'
        "```bash\nmake demo\n```\n\n```sh\nhybridtrain plan -c r.yaml\n```\n\n"
        '<!-- doc-test: skip -->\n```bash\nmake test\n```\n')
    first, unmarked, skipped = rdc.parse_blocks("page.md", tmp_path)
    assert (first.mode, first.line, first.text) == ("run", 4, "make demo\n")
    assert first.attrs == {"expect": ["a b", "c"], "files": ["x y"], "rc": ["2"]}
    found = rdc.problems([first, unmarked, skipped])
    assert len(found) == 2 and "page.md:8" in found[0] and "reason" in found[1]


def test_append_makes_the_cheaper_form_of_each_recipe_command():
    text = ("export A=1\n"
            "hybridtrain finetune -c r.yaml --nproc-per-node 2   # FSDP2\n"
            "torchrun --nproc-per-node 4 -m hybridtrain finetune -c r.yaml \\\n    --distributed.pp=2\n"
            "hybridtrain plan -c r.yaml --nproc-per-node 8\n")
    b = rdc.Block("p.md", 1, "bash", text, "run", {"append": ["--training.max_steps=3"]})
    assert rdc.run_form(b).splitlines() == [
        "export A=1",
        "hybridtrain finetune -c r.yaml --nproc-per-node 2 --training.max_steps=3  # FSDP2",
        "torchrun --nproc-per-node 4 -m hybridtrain finetune -c r.yaml --distributed.pp=2"
        " --training.max_steps=3",
        "hybridtrain plan -c r.yaml --nproc-per-node 8",
    ]
    assert rdc.problems([b]) == []


@pytest.mark.parametrize("line, too_long", [
    ("hybridtrain finetune -c r.yaml --nproc-per-node 2", True),
    ("hybridtrain finetune -c r.yaml --nproc-per-node=4 --training.max_steps=10", True),
    ("torchrun --nproc-per-node 2 -m hybridtrain dpo -c r.yaml", True),
    ("hybridtrain finetune -c r.yaml --nproc-per-node 2 --training.max_steps=3", False),
    ("hybridtrain grpo -c r.yaml --training.max_steps=50", False),  # one process
    ("hybridtrain finetune -c r.yaml --nproc-per-node 1", False),
    ("hybridtrain plan -c r.yaml --nproc-per-node 8", False),  # trains nothing
])
def test_a_multi_process_training_command_runs_at_most_three_steps(line, too_long):
    assert rdc.too_long_parallel(line) == too_long
    found = rdc.problems([rdc.Block("p.md", 7, "bash", line + "\n", "run")])
    assert bool(found) == too_long
    assert all("p.md:7" in f and "--training.max_steps=3" in f for f in found)


def test_only_run_and_skip_are_modes_and_some_pages_skip_nothing():
    found = rdc.problems([rdc.Block("p.md", 3, "bash", "make demo\n", "check")])
    assert len(found) == 1 and "'check'" in found[0] and "skip reason=" in found[0]
    skip = {"reason": ["needs 8 GPUs"]}
    assert rdc.problems([rdc.Block("docs/memory.md", 3, "bash", "make demo\n", "skip", skip)]) == []
    for page in ("docs/getting-started.md", "docs/distributed.md", "docs/rl.md", "docs/vlm.md"):
        found = rdc.problems([rdc.Block(page, 3, "bash", "make demo\n", "skip", skip)])
        assert len(found) == 1 and f"{page}:3" in found[0], found


def test_a_block_marked_run_that_skips_itself_fails(tmp_path):
    for text in ("echo no GPU; exit 77\n",
                 "echo '1 passed, 2 skipped in 0.51s'\n",
                 "echo '=========== 3 skipped in 1.20s ==========='\n"):
        passed, why, _, _ = rdc.run_block(rdc.Block("p.md", 1, "bash", text, "run"),
                                          tmp_path, tmp_path, timeout=30)
        assert not passed and "skipped" in why, text
    ok = rdc.Block("p.md", 1, "bash", "echo 'skipped_steps: 0; 3 passed in 1.0s'\n", "run")
    assert rdc.run_block(ok, tmp_path, tmp_path, timeout=30)[0]


def test_run_block_checks_exit_status_output_and_files(tmp_path):
    ok = rdc.Block("p.md", 1, "bash", "echo hello; touch made\n", "run",
                   {"expect": ["hello"], "files": ["made"]})
    assert rdc.run_block(ok, tmp_path, tmp_path, timeout=30)[:2] == (True, "")
    bad = rdc.Block("p.md", 9, "bash", "echo bye; false\n", "run",
                    {"expect": ["hello"], "files": ["absent"]})
    passed, why, _, _ = rdc.run_block(bad, tmp_path, tmp_path, timeout=30)
    assert not passed
    assert "exit status 1" in why and "'hello'" in why and "missing absent" in why
    slow = rdc.Block("p.md", 20, "bash", "echo started; sleep 30\n", "run", {})
    passed, why, seconds, _ = rdc.run_block(slow, tmp_path, tmp_path, timeout=1)
    assert not passed and "timed out" in why and "started" in why and seconds < 20


def test_blocks_after_a_command_share_its_lane_and_must_name_an_earlier_block():
    demo = rdc.Block("README.md", 1, "bash", "make demo\n", "run")
    plan = rdc.Block("README.md", 5, "bash", "hybridtrain plan -c r.yaml\n", "run")
    use = rdc.Block("a.md", 1, "bash", "hybridtrain evaluate -c r.yaml\n", "run",
                    {"after": ["make demo"]})
    other = rdc.Block("b.md", 1, "bash", "hybridtrain dpo -c d.yaml\n", "run")
    assert rdc.lanes([demo, plan, use, other]) == ([demo, use], [plan, other])
    assert rdc.problems([demo, plan, use, other]) == []
    found = rdc.problems([use, demo])
    assert len(found) == 1 and "a.md:1" in found[0] and "make demo" in found[0]


def test_the_lanes_run_every_block_once_and_the_chain_in_order_in_its_own_copy():
    """The first lane runs the after-chain, then takes the other blocks from the end, in a
    copy of their own; the second takes them from the start: both finish together."""
    import time

    chain = [rdc.Block("README.md", i, "bash", f"chain {i}\n", "run") for i in range(3)]
    rest = [rdc.Block("a.md", i, "bash", f"other {i}\n", "run") for i in range(8)]
    ran = []

    def run(b, copy):
        time.sleep(0.01)
        ran.append((b.path, b.line, copy))

    for t in (threads := rdc.lane_threads(chain, rest, ["A", "B", "C"], run)):
        t.start()
    for t in threads:
        t.join()
    assert sorted(x[:2] for x in ran) == sorted(
        [("README.md", i) for i in range(3)] + [("a.md", i) for i in range(8)])
    assert [x[1] for x in ran if x[2] == "A"] == [0, 1, 2]
    second = [x[1] for x in ran if x[2] == "B"]
    from_end = [x[1] for x in ran if x[2] == "C"]
    assert sorted(second + from_end) == list(range(8))
    assert second == list(range(len(second))) and from_end == sorted(from_end, reverse=True)
    assert second and from_end  # both lanes took some


def test_the_scratch_copy_leaves_the_venv_installed(tmp_path):
    """`make` in the copy must not reinstall: its pyproject.toml is not newer than the venv's
    stamp, to the nanosecond (a reinstall would point the venv's package at the copy)."""
    venv, dest = tmp_path / "venv", tmp_path / "copy"
    venv.mkdir()
    dest.mkdir()
    (venv / ".installed").touch()
    t = (ROOT / "pyproject.toml").stat().st_mtime_ns - 1_234_567_891  # older than the checkout's
    os.utime(venv / ".installed", ns=(t, t))
    rdc.scratch_copy(dest, venv)
    assert (dest / "README.md").is_file() and (dest / ".venv").resolve() == venv.resolve()
    assert (dest / "pyproject.toml").stat().st_mtime_ns <= t


def test_the_readme_links_to_pages_that_exist():
    """mkdocs --strict checks the site's links; the README is outside the site."""
    import re

    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    assert links and all((ROOT / link).is_file() for link in links), links
