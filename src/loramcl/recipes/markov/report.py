"""The Markov experiment's outputs: report.json (numbers), report.md (the same in words), figure.png."""

from __future__ import annotations

import numpy as np

from loramcl.recipes.markov.chains import MarkovMixture
from loramcl.recipes.markov.experiment import RunResult, transition_error
from loramcl.recipes.markov.theory import Theory, chain_posterior

# The claims of the paper this run checks, with the tolerances of issue 3.
BAND_TOLERANCE = 0.01
MLE_TOLERANCE = 0.005
MIN_GAP = 0.01
MAX_TRANSITION_ERROR = 0.05
MIXTURE_ROUNDING = 1e-3  # a learned density may come this close below the true one on the validation set
MAX_SCORE_ERROR = 0.05  # issue 17: p(k | c) within 0.05 of the chain's posterior given the first state


def summarise(mixture: MarkovMixture, theory: Theory, runs: list[RunResult], settings: dict) -> dict:
    mle = [r for r in runs if r.name == "mle"]
    mcl = [r for r in runs if r.name == "mcl"]
    pbar = np.array(theory.pbar)
    report = {
        "mle_optimum": theory.mle_optimum,
        "mcl_lower": theory.mcl_lower,
        "mcl_upper": theory.mcl_upper,
        "bigram_cross_entropy": theory.bigram_cross_entropy,
    }
    if mle:
        finals = [r.final_loss for r in mle]
        errors = [float(np.abs(np.array(r.transitions[0], dtype=float) - pbar).max()) for r in mle]
        report.update(mle_final_loss=float(np.mean(finals)), mle_final_loss_std=float(np.std(finals)),
                      mle_transition_error_vs_pbar=max(errors))
    if mcl:
        finals = [r.final_loss for r in mcl]
        matched = [transition_error(np.array(r.transitions, dtype=float), mixture.chains)
                   if len(r.transitions) >= mixture.num_chains else (None, None) for r in mcl]
        errors = [e for e, _ in matched]
        report.update(mcl_final_loss=float(np.mean(finals)), mcl_final_loss_std=float(np.std(finals)),
                      mcl_transition_error=None if None in errors else max(errors),
                      mcl_hypothesis_of_chain=[a for _, a in matched])
        scored = [(r, a) for r, (_, a) in zip(mcl, matched, strict=True) if "scores_given_first_state" in r.extra]
        if scored:
            posterior = chain_posterior(mixture)  # [V, C]
            score_errors = [float(np.abs(np.array(r.extra["scores_given_first_state"])[:, a] - posterior).max())
                            for r, a in scored if a is not None]
            mixtures = [r.extra["mixture_nll"] for r, _ in scored]
            optima = [r.extra["validation_optimum"] for r, _ in scored]
            report.update(chain_posterior=posterior.tolist(), validation_optimum=float(np.mean(optima)),
                          mcl_score_error=max(score_errors) if len(score_errors) == len(scored) else None,
                          mcl_mixture_nll=float(np.mean(mixtures)), mcl_mixture_nll_std=float(np.std(mixtures)))
    report["checks"] = checks(report)
    report["settings"] = settings
    report["theory"] = theory.to_dict()
    report["chains"] = mixture.to_dict()
    report["runs"] = [vars(r) for r in runs]
    return report


def checks(report: dict) -> dict[str, bool]:
    """The paper's central claim, number by number (issue 3's tolerances)."""
    result = {}
    if "mcl_final_loss" in report:
        result["mcl_in_band"] = (report["mcl_lower"] - BAND_TOLERANCE <= report["mcl_final_loss"]
                                 <= report["mcl_upper"] + BAND_TOLERANCE)
        if report.get("mcl_transition_error") is not None:
            result["mcl_recovers_chains"] = report["mcl_transition_error"] <= MAX_TRANSITION_ERROR
    if "mle_final_loss" in report:
        result["mle_not_below_optimum"] = report["mle_final_loss"] >= report["mle_optimum"] - MLE_TOLERANCE
    if "mle_final_loss" in report and "mcl_final_loss" in report:
        result["mcl_below_mle"] = report["mcl_final_loss"] <= report["mle_final_loss"] - MIN_GAP
    if report.get("mcl_score_error") is not None:
        result["scores_recover_posterior"] = report["mcl_score_error"] <= MAX_SCORE_ERROR
    if "mcl_mixture_nll" in report:
        # A density model: on the validation sequences, not below the true mixture's own loss (beyond rounding), and
        # at most as far above it as LoRA-MLE's loss (or within the tolerance of it).
        optimum = report["validation_optimum"]
        reference = max(optimum, report.get("mle_final_loss", optimum))
        result["mixture_as_good_as_mle"] = (optimum - MIXTURE_ROUNDING <= report["mcl_mixture_nll"]
                                            <= reference + MLE_TOLERANCE)
    return result


