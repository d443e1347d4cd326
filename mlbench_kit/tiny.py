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
