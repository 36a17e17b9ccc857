"""`make test` runs the suite on two pytest-xdist workers with ``--dist loadgroup``: a file (or a
named group, tests/conftest.py) runs whole on one worker, so its module fixtures -- most of them
multi-process runs -- are built once. xdist learns the groups from the node ids it suffixes with
``@group``; pytest 9.2 keeps node ids where pytest-xdist 3.8 cannot change them, and every test
was then scheduled alone, silently, its file's fixtures built again on the other worker (a fresh
clone's suite took ~35 % more CPU, 2026-12-06). pyproject bounds pytest below 9.2 for it."""

import os

import pytest


def test_the_worker_runs_this_file_as_one_group(request):
    # (a worker sees `--dist` as "no" and this option set from it)
    if not os.environ.get("PYTEST_XDIST_WORKER") or not getattr(request.config.option, "loadgroup", False):
        pytest.skip("runs under `make test`: pytest-xdist with --dist loadgroup")
    assert request.node.nodeid.endswith("@test_xdist_groups.py"), (
        f"{request.node.nodeid}: xdist did not receive the test's group; pytest or pytest-xdist "
        "changed how node ids are kept (see this file's docstring)")
