"""One table of dtype names (hybridtrain.config.dtypes) for recipes, exports and FLOP tables."""

import pytest
import torch

from hybridtrain.config.dtypes import (
    DTYPE_ALIASES,
    DTYPE_NAMES,
    canonical_dtype_name,
    dtype_name,
    short_dtype_name,
    to_torch_dtype,
)
from hybridtrain.models.nemotron_h.hf_io import parse_dtype
from hybridtrain.training.flops import gpu_peak_tflops


@pytest.mark.parametrize("alias", sorted(DTYPE_ALIASES))
def test_every_alias_round_trips(alias):
    dt = to_torch_dtype(alias)
    assert isinstance(dt, torch.dtype) and dtype_name(dt) == DTYPE_ALIASES[alias]
    for spelling in (alias.upper(), f"torch.{alias}", dt):
        assert canonical_dtype_name(spelling) == DTYPE_ALIASES[alias]
    assert short_dtype_name(alias) == {"float32": "fp32", "bfloat16": "bf16",
                                       "float16": "fp16"}[DTYPE_ALIASES[alias]]


def test_unknown_names():
    assert canonical_dtype_name("fp8") is None and short_dtype_name(torch.int64) is None
    with pytest.raises(ValueError, match=r"checkpoint.save_dtype: unknown dtype 'fp8'; use one "
                                         r"of float32, bfloat16, float16"):
        to_torch_dtype("fp8", "checkpoint.save_dtype")
    assert DTYPE_NAMES == ("float32", "bfloat16", "float16")


def test_users_share_the_table():
    assert parse_dtype("auto") is None and parse_dtype(None) is None
    assert parse_dtype("BF16") is torch.bfloat16 and parse_dtype(torch.float16) is torch.float16
    assert gpu_peak_tflops("NVIDIA H100", "half") == gpu_peak_tflops("NVIDIA H100", torch.float16)
    assert gpu_peak_tflops("NVIDIA H100", "tf32") == 494.7
