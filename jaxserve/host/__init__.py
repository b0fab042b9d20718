"""The host side, no jax: the request record, the scheduler and its pages and buckets, the
plain-data step plan and step output, the engine loop, output text and streams."""
