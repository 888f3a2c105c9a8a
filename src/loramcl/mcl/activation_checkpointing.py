"""Activation checkpointing of the frozen base model, as ``transformers.Trainer`` asks an ``MCLModel`` for it."""

from __future__ import annotations


class ActivationCheckpointing:
    """The methods of ``MCLModel`` that Trainer calls for ``activation_checkpointing=True`` (or its former name,
    ``gradient_checkpointing``); they act on the model's ``base_model``."""

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None, **kwargs) -> None:
        """Activation checkpointing in the base model (what Trainer calls for ``activation_checkpointing=True``;
        ``kwargs`` such as ``every_n_layers`` go to the base model). The frozen embeddings then must emit
        grad-requiring outputs so that reentrant checkpointing still reaches the adapters (as PEFT does)."""
        base = self.base_model
        if hasattr(base, "activation_checkpointing_enable"):
            base.activation_checkpointing_enable(activation_checkpointing_kwargs=activation_checkpointing_kwargs,
                                                 **kwargs)
        else:  # transformers releases before the rename
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=activation_checkpointing_kwargs)
        base.enable_input_require_grads()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, **kwargs) -> None:
        """The former name of ``activation_checkpointing_enable``."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def activation_checkpointing_disable(self) -> None:
        base = self.base_model
        getattr(base, "activation_checkpointing_disable", base.gradient_checkpointing_disable)()

    @property
    def is_activation_checkpointing(self) -> bool:
        return any(getattr(m, "gradient_checkpointing", False) is True for m in self.base_model.modules())
