"""SFT data: tokenizers, SQuAD, chat, packing and collators.

Builders a YAML ``_target_`` can call (signatures in each module's docstring):

- ``hybridtrain.data.load_tokenizer`` / ``build_bpe_tokenizer``       (tokenizer.py)
- ``hybridtrain.data.build_squad_dataset``                          (squad.py)
- ``hybridtrain.data.build_chat_dataset`` / ``ChatDataset``         (chat.py)
- ``hybridtrain.data.pack_dataset``                                 (packing.py)
- ``hybridtrain.data.PaddingCollator`` / ``PackedCollator`` / ``build_collator`` (collate.py)
- ``hybridtrain.data.write_synthetic_squad``                        (synthetic.py)

Label convention (all datasets, packed or not): ``labels`` are already shifted --
``labels[t] == input_ids[t + 1]`` when token ``t + 1`` is trained on, else -100 -- and the last
token of every document is -100, so the loss is ``cross_entropy(logits[t], labels[t])`` and no
label crosses a document boundary. Every batch carries ``num_label_tokens`` and ``num_tokens``.
"""

from .chat import ChatDataset, build_chat_dataset
from .collate import PackedCollator, PaddingCollator, build_collator
from .dataset import IGNORE_INDEX, TokenizedDataset, default_cache_dir
from .io import (
    AnswerMismatchError,
    ChatFormatError,
    DataError,
    EmptyDatasetError,
    MalformedJSONError,
    MissingFieldError,
)
from .packing import PackedDataset, first_fit_decreasing, pack_dataset, pack_sequences
from .squad import SquadDataset, build_squad_dataset, read_squad
from .synthetic import synthetic_squad, synthetic_texts, write_synthetic_squad
from .tokenizer import (
    CHATML_TEMPLATE,
    CHATML_TEMPLATE_NO_GENERATION,
    build_bpe_tokenizer,
    load_tokenizer,
    tokenizer_fingerprint,
)

__all__ = [
    "AnswerMismatchError",
    "CHATML_TEMPLATE",
    "CHATML_TEMPLATE_NO_GENERATION",
    "ChatDataset",
    "ChatFormatError",
    "DataError",
    "EmptyDatasetError",
    "IGNORE_INDEX",
    "MalformedJSONError",
    "MissingFieldError",
    "PackedCollator",
    "PackedDataset",
    "PaddingCollator",
    "SquadDataset",
    "TokenizedDataset",
    "build_bpe_tokenizer",
    "build_chat_dataset",
    "build_collator",
    "build_squad_dataset",
    "default_cache_dir",
    "first_fit_decreasing",
    "load_tokenizer",
    "pack_dataset",
    "pack_sequences",
    "read_squad",
    "synthetic_squad",
    "synthetic_texts",
    "tokenizer_fingerprint",
    "write_synthetic_squad",
]
