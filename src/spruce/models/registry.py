"""Model registry: a checkpoint's architecture (config.json `architectures`) -> the spruce class that runs it.

A new target architecture has one home: a module under `spruce.models` and one line here."""

from __future__ import annotations

import importlib

from spruce.models.hf_config import ModelConfig

# architecture -> "module:Class"
TARGET_CLASSES = {
    "LlamaForCausalLM": "spruce.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "spruce.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "spruce.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "spruce.models.llama:LlamaForCausalLM",
    "Qwen2MoeForCausalLM": "spruce.models.qwen_moe:MoEDecoderLM",
    "Qwen3MoeForCausalLM": "spruce.models.qwen_moe:MoEDecoderLM",
    "MixtralForCausalLM": "spruce.models.qwen_moe:MoEDecoderLM",
    "DeepseekV2ForCausalLM": "spruce.models.deepseek:DeepseekForCausalLM",
    "DeepseekV3ForCausalLM": "spruce.models.deepseek:DeepseekForCausalLM",
    "GptOssForCausalLM": "spruce.models.gpt_oss:GptOssForCausalLM",
    "Llama4ForCausalLM": "spruce.models.llama4:Llama4ForCausalLM",
    "Llama4ForConditionalGeneration": "spruce.models.llama4:Llama4ForCausalLM",
}


def target_class(cfg: ModelConfig) -> type:
    """The model class for `cfg.architecture` (ModelConfig.from_dir already refused unknown ones)."""
    module, name = TARGET_CLASSES[cfg.architecture].split(":")
    return getattr(importlib.import_module(module), name)
