"""The model config of a benchmark recipe for the GPU scripts beside this file (decode.py,
hf_train.py): the recipe's ``model.config`` keys, or with ``small`` tiny shapes for a CPU dry run."""
import yaml

from hybridtrain.models.nemotron_h import small_moe_config

SMALL = dict(hidden_size=128, vocab_size=1024, n_routed_experts=4, num_experts_per_tok=2,
             mamba_num_heads=4, intermediate_size=256, moe_intermediate_size=64,
             moe_shared_expert_intermediate_size=128, num_attention_heads=4, head_dim=32,
             n_groups=2, ssm_state_size=16)


def recipe_model_config(path: str, small: bool = False):
    """(recipe dict, NemotronHConfig) of the benchmark recipe at ``path``."""
    with open(path) as f:
        recipe = yaml.safe_load(f)
    kw = {k: v for k, v in recipe["model"]["config"].items() if k != "_target_"}
    if small:
        kw.update(SMALL)
    return recipe, small_moe_config(**kw)