def _matrix(m) -> str:
    return "[" + "; ".join(" ".join("  -  " if v is None else f"{v:.3f}" for v in row) for row in m) + "]"


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [f"# Markov mixture: LoRA-MLE vs LoRA-MCL ({s['name']})", ""]
    lines.append(f"{len(report['chains']['chains'])} chains over {len(report['chains']['chains'][0])} states, "
                 f"weights {[round(w, 3) for w in report['chains']['weights']]}, sequences of "
                 f"{report['chains']['seq_len']} tokens. All losses are in nats per predicted token (the first "
                 "token is excluded), on validation sequences, with the vanilla WTA loss for MCL.")
    lines += ["", "| quantity | value |", "|---|---|"]
    lines.append(f"| MLE optimum H(x) (Monte Carlo, N={report['theory']['num_samples']}) | "
                 f"{report['mle_optimum']:.4f} |")
    lines.append(f"| MCL band [H(x) - log K/(T-1), H(x\\|z)] | "
                 f"[{report['mcl_lower']:.4f}, {report['mcl_upper']:.4f}] |")
    lines.append(f"| loss of predicting P-bar from the current token only | {report['bigram_cross_entropy']:.4f} |")
    if "mle_final_loss" in report:
        lines.append(f"| LoRA-MLE final loss (mean ± std over {s['seeds']} seeds) | "
                     f"{report['mle_final_loss']:.4f} ± {report['mle_final_loss_std']:.4f} |")
        lines.append(f"| LoRA-MLE max error of its matrix vs P-bar (worst seed) | "
                     f"{report['mle_transition_error_vs_pbar']:.3f} |")
    if "mcl_final_loss" in report:
        lines.append(f"| LoRA-MCL final loss (mean ± std) | "
                     f"{report['mcl_final_loss']:.4f} ± {report['mcl_final_loss_std']:.4f} |")
        if report.get("mcl_transition_error") is not None:
            lines.append(f"| LoRA-MCL max error of its matrices vs the P_k, best matching (worst seed) | "
                         f"{report['mcl_transition_error']:.3f} |")
        if "mcl_mixture_nll" in report:
            lines.append(f"| the true mixture's loss on the validation sequences (mean over seeds) | "
                         f"{report['validation_optimum']:.4f} |")
            lines.append(f"| LoRA-MCL mixture NLL -log sum_k p(k\\|c) p_k(x\\|c), with its scores (mean ± std) | "
                         f"{report['mcl_mixture_nll']:.4f} ± {report['mcl_mixture_nll_std']:.4f} |")
        if report.get("mcl_score_error") is not None:
            lines.append(f"| LoRA-MCL max error of p(k\\|x_1) vs the chain's posterior p(z\\|x_1) (worst seed) | "
                         f"{report['mcl_score_error']:.3f} |")
    lines += ["", "## The paper's claims on this run", ""]
    words = {
        "mcl_in_band": f"LoRA-MCL's loss lies in the theoretical band (± {BAND_TOLERANCE})",
        "mcl_recovers_chains": f"each true chain is recovered by one MCL hypothesis (max error ≤ "
                               f"{MAX_TRANSITION_ERROR})",
        "mle_not_below_optimum": f"LoRA-MLE does not beat its optimum H(x) (tolerance {MLE_TOLERANCE})",
        "mcl_below_mle": f"LoRA-MCL's loss is below LoRA-MLE's by at least {MIN_GAP}",
        "scores_recover_posterior": f"LoRA-MCL's scores p(k|x_1) recover the chain's posterior p(z|x_1) (max error "
                                    f"≤ {MAX_SCORE_ERROR})",
        "mixture_as_good_as_mle": "LoRA-MCL's mixture NLL with its scores is a density as good as LoRA-MLE's: between "
                                  "the true mixture's loss on the validation sequences and LoRA-MLE's loss (+ "
                                  f"{MLE_TOLERANCE})",
    }
    for key, ok in report["checks"].items():
        lines.append(f"- {'yes' if ok else '**NO**'}: {words[key]}")
    lines += ["", "## Learned transition matrices (seed of the first run)", ""]
    chains = report["chains"]["chains"]
    for k, p in enumerate(chains):
        lines.append(f"- true P_{k + 1} = {_matrix(p)}")
    lines.append(f"- P-bar (eq. 7) = {_matrix(report['theory']['pbar'])}")
    for run in report["runs"]:
        if run["seed"] != report["runs"][0]["seed"]:
            continue
        for h, t in enumerate(run["transitions"]):
            label = "LoRA-MLE" if run["name"] == "mle" else f"LoRA-MCL hypothesis {h + 1}"
            lines.append(f"- {label} = {_matrix(t)} (wins {run['win_rates'][h]:.0%} of validation sequences)")
    if s.get("notes"):
        lines += ["", "## Notes", "", s["notes"]]
    lines += ["", "## Settings", "", "```", *(f"{k}: {v}" for k, v in s.items() if k != "notes"), "```", ""]
    return "\n".join(lines)


