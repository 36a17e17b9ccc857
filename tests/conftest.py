"""Suite-wide settings: one intra-op thread. The tests use tiny shapes, for which a second
thread only adds synchronisation (measured up to 10x slower on a loaded 2-core machine), and
multi-process tests run one thread per rank anyway. Fixtures shared by the test files."""

import pytest
import torch

from tests.helpers.data import bpe_tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The byte-level BPE of :func:`tests.helpers.data.bpe_tokenizer` (built once per process)."""
    return bpe_tokenizer(tmp_path_factory)


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory):
    """The tiny VLM recipe's data directory (tokenizer, data) for the whole session: the
    one-process references of ``tests.helpers.vlm`` computed in it serve every test file."""
    return str(tmp_path_factory.mktemp("vlm_shared"))


@pytest.fixture(scope="session")
def vlm_ckpt(tmp_path_factory):
    """Checkpoints of one-process VLM runs shared by the test files
    (``tests.helpers.vlm.colocated_checkpoint``)."""
    return str(tmp_path_factory.mktemp("vlm_ckpt"))
