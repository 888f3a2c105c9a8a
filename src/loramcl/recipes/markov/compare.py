"""The trained systems of the paper side by side on the Markov mixture (§3.3): LoRA-MLE, LoRA-MCL, LoRA-MoE and
multi-head MCL, each trained through ``MCLTrainer`` on the same data and decoded through ``generate_hypotheses`` at
the same forward budget B = K.

    python -m loramcl.recipes.markov.compare --out runs/baselines-markov [--seeds 3] [--quick]

Per system: the oracle NLL per token (LoRA-MCL's eval loss: mean over sequences of min_k NLL; the plain NLL of a
one-hypothesis model), the win rate of each hypothesis, the transition matrices each hypothesis learned against the
chains; for LoRA-MoE the router's expert usage on each chain's sequences. Decoding K continuations of a 4-token
prompt: how often the K candidates differ, how often they cover both chains (each candidate assigned to the chain
under which it is most likely), and their likelihood under the true mixture. Writes report.json and report.md.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import torch

from loramcl.recipes.markov.chains import MarkovMixture, preset_mixture
from loramcl.utils.threads import use_threads

PROMPT_TOKENS, NEW_TOKENS = 4, 12


def systems(settings) -> dict[str, dict]:
    """name -> how to build it. LoRA-MLE has rank K*r (LoRA-MCL's trainable count); LoRA-MoE has E = K experts of
    rank r (the same, plus its routers); multi-head MCL duplicates the toy model's LM head (tied to the embeddings
    in the base, untied copies here)."""
    k, loss = settings.hypotheses, {name: value for name, value in settings.loss_options().items()
                                    if name not in ("tie_break", "scoring")}
    return {
        "LoRA-MLE": {"kind": "mcl", "num_hypotheses": 1, "r": k * settings.rank},
        "LoRA-MCL": {"kind": "mcl", "num_hypotheses": k, "r": settings.rank, "tie_break": settings.tie_break, **loss},
        "LoRA-MoE": {"kind": "moe", "num_experts": k, "r": settings.rank},
        "multi-head (copy)": {"kind": "multihead", "num_hypotheses": k, "init": "copy", **loss},
        "multi-head (copy, relaxed 0.1)": {"kind": "multihead", "num_hypotheses": k, "init": "copy",
                                           **{**loss, "loss": "relaxed", "epsilon": 0.1}},
        "multi-head (random)": {"kind": "multihead", "num_hypotheses": k, "init": "random", **loss},
    }


def build(spec: dict, base):
    from loramcl.baselines import MoEConfig, MultiHeadConfig, get_moe_model, get_multihead_model
    from loramcl.mcl.build import get_mcl_model
    from loramcl.mcl.config import MCLConfig
    from loramcl.recipes.markov.experiment import TARGETS

    values = {key: value for key, value in spec.items() if key != "kind"}
    if spec["kind"] == "mcl":
        if values["num_hypotheses"] == 1:
            values = {"num_hypotheses": 1, "r": values["r"]}
        return get_mcl_model(base, MCLConfig(alpha=values["r"], target_modules=TARGETS, **values))
    if spec["kind"] == "moe":
        return get_moe_model(base, MoEConfig(alpha=values["r"], target_modules=TARGETS, **values))
    return get_multihead_model(base, MultiHeadConfig(module="lm_head", **values))


def expert_usage(model, sequences: torch.Tensor, chains: np.ndarray) -> dict:
    """LoRA-MoE: mean router probability of each expert over the tokens of each chain's sequences, per layer.

    largest_gap_between_chains: max over layers and experts of the difference of that mean between the two chains'
    sequences. The chains visit their states in different proportions, so a router that only follows the current
    token already shows a gap there; largest_gap_given_token compares the chains on tokens of the same state, the
    part of the routing that depends on which chain (mode) the sequence comes from.
    """
    captured = {}
    hooks = [layer.register_forward_pre_hook(
        lambda module, args, name=name: captured.__setitem__(name, module.router_probabilities(args[0]).detach()))
        for name, layer in model.mcl_layers()]
    try:
        with torch.no_grad():
            model(input_ids=sequences)
    finally:
        for hook in hooks:
            hook.remove()
    states = sequences.cpu().numpy()  # [N, T]
    usage, gaps, token_gaps = {}, [], []
    for name, gamma in captured.items():
        gamma = gamma.cpu().numpy()  # [N, T, E]
        per_chain = np.stack([gamma[chains == c].mean(axis=(0, 1)) for c in (0, 1)])  # [2, E]
        usage[name] = per_chain.tolist()
        gaps.append(float(np.abs(per_chain[0] - per_chain[1]).max()))
        for state in np.unique(states):
            tokens = [gamma[(chains == c)[:, None] & (states == state)] for c in (0, 1)]  # each [n_c, E]
            if all(len(t) for t in tokens):
                token_gaps.append(float(np.abs(tokens[0].mean(axis=0) - tokens[1].mean(axis=0)).max()))
    return {"per_layer": usage, "largest_gap_between_chains": max(gaps), "largest_gap_given_token": max(token_gaps)}


def _log_likelihoods(mixture: MarkovMixture, x: np.ndarray) -> np.ndarray:
    """log p(x | chain c) with the first state from the chain's stationary distribution: [N, C]."""
    from loramcl.recipes.markov.theory import sequence_log_likelihoods

    with np.errstate(divide="ignore"):
        first = np.log(mixture.stationary)[:, x[:, 0]].T  # [N, C]
    return first + sequence_log_likelihoods(mixture, x)


