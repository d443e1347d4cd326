"""ML-Agent's prompts: the paper's texts (arXiv 2311.09835, Appendix Tables 22-23) word for word, the two
prompts of the released agent's FILE path (``functions/args_function.yml``, ``code_function.yml``, which the paper
does not print), and the one addition open models need: the step's JSON answer asked for in text, since these
models have no function calling (the released agent passed the same fields as an OpenAI function schema).

Tables 20 and 21 (keywords, repository ranking: steps 1-2) are not used by the benchmark's evaluation, which ran
steps 3-4 on the row's own repository; ``steps: "1-4"`` runs them over the local repositories (no web search)."""

from __future__ import annotations

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

# The answer format, in text (the function schemas' fields; their descriptions shortened)
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


def with_format(prompt: str, step: str) -> str:
    return prompt + FORMAT_LINE.format(schema=FORMAT[step])
