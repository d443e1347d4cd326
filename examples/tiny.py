"""Tiny, offline stand-ins for real models: a byte-level BPE tokenizer trained with `tokenizers`.

Used by the tests and the demo, never instead of a real model at run time.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from mlbench_kit.io import atomic_dir, honour_umask

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
    honour_umask(out)
    return out


def pretrain(model_dir: str | Path, texts: list[str], steps: int = 300, seq_len: int = 128, batch: int = 8,
             lr: float = 3e-3, seed: int = 0, every: float = 30.0, threads: int = 1) -> list[float]:
    """Full-weight causal-LM training of a tiny model on ``texts``, in place: the stand-in for the pretraining a
    real code model has had (it has read READMEs), so that the LoRA stage starts from a model that knows the
    vocabulary rather than from noise. Returns the loss curve. Progress on stderr: a bar on a terminal, else
    ``pretrain: i/N steps (p%), loss L, elapsed m:ss, ETA m:ss`` every ``every`` seconds (the demo shows them).
    ``threads``: torch's intra-op threads while it trains (restored after). One is the default because this model's
    matrices are too small to split: on a busy 2-core box two threads wait on each other and run several times
    slower than one (bench/demo_stage1.sh); the losses are the same."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mlbench_kit.progress import Progress

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.tensor([t for text in texts for t in tok(text)["input_ids"] + [tok.eos_token_id]])
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / steps)
    g = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    model.train()
    bar = Progress(steps, "pretrain", "step", every=every)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(steps):
            starts = torch.randint(0, max(1, len(ids) - seq_len - 1), (batch,), generator=g)
            x = torch.stack([ids[s: s + seq_len] for s in starts])
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
            bar.update(1, f"loss {sum(losses[-20:]) / len(losses[-20:]):.2f}")
    finally:
        torch.set_num_threads(before)
    bar.close()
    model.save_pretrained(model_dir)
    honour_umask(model_dir)  # safetensors writes 0600: a labmate could not load the model
    return losses


def corpus(repos: str | Path, synthetic: str | Path | None, paired: list[str]) -> tuple[list[str], list[str]]:
    """``(tokenizer texts, pretraining texts)`` of the demo's base model.

    Both come from the fixture repositories (READMEs and source) and the synthetic pairs only; nothing reads the
    sample's rows, so no test answer reaches the model before evaluation. Pretraining sees the pairs of the
    ``paired`` repositories as plain request + fenced command (no README, no benchmark template: what a code
    model has seen before fine-tuning), and the other pairs' requests and commands apart, shuffled."""
    import json
    import random
    repo_text = [f.read_text() for f in sorted(Path(repos).rglob("*")) if f.is_file()
                 and (f.name.startswith("README") or f.suffix in (".py", ".sh"))]
    synth = [json.loads(x) for f in sorted(Path(synthetic).glob("synthetic-*.jsonl")) for x in f.open()] \
        if synthetic else []
    pairs = [r for r in synth if r["github"].rsplit("/", 1)[-1] in paired]
    single = [r for r in synth if r not in pairs]
    tokenizer_texts = repo_text + [r["instruction"] + "\n" + r["output"] for r in synth]
    texts = (repo_text + [r["instruction"] for r in single] + [r["output"] for r in single]
             + [f"{r['instruction']}\n```\n{r['output']}\n```" for r in pairs])
    random.Random(0).shuffle(texts)
    return tokenizer_texts, texts


def _positive(text: str) -> int:
    """argparse's type for a count of at least 1."""
    import argparse
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return n


def main() -> None:
    """`python examples/tiny.py --repos DIR [--synthetic DIR] --out DIR`: the demo's base model (see corpus());
    without --synthetic it reads the repositories alone (the sweep tests' models)."""
    import argparse

    from mlbench_kit.progress import bars_only_on_tty
    bars_only_on_tty()  # the demo logs this: no library bars in its log
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--repos", required=True, help="fixture repositories (their READMEs and source are the corpus)")
    p.add_argument("--synthetic", help="folder of synthetic-*.jsonl (examples/synth.py)")
    p.add_argument("--paired", nargs="*", default=[], help="repositories whose synthetic pairs pretraining sees paired")
    p.add_argument("--out", required=True)
    p.add_argument("--pretrain-steps", type=int, default=300)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--threads", type=_positive, default=1,
                   help="torch threads while pretraining (default 1: fastest for this model on a shared box)")
    a = p.parse_args()
    tok_texts, texts = corpus(a.repos, a.synthetic, a.paired)
    out = Path(a.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SystemExit(f"tiny: {out} exists and is not empty: choose another --out, or remove it first")
    # built whole or not at all (OUT.tmp, renamed when pretraining is done): Ctrl-C in pretraining leaves no OUT,
    # so the demo redoes its first stage instead of taking a random-init model for a pretrained one
    with atomic_dir(out) as work:
        build_tokenizer(tok_texts, work, vocab_size=1200)
        build_llama(work, work, hidden=a.hidden, layers=a.layers, heads=a.hidden // 64, max_positions=2048)
        if a.pretrain_steps:
            losses = pretrain(work, texts, steps=a.pretrain_steps, threads=a.threads)
            print(f"tiny: pretrained {a.pretrain_steps} steps, loss {losses[0]:.2f} -> {sum(losses[-20:]) / 20:.2f}")
    print(f"tiny: model in {out}")


if __name__ == "__main__":
    main()
