"""Read a LoRA adapter in the PEFT format into host arrays laid out as the model's weights.

A PEFT directory holds `adapter_config.json` (`r`, `lora_alpha`, `target_modules`,
`use_rslora`, ...) and `adapter_model.safetensors`, whose tensors are named after the
base model's modules: `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r]. PEFT computes `B(A(x)) × scale`, scale being
lora_alpha / r (lora_alpha / √r with rsLoRA); here A and B are stored transposed ([in, r]
and [r, out], as the model stores its kernels) and stacked over layers, a layer the
adapter leaves alone holding zeros. What the engine cannot serve exactly (DoRA, per-module
ranks or alphas, trained biases, extra trained modules, targets other than the decoder's
seven projections) is refused with an `AdapterError` that says why, never approximated.
"""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxserve.config import ModelConfig

# the projections an adapter may target
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)
# adapter_config.json options that change the arithmetic; each must be off
_UNSUPPORTED = {
    "use_dora": "DoRA",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "lora_bias": "trained LoRA biases (lora_bias)",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
}


class AdapterError(ValueError):
    """An adapter that cannot be served: the message names the file and the reason."""


@dataclass(frozen=True, slots=True, eq=False)
class Adapter:
    """One LoRA adapter on the host, ready to be written into a device slot; compared by
    identity (the same name loaded again is another adapter, with another serial)."""

    name: str
    path: Path
    rank: int
    scale: float  # lora_alpha / r (or / √r with rsLoRA)
    # target -> (A f32[num_layers, in, rank], B f32[num_layers, rank, out])
    weights: dict[str, tuple[np.ndarray, np.ndarray]]
    serial: int = 0  # the registry's count of loads when it was loaded

    @property
    def key(self) -> str:
        """What tells this adapter apart in prefix-cache keys: name and serial."""
        return f"{self.name}#{self.serial}"


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target's (input, output) size in `config`'s model."""
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> Adapter:
    """The adapter at `path` for a model of `config`; AdapterError when it cannot be served
    (unreadable, a rank above `max_rank`, a target the model does not have, wrong shapes)."""
    from safetensors import safe_open

    path = Path(path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise AdapterError(
            f"{path}: not a PEFT adapter directory (needs adapter_config.json and "
            "adapter_model.safetensors)"
        )
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{config_file}: unreadable ({e})") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{config_file}: peft_type {raw.get('peft_type')!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if raw.get(key):
            raise AdapterError(f"{config_file}: {what} is not supported")
    if raw.get("bias", "none") != "none":
        raise AdapterError(
            f"{config_file}: trained biases (bias={raw['bias']!r}) are not supported"
        )
    if raw.get("fan_in_fan_out"):
        raise AdapterError(f"{config_file}: fan_in_fan_out (Conv1D layers) is not supported")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{config_file}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{config_file}: rank {rank} exceeds --max-lora-rank {max_rank}")
    _check_target_modules(raw.get("target_modules"), config_file)
    scale = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank

    shapes = projection_shapes(config)
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    try:
        with safe_open(weights_file, framework="numpy") as f:
            names = list(f.keys())
            for tensor in names:
                match = _TENSOR.search(tensor)
                if match is None:
                    raise AdapterError(
                        f"{weights_file}: tensor {tensor!r} is not a LoRA A or B of a decoder "
                        f"projection ({', '.join(TARGETS)})"
                    )
                layer, target, which = int(match[1]), match[2], match[3]
                if target not in shapes:
                    raise AdapterError(
                        f"{weights_file}: target module {target!r} does not exist in this "
                        f"model (adapters may target {', '.join(TARGETS)})"
                    )
                if layer >= config.num_layers:
                    raise AdapterError(
                        f"{weights_file}: {tensor!r} is for layer {layer}; the model has "
                        f"{config.num_layers}"
                    )
                fan_in, fan_out = shapes[target]
                want = (rank, fan_in) if which == "A" else (fan_out, rank)
                value = np.asarray(f.get_tensor(tensor), dtype=np.float32)
                if value.shape != want:
                    raise AdapterError(
                        f"{weights_file}: {tensor!r} has shape {value.shape}, expected {want} "
                        "(an adapter of another base model?)"
                    )
                if target not in weights:
                    weights[target] = (np.zeros((config.num_layers, fan_in, rank), np.float32),
                                       np.zeros((config.num_layers, rank, fan_out), np.float32))
                weights[target][0 if which == "A" else 1][layer] = value.T
    except AdapterError:
        raise
    except Exception as e:  # noqa: BLE001 (safetensors raises its own error types)
        raise AdapterError(f"{weights_file}: unreadable safetensors file ({e})") from None
    if not weights:
        raise AdapterError(f"{weights_file}: holds no LoRA weights")
    return Adapter(name, path, rank, float(scale), weights)


def _check_target_modules(targets, config_file: Path) -> None:
    """A list of module names must name the model's projections; "all-linear" and a regex
    (a string) are checked against the tensors instead."""
    if isinstance(targets, list):
        for module in targets:
            if module.rsplit(".", 1)[-1] not in TARGETS:
                raise AdapterError(
                    f"{config_file}: target module {module!r} does not exist in this model "
                    f"(adapters may target {', '.join(TARGETS)})"
                )
