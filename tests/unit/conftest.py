"""Fixtures shared by the tests/unit files (helpers they import stay in *_testutils.py)."""

import pytest
from data_testutils import bpe_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The byte-level BPE of data_testutils.bpe_tokenizer (built once per process)."""
    return bpe_tokenizer(tmp_path_factory)
