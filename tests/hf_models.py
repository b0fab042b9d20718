"""Small random Hugging Face models saved as safetensors directories, for reference checks."""

from pathlib import Path

import torch
import transformers

CONFIGS = {
    "llama-gqa-tied": (
        transformers.LlamaConfig,
        {"num_attention_heads": 8, "num_key_value_heads": 2, "tie_word_embeddings": True},
    ),
    "llama3-rope-scaling": (
        transformers.LlamaConfig,
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "qwen2-bias": (
        transformers.Qwen2Config,
        {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False},
    ),
}


def save_random_model(kind: str, path: Path, seed: int = 0) -> torch.nn.Module:
    """A random float32 model of `kind`, every weight perturbed so errors cannot hide."""
    config_cls, overrides = CONFIGS[kind]
    config = config_cls(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        **overrides,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Plain argmax continuation with a KV cache (EOS does not stop it)."""
    out, past, step_ids = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            result = model(step_ids, past_key_values=past, use_cache=True)
            past = result.past_key_values
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            step_ids = torch.tensor([[token]])
    return out
