"""Model math: the llama-family transformer and its KV cache."""