def figure(report: dict, path: str) -> None:
    """Validation loss vs step (mean ± std over seeds) with H(x) and the MCL band; learned vs true matrices."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    first_seed = runs[0]["seed"]
    learned = []
    for run in (r for r in runs if r["seed"] == first_seed):
        order = list(range(len(run["transitions"])))
        if run["name"] == "mcl" and report.get("mcl_hypothesis_of_chain"):  # hypothesis matched to P_k under P_k
            matched = report["mcl_hypothesis_of_chain"][0]
            order = matched + [h for h in order if h not in matched]
        learned += [("MLE" if run["name"] == "mle" else f"MCL h{h + 1}", run["transitions"][h]) for h in order]
    true = [("P-bar", report["theory"]["pbar"])] + [(f"P{k + 1}", p) for k, p in enumerate(report["chains"]["chains"])]
    columns = max(len(learned), len(true))
    fig = plt.figure(figsize=(7 + 2.2 * columns, 5))
    grid = fig.add_gridspec(2, 1 + columns, width_ratios=[3.2] + [1] * columns)
    ax = fig.add_subplot(grid[:, 0])
    for name, color, label in (("mle", "tab:blue", "LoRA-MLE"), ("mcl", "tab:red", "LoRA-MCL (WTA loss)")):
        curves = [r for r in runs if r["name"] == name]
        if not curves:
            continue
        steps = np.array(curves[0]["eval_steps"])
        losses = np.array([r["eval_losses"] for r in curves])  # [seeds, points]
        mean, std = losses.mean(0), losses.std(0)
        ax.plot(steps, mean, color=color, label=f"{label}, {len(curves)} seeds")
        ax.fill_between(steps, mean - std, mean + std, color=color, alpha=0.2)
    ax.axhline(report["mle_optimum"], color="tab:blue", linestyle="--", label="H(x): MLE optimum")
    ax.axhspan(report["mcl_lower"], report["mcl_upper"], color="grey", alpha=0.35,
               label="MCL optimum band [H(x) - log K/(T-1), H(x|z)]")
    top = max(report.get("mle_final_loss", report["mle_optimum"]), report["mle_optimum"]) + 0.06
    ax.set_ylim(report["mcl_lower"] - 0.03, top)
    ax.set_xlabel("training step")
    ax.set_ylabel("validation loss (nats / token)")
    ax.set_title(f"Markov mixture ({report['settings']['name']})")
    ax.legend(fontsize=8)
    for row, items in ((0, learned), (1, true)):
        for col, (title, matrix) in enumerate(items):
            sub = fig.add_subplot(grid[row, 1 + col])
            matrix = np.array(matrix, dtype=float)  # NaN: a state the hypothesis never saw (left blank)
            sub.imshow(matrix, cmap="viridis", vmin=0, vmax=1)
            sub.set_title(title, fontsize=10)
            sub.set_xticks([])
            sub.set_yticks([])
            for (i, j), v in np.ndenumerate(matrix):
                if not np.isnan(v):
                    sub.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                             color="white" if v < 0.5 else "black")
    fig.text(0.99, 0.01, f"top row: learned (seed {first_seed}), each MCL hypothesis above the chain matched to "
             "it; bottom row: true", ha="right", fontsize=8)
    fig.tight_layout(h_pad=2.0)
    fig.savefig(path, dpi=120)
    plt.close(fig)
