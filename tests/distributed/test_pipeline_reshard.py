"""``fsdp_reshard_after_forward: always`` under pipeline parallelism: each FSDP unit reshards
after its backward too (torch's PipelineStage would keep the whole stage gathered until the
last micro-batch), and the per-step losses and gradient norms are bit-identical to the
default (gathered weights are exact copies; unsynced gradients accumulate as before)."""

import torch

from tests.helpers import parity as pu
from tests.helpers.distributed import run_distributed

LORA = {"dim": 8, "alpha": 16, "match_all_linear": True}


def _losses(rank, world):
    torch.set_num_threads(1)
    out = {}
    for name, layout in {"default": {"pp": 2, "ep": 2},
                         "always": {"pp": 2, "ep": 2, "reshard": "always"}}.items():
        losses, _, val, norms = pu.run_layout(layout, world, False, peft=LORA)
        out[name] = ([float(x) for x in losses], [float(x) for x in norms], float(val))
    return out


def test_pp_ep_reshard_always_is_bit_identical():
    res = run_distributed(_losses, 4)
    for r in res:
        assert r["always"] == r["default"], r
