"""The tables of the study across budgets (``benchmarks.studies.budget_study``, issue 64), from its results.json
files: per task, every system at every budget (means over the finished seeds), and the crossover of each MCL setting
with each baseline (on the seeds both finished, at the same learning rate); where systems ran at several learning
rates, the same tables with each system at its rate of lowest validation loss (``tuned``: chosen on the seeds
that ran every rate, then every seed at it)."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from benchmarks.studies import defaults_study as study
from benchmarks.studies.budget_study import ENSEMBLE, LEARNING_RATE, MLE_STRATEGIES, rate_suffix
from benchmarks.studies.spoken_budgets import HYPOTHESES, TASK
from loramcl.utils.run_record import RunRecord

# the baselines MCL is held to, as the crossover table heads them: the one LoRA's decodings (beam search of K beams,
# diverse beam search of K groups, K samples) and the K-seed ensemble
BASELINES = {"beam": "beam K", "diverse_beam": "diverse beam K", "sample": "sample K", ENSEMBLE: "ensemble"}

CHRF_TASKS = ("bilingual", TASK)  # scored by chrF (0-100): one decimal
MEASURES = ("oracle", "mean", "distinct", "modes_covered", "oracle_nll", "best_step", "train_seconds", "partial")


def tasks() -> dict[str, int]:
    """Task -> K: the study's tasks, then spoken translation (its recipe's runs, ``spoken_budgets``)."""
    return study.TASKS | {TASK: HYPOTHESES}


def read_result(path: Path) -> dict:
    """One finished run's results (its results.json at ``path``), with ``seconds_partial`` from its run.json (a
    ``--record`` folder's results hold it): its training seconds leave out the processes before a resume (a
    checkpoint that did not record their seconds; an ensemble: some member's)."""
    result = json.loads(path.read_text())
    record = path.parent / "run.json"
    if record.exists():
        result["seconds_partial"] = RunRecord.of(json.loads(record.read_text())).seconds_partial
    return result


def read_results(out: Path) -> list[dict]:
    """Every finished run's results in ``out`` (``read_result``)."""
    return [read_result(path) for path in sorted(out.glob("*/*-steps/*/results.json"))]


def members_mean(value: float | list[float]) -> float:
    """A run's value, or an ensemble's members' mean (best_step, best_eval_loss: a list for an ensemble)."""
    return statistics.mean(value) if isinstance(value, list) else value


def systems(result: dict):
    """(system, scores) of one run: an MCL setting's greedy hypotheses; the one LoRA's four decodings
    ("mle:beam", ...); the ensemble; each with its learning rate when not the study's ("mle-lr0.004:beam").
    scores: the test scores with the run's oracle NLL, best step and training seconds (an ensemble's best step: the
    mean of its members')."""
    shared = {"oracle_nll": result["oracle_nll"], "train_seconds": result["train_seconds"],
              "best_step": members_mean(result["best_step"]),
              "partial": bool(result.get("seconds_partial"))}
    setting = result["setting"] + rate_suffix(result.get("learning_rate", LEARNING_RATE))
    for strategy, scores in result["test"].items():
        yield (f"{setting}:{strategy}" if study.is_mle(result["setting"]) else setting), scores | shared


def parts(name: str) -> tuple[str, str, str]:
    """(setting, learning-rate suffix, strategy) of a system's name: "mle-lr0.004:beam" -> ("mle", "-lr0.004",
    "beam"); "relaxed-0.05" -> ("relaxed-0.05", "", "")."""
    system, _, strategy = name.partition(":")
    setting, rate = re.fullmatch(r"(.+?)(-lr[0-9.e+-]+)?", system).groups()
    return setting, rate or "", strategy


def per_seed(results: list[dict]) -> dict:
    """{task: {system: {budget: {seed: scores}}}}"""
    found: dict = {}
    for result in results:
        for name, scores in systems(result):
            found.setdefault(result["task"], {}).setdefault(name, {}).setdefault(result["budget"], {})[
                result["seed"]] = scores
    return found


def mean(runs: list[dict]) -> dict:
    return {m: statistics.mean(r[m] for r in runs) for m in MEASURES}


def means(found: dict) -> dict:
    """{task: {system: {budget: (seeds, {measure: mean over the seeds})}}} of ``per_seed``'s runs"""
    return {task: {name: {budget: (len(runs), mean(list(runs.values()))) for budget, runs in by_budget.items()}
                   for name, by_budget in by_system.items()} for task, by_system in found.items()}


