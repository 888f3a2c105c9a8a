"""The method: K LoRA adapter sets on one frozen model, trained together with a winner-takes-all loss.

- ``config``: ``MCLConfig``. ``layers``: ``MCLLoraLinear``, K stacked adapters per linear layer.
- ``build``: ``get_mcl_model``, how a model becomes an ``MCLModel``: the target layers (PEFT's matching), the base
  checks, the size checks (``adapter_size``: the rank and K against the layers and the memory), ``replace_modules``.
- ``model``: ``MCLModel`` and ``MCLOutput``, the forward and the routing; its components: the hooks making the K copies
  of the batch (``copies.CopyHooks``) and keeping the logits at label positions, in chunks (``logits.LabelLogits``),
  both reading the call in progress (``scope``); one base-model call on the forward's rows (``rows``), the hypotheses
  routed (``routing``), the context computed once (``context``), its own ``generate`` (``generate``), gradient
  checkpointing (``activation_checkpointing``). Loading one from files is a floor above (``loramcl.models.mcl``).
- ``losses``: the WTA, relaxed and annealed losses. ``nll``: the per-hypothesis NLL. ``scores``: the scoring head.
- ``adapter_files``, ``fingerprint``: saving and loading, checksums, the base weights' fingerprint.
- ``peft_interop``: export, merge and unload. ``methods``: the loaders of the methods built on the model.
  ``compat``: every reliance on an upstream internal, each guarded, and the token-id check.
"""
