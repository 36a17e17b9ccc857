"""The model family from outside the tree (tests/families/hybridtrain_dense, a package that
registers the spec ``dense_test`` through the entry-point group ``hybridtrain.models``), which
the test set-up installs (``make test``); the tests that use it skip without it."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

# its model in a recipe's model section
DENSE = {"_target_": "hybridtrain_dense.DenseLM",
         "config": {"_target_": "hybridtrain_dense.DenseConfig"}}
DENSE_PREFIXES = ["tests.", "hybridtrain_dense."]  # allowed_target_prefixes of such a recipe


def require_dense():
    """The installed ``hybridtrain_dense`` package; a skip when it is not installed."""
    why = ("the dense test family is not installed: pip install --no-deps -e "
           "tests/families/hybridtrain_dense (make test does)")
    if not any(ep.name == "dense_test" for ep in entry_points(group="hybridtrain.models")):
        pytest.skip(why)
    try:
        import hybridtrain_dense
    except ImportError:  # its metadata without its package
        pytest.skip(why)
    return hybridtrain_dense


def dense_spec():
    """The family's registered spec (found through its entry point)."""
    require_dense()
    from hybridtrain.models.spec import get_model_spec

    return get_model_spec("dense_test")