def system_name(name: str, task: str, rank: int) -> str:
    k, (setting, rate, strategy) = tasks()[task], parts(name)
    rate = f" (lr {rate[3:]})" if rate else ""
    if setting == ENSEMBLE:
        return f"ensemble of {k} LoRA-MLE r{rank}{rate}, greedy"
    if strategy:
        what = {"beam": f"beam {k}", "diverse_beam": f"diverse beam {k}", "sample": f"sample {k}",
                "greedy": "greedy 1"}[strategy]
        return f"LoRA-MLE r{rank * k}{setting[3:]}{rate}, {what}"
    return setting + rate


def order(name: str) -> tuple:
    """MCL settings in the study's order (a setting of its own, spoken translation's annealed MCL, after them), then
    the one LoRA's decodings, then the ensemble; each system's learning rates in increasing order (the study's
    first)."""
    setting, rate, strategy = parts(name)
    rate = float(rate[3:]) if rate else 0.0
    known = list(study.SETTINGS).index(setting) if setting in study.SETTINGS else len(study.SETTINGS)
    if setting == ENSEMBLE:
        return (2, 0, rate, 0)
    if strategy:
        return (1, known, rate, MLE_STRATEGIES.index(strategy))
    return (0, known, rate, 0)


def task_table(task: str, by_system: dict, rank: int) -> str:
    scale = "{:.1f}" if task in CHRF_TASKS else "{:.2f}"
    lines = [f"{task} (K = {tasks()[task]})", "",
             "| system | steps | seeds | valid or chrF: best of K | mean over K | distinct | modes covered | "
             "oracle NLL | best step | training s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in sorted(by_system, key=order):
        for budget in sorted(by_system[name]):
            seeds, m = by_system[name][budget]
            lines.append(f"| {system_name(name, task, rank)} | {budget} | {seeds} | {scale.format(m['oracle'])} | "
                         f"{scale.format(m['mean'])} | {m['distinct']:.2f} | {m['modes_covered']:.2f} | "
                         f"{m['oracle_nll']:.3f} | {m['best_step']:.0f} | {m['train_seconds']:.0f}"
                         f"{'*' if m['partial'] else ''} |")
    if any(m["partial"] for by_budget in by_system.values() for _, m in by_budget.values()):
        lines += ["", "\\* a run resumed from a checkpoint that did not record the seconds before it: its training "
                  "seconds count from the resume"]
    return "\n".join(lines)


def beats(mcl: dict, baseline: dict) -> bool:
    """MCL beats a baseline on best-of-K and modes covered: as good on both and better on one (on the Markov task
    every system finds a valid sequence, so there the modes decide)."""
    at_least = mcl["oracle"] >= baseline["oracle"] and mcl["modes_covered"] >= baseline["modes_covered"]
    return at_least and (mcl["oracle"] > baseline["oracle"] or mcl["modes_covered"] > baseline["modes_covered"])


def crossover(points: dict[int, tuple[dict, dict]]) -> str:
    """The smallest budget from which on MCL beats the baseline (at it and at every larger budget measured), from
    ``points`` {budget: (MCL's means, the baseline's)} of the budgets where both were measured; else "not within
    <largest budget> steps" ("-": none measured)."""
    if not points:
        return "-"
    since = None
    for budget in sorted(points):
        if beats(*points[budget]):
            since = since or budget
        else:
            since = None
    return str(since) if since is not None else f"not within {max(points)} steps"


def paired(mine: dict, other: dict) -> dict[int, tuple[dict, dict]]:
    """{budget: (MCL's means, the baseline's)} over the seeds both finished at that budget (a setting run with seed 0
    only is held to the baseline's seed 0, not to its mean over more seeds); budgets with no common seed left out."""
    points = {}
    for budget in mine.keys() & other.keys():
        seeds = sorted(mine[budget].keys() & other[budget].keys())
        if seeds:
            points[budget] = (mean([mine[budget][s] for s in seeds]), mean([other[budget][s] for s in seeds]))
    return points


def crossover_table(found: dict, mle: str = "mle") -> str:
    """Per task and MCL setting, the crossover with each baseline (``BASELINES``: the one LoRA ``mle``'s beam K,
    diverse beam K and samples, the ensemble) at the setting's learning rate, from ``per_seed``'s runs: each budget
    compared on the common seeds."""
    lines = ["| task | setting | " + " | ".join(BASELINES.values()) + " |",
             "|---|---|" + "---|" * len(BASELINES)]
    for task, by_system in found.items():
        for setting in sorted((n for n in by_system if ":" not in n and parts(n)[0] != ENSEMBLE), key=order):
            cells, rate = [], parts(setting)[1]
            for baseline in BASELINES:
                other = by_system.get(ENSEMBLE + rate if baseline == ENSEMBLE else f"{mle}{rate}:{baseline}", {})
                cells.append(crossover(paired(by_system[setting], other)))
            lines.append(f"| {task} | {setting} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def validation_loss(result: dict) -> float:
    """A run's ``best_eval_loss`` (an ensemble: its members' mean); a run without it is refused with what to do."""
    if "best_eval_loss" not in result:
        raise SystemExit(f"{result['task']} {result['setting']} {result['budget']} steps seed {result['seed']} at "
                         f"learning rate {result.get('learning_rate', LEARNING_RATE):g} has no best_eval_loss "
                         "(results.json of a study before 2026-11-30): add it from the run's best/best.json "
                         "(eval_loss)")
    return members_mean(result["best_eval_loss"])


def tuned(results: list[dict]) -> tuple[list[dict], list[str]]:
    """Each system at its own learning rate: of a setting run on a task and budget at two learning rates or more, the
    rate of the lowest validation loss (``validation_loss``), compared on the seeds that ran at every one of its rates
    (the mean over them; where no seed did, each rate's own seeds), then every seed's run at that rate, named as at
    the study's rate: a rate is tuned on one seed and the other seeds measure it. (those runs, a table of the
    choices)."""
    groups: dict = {}
    for result in results:
        key = (result["task"], result["setting"], result["budget"])
        groups.setdefault(key, {}).setdefault(result.get("learning_rate", LEARNING_RATE), {})[result["seed"]] = result
    chosen, lines = [], ["| task | system | steps | chosen on seeds | validation loss at each learning rate | chosen "
                         "| its seeds |", "|---|---|---|---|---|---|---|"]
    for (task, setting, budget), by_rate in sorted(groups.items(), key=lambda g: (
            list(tasks()).index(g[0][0]), order(g[0][1]), g[0][2])):
        if len(by_rate) < 2:
            continue
        common = set.intersection(*(set(runs) for runs in by_rate.values()))
        losses = {rate: statistics.mean(validation_loss(run) for seed, run in runs.items()
                                        if not common or seed in common) for rate, runs in by_rate.items()}
        pick = min(losses, key=losses.get)
        chosen += [run | {"learning_rate": LEARNING_RATE} for _, run in sorted(by_rate[pick].items())]
        lines.append(f"| {task} | {setting} | {budget} | {', '.join(map(str, sorted(common))) or 'each its own'} | "
                     + ", ".join(f"{rate:g}: {loss:.3f}" for rate, loss in sorted(losses.items()))
                     + f" | {pick:g} | {', '.join(map(str, sorted(by_rate[pick])))} |")
    return chosen, lines


def sections(results: list[dict], rates: str = "at the same learning rate") -> list[str]:
    """Every task's table and the crossover tables of ``results`` (``rates``: how the systems' learning rates were
    set, for the crossover's heading)."""
    found = dict(sorted(per_seed(results).items(), key=lambda t: list(tasks()).index(t[0])))
    rank = results[0]["rank"]
    shown = [task_table(task, by_system, rank) for task, by_system in means(found).items()]
    shown.append("Crossover: the smallest budget (steps) from which each MCL setting beats the baseline on best of "
                 f"K and modes covered (as good on both, better on one), on the seeds both ran, {rates}\n\n"
                 + crossover_table(found))
    others = sorted({parts(n)[0] for by_system in found.values() for n in by_system if ":" in n} - {"mle"})
    for mle in others:  # the one LoRA trained as an option trains MCL (mle-loraplus): MCL held to it too
        ran = {task: by_system for task, by_system in found.items() if any(parts(n)[0] == mle for n in by_system)}
        shown.append(f"Crossover against the one LoRA of `{mle}` (its decodings; the ensemble as above)\n\n"
                     + crossover_table(ran, mle))  # on the tasks where it ran
    return shown


def tables(out: Path) -> str:
    """Every task's table and the crossover tables, of the runs finished in ``out``; where systems ran at several
    learning rates, the same of those systems each at its rate of lowest validation loss (``tuned``)."""
    results = read_results(out)
    if not results:
        return f"no finished run in {out} (a finished run has a results.json)"
    shown = sections(results)
    chosen, choices = tuned(results)
    if chosen:
        shown += ["Each system at its own learning rate: of the systems run at two learning rates or more, the run "
                  "of the lowest validation loss (oracle NLL of the kept adapters; an ensemble: its members' mean)"
                  "\n\n" + "\n".join(choices), *sections(chosen, "each at its own learning rate")]
    return "\n\n".join(shown)
