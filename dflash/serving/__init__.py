"""An export served: decoded in vLLM (`vllm`) and in llama.cpp's `llama-server` (`llamacpp`,
which also builds llama.cpp and converts a target to GGUF), each against the engine's own plain
greedy decoding; `EngineRun` is one such decoding's outputs and spec-decode counters."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["EngineRun"]


@dataclass
class EngineRun:
    """One decoding of the prompts in a serving engine: the generated ids per prompt and,
    with a drafter, its spec-decode counters (`drafts`: verify steps with a draft)."""

    outputs: list[list[int]]
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] | None = None
    seconds: float = 0.0
    stops: list[str] = field(default_factory=list)  # llama.cpp: why each generation ended
    tokens_per_s: float | None = None  # llama.cpp: its own, generation only (prompts excluded)

    @property
    def tau(self) -> float:
        """Tokens per verify step: the accepted drafts plus the target's own token."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0
