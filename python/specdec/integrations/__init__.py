"""Integrations of specdec's speculative decoding with other libraries' models.

specdec.integrations.transformers: a Hugging Face transformers causal LM as the target
(its own layers, specdec's tree attention, drafters and sampler)."""
