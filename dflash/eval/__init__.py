"""Speculative decoding of held-out prompts with a drafter and its target: τ, per-position
acceptance, the lossless check (`decode`), the prompt sets (`prompts`)."""
