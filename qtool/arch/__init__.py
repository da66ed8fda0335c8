"""Model-family knowledge as data: which tensor is what, for the Qwen3.5 MoE family."""
