"""The parts every recipe report has: the trained runs, quality and diversity per system at equal budget, and the
training curves. Each function returns markdown lines or writes a figure and returns its path."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from loramcl.recipes.grid import System
from loramcl.utils.files import read_json
from loramcl.utils.run_record import RunRecord


@dataclass(frozen=True)
class Column:
    """A metrics-table column: ``key`` in a system's metrics, its header, and its number format."""

    key: str
    header: str
    format: str = ".3f"


def inline(text: str, limit: int = 90) -> str:
    """One markdown line: newlines shown as ⏎, backticks made quotes, long text cut."""
    text = text.replace("\n", "⏎").replace("`", "'")
    return f"`{text[:limit]}{'…' if len(text) > limit else ''}`" if text.strip() else "(empty)"


def percent(x: float) -> str:
    return f"{100 * x:.1f}"


def wins_table(systems: dict, key: str, groups: Sequence[str], header: str) -> list[str]:
    """Markdown rows: for each system and reference group (a language, a mode), how often each candidate k wins it
    (``result[key]`` of each system: ``analysis.language_wins``) and how often candidates tie. ``header``: the
    table's header row, one column per candidate after the system and the group, then the ties."""
    lines = [header, "|---|---|" + "---:|" * (header.count("|") - 3)]
    for name, result in systems.items():
        wins = result[key]
        for group in groups:
            rates = " | ".join(percent(rate) for rate in wins["by_group"][group]["win_rate"])
            lines.append(f"| {name} | {group} | {rates} | {percent(wins['tie_rate'])} |")
    return lines


def runs_nll(root: Path, runs: Sequence[str], ids: list, references: list[list[str]],
             groups: list[list[str]]) -> dict:
    """Per run scored by the NLL stage (root/nll/<run>.jsonl): the oracle NLL of the test references
    (``metrics.oracle_nll``, paper Table 1) and, per reference group (``groups``: per item, a label per reference),
    which hypothesis each reference is most likely under (``metrics.likelihood_wins``: the paper's winner)."""
    from loramcl.metrics import likelihood_wins, oracle_nll
    from loramcl.metrics.io import load_nll

    result = {}
    for run in runs:
        nll = load_nll(root / "nll" / f"{run}.jsonl", ids, references)
        result[run] = {**oracle_nll(nll), "likelihood_wins": likelihood_wins(nll, groups)}
    return result


def nll_section(likelihood: dict, groups: Sequence[str], group: str) -> list[str]:
    """Markdown section of ``runs_nll``: a row per run, its oracle NLL and who wins each reference group."""
    lines = ["## Likelihood of the test references (paper Table 1) and the paper's winner (Table 7)", "",
             "Oracle NLL: each reference's NLL (nats per target token) under the hypothesis that gives it the lowest "
             "(K = 1: the plain test NLL); best single: the best hypothesis's own mean. Won by: for the references of "
             f"each {group}, the share each hypothesis gives the lowest NLL (h0 / h1 / ...; the paper's definition of "
             "the winner; ties go to h0).", "",
             "| run | K | oracle NLL | oracle PPL | best single | "
             + " | ".join(f"won by ({g})" for g in groups) + " |",
             "|---|---:|---:|---:|---:|" + "---|" * len(groups)]
    for run, row in likelihood.items():
        k, wins = len(row["hypothesis_nll"]), row["likelihood_wins"]["by_group"]
        won = [" / ".join(percent(w) for w in wins[g]["win_rate"]) if k > 1 and g in wins else "–" for g in groups]
        lines.append(f"| {run} | {k} | {row['oracle_nll']:.3f} | {row['oracle_ppl']:.2f} | "
                     f"{min(row['hypothesis_nll']):.3f} | " + " | ".join(won) + " |")
    return lines


def written_report(root: Path, report: dict, markdown: Callable[[dict], str]) -> dict:
    """``report`` made JSON-ready (``metrics.io.to_jsonable``), its markdown written to root/report.md."""
    from loramcl.metrics.io import to_jsonable

    report = to_jsonable(report)
    (root / "report.md").write_text(markdown(report), encoding="utf-8")
    return report


def loss_name(mcl: dict, method: str = "mcl") -> str:
    """How a run was trained, from its method's configuration: MLE for K = 1, else the loss and its parameter; a
    LoRA-MoE run (``method`` 'moe') is a single model trained with plain NLL."""
    if method == "moe":
        return f"MoE NLL, {mcl['num_experts']} experts"
    if mcl["num_hypotheses"] == 1:
        return "MLE"
    if mcl["loss"] == "relaxed":
        epsilon = mcl["epsilon"]
        form = " (mean form)" if mcl.get("epsilon_form", "paper") == "mean" else ""
        return f"relaxed ε={epsilon if isinstance(epsilon, str) else format(epsilon, 'g')}{form}"
    if mcl["loss"] == "annealed":
        decay = mcl["temperature_decay"]
        return f"annealed τ0={mcl['temperature0']:g}, ρ={decay if isinstance(decay, str) else format(decay, 'g')}"
    return "WTA"


