"""A model folder's chat template is untrusted code: rendered within bounds, to the same text (issue 30 item 7)."""

from __future__ import annotations

import time

import pytest

from mlbench_kit.errors import MLBenchError

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
FEATURES = ("{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
            "{% if m.role == 'system' %}{{ raise_exception('no system') }}{% endif %}"
            "[{{ loop.index }}/{{ ns.n }}] {{ m['content'] | trim | tojson }} {{ '%-5s|' % m.role }}"
            "{{ '{:>4}'.format(loop.index) }}{{ m.content[:3] * 2 }}{{ 'x' | center(9) }}{% endfor %}"
            "{% if add_generation_prompt %}{{ eos_token }}{% endif %}")


@pytest.fixture
def tok(tiny_tokenizer):
    original = tiny_tokenizer.chat_template
    yield tiny_tokenizer
    tiny_tokenizer.chat_template = original


@pytest.mark.parametrize("template", [None, CHATML, FEATURES], ids=["tiny", "chatml", "features"])
@pytest.mark.parametrize("gen", [True, False])
def test_same_text_as_transformers(tok, template, gen) -> None:
    from mlbench_kit.chat_template import render_chat
    if template:
        tok.chat_template = template
    messages = [{"role": "user", "content": "  Train a GAT on cora <b>{x}</b> %s 100% \n"},
                {"role": "assistant", "content": "python train.py --lr 0.05"}]
    assert render_chat(tok, messages, gen) == tok.apply_chat_template(messages, tokenize=False,
                                                                      add_generation_prompt=gen)


HOSTILE = {
    "nested loops": "{% for i in range(3000) %}{% for j in range(10000) %}xx{% endfor %}{% endfor %}",
    "repeat": "{{ 'x' * 2000000000 }}",
    "center": "{{ 'x' | center(2000000000) }}",
    "method": "{{ 'x'.center(2000000000) }}",
    "format width": "{{ '%2000000000d' % 1 }}{{ '{:>2000000000}'.format(1) }}",
    "power": "{{ 10 ** 100000000 }}",
    "doubling": "{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                "{% endfor %}{{ ns.s | length }}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_prep_refuses_a_template_that_makes_too_much(tok, name) -> None:
    """Through prep's own renderer: one clear error, at the budget (1 MiB here), never the whole value made."""
    import resource

    from mlbench_kit.data_prep.templates import render
    tok.chat_template = HOSTILE[name]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with pytest.raises(MLBenchError) as exc:
        render("chat", "Train a GAT on cora", "readme", "python train.py", "Bash Script", tok)
    assert "the chat template made more than" in str(exc.value) and "chat_template" in str(exc.value)
    assert time.monotonic() - t0 < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB: never 2 GB allocated


def test_a_template_that_runs_forever_is_stopped_and_the_thread_goes_on(tok) -> None:
    """Loops that neither output nor call anything (1e15 iterations): the watchdog stops them in time."""
    from mlbench_kit.chat_template import render_chat
    tok.chat_template = ("{% set x = range(100000) | list %}{% for a in x %}{% for b in x %}{% for c in x %}"
                         "{% endfor %}{% endfor %}{% endfor %}")
    t0 = time.monotonic()
    with pytest.raises(MLBenchError, match="ran past 1 s"):
        render_chat(tok, [{"role": "user", "content": "hi"}], seconds=1)
    assert time.monotonic() - t0 < 3
    tok.chat_template = CHATML
    for _ in range(3):  # nothing left pending in this thread
        assert render_chat(tok, [{"role": "user", "content": "hi"}], seconds=0.2).endswith("assistant\n")
        time.sleep(0.3)


def test_the_error_names_the_templates_file_and_line(tok, tmp_path) -> None:
    """The refusal names where the template went past its budget: the model folder's chat_template.jinja and the
    line (it named the tokenizer's folder alone), or the chat_template entry of tokenizer_config.json."""
    from transformers import AutoTokenizer

    from mlbench_kit.chat_template import render_chat
    tok.chat_template = "{{ bos_token }}\n{% for m in messages %}\n{{ m.content * 2000000000 }}{% endfor %}\n"
    tok.save_pretrained(tmp_path)
    saved = AutoTokenizer.from_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").read_text() == tok.chat_template
    with pytest.raises(MLBenchError) as exc:
        render_chat(saved, [{"role": "user", "content": "hi"}])
    assert exc.value.where == f"{tmp_path}/chat_template.jinja:3", exc.value.where
    with pytest.raises(MLBenchError) as exc:  # a template set in code: no file of its own holds it
        render_chat(tok, [{"role": "user", "content": "hi"}])
    assert exc.value.where.endswith("tokenizer_config.json: chat_template, line 3"), exc.value.where
