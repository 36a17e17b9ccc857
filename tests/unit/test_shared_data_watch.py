"""The suite's watch on ``../shared`` (tests/conftest.py): a test that opens a file there is
noted (CI runs it again without the folder), and under ``HYBRIDTRAIN_TEST_SHARED=0`` such an
access fails the test instead of silently reading the data."""

from __future__ import annotations

import os
import sys

import pytest

from tests.helpers.data import SHARED_DATA, SHARED_SWITCH, require_shared


def _watch():
    return sys.modules["tests.conftest"]


def test_a_read_under_shared_is_noted(request, monkeypatch):
    monkeypatch.setenv(SHARED_SWITCH, "1")
    watch = _watch()
    try:
        with pytest.raises(OSError):
            open(SHARED_DATA / "no-such-file-here.json")  # noted before the open fails
        assert request.node.nodeid in watch._readers
    finally:
        watch._readers.discard(request.node.nodeid)  # not a real reader


def test_a_read_under_shared_fails_when_switched_off(monkeypatch):
    monkeypatch.setenv(SHARED_SWITCH, "0")
    with pytest.raises(PermissionError, match="require_shared"):
        open(SHARED_DATA / "squad-v2-dev-subset.json")
    with pytest.raises(PermissionError):
        os.listdir(SHARED_DATA)
    with pytest.raises(pytest.skip.Exception, match="switched off"):
        require_shared(SHARED_DATA / "squad-v2-dev-subset.json")