def candidate_statistics(mixture: MarkovMixture, prompts: np.ndarray, candidates: list[list[list[int]]]) -> dict:
    """How the K continuations of each prompt differ and which chains they follow.

    distinct: share of prompts whose K candidates are not all equal; chains_covered: share of prompts whose K
    candidates, each assigned to the chain under which prompt + candidate is most likely, cover every chain;
    log_prob_per_token: mean log p(candidate | prompt) under the true mixture, per generated token.
    """
    k = len(candidates[0])
    full = np.array([np.concatenate([prompts[i], c]) for i, row in enumerate(candidates) for c in row])  # [N*K, T]
    per_chain = _log_likelihoods(mixture, full)  # [N*K, C]
    chain = per_chain.argmax(axis=1).reshape(len(candidates), k)  # [N, K]
    log_weights = np.log(mixture.weights)
    joint = np.logaddexp.reduce(per_chain + log_weights, axis=1)  # [N*K]
    prefix = np.logaddexp.reduce(_log_likelihoods(mixture, np.repeat(prompts, k, axis=0)) + log_weights, axis=1)
    return {
        "distinct": float(np.mean([len({tuple(c) for c in row}) > 1 for row in candidates])),
        "chains_covered": float(np.mean([len(set(row)) == mixture.num_chains for row in chain.tolist()])),
        "log_prob_per_token": float(np.mean(joint - prefix) / NEW_TOKENS),
    }


def decodings(name: str, model, k: int) -> dict[str, dict]:
    """The decodings of each system at the forward budget B = K (paper App. F): a single model's beam search of
    width K returning K sequences (and K samples); K hypotheses greedy each (beam B/K = 1); LoRA-MoE's K
    stochastic-router passes, greedy each."""
    if model.num_hypotheses > 1:
        return {"greedy per hypothesis": dict(strategy="greedy")}
    result = {"beam B=K, K best": dict(strategy="beam", num_beams=k, num_sequences=k),
              "sampling": dict(strategy="sample", num_sequences=k)}
    if name == "LoRA-MoE":
        result["stochastic router, greedy"] = dict(strategy="stochastic_router", num_sequences=k)
    return result


def compare(out: str = "runs/baselines-markov", preset: str = "fig2", seeds: int = 1, steps: int | None = None,
            prompts: int = 500, quick: bool = False, threads: int | None = None) -> dict:
    """Train and compare LoRA-MLE, LoRA-MCL, LoRA-MoE and multi-head MCL on a Markov mixture.

    Args:
        out: output folder (report.json, report.md, one folder of weights per run).
        preset: a preset of ``loramcl markov`` (fig2, fig6, three, paper-fig2, ...): chains and training settings.
        seeds: seeds per system.
        steps: training steps (default: the preset's, 500).
        prompts: validation prompts decoded per system.
        quick: a short run for tests (20 steps, 64 validation sequences, 32 prompts).
        threads: torch CPU threads (default: the cores that are free when the command starts).
    """
    from transformers.utils import logging

    from loramcl.decoding import generate_hypotheses
    from loramcl.recipes.markov.experiment import (
        EVAL_SEED_OFFSET,
        RunSettings,
        toy_model,
        train_run,
        transition_error,
    )
    from loramcl.recipes.markov.reproduce import PRESETS
    from loramcl.recipes.markov.theory import average_transition, theory

    logging.set_verbosity_error()
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    chains_name, overrides, _ = PRESETS[preset]
    mixture = preset_mixture(chains_name)
    # validation every 50 steps, not 10: only the final numbers are compared here, and validation costs a third of
    # the run at every 10
    settings = RunSettings().with_values(**overrides, eval_every=50)
    if quick:
        settings, seeds, prompts = settings.with_values(steps=20, eval_every=10, eval_sequences=64), 1, 32
    if steps is not None:
        settings = settings.with_values(steps=steps)
    use_threads(threads)
    os.makedirs(out, exist_ok=True)
    th = theory(mixture, settings.hypotheses)
    pbar = average_transition(mixture)
    started = time.perf_counter()
    rows = []
    for seed in range(seeds):
        eval_x, eval_chain = mixture.sample(settings.eval_sequences, seed + EVAL_SEED_OFFSET)
        prompt_x, _ = mixture.sample(prompts, seed + 2 * EVAL_SEED_OFFSET)
        prompt_x = prompt_x[:, :PROMPT_TOKENS]
        for name, spec in systems(settings).items():
            model = build(spec, toy_model(settings, mixture.num_states, seed))
            run = train_run(name, mixture, settings, seed, os.path.join(out, f"{_slug(name)}-seed{seed}"),
                            show_progress=not quick, model=model)
            device = next(p for p in model.parameters() if p.requires_grad).device
            transitions = np.array(run.transitions, dtype=float)  # [K, V, V], on the sequences each hypothesis wins
            row = {"system": name, "seed": seed, "oracle_nll": run.final_loss, "win_rates": run.win_rates,
                   "trainable_parameters": run.trainable_parameters, "seconds": run.seconds,
                   "transition_error_vs_pbar": float(np.nanmax(np.abs(np.array(run.transitions_all[0], dtype=float)
                                                                      - pbar)))}
            if len(transitions) >= mixture.num_chains:
                row["transition_error_vs_chains"], row["hypothesis_of_chain"] = transition_error(
                    transitions, mixture.chains)
            if spec["kind"] == "moe":
                row["expert_usage"] = expert_usage(model, torch.from_numpy(eval_x).to(device), eval_chain)
            batch = {"input_ids": torch.from_numpy(prompt_x).to(device)}
            row["decoding"] = {}
            for label, strategy in decodings(name, model, settings.hypotheses).items():
                outs = generate_hypotheses(model, None, batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                           pad_token_id=0, seed=seed, log_probs=False, **strategy)
                candidates = [[c.token_ids for c in row_candidates] for row_candidates in outs]
                row["decoding"][label] = candidate_statistics(mixture, prompt_x, candidates)
            rows.append(row)
            del model
    report = {"preset": preset, "seeds": seeds, "quick": quick, "settings": settings.to_dict(),
              "theory": th.to_dict(), "chains": mixture.to_dict(), "runs": rows,
              "seconds": round(time.perf_counter() - started, 1), "summary": summarise(rows)}
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    text = markdown(report)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    print(text)
    print(f"Wrote {out}/report.json and {out}/report.md ({report['seconds']:.0f} s)")
    return report


