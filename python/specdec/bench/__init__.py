"""The end-to-end benchmarks (docs/benchmarks.md): MT-bench against HF transformers and
llama.cpp (e2e, hf, llamacpp), a row per drafter (drafters), the online engine under load
(serving), and what they share (common)."""
