"""The method: K LoRA adapter sets on one frozen model, trained together with a winner-takes-all loss.

- ``config``: ``MCLConfig``. ``layers``: ``MCLLoraLinear``, K stacked adapters per linear layer.
- ``model``: ``MCLModel``, ``get_mcl_model``, ``load_mcl_model``; its components: the hooks making the K copies of the
  batch (``copies.CopyHooks``) and keeping the logits at label positions, in chunks (``logits.LabelLogits``), both
  reading the call in progress (``scope``); the hypotheses routed (``routing``), the context computed once
  (``context``), its own ``generate`` (``generate``), gradient checkpointing (``activation_checkpointing``).
- ``losses``: the WTA, relaxed and annealed losses. ``nll``: the per-hypothesis NLL. ``scores``: the scoring head.
- ``adapter_files``, ``fingerprint``: saving and loading, checksums, the base weights' fingerprint.
- ``adapter_size``: the rank and K checked against the layers and the memory. ``peft_interop``: PEFT's targets,
  export and merge. ``compat``: every reliance on an upstream internal, each guarded, and the token-id check.
"""