def runs_table(records: dict[str, RunRecord | dict]) -> list[str]:
    """One row per trained run (its run.json): K, rank, loss, steps x batch, trainable parameters, seconds (a resumed
    run's earlier processes counted as its checkpoint recorded them; it says from which checkpoint, and when the
    checkpoint recorded none that the seconds count from the resume)."""
    lines = ["| run | K | rank | loss | steps x batch | trainable | seconds |", "|---|---:|---:|---|---|---:|---:|"]
    for run, record in records.items():
        record = RunRecord.of(record)
        settings = record.settings
        mcl, training = settings.method_block, settings.training  # a baseline's under its method's name
        resumed = record.resumed_from
        notes = [f"resumed from {resumed}"] * bool(resumed) + ["counted from the resume"] * record.seconds_partial
        seconds = f"{record.seconds:.0f}" + (f" ({', '.join(notes)})" if notes else "")
        # an ensemble run (recipes.ensemble): its members' training
        loss = f"ensemble of {' + '.join(settings.ensemble)}" if settings.ensemble else loss_name(mcl, settings.method)
        lines.append(f"| {run} | {mcl.get('num_hypotheses', 1)} | {mcl.get('r', '–')} | {loss} | "
                     f"{training['steps']} x {training['batch_size']} | {record.trainable_parameters:,} | "
                     f"{seconds} |")
    return lines


def metrics_table(results: dict[str, dict], columns: Sequence[Column]) -> list[str]:
    """One row per system: its budget, then ``columns`` of its metrics (``results[name]["metrics"]``; a missing
    metric is shown as –)."""
    lines = ["| system | budget | " + " | ".join(c.header for c in columns) + " |",
             "|---|---:|" + "---:|" * len(columns)]
    for name, result in results.items():
        metrics = result["metrics"]
        cells = [format(metrics[c.key], c.format) if metrics.get(c.key) is not None else "–" for c in columns]
        lines.append(f"| {name} | {result['system']['budget']} | " + " | ".join(cells) + " |")
    return lines


def method_label(record: RunRecord | dict) -> str:
    """The paper's name of a trained run (Fig. 3 legend), from its run.json."""
    settings = RunRecord.of(record).settings
    if settings.method == "moe":
        return "LoRA-MoE"
    mcl = settings.values["mcl"]
    return f"LoRA-MLE r={mcl['r']}" if mcl["num_hypotheses"] == 1 else f"LoRA-MCL ({loss_name(mcl)})"


def decoding_label(system: System) -> str:
    """The decoding of a system (Fig. 3 colours): an MCL run's beam and greedy decoding are beam search with one beam
    per hypothesis at B = K (greedy: with the repetition penalty on the logits)."""
    options = system.options
    if system.strategy == "diverse_beam":  # an MCL run's: diverse MCL decoding at the recipe's λ
        return f"diverse beam λ={options['diversity_penalty']:g}" if "diversity_penalty" in options else \
            "diverse MCL decoding"
    if system.strategy == "tta":
        return "TTA φ=({:g}, {:g})".format(*options["tta_strength"])
    if system.strategy == "sample":
        return "sampling " + ", ".join(f"{key}={value:g}" for key, value in options.items())
    return "greedy (penalty on logits)" if system.strategy == "greedy" else "beam search"


def tradeoff_figure(results: dict[str, dict], systems: Sequence[System], records: dict[str, RunRecord], x: str,
                    y: str, out: Path, title: str | None = None) -> Path:
    """Quality ``y`` against diversity ``x`` of every system (paper Fig. 3-4; ``results[name]["metrics"]``): a marker
    per method (``method_label`` of its run's record), a colour per decoding (``decoding_label``), each point
    labelled with its budget."""
    from loramcl.metrics.plot import tradeoff_plot

    return tradeoff_plot([results[s.name] for s in systems], x=x, y=y, out=out, title=title,
                         labels=[f"B={s.budget}" for s in systems],
                         methods=[method_label(records[s.run]) for s in systems],
                         decodings=[decoding_label(s) for s in systems])


def training_curves(runs: dict[str, Path], out: Path) -> str:
    """Training loss and validation WTA loss per run, and hypothesis 0's share of the wins, from each run's
    train_log.json; written to ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_win) = plt.subplots(1, 2, figsize=(10, 3.6))
    for run, folder in runs.items():
        log = read_json(Path(folder) / "train_log.json", "it was damaged or edited: train the run again")
        train = [(e["step"], e["loss"]) for e in log if "loss" in e]
        evals = [(e["step"], e["eval_loss"]) for e in log if "eval_loss" in e]
        line, = ax_loss.plot(*zip(*train, strict=True), label=f"{run} (train)") if train else (None,)
        if evals:
            ax_loss.plot(*zip(*evals, strict=True), "o--", color=line.get_color() if line else None,
                         label=f"{run} (validation, WTA)")
        wins = [(e["step"], e["win_rate_h0"]) for e in log if "win_rate_h0" in e and "win_rate_h1" in e]
        if wins:
            ax_win.plot(*zip(*wins, strict=True), label=run)
    ax_loss.set(xlabel="step", ylabel="NLL per target token (nats)", title="Loss")
    ax_win.set(xlabel="step", ylabel="share of the batch won by h0", ylim=(-0.02, 1.02),
               title="Training win rate of hypothesis 0")
    for ax in (ax_loss, ax_win):
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return str(out)
