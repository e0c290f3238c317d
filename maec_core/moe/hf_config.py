"""config.json of the MoE: the base's config carried into the output architecture's
config class (transformers'), with the MoE fields mergekit-moe 0.1.5 sets."""

from __future__ import annotations

from maec_core.errors import CheckpointError
from maec_core.io.folder import ModelFolder
from maec_core.moe.config import MoeConfig
from maec_core.moe.plan import MoePlan
from maec_core.runtime import torch_dtype


def output_config_json(plan: MoePlan, config: MoeConfig, base: ModelFolder) -> bytes:
    """The bytes transformers' ``save_pretrained`` would write for the output config."""
    import transformers

    try:
        base_cfg = transformers.AutoConfig.from_pretrained(str(base.root),
                                                           trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{base.root.name}: config.json cannot be read as a "
                              f"transformers config ({exc})") from None
    per_token = config.experts_per_token
    out: transformers.PretrainedConfig
    if plan.arch == "mixtral":
        if not isinstance(base_cfg, transformers.MistralConfig):
            # Through Mistral's config first, as mergekit does (a Llama's fields that
            # Mistral lacks go, and there is no sliding window).
            mistral = transformers.MistralConfig(**base_cfg.to_dict())
            mistral.sliding_window = None
            mistral.max_position_embeddings = base_cfg.max_position_embeddings
            base_cfg = mistral
        out = transformers.MixtralConfig(**base_cfg.to_dict())
        out.architectures = ["MixtralForCausalLM"]
        out.num_local_experts = len(config.experts)
        out.num_experts_per_tok = per_token
        out.sliding_window = None
    elif plan.arch == "qwen3_moe":
        out = transformers.Qwen3MoeConfig(**base_cfg.to_dict())
        out.architectures = ["Qwen3MoeForCausalLM"]
        out.num_experts = len(config.experts)
        out.num_experts_per_tok = per_token
        out.decoder_sparse_step = 1
        out.norm_topk_prob = True
        out.moe_intermediate_size = out.intermediate_size
    else:
        out = transformers.Qwen2MoeConfig(**base_cfg.to_dict())
        out.architectures = ["Qwen2MoeForCausalLM"]
        out.num_experts = len(config.experts)
        out.num_experts_per_tok = per_token
        out.decoder_sparse_step = 1
        out.norm_topk_prob = True
        out.sliding_window = None
        out.use_sliding_window = False
        out.shared_expert_intermediate_size = out.intermediate_size
        out.moe_intermediate_size = out.intermediate_size
    out.dtype = torch_dtype(plan.out_dtype)
    return str(out.to_json_string(use_diff=True)).encode()
