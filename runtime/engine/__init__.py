"""Ember's LLM engine: paged KV cache with prefix reuse, continuous batching, Llama/Qwen2/Qwen3 models."""
