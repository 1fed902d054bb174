"""A tiny random Llama with a real (byte-fallback BPE) tokenizer: a target llama.cpp can load,
convert (its converter reads this tokenizer.json as Llama's) and hook, for the GGUF tests."""

from __future__ import annotations

from pathlib import Path


def tiny_tokenizer(vocab_size: int = 512):
    """<unk> <s> </s>, the 256 byte tokens, "▁" and printable ASCII, then letter pairs up to
    `vocab_size` (at least 354)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for c in ["▁"] + [chr(c) for c in range(33, 127)]:
        vocab[c] = len(vocab)
    letters, merges = "etaoinshrdlucmfwypvbgk", []
    for piece in ["▁" + c for c in letters] + [a + b for a in letters for b in letters]:
        if len(vocab) == vocab_size:
            break
        merges.append((piece[0], piece[1:]))
        vocab[piece] = len(vocab)
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def save_tiny_llama(
    folder: Path, hidden: int = 64, layers: int = 4, vocab_size: int = 512, seed: int = 0, positions: int = 4096
) -> Path:
    """The model and its tokenizer, saved as a Hugging Face folder (`positions`: its
    max_position_embeddings)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2, max_position_embeddings=positions,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
        with torch.no_grad():  # as the tiny Qwen3: varied greedy continuations, something to learn
            model.get_input_embeddings().weight.normal_(0.0, 1.0)
    model.save_pretrained(folder)
    tiny_tokenizer(vocab_size).save_pretrained(folder)
    return folder
