"""The decode engine: the batched speculative loop (engine), a request's life in it
(requests), its metrics (stats), and the verify step through torch.compile (compiled_step)."""
