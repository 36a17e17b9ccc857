"""SFT data: tokenizers, SQuAD, chat, packing and collators.

Builders a YAML ``_target_`` can call (signatures in each module's docstring):

- ``hybridtrain.data.load_tokenizer`` / ``build_bpe_tokenizer``       (tokenizer.py)
- ``hybridtrain.data.build_squad_dataset``                          (squad.py)
- ``hybridtrain.data.build_chat_dataset`` / ``ChatDataset``         (chat.py)
- ``hybridtrain.data.pack_dataset``                                 (packing.py)
- ``hybridtrain.data.PaddingCollator`` / ``PackedCollator`` / ``build_collator`` (collate.py)
- ``hybridtrain.data.write_synthetic_squad``                        (synthetic.py)
- ``hybridtrain.data.build_preference_dataset`` / ``write_synthetic_preferences`` (preference.py)
- ``hybridtrain.data.build_vision_chat_dataset`` (images + chat)     (vision_chat.py, images.py)
- ``hybridtrain.data.write_synthetic_shapes`` / ``shapes_texts``    (synthetic_shapes.py)
- ``hybridtrain.data.registered_dataset`` (a dataset from outside, by its entry point)  (registry.py)

What a dataset, an example and a batch are is written in ``hybridtrain.data.contract``; the
batch's keys, ``IGNORE_INDEX``, the label convention and token counts in ``hybridtrain.data.batch``. The names below are imported on first use.
"""

import importlib

# public name -> the module that defines it; imported on first use, so that importing a light
# module (``hybridtrain.data.batch``) does not load torch, datasets or transformers
_EXPORTS = {
    "IGNORE_INDEX": "batch",
    "ChatDataset": "chat", "build_chat_dataset": "chat",
    "PackedCollator": "collate", "PaddingCollator": "collate", "build_collator": "collate",
    "TokenDataset": "contract", "check_dataset": "contract",
    "registered_dataset": "registry",
    "TokenizedDataset": "dataset", "default_cache_dir": "dataset",
    "AnswerMismatchError": "io", "ChatFormatError": "io", "DataError": "io",
    "EmptyDatasetError": "io", "EncodingError": "io", "MalformedJSONError": "io",
    "MissingFieldError": "io",
    "PackedDataset": "packing", "first_fit_decreasing": "packing", "pack_dataset": "packing",
    "pack_sequences": "packing",
    "PreferenceDataset": "preference", "build_preference_dataset": "preference",
    "preference_batch": "preference", "response_batch": "preference",
    "synthetic_preference_texts": "preference",
    "write_synthetic_preferences": "preference",
    "SquadDataset": "squad", "build_squad_dataset": "squad", "read_squad": "squad",
    "synthetic_squad": "synthetic", "synthetic_texts": "synthetic",
    "write_synthetic_squad": "synthetic",
    "CHATML_TEMPLATE": "tokenizer", "CHATML_TEMPLATE_NO_GENERATION": "tokenizer",
    "build_bpe_tokenizer": "tokenizer", "load_tokenizer": "tokenizer",
    "tokenizer_fingerprint": "tokenizer",
    "VisionChatDataset": "vision_chat", "build_vision_chat_dataset": "vision_chat",
    "shapes_texts": "synthetic_shapes", "write_synthetic_shapes": "synthetic_shapes",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = sorted(_EXPORTS)
