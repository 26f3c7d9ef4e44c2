"""layerplan: a torch-free offload planner for GGUF models (filled by the layerplan issue)."""
