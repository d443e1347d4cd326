"""ML-Agent's prompts: the paper's texts (arXiv 2311.09835, Appendix Tables 22-23) word for word, the two
prompts of the released agent's FILE path (``functions/args_function.yml``, ``code_function.yml``, which the paper
does not print), and the one addition open models need: the step's JSON answer asked for in text, since these
models have no function calling (the released agent passed its function schema to OpenAI's API; here the same
schema is sent as JSON in the prompt, its descriptions the paper's captions: ``answer_format: function``).

Tables 20 and 21 (keywords, repository ranking: steps 1-2) are not used by the benchmark's evaluation, which ran
steps 3-4 on the row's own repository; ``steps: "1-4"`` runs them over the local repositories (no web search)."""

from __future__ import annotations

import json
from typing import Any

from mlbench_kit.chat_template import render_chat

# Table 20 (step 1)
KEYWORDS = ("Please help me extract the keywords in this sentence about the model used and the task I want to do.\n"
            "Sentence :{sentence}")

# Table 21 (step 2). The paper's URLS are the candidates' URLs; here each with its description (the repository's
# main README's first paragraph: the local checkouts carry no GitHub descriptions), one per line.
RANK = ("Sort the names and descriptions of the GitHub repositories below based on their relevance to the keywords "
        "{{{keywords}}}.\n\n"
        "URLS: {{\n{urls}\n}} Make sure your answer is in standard json format, start!")

# Table 22 (step 3). The paper prints the fields on one line; the released agent put each on its own line.
PLAN = ("I will provide you with the name of a GitHub repository and the main readme file. Please determine if you "
        "can accomplish the following task. If you can, output 'Yes' and sort the provided readme files below based "
        "on their helpfulness in completing the task, from most helpful to least helpful. If you believe you cannot "
        "complete the task, please output 'No.'\n"
        "repo_name: {repo_name}\n"
        "main_readmefile: {readme}\n"
        "task: {instruction}")
# the released agent's fourth field (step3_function_repo.yml); AgentConfig.list_readmes
PLAN_LIST = "\nreadme_files need to be sorted: {readmes}"

# Table 23 (step 4)
CODE_OR_FILE = ("I will provide you with a github readme file and directory index, please determine if this "
                "information is enough to write the code or script for the task I gave you. Write the code or script "
                "directly if you can, give us the path to the py file you want from the repository index file if you "
                "need more information. Please make sure that the file path you return is in the repository index "
                "file!!! And return NO if you don't think all of this information will do the job.\n\n"
                "repository_index_file: {index}\n\n"
                "readmefile: {readme}\n\n"
                "task: {instruction}")

# The released agent's FILE path: read the requested file's argument code, then write the code from it
READ_ARGS = ("Read the code in the following py file to find all the code related to the parameter section.\n"
             "If there is no code snippet associated with the parameter, output 'None' in function_call.\n"
             "Make sure that the code returned is as short as possible.\n"
             "py_file:{py_file}")
WRITE_CODE = ("I will provide you with a github readme file and code arguments please determine if this information "
              "is enough to write the code or script for the task. If you can, please write the code or script "
              "directly. If you can't, please print 'No'.\n"
              "readmefile:{readme}\n"
              "code_arguments:{args}\n"
              "task:{instruction}")

# The answer format, in text (answer_format: fields): the function schemas' fields, their descriptions shortened
FORMAT = {
    "keywords": '{"keywords": ["the keywords about the model used and the task"]}',
    "rank": '{"ranked_repos": ["the repository URLs, most relevant first"]}',
    "plan": '{"task_flag": "Yes" or "No", "ranked_readmefiles": ["the readme files, most helpful first"]}',
    "code_or_file": '{"flag": "CODE" or "FILE" or "No", "file_path": "the py file to read when flag is FILE", '
                    '"code": "the code or script when flag is CODE"}',
    "read_args": '{"args_code": "the code related to the parameters, or None"}',
    "write_code": '{"flag": "CODE" or "No", "finally_code": "the code or script when flag is CODE"}',
}
FORMAT_LINE = "\n\nAnswer with one JSON object and nothing else: {schema}"