def summarise(rows: list[dict]) -> list[dict]:
    """Mean (and spread) over seeds, per system and decoding."""
    summary = []
    for name in dict.fromkeys(r["system"] for r in rows):
        runs = [r for r in rows if r["system"] == name]
        entry = {"system": name, "trainable_parameters": runs[0]["trainable_parameters"],
                 "oracle_nll": float(np.mean([r["oracle_nll"] for r in runs])),
                 "oracle_nll_std": float(np.std([r["oracle_nll"] for r in runs])),
                 "min_win_rate": float(np.mean([min(r["win_rates"]) for r in runs]))}
        if len(runs[0]["win_rates"]) == 1:  # a single model's optimum is P-bar (Cor. 1)
            entry["transition_error_vs_pbar"] = float(np.mean([r["transition_error_vs_pbar"] for r in runs]))
        if all("transition_error_vs_chains" in r for r in runs):
            entry["transition_error_vs_chains"] = float(np.mean([r["transition_error_vs_chains"] for r in runs]))
        if all("expert_usage" in r for r in runs):
            for key, label in (("largest_gap_between_chains", "expert_usage_gap"),
                               ("largest_gap_given_token", "expert_usage_gap_given_token")):
                entry[label] = float(np.mean([r["expert_usage"][key] for r in runs]))
        entry["decoding"] = {label: {key: float(np.mean([r["decoding"][label][key] for r in runs]))
                                     for key in runs[0]["decoding"][label]}
                             for label in runs[0]["decoding"]}
        summary.append(entry)
    return summary


def markdown(report: dict) -> str:
    th = report["theory"]
    lines = [f"# LoRA-MCL and its trained baselines on the Markov mixture ({report['preset']}, "
             f"{report['seeds']} seed(s){', quick' if report['quick'] else ''})", "",
             f"Theory (nats/token): MLE optimum H(x) = {th['mle_optimum']:.4f}; MCL band "
             f"[{th['mcl_lower']:.4f}, {th['mcl_upper']:.4f}].", "",
             "| system | trainable | oracle NLL | smallest win rate | transition error vs chains | vs P-bar | "
             "MoE usage gap: chains | same token |", "|---|---|---|---|---|---|---|---|"]
    for s in report["summary"]:
        numbers = [s.get(key) for key in ("transition_error_vs_chains", "transition_error_vs_pbar", "expert_usage_gap",
                                          "expert_usage_gap_given_token")]
        lines.append(f"| {s['system']} | {s['trainable_parameters']:,} | {s['oracle_nll']:.4f} ± "
                     f"{s['oracle_nll_std']:.4f} | {s['min_win_rate']:.2f} | "
                     + " | ".join("-" if n is None else f"{n:.3f}" for n in numbers) + " |")
    lines += ["", f"Decoding {PROMPT_TOKENS}-token prompts into {NEW_TOKENS} more tokens, K candidates at the "
              "forward budget B = K:", "",
              "| system | decoding | distinct | both chains covered | log p per token (true mixture) |",
              "|---|---|---|---|---|"]
    for s in report["summary"]:
        for label, d in s["decoding"].items():
            lines.append(f"| {s['system']} | {label} | {d['distinct']:.2f} | {d['chains_covered']:.2f} | "
                         f"{d['log_prob_per_token']:.3f} |")
    return "\n".join(lines) + "\n"


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in name.lower()).strip("-").replace("--", "-")


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(compare, as_positional=False)
