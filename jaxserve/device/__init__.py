"""The device side: the model runner, packing a step plan into arrays, the jitted step,
sampling, attention and its backends, the KV cache, meshes and multi-host."""