def _function(name: str, description: str, fields: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "description": description,
            "parameters": {"type": "object", "properties": {k: {"type": "string", "description": v}
                                                            for k, v in fields.items()},
                           "required": list(fields)}}


# answer_format: function. The function each step's model was given (the released agent's OpenAI function call), as
# valid JSON: the descriptions are the captions the paper prints under its Tables 20-23 (Table 22's caption is its
# function's description, then its two fields'); where the paper prints no caption for a field (Table 23's, the two
# FILE-path steps'), the description says what the field holds, as the step's prompt asks for it.
FUNCTIONS: dict[str, dict[str, Any]] = {
    "keywords": _function(
        "get_keywords", "The function of this prompt agent is to extract keywords about the model used and the task I "
        "want to do from the given sentence.",
        {"keywords": "The keywords about the model used and the task, as a list of strings."}),
    "rank": _function(
        "rank_repositories", "Rank github repositories related to keywords. Sort the github repository related to "
        "keywords, and the array is arranged.",
        {"ranked_repos": "The repository URLs, most relevant first, as a list of strings."}),
    "plan": _function(
        "Evaluation_task", "Use the information given to determine whether the task can be completed.",
        {"task_flag": "The given information serves as an indicator of whether the task can be completed. If it can "
                      "be completed, return 'Yes'; if it cannot be completed, return 'No'. eg: No. eg: Yes.",
         "ranked_readmefiles": "Sorted list of readme files based on their helpfulness in completing the task. "
                               "Remember that the result must be a list! eg: repo_name/README.md, "
                               "repo_name/examples/README.md, repo_name/scripts/atlas/README.md."}),
    "code_or_file": _function(
        "Evaluation_readme", "Code that uses given information to determine whether or not it can accomplish a given "
        "task.",
        {"flag": "'CODE' when the code or script can be written now (it goes in 'code'), 'FILE' when a py file of the "
                 "repository index must be read first (its path goes in 'file_path'), 'No' when the task cannot be "
                 "done with this information.",
         "file_path": "With 'FILE': the path of the py file to read, as the repository index lists it.",
         "code": "With 'CODE': the code or script that does the task."}),
    "read_args": _function(
        "read_code", "Find the code related to the parameters in the given py file.",
        {"args_code": "The code of the py file related to the parameters, as short as possible; 'None' if there is "
                      "none."}),
    "write_code": _function(
        "write_code", "Determine from the given readme file and code arguments whether the code for the task can be "
        "written.",
        {"flag": "'CODE' when the code or script can be written (it goes in 'finally_code'), 'No' when it cannot.",
         "finally_code": "With 'CODE': the code or script that does the task."}),
}
FUNCTION_LINE = ("\n\nAnswer by calling this function: reply with one JSON object holding its arguments "
                 "(every required field, each a string or, where its description asks for one, a list of strings) "
                 "and nothing else.\n{function}")


def with_format(prompt: str, step: str, answer_format: str = "function") -> str:
    """The step's prompt with its answer format: the step's function as JSON (``function``: the paper's captions as
    its descriptions), or the short field line of the first versions (``fields``)."""
    if answer_format == "fields":
        return prompt + FORMAT_LINE.format(schema=FORMAT[step])
    return prompt + FUNCTION_LINE.format(function=json.dumps(FUNCTIONS[step], ensure_ascii=False))


def render_prompt(tokenizer: Any, conversation: str | list[dict[str, str]], chat: bool) -> str:
    """The text the engine receives for a turn: one prompt text (a user turn) or a conversation (the bash policy's
    user/assistant messages), through the model's chat template (``chat``), else the text as is, a conversation as
    ``ROLE:`` blocks ending with ``ASSISTANT:``. The encoder and the SFT records of episodes both render with it."""
    messages = [{"role": "user", "content": conversation}] if isinstance(conversation, str) else conversation
    if chat:
        return render_chat(tokenizer, messages)
    if isinstance(conversation, str):
        return conversation
    return "".join(f"{m['role'].upper()}:\n{m['content']}\n\n" for m in messages) + "ASSISTANT:\n"
