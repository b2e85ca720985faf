"""The target model and what it is made of: the Llama-family modules (llama), their
configuration (config), the paged KV cache (cache), loading checkpoints and the default GGUF
(loader, gguf), the tokenizer and chat template (tokenizer), tensor parallelism
(tensor_parallel). Nothing here imports the CPU decode path or the engine."""
