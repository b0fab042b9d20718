"""What is read from disk: model configs, weights (safetensors, GGUF, Orbax), the
tokenizer, and the default model."""
