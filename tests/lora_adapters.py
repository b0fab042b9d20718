"""Random PEFT LoRA adapters for a saved Hugging Face model, for reference checks."""

from pathlib import Path

import peft
import torch
import transformers


def save_random_adapter(model_dir: Path, path: Path, rank: int, targets: list[str] | str,
                        seed: int, alpha: int | None = None, rslora: bool = False,
                        std: float = 0.05) -> torch.nn.Module:
    """A random adapter on the model at `model_dir`, saved at `path`; returns the base
    model with the adapter applied (f32, eval mode), for reference logits."""
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets,
                             use_rslora=rslora, init_lora_weights=False)
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * std)
    model.eval()
    model.save_pretrained(path)
    return model
