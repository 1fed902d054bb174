"""Serving engines at both ends: vLLM running an export as drafter (`vllm`), and an
OpenAI-compatible chat server writing regen's replies (`server`)."""
