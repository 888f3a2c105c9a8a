"""Independently trained adapters as the hypotheses of one MCL model: the ensemble baseline (K LoRA-MLE runs, e.g.
K seeds) served, decoded and scored as LoRA-MCL is, at the same inference cost (K adapters, one batched decode)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from loramcl.mcl.adapter_files import TRAINING_SETTINGS, WEIGHTS_NAME, read_adapters
from loramcl.mcl.config import MCLConfig
from loramcl.utils.files import sha256
from loramcl.utils.validate import require

# The member settings that may differ: how many hypotheses each holds (they add up), and whether it had a scoring head
# (refused below), beside those that only shaped its training (adapter_files.TRAINING_SETTINGS).
STACKED = frozenset({"num_hypotheses", "scoring"})


def assemble_hypotheses(model: nn.Module, folders: Sequence[str | os.PathLike], verify: bool = True,
                        strict: bool = False):
    """An MCLModel on ``model`` (the plain base every member was trained on) whose hypotheses are those of the
    ``folders`` (each written by ``MCLModel.save_pretrained``, e.g. a `loramcl train` run with K = 1), in order:
    lora_A [K, d_in, r] and lora_B [K, r, d_out] of every layer are the members' stacked, K the sum of theirs, so
    hypothesis k computes exactly what its member computes alone. The members must agree on every setting that
    changes the outputs but K (targets, rank, alpha, rsLoRA, ...) and on their base weights; none may have hypothesis
    scores (they rank one run's hypotheses, not a union), and none may be named twice or hold another's adapters (the
    same weights file, byte for byte: two identical hypotheses). Each folder is checked as ``load_mcl_model`` checks it
    (``verify``, ``strict``), and ``model``'s weights against the members' fingerprint. Returned in eval mode, the
    adapters frozen (``save_pretrained`` writes it as one K-hypothesis folder)."""
    from loramcl.mcl.adapter_files import check_adapters_fit
    from loramcl.mcl.build import get_mcl_model, matched_layer_names, resolve_target_modules
    from loramcl.mcl.fingerprint import check_base_weights, known_fingerprint
    from loramcl.mcl.layers import linear_features
    from loramcl.mcl.model import MCLModel

    require(isinstance(folders, Sequence) and not isinstance(folders, str) and len(folders) >= 2,
            f"assemble_hypotheses takes the folders of two or more trained runs, got {folders!r}")
    require(not isinstance(model, MCLModel), "this model already has MCL adapters: assemble onto the plain base model")
    same = [(a, b) for i, a in enumerate(folders) for b in folders[:i]
            if os.path.realpath(a) == os.path.realpath(b)]
    if same:
        raise ValueError(f"assemble_hypotheses: {same[0][0]} is named twice (as {same[0][1]}): each member is a "
                         "distinct run, named once (the recipe runner refuses such a list too)")
    # (folder, saved metadata, MCLConfig, tensors) of each member, each checked on its own
    members = [(folder, *read_adapters(folder, verify, strict)) for folder in folders]
    digests = [saved.get("weights_sha256") or sha256(os.path.join(folder, WEIGHTS_NAME))
               for folder, saved, _, _ in members]
    twins = [(folders[i], folders[digests.index(d)]) for i, d in enumerate(digests) if digests.index(d) < i]
    if twins:
        raise ValueError(f"assemble_hypotheses: {twins[0][0]} holds the same adapters as {twins[0][1]} (the same "
                         "weights file, byte for byte): two identical hypotheses would make no ensemble; train each "
                         "member on its own (another seed or data), or name the run once")
    first, first_saved, first_config, _ = members[0]
    for folder, saved, config, _ in members:
        require(not config.shared_r, f"{folder} has a shared adapter (shared_r {config.shared_r}), one per run: "
               "the members' hypotheses would not share one. Export each member's hypotheses (each one LoRA of rank "
               "shared_r + r) and serve them as PEFT adapters, or assemble runs trained without shared_r")
        require(not config.scoring, f"{folder} has hypothesis scores p(k | c), which rank its own hypotheses: "
               "assemble runs trained without scoring")
        differing = sorted(name for name, value in _output_settings(config).items()
                           if value != _output_settings(first_config).get(name))
        require(not differing, f"{folder} differs from {first} in {', '.join(differing)}: the members of one model "
               "share every setting that changes the outputs but K (train them from one recipe, only the seed or "
               "the data changed)")
        require(saved.get("base_fingerprint") == first_saved.get("base_fingerprint"), f"{folder} and {first} were "
               "trained on different base weights (their base_fingerprint differs): train every member on one base")
    config = replace(first_config, num_hypotheses=sum(config.num_hypotheses for _, _, config, _ in members))
    names = matched_layer_names(model, resolve_target_modules(model, config), config)
    features = {name: linear_features(model.get_submodule(name)) for name in names}
    for folder, saved, member_config, tensors in members:
        check_adapters_fit(folder, saved, member_config, tensors, names, features)
    fingerprint = check_base_weights(first, first_saved, model, strict)
    with known_fingerprint(model, fingerprint):
        assembled = get_mcl_model(model, config)
    with torch.no_grad():
        for name, layer in assembled.mcl_layers():
            for part in ("lora_A", "lora_B"):  # each member's [K_m, d_in, r] / [K_m, r, d_out], stacked on K
                getattr(layer, part).copy_(torch.cat([tensors[f"{name}.{part}"] for *_, tensors in members]))
                getattr(layer, part).requires_grad_(False)
    return assembled.eval()


def _output_settings(config: MCLConfig) -> dict:
    """The settings of a member that change its outputs and must be the others' too."""
    return {name: value for name, value in config.to_dict().items() if name not in TRAINING_SETTINGS | STACKED}
