"""`jaxserve route`: the gateway in front of the replicas (pools, guardrails, batches)."""
