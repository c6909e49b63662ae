"""DistillSparse's sampler adapter: a LoRA injected into the policy model, on only while the sparse
sampler runs (and for sparse-inference evaluation).

The adapter (peft LoRA, B = 0 at start, so the sampler starts as the policy) is disabled for the
dense recompute of π_old, the learner's update, the reference and α's dense side: they all see the
plain policy. This module is the sampling side only (what a Ray worker holds); training the
adapter, with its optimizer, is `learner.distill.DistillTrainer`.
"""

from __future__ import annotations

import contextlib
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..errors import ConfigError

ADAPTER_NAME = "sampler"


@dataclass
class AdapterConfig:
    rank: int = 8
    alpha: float = 16.0
    target_modules: str = "all-linear"


def adapter_config(train) -> AdapterConfig:
    """The adapter's shape from the `distill_*` fields of a `TrainConfig`."""
    return AdapterConfig(rank=train.distill_rank, alpha=train.distill_alpha, target_modules=train.distill_target_modules)


class SamplerAdapter:
    """The LoRA of the sparse sampler, injected into the policy model and disabled outside `active()`."""

    def __init__(self, model, config: AdapterConfig):
        from peft import LoraConfig, inject_adapter_in_model

        targets = config.target_modules if config.target_modules == "all-linear" else \
            [name.strip() for name in config.target_modules.split(",") if name.strip()]
        lora = LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=0.0, target_modules=targets,
                          init_lora_weights=True)
        policy_trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        inject_adapter_in_model(lora, model, adapter_name=ADAPTER_NAME)
        # peft freezes everything but adapters; the policy's own weights must stay trainable.
        for name, parameter in model.named_parameters():
            if name.replace(".base_layer.", ".") in policy_trainable:
                parameter.requires_grad_(True)
        from peft.tuners.tuners_utils import BaseTunerLayer

        if isinstance(model.get_output_embeddings(), BaseTunerLayer):
            raise ConfigError("distill_target_modules must not include the LM head: the dense and the sparse "
                             "side share it")
        self.model = model
        self.config = config
        self.parameters = {name: p for name, p in model.named_parameters() if ".lora_" in name}
        if not self.parameters:
            raise ConfigError(f"distill_target_modules {config.target_modules!r} matched no layer of the model")
        self._set(False)

    # ------------------------------------------------------------------ switching
    def _set(self, enabled: bool) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        for module in self.model.modules():
            if isinstance(module, BaseTunerLayer):
                module.enable_adapters(enabled)
        for parameter in self.parameters.values():  # peft ties requires_grad to enabled; we train outside too
            parameter.requires_grad_(True)

    @contextmanager
    def active(self):
        """The sparse sampler: the adapter on, for what runs inside."""
        self._set(True)
        try:
            yield
        finally:
            self._set(False)

    def is_policy_parameter(self, name: str) -> bool:
        return name not in self.parameters

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's weights under their own names, without the adapter (for `save_pretrained`)."""
        return {name.replace(".base_layer.", "."): tensor for name, tensor in self.model.state_dict().items()
                if ".lora_" not in name}


def sampler_context(adapter: SamplerAdapter | None):
    """The sparse sampler's context: DistillSparse's adapter on inside (nothing without one)."""
    return adapter.active() if adapter is not None else contextlib.nullcontext()
