"""mlbench_kit.infer: ``mlbench infer``, n sampled responses per prep record through vLLM, transformers or an
OpenAI-compatible endpoint, written as generation records eval/ scores."""
