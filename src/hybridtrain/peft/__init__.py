"""Parameter-efficient fine-tuning: LoRA (adapters, merging, Hugging Face PEFT export)."""

from .export import (
    export_peft,
    load_peft_adapter,
    merge_adapter_into_hf,
    peft_state_dict,
    save_merged_hf,
    save_peft_adapter,
)
from .lora import (
    LoRAExperts,
    LoRALinear,
    apply_lora,
    has_lora,
    init_lora_weights,
    is_lora_param,
    load_lora_state_dict,
    lora_settings,
    lora_state_dict,
    merge_lora,
    merged_state_dict,
)

__all__ = [
    "LoRAExperts",
    "LoRALinear",
    "apply_lora",
    "export_peft",
    "has_lora",
    "init_lora_weights",
    "is_lora_param",
    "load_lora_state_dict",
    "load_peft_adapter",
    "lora_settings",
    "lora_state_dict",
    "merge_adapter_into_hf",
    "merge_lora",
    "merged_state_dict",
    "peft_state_dict",
    "save_merged_hf",
    "save_peft_adapter",
]
