"""Suite-wide settings: one intra-op thread. The tests use tiny shapes, for which a second
thread only adds synchronisation (measured up to 10x slower on a loaded 2-core machine), and
multi-process tests run one thread per rank anyway. Fixtures shared by the test files.

Reference data (``../shared``) watch: an audit hook sees every file this process opens or lists
there and notes the test (and the fixture) that did. With ``HYBRIDTRAIN_TEST_SHARED_REPORT=FILE``
the ids of those tests (and of every test using a fixture that did) are written to FILE at the
end, so that CI can run exactly them again with ``HYBRIDTRAIN_TEST_SHARED=0``. Under that switch
any such access fails the test: a test must reach the data through
``tests.helpers.data.require_shared``, which skips instead."""

import fcntl
import gc
import os
import sys

# one thread in the processes the tests start, too (the CLI, scripts, launched ranks), unless set
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Intel MKL keeps no pool of freed GEMM buffers in any of the suite's processes (MKL reads this
# when torch loads it: before torch is imported here). The memory tests need it
# (tests.helpers.memory.no_blas_buffers), and with it set for all, their ranks fork from the same
# preloaded server as every other test's (no step time measurably moved: 2026-12-06).
os.environ["MKL_DISABLE_FAST_MM"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers.data import (
    SHARED_DATA,
    SHARED_EVENT,
    SHARED_SWITCH,
    bpe_tokenizer,
    shared_data_enabled,
)

torch.set_num_threads(1)

SHARED_ROOT = os.path.realpath(SHARED_DATA.parent)
REPORT_ENV = "HYBRIDTRAIN_TEST_SHARED_REPORT"
_now = {"test": None, "fixture": None}
_readers: set[str] = set()  # node ids of tests that touched ../shared
_reading_fixtures: set[str] = set()  # fixtures that touched it while being set up


def _under_shared(path) -> bool:
    try:
        real = os.path.realpath(os.fsdecode(os.fspath(path)))
    except TypeError:  # a file descriptor
        return False
    return real == SHARED_ROOT or real.startswith(SHARED_ROOT + os.sep)


def _audit(event: str, args: tuple) -> None:
    if event not in ("open", "os.listdir", "os.scandir", SHARED_EVENT) or _now["test"] is None:
        return
    if not args or args[0] is None or not _under_shared(args[0]):
        return
    if not shared_data_enabled() and event != SHARED_EVENT:
        raise PermissionError(f"{_now['test']} opened {args[0]} under {SHARED_SWITCH}=0: reach "
                              "../shared only through tests.helpers.data.require_shared (it skips)")
    _readers.add(_now["test"])
    if _now["fixture"] is not None:
        _reading_fixtures.add(_now["fixture"])


sys.addaudithook(_audit)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Also: each test leaves the process environment as it found it. A command run in-process
    (``hybridtrain.cli.main``) sets variables for its own process (the recipe's ``dist_env``,
    the OpenMP and allocator defaults), which must neither reach later tests nor make their
    ranks start as new interpreters (tests.helpers.distributed spawns them when the environment
    differs from the preloaded server's)."""
    _now["test"] = item.nodeid
    environ = dict(os.environ)
    yield
    _now["test"] = None
    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    outer, _now["fixture"] = _now["fixture"], fixturedef.argname
    yield
    _now["fixture"] = outer


def pytest_sessionfinish(session):
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    ids = set(_readers)
    ids.update(item.nodeid for item in session.items
               if _reading_fixtures.intersection(getattr(item, "fixturenames", ())))
    ids = {_plain_nodeid(i) for i in ids}
    with open(path, "a+") as f:  # parallel workers each add theirs
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        ids.update(line.strip() for line in f if line.strip())
        f.seek(0)
        f.truncate()
        f.writelines(f"{i}\n" for i in sorted(ids))


# -- Parallel runs (pytest-xdist; `make test` runs ``-n 2 --dist loadgroup``) -------------------
# A test file runs whole on one worker, so its module fixtures are built once; a test may name a
# group of its own instead (``@pytest.mark.xdist_group("...")``: a file whose fixtures are
# independent process groups spreads them over the workers). One-process references are
# computed once per worker (``tests.helpers.parity.reference``, ``tests.helpers.vlm``).


def _plain_nodeid(nodeid: str) -> str:
    """``nodeid`` without the ``@group`` suffix xdist's ``loadgroup`` adds to it."""
    return nodeid.split("@", 1)[0] if "@" in nodeid.rpartition("::")[2] else nodeid


# -- After collection ----------------------------------------------------------------------------
def pytest_collection_finish(session):
    """The environment as the test modules' imports left it (lm_eval's sets a variable) is the
    one every test starts in, so the one launched ranks fork in (tests.helpers.distributed).

    Garbage collection: a test process holds ~0.5M objects after collection (torch,
    transformers, the test modules), and Python's default thresholds walk them all in a full
    collection every ~70k net allocations: 10 % of a worker's CPU (2026-12-06). Collected, they
    move to the permanent generation, and young collections run 30 times less often (a full one
    with them)."""
    from tests.helpers.distributed import take_suite_environment

    take_suite_environment()
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)


def _group(item) -> str:
    """``item``'s xdist group (every item has one: :func:`pytest_itemcollected`)."""
    return item.get_closest_marker("xdist_group").args[0]


def pytest_itemcollected(item):
    """Each item's group (its file, unless it names one), marked as the item is collected: before
    any plugin's ``pytest_collection_modifyitems``, whatever their order, where xdist's turns the
    marks into the scopes it schedules (the ``@group`` suffix of the node ids; the test of it:
    tests/unit/test_xdist_groups.py)."""
    if not item.get_closest_marker("xdist_group"):
        item.add_marker(pytest.mark.xdist_group(item.path.name))


def pytest_collection_modifyitems(config, items):
    """Under xdist: the groups holding a ``slow`` test first, then the multi-process ones
    (tests/distributed/), then the rest (a worker takes the next group when it is free, so the
    longest ones do not come last)."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    first = {_group(item) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (_group(item) not in first, item.path.parent.name != "distributed"))


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


# -- Where the suite's time goes -----------------------------------------------------------------
def pytest_terminal_summary(terminalreporter):
    """One line: the seconds the tests of each folder under tests/ took (set-up, call and
    tear-down, summed over the parallel workers: the suite's wall time is about their sum over
    the workers' count)."""
    seconds: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            if isinstance(getattr(r, "duration", None), float) and getattr(r, "nodeid", ""):
                folder = r.nodeid.split("::")[0].rpartition("/")[0]
                seconds[folder] = seconds.get(folder, 0.0) + r.duration
    if seconds:
        terminalreporter.write_line("test seconds per folder: " + ", ".join(
            f"{k} {v:.0f} s" for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])))
