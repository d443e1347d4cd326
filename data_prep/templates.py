"""Prompt templates, named and selectable, in one place.

- ``paper``: the prompt of the ML-Bench paper (``[readme]`` + ``[instruction]`` + ``[System]`` block), one user turn.
- ``llama-inst``: the fine-tuning template of the benchmark's scripts (``[INST] … [/INST]`` user turn, the
  assistant answer in a code fence).
- ``chat``: the tokenizer's own chat template, with the ``llama-inst`` wording for the turns.

The quoted wording is the benchmark's and is reproduced unchanged so that prompts match the paper's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlbench_kit.chat_template import render_chat
from mlbench_kit.errors import MLBenchError

TEMPLATES = ("paper", "llama-inst", "chat")

# Quoted from the ML-Bench paper's prompt (spelling as published).
PAPER_PROMPT = (
    "[readme]:{readme}\n[instruction]:{instruction}\n\n[System]\n"
    "You are given [readme], you need to carefully see [readme] and choose wirte code or script to implement "
    "my [instruction]. \nPlease output code or script directly, use markdown to output code without any explanation ."
)
# Quoted from the benchmark's fine-tuning dataset script.
INST_USER = (
    "\nSuppose you are a data scientist, you will read the following README file and write a python script to do "
    "the task described by the user.\nYou want to help me with this task:\n{instruction}\n\nHere is the README of "
    "this Github Repo, you might refer to it to write the script:\n{readme}\n"
)
INST_ANSWER = "\nHere is the script I wrote for you:\n```\n{output}\n```\n"
B_INST, E_INST = "[INST]", "[/INST]"


@dataclass(frozen=True)
class Rendered:
    """A rendered example: ``prompt`` is what the model sees, ``answer`` what it should produce (no EOS)."""

    prompt: str
    answer: str
    messages: list[dict[str, str]]


def fenced(output: str, sample_type: str) -> str:
    """The paper-template answer: the ground truth in a markdown code block tagged by type."""
    lang = "bash" if sample_type == "Bash Script" else "python"
    return f"```{lang}\n{output}\n```"


def render(template: str, instruction: str, context: str, output: str, sample_type: str,
           tokenizer: Any | None = None) -> Rendered:
    """Render one example with the named template."""
    if template == "paper":
        user = PAPER_PROMPT.format(readme=context, instruction=instruction)
        answer = fenced(output, sample_type)
        return Rendered(user, answer, [{"role": "user", "content": user},
                                       {"role": "assistant", "content": answer}])
    user = INST_USER.format(instruction=instruction, readme=context)
    assistant = INST_ANSWER.format(output=output)
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    if template == "llama-inst":
        # The benchmark's script: f"{bos}[INST] {user.strip()} [/INST]" then f"{answer.strip()} {eos}";
        # BOS/EOS are added when tokenising for training, not stored in the text.
        return Rendered(f"{B_INST} {user.strip()} {E_INST}", f" {assistant.strip()}", messages)
    if template == "chat":
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise MLBenchError("template 'chat' needs a tokenizer with a chat template", "--template chat",
                               "pass --tokenizer with a chat model's tokenizer, or use --template paper/llama-inst")
        prompt = render_chat(tokenizer, messages[:1])
        return Rendered(prompt, assistant.strip(), messages)
    raise MLBenchError(f"unknown template {template!r}", "--template", f"use one of {TEMPLATES}")
