"""The batch contract (hybridtrain.data.batch): one IGNORE_INDEX, the model-input keys, the
token counts, and a module that imports nothing heavy."""

import subprocess
import sys

import torch

from hybridtrain.data import IGNORE_INDEX as exported
from hybridtrain.data.batch import (
    IGNORE_INDEX,
    MODEL_INPUT_KEYS,
    count_label_tokens,
    count_tokens,
    model_inputs,
)
from hybridtrain.data.collate import PaddingCollator


def test_helpers_on_a_collated_batch():
    batch = PaddingCollator(pad_token_id=0)([
        {"input_ids": [5, 6, 7], "labels": [6, 7, IGNORE_INDEX]},
        {"input_ids": [8, 9], "labels": [IGNORE_INDEX, IGNORE_INDEX]},
    ])
    assert exported == IGNORE_INDEX == -100
    assert count_label_tokens(batch) == int(batch["num_label_tokens"]) == 2
    assert count_tokens(batch) == 5
    assert count_tokens({k: v for k, v in batch.items() if k != "num_tokens"}) == 5  # mask sum
    assert count_tokens({"input_ids": batch["input_ids"]}) == 6
    assert set(model_inputs(batch)) == {"position_ids"} and MODEL_INPUT_KEYS[0] == "position_ids"
    assert model_inputs({**batch, "cu_seqlens": None}).keys() == {"position_ids"}
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    assert model_inputs({**batch, "cu_seqlens": cu})["cu_seqlens"] is cu


def test_importing_the_batch_module_is_cheap():
    code = ("import sys, hybridtrain.data.batch; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'numpy', 'datasets', 'transformers', 'tokenizers'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
