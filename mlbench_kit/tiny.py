"""Tiny, offline stand-ins for real models: a byte-level BPE tokenizer trained with `tokenizers`.

Used by the tests and the demo, never instead of a real model at run time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

# A Llama-2-style chat template, so the "chat" prompt template has something real to render.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] | trim }} [/INST]"
    "{% else %} {{ m['content'] | trim }} {{ eos_token }}{% endif %}{% endfor %}"
)


def build_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 2000) -> Path:
    """Train a byte-level BPE tokenizer on ``texts`` and save it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    from tokenizers.processors import TemplateProcessing
    tok.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    fast.save_pretrained(out)
    return out


def build_llama(tokenizer_dir: str | Path, out_dir: str | Path, hidden: int = 128, layers: int = 2,
                heads: int = 2, max_positions: int = 4096, seed: int = 0) -> Path:
    """Save a random-init Llama (head_dim = hidden/heads, kept >= 32 for vLLM's CPU attention) with the tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if hidden // heads < 32:
        raise ValueError("vLLM's CPU attention needs head_dim >= 32")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_positions,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    out = Path(out_dir)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
