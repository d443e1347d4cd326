"""`mlbench agent`'s options as one typed config (``configs/agent/*.yaml``), loaded by ``mlbench_kit.config.load``:
an unknown key or a bad value is one error with the file's line (or the flag). Its inputs (model, rows,
repositories, run folder) are keys too, so a run's ``OUT/config.yaml`` replays it; they are not part of the
settings a run folder keeps (:meth:`AgentConfig.settings`): the run records them its own way."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Literal

from .config import Check, option
from .engine import check_endpoint
from .errors import MLBenchError


@dataclass
class AgentSampling:
    """One completion per turn. Defaults: the benchmark's open-model sampling (temperature 1.0, top_p 1.0, top_k
    50, seed 42); 512 new tokens per turn (a step's JSON answer)."""

    temperature: float = option(1.0, "sampling temperature")
    top_p: float = option(1.0, "nucleus sampling: the smallest set of tokens holding this probability")
    top_k: int = option(50, "sample among the k likeliest tokens")
    max_new_tokens: int = option(512, "new tokens per turn", flag=True)
    seed: int = option(42, "sampling seed", flag=True)


@dataclass
class AgentLimits:
    """Hard limits, counted by the harness (never by the model); the one hit is recorded as the episode's exit."""

    max_turns: int | None = option(10, "model calls per episode (OpenHands' ML-Agent-Bench: 10 iterations); null: "
                                   "none (policy ml-agent: the released loop, 1 + 3 calls per ranked README, plus "
                                   "format errors asked again)", flag=True)
    max_episode_tokens: int = option(4096, "new tokens summed over an episode's turns")
    max_episode_total_tokens: int | None = option(None, "prompt and new tokens summed over an episode's turns (a "
                                                  "prompt that would pass it is not sent); null: no such limit")
    max_episode_seconds: float = option(600.0, "generation wall time summed over an episode's turns (as recorded)")
    max_format_errors: int = option(3, "consecutive unparseable replies")
    max_episode_cost: float | None = option(None, "what an episode may cost at prompt_price and completion_price "
                                            "(a turn that could pass it gets fewer new tokens, or is not sent); "
                                            "null: no such limit")
    prompt_price: float = option(0.0, "price of a million prompt tokens (max_episode_cost, and each episode's cost "
                                 "in its summary)")
    completion_price: float = option(0.0, "price of a million new tokens")


@dataclass
class AgentRead:
    """What the harness shows of the (untrusted) repository: every text it inserts is capped in characters, and
    the cut is said in the text the model sees. Reads are confined to the checkout; links are never followed."""

    max_index_chars: int = option(6000, "the directory index (files, one per line): the task folder's first")
    max_readme_chars: int = option(8000, "a README as the model sees it")
    # "prefix": the first max_readme_chars characters (the only window before this key existed)
    readme_window: Literal["relevant", "prefix"] = option("relevant", "which part of a longer README is shown: "
                                                          "relevant (its sections ranked by BM25 against the task) "
                                                          "or prefix (its beginning)")
    max_file_chars: int = option(8000, "a file the model asked to read (step 4's FILE)")
    max_file_bytes: int = option(1_000_000, "larger files are refused unread")


@dataclass
class AgentBash:
    """The ``bash`` policy (ML-Agent-Bench offline): each action is one sandboxed execution in the row's
    environment, network off, with the episode's files kept in a disk-capped layer between actions."""

    # engines that keep the layer: the stage script's (podman: as root), and docker's runner
    sandbox: Literal["bwrap", "podman", "docker"] = option("bwrap", "the sandbox actions run in")
    action_wall_s: float = option(60.0, "one action's wall time")
    action_mem_mb: int = option(4096, "one action's memory")
    action_pids: int = option(256, "one action's processes at once")
    disk_mb: int = option(1024, "the episode's writable layer (files persist between actions) plus home")
    # each entry of a layer is copied in before every action and back after it, on the action's wall time
    layer_entries: int = option(20_000, "files, folders and links of one episode's layer and home together")
    layers_mb: int = option(4096, "every live episode's layer together, on the host's disk (an action whose files "
                            "would pass it keeps the earlier ones and is told so)")
    layers_entries: int = option(200_000, "every live episode's layer together, in entries")
    observation_chars: int = option(4000, "an action's output as the model sees it: head and tail, cut in the "
                                    "middle")
    observation_tokens: int = option(1024, "then cut again to this many of the model's tokens (head and tail)")
    # OpenHands' ML-Bench harness: `timeout 120 bash run.sh` in the task folder of the episode's final files
    openhands_check: bool = option(True, "the OpenHands rule at the episode's end: exit 0 or 124, or "
                                   "KeyboardInterrupt printed = success")
    openhands_timeout_s: int = option(120, "that check's time limit")


@dataclass
class AgentOpenAI:
    """``backend: openai``: an OpenAI-compatible server (`vllm serve`); ``--model`` is the served name, ``--adapter``
    a served LoRA's name, ``--tokenizer`` the model's tokenizer folder (prompts go as token ids). Where it runs, not
    what an episode does: not part of a run folder's settings."""

    base_url: str = option("http://127.0.0.1:8000/v1", "the server's OpenAI API root")
    # chat: the server applies the model's chat template (its own, or `vllm serve --chat-template`); the prompt's
    # tokens are still counted with --tokenizer's, for the context and the budgets
    api: Literal["completions", "chat"] = option("completions", "completions (the prompts' token ids, rendered "
                                                 "here) or chat (messages; needed by actions: tools)")
    api_key_env: str = option("OPENAI_API_KEY", "the environment variable the key is read from (the key never "
                              "sits in a file)")
    concurrency: int = option(8, "requests of one lockstep round in flight at once")
    timeout_s: float = option(600.0, "one request's time limit")
    max_retries: int = option(5, "retries of a failed request")


@dataclass
class AgentConfig:
    """Everything `mlbench agent` runs: its inputs (usually flags), then how the episodes run (configs/agent/*.yaml)."""

    # the inputs: what a run works on, not how (left out of settings(): the run folder records them its own way)
    # keys added after run folders existed -> the value that does what the code did before them: at that value a
    # key is left out of settings(), so a folder made before it resumes with it (and only with it)
    BEFORE: ClassVar[dict[str, Any]] = {"read.readme_window": "prefix", "answer_format": "fields",
                                        "write_code_readme": "text", "decoding": "free", "actions": "text",
                                        "limits.max_episode_total_tokens": None, "limits.max_episode_cost": None,
                                        "limits.prompt_price": 0.0, "limits.completion_price": 0.0,
                                        # unbounded before; the defaults change no run that fits them
                                        "bash.layer_entries": 20_000, "bash.layers_mb": 4096,
                                        "bash.layers_entries": 200_000}
    INPUTS: ClassVar[tuple[str, ...]] = ("model", "adapter", "adapters", "with_base", "tokenizer", "data", "split",
                                         "repos_dir", "tarballs", "envs", "repos", "rows_of", "limit", "out",
                                         "gold_episodes", "eval_rows", "own_episodes", "own_episodes_eval",
                                         "own_per_row")

    # inputs
    model: str | None = option(None, "base model folder or hub id (backend openai: the served name); required",
                               flag=True)
    adapter: str | None = option(None, "PEFT LoRA adapter folder (from train/; backend openai: a served LoRA's name)",
                                 flag=True)
    adapters: list[str] = option(help="several adapters of the same base on one engine: NAME=DIR each (backend "
                                 "openai: NAME=served LoRA name); one run folder per adapter, OUT/NAME/",
                                 factory=list, metavar="NAME=DIR", flag=True)
    with_base: bool = option(False, "with --adapters: the model as released too, in OUT/base/", flag=True)
    tokenizer: str | None = option(None, "tokenizer folder or id (default: the model's; backend openai: required)",
                                   flag=True)
    data: str | None = option(None, "ML-Bench rows (file, folder or hub id); required", flag=True)
    split: str = option("full", "split of --data (default full)", flag=True)
    repos_dir: str | None = option(None, "folder holding one pristine checkout per repository (<repo>/); this or "
                                   "--tarballs", flag=True)
    tarballs: str | None = option(None, "folder of <repo>.tar.gz checkouts, unpacked into OUT/checkouts/; this or "
                                  "--repos-dir", flag=True)
    envs: str | None = option(None, "policy bash: the environments file (envs.yaml of `mlbench env build`) whose "
                              "environments the actions run in (default: each repository's checkout with the base "
                              "interpreter)", flag=True)
    repos: list[str] = option(help="only these repositories' rows", factory=list, flag=True)
    rows_of: str | None = option(None, "only the rows a JSONL file names by github_id and id (e.g. prep's split "
                                 "file RUN/prep/test/task3.jsonl, or a generations file), in the data's order",
                                 metavar="FILE", flag=True)
    limit: int | None = option(None, "only the first N rows (after --repos and --rows-of)", flag=True)
    out: str | None = option(None, "run folder; required", flag=True)
    # training data from the harness itself (agent/gold.py): no model runs
    gold_episodes: bool = option(False, "write the turns of a correct episode of each row (from its gold answer, "
                                 "through the harness's own episode code) as SFT records in prep's format into "
                                 "OUT/sft.jsonl instead of running a model; training rows only (--eval-rows)",
                                 flag=True)
    eval_rows: str | None = option(None, "with --gold-episodes: the rows models are scored on (a JSONL file of "
                                   "github_id and id, e.g. RUN/prep/test/task3.jsonl), refused with any training "
                                   "row sharing an instruction or an answer with them", metavar="FILE", flag=True)
    own_episodes: str | None = option(None, "with --gold-episodes (expert iteration): an `mlbench agent` run folder on "
                                  "these training rows; the turns of its episodes that passed in --own-episodes-eval "
                                  "are added to the gold ones", metavar="RUN", flag=True)
    own_episodes_eval: str | None = option(None, "with --own-episodes: the strict `mlbench eval` folder of that run's "
                                       "answers", metavar="DIR", flag=True)
    own_per_row: int = option(4, "with --own-episodes: passing episodes kept per row (distinct answers)", flag=True)
    # how the episodes run
    policy: Literal["ml-agent", "bash"] = option("ml-agent", "ml-agent (the paper's agent: reads files, executes "
                                                 "nothing) or bash (ML-Agent-Bench offline: actions run in the "
                                                 "sandbox)", flag=True)
    # steps the episode runs: "3-4" is what the benchmark's evaluation ran (its eval.py -> run_choose_repo.py):
    # the row's own repository, README ranking, then the code loop.
    # "1-4": keywords (Table 20) and repository ranking (Table 21) over the local repositories first (no web
    # search: each candidate is its URL and its main README's first paragraph), then step 3 on the ranked
    # repositories in turn (a No moves to the next one)
    steps: Literal["3-4", "1-4"] = option("3-4", "the agent steps an episode runs (3-4: the benchmark's "
                                          "evaluation; 1-4: keyword search and repository ranking first)")
    backend: Literal["vllm", "hf", "openai"] = option("vllm", "engine (openai: an OpenAI-compatible server, "
                                                       "`vllm serve`)", flag=True)
    episodes: int = option(5, "k: episodes (answers) per row (the paper's Pass@1/2/5 on ML-Agent: 5)", flag=True)
    template: Literal["auto", "chat", "plain"] = option("auto", "auto: the model's chat template when it has one")
    # The released agent listed the README files to sort after the task (step3_function_repo.yml's
    # "readme_files need to be sorted:{}"); the paper's Table 22 prints the prompt without that line.
    list_readmes: bool = option(True, "list the README files to sort after the task (the released agent)")
    # "fields": the short field line of the first versions (not valid JSON; placeholders small models copied back)
    answer_format: Literal["function", "fields"] = option("function", "how each step asks for its JSON answer: "
                                                          "function (the step's function schema as JSON, the paper's "
                                                          "captions as its descriptions) or fields (a short field "
                                                          "line)")
    # the released agent's code_function prompt (after FILE) got the ranked README's path as `readmefile`
    write_code_readme: Literal["path", "text"] = option("path", "the README in the write_code step's prompt: its path "
                                                        "(the released agent) or its text")
    # json: vLLM's structured outputs hold each ml-agent step's reply to the step's JSON schema, its names to the
    # ones the prompt offers (agent/constrain.py); free: the model writes what it likes (the paper's API models)
    decoding: Literal["free", "json"] = option("free", "the JSON steps' replies: free (sampled as they come) or json "
                                               "(constrained to the step's schema and the names the harness "
                                               "offers; backend vllm, policy ml-agent)")
    # tools: each JSON step is a function the model is made to call (OpenAI tool calls; agent/tools.py)
    actions: Literal["text", "tools"] = option("text", "how the ml-agent policy's model answers a step: text (a "
                                               "JSON object in its reply) or tools (a call of the step's function, "
                                               "forced by name; backend openai with openai.api: chat)")
    sampling: AgentSampling = field(default_factory=AgentSampling)
    limits: AgentLimits = field(default_factory=AgentLimits)
    read: AgentRead = field(default_factory=AgentRead)
    bash: AgentBash = field(default_factory=AgentBash)
    openai: AgentOpenAI = field(default_factory=AgentOpenAI)
    max_model_len: int | None = option(None, "context: prompt + new tokens (default: the model's positions)", flag=True)
    fit_context: bool = option(True, "a prompt over the context has its repository texts (README, index, file) "
                               "cut further to fit, the task never (off: such a prompt ends the episode as "
                               "context_exceeded)")
    gpu_memory_utilization: float = option(0.9, "share of the GPU's memory vLLM may take")
    enforce_eager: bool = option(False, "vLLM without torch.compile: an engine starts in seconds instead of minutes "
                                 "of compilation on CPU, and decodes more slowly (short runs, CI)")

    def check(self, at: Check) -> None:
        if self.repos_dir is not None and self.tarballs is not None:
            raise MLBenchError("repos_dir and tarballs are both set: the checkouts come from one of them",
                               at("tarballs"), "keep one")
        if self.limit is not None and self.limit < 1:
            raise MLBenchError(f"limit must be at least 1, got {self.limit}", at("limit"))
        if self.steps == "1-4" and self.policy != "ml-agent":
            raise MLBenchError("steps: 1-4 (keywords, repository ranking) belong to the ml-agent policy", at("steps"),
                               "use policy: ml-agent, or steps: 3-4")
        if self.decoding == "json" and self.policy != "ml-agent":
            raise MLBenchError("decoding: json constrains the ml-agent policy's JSON steps; the bash policy's replies "
                               "are a thought and a bash block", at("decoding"), "use decoding: free with policy bash")
        if self.decoding == "json" and self.backend != "vllm":
            raise MLBenchError(f"decoding: json needs backend vllm (its structured outputs); backend {self.backend} "
                               "cannot constrain a reply", at("decoding"),
                               "use backend: vllm, or decoding: free")
        if self.actions == "tools" and self.policy != "ml-agent":
            raise MLBenchError("actions: tools offers the ml-agent policy's JSON steps as functions; the bash policy "
                               "acts in a bash block (a tool for it is not built: docs/agent.md)", at("actions"),
                               "use actions: text with policy bash")
        if self.actions == "tools" and (self.backend != "openai" or self.openai.api != "chat"):
            what = f"backend {self.backend}" if self.backend != "openai" else "openai.api: completions"
            raise MLBenchError(f"actions: tools needs an OpenAI-compatible chat endpoint; {what} cannot offer tools",
                               at("actions"), "use backend: openai with openai.api: chat, or actions: text")
        if self.episodes < 1:
            raise MLBenchError("episodes must be at least 1", at("episodes"))
        if self.own_per_row < 1:
            raise MLBenchError("own_per_row must be at least 1", at("own_per_row"))
        if (self.own_episodes or self.own_episodes_eval) and not self.gold_episodes:
            raise MLBenchError("--own-episodes adds a run's passing episodes to the gold episodes' training data",
                               at("own_episodes" if self.own_episodes else "own_episodes_eval"),
                               "add --gold-episodes (and --eval-rows)")
        if self.gold_episodes and (self.adapters or self.with_base):
            raise MLBenchError("--gold-episodes runs no model: it takes no --adapters or --with-base",
                               at("adapters" if self.adapters else "with_base"), "drop them")
        if bool(self.own_episodes) != bool(self.own_episodes_eval):
            raise MLBenchError("--own-episodes and --own-episodes-eval go together: the run and the strict "
                               "`mlbench eval` folder of its answers", at("own_episodes_eval"))
        lim = self.limits
        for key in ("max_turns", "max_episode_tokens", "max_episode_total_tokens", "max_format_errors"):
            if getattr(lim, key) is not None and getattr(lim, key) < 1:
                raise MLBenchError(f"limits.{key} must be at least 1", at(f"limits.{key}"))
        if lim.max_turns is None and self.policy == "bash":
            raise MLBenchError("limits.max_turns: null (no turn cap) ends no bash episode, whose loop has no end of "
                               "its own", at("limits.max_turns"), "give the bash policy a turn cap, e.g. 10")
        if lim.max_episode_seconds <= 0:
            raise MLBenchError("limits.max_episode_seconds must be positive", at("limits.max_episode_seconds"))
        for key in ("prompt_price", "completion_price"):
            if getattr(lim, key) < 0:
                raise MLBenchError(f"limits.{key} must be at least 0", at(f"limits.{key}"))
        if lim.max_episode_cost is not None and (lim.max_episode_cost <= 0 or
                                                 lim.prompt_price == lim.completion_price == 0):
            raise MLBenchError("limits.max_episode_cost is a positive amount at prices that are not both 0",
                               at("limits.max_episode_cost"), "set limits.prompt_price and limits.completion_price "
                               "(per million tokens), e.g. the endpoint's list prices")
        if self.sampling.max_new_tokens < 1:
            raise MLBenchError("sampling.max_new_tokens must be at least 1", at("sampling.max_new_tokens"))
        for key in ("max_index_chars", "max_readme_chars", "max_file_chars", "max_file_bytes"):
            if getattr(self.read, key) < 100:
                raise MLBenchError(f"read.{key} must be at least 100", at(f"read.{key}"))
        if self.openai.concurrency < 1:
            raise MLBenchError("openai.concurrency must be at least 1", at("openai.concurrency"))
        check_endpoint(self.openai.base_url, self.openai.api_key_env, at)
        b = self.bash
        for key, low in (("action_wall_s", 1), ("action_mem_mb", 64), ("action_pids", 8), ("disk_mb", 16),
                         ("observation_chars", 200), ("observation_tokens", 64),
                         ("openhands_timeout_s", 1), ("layer_entries", 16), ("layers_mb", 1), ("layers_entries", 16)):
            if getattr(b, key) < low:
                raise MLBenchError(f"bash.{key} must be at least {low}", at(f"bash.{key}"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def settings(self) -> dict[str, Any]:
        """The keys that change what an episode does, as a run folder keeps them: not the inputs (the run records
        those its own way), nor where or how it runs (GPU share, eager or compiled vLLM, the server); ``bash`` only
        for that policy, so run folders of ml-agent made before the bash policy existed still resume; a key of
        :attr:`BEFORE` only when it differs from what the code did before it existed, for the same reason."""
        d = self.to_dict()
        for key in (*self.INPUTS, "gpu_memory_utilization", "enforce_eager", "openai",
                    *(("bash",) if self.policy != "bash" else ())):
            d.pop(key)
        for dotted, before in self.BEFORE.items():
            *parents, last = dotted.split(".")
            sub = d
            for p in parents:
                sub = sub.get(p, {})
            if sub.get(last, before) == before:
                sub.pop(last, None)
        return d

    def sha(self) -> str:
        """A digest of :meth:`settings`."""
        return hashlib.sha256(json.dumps(self.settings(), sort_keys=True).encode()).hexdigest()[:16]

    def require_inputs(self, source: str | None) -> None:
        """A run needs a model, rows, checkouts and a run folder (a config without them is fine to load)."""
        missing = [f"--{k}" for k in ("model", "data", "out") if getattr(self, k) is None]
        if self.repos_dir is None and self.tarballs is None:
            missing.append("--repos-dir or --tarballs")
        if missing:
            raise MLBenchError(f"missing {', '.join(missing)}: mlbench agent needs --model, --data, --repos-dir or "
                               "--tarballs, and --out", source, "e.g. mlbench agent --model MODEL --data ROWS "
                               "--tarballs REPOS --out runs/agent (mlbench agent --help lists every option)")

