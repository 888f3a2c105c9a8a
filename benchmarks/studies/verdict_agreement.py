"""Do the verdicts see the split by mode? The NLL verdict (``training.specialisation``) and the output verdict
(``analysis.outputs``, issue 64) on the defaults study's finished MCL runs, against what the study knows.

The study knows each prompt's modes (the language of each reference) and decodes every hypothesis greedily on the
test prompts (``candidates.json``). The truth here: a run **split by mode** when each hypothesis writes one language
of its own, its most written language (the study's character n-gram identifier, trained on the task's own text, the
one its "modes covered" reads) at least ``MODE_PURITY`` of its answers, and the K most written languages all
different. On the Markov task an answer's mode is the chain it follows (``defaults_study.markov_score``: the chain
whose typical transitions it takes, "invalid" for a sequence no chain explains), over its 3 test prompts. The output
verdict reads the same answers another way (an answer's mode: the mode of the reference it is closest to by chrF,
"prompt" when it copies the prompt; the Markov task's references: the budget study's sequences drawn from the
mixture, each of the chain that explains it; the defaults study keeps none, and its Markov runs are left out); the
NLL verdict reads the training logs only. It reads the budget study's runs too (``benchmarks.studies.budget_study``:
OUT/<task>/<budget>-steps/<run>, decoded from the best checkpoint), and there adds the verdict the run gave itself
in training (``output_verdict: 16`` on validation prompts, with the rows' mode column), and its records
(``budget_study --record``), which keep no data: ``--data`` names the tasks' data built again (``budget_study
--data_only``), refused unless it is the data the runs were scored on. The spoken-translation runs
(``spoken_budgets``: OUT/spoken-translation/<B>-steps/<run>) are read on the recipe's data (``--spoken_data``, default
OUT/spoken-translation/data): English, the transcript, is one of their two modes, and their prompts are clips.

    python -m benchmarks.studies.verdict_agreement --out /tmp/defaults   # the defaults study's --out
    python -m benchmarks.studies.verdict_agreement --out /tmp/budgets    # the budget study's
    python -m benchmarks.studies.verdict_agreement --out benchmarks/studies/records/budget --data /tmp/budgets/data \
        --spoken_data /tmp/budgets/spoken-translation/data
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from benchmarks.studies.defaults_study import (SHORT_LANGUAGES, is_markov, is_mle, language_identifier, markov_score,
                                              read_rows)
from loramcl.analysis.outputs import MODE_PURITY, output_verdict

TASKS = ("markov", "markov-skewed", "bilingual", "short")
LANGUAGES = {"bilingual": ("fr", "de"), "short": SHORT_LANGUAGES}
NOT_A_MODE = {"en", "empty", "invalid"}  # what no hypothesis may own: the source language, nothing, no chain
EXAMPLES_PER_STEP = 16  # the study's batch, and the spoken-translation recipe's
SPOKEN = "spoken-translation"  # spoken_budgets.TASK: its runs in OUT/spoken-translation/<B>-steps


def split_by_mode(languages: list[list[str]], not_a_mode=NOT_A_MODE) -> tuple[bool, list[str], list[float]]:
    """(split, most written language, its share) per hypothesis from ``languages`` [N][K], each answer's language;
    no hypothesis may own one of ``not_a_mode``."""
    counts = [Counter(row[k] for row in languages) for k in range(len(languages[0]))]
    majority = [c.most_common(1)[0][0] for c in counts]
    purity = [c[m] / len(languages) for c, m in zip(counts, majority, strict=True)]
    split = len(set(majority)) == len(majority) and min(purity) >= MODE_PURITY and not set(not_a_mode) & set(majority)
    return split, majority, purity


def chain(prompt: str, answer: str) -> str:
    """The Markov chain ``answer`` follows after ``prompt`` ("chain k"), "invalid" when none explains it."""
    valid, mode = markov_score(prompt, answer)
    return f"chain {mode}" if valid else "invalid"


def test_prompts(data: Path, task: str) -> tuple[list[dict], list[list[str]]] | None:
    """The test prompts with their references, and each reference's mode; None for a Markov task without drawn
    references (the defaults study's)."""
    if not is_markov(task):
        tests = read_rows(data / "test.jsonl")
        return tests, [[LANGUAGES[task][m] for m in t["reference_modes"]] for t in tests]
    if not (data / "references.jsonl").exists():
        return None
    tests = read_rows(data / "references.jsonl")  # the budget study's: every test prompt has drawn sequences
    return tests, [[chain(t["prompt"], r) for r in t["references"]] for t in tests]


def run_verdicts(out: Path, data: Path | None = None, spoken_data: Path | None = None) -> list[dict]:
    """One row per finished MCL run of each task: the truth and the two verdicts. ``data``: the tasks' data folders
    (default ``out``/data; a budget-study record's must be the data it recorded); ``spoken_data``: the spoken-
    translation recipe's data folder (default ``out``/spoken-translation/data), read where ``out`` has its runs."""
    from benchmarks.studies.budget_study import check_data

    rows, root = [], out / "data" if data is None else data
    for task in TASKS:
        data = root / task
        check_data(out, data, task)
        if not (data / "test.jsonl").exists() or (found := test_prompts(data, task)) is None:
            continue
        (tests, modes), identifier = found, None
        for result, answers in mcl_runs([*(out / task).glob("*/results.json"),
                                         *(out / task).glob("*-steps/*/results.json")]):
            if is_markov(task):
                written = [[chain(t["prompt"], a) for a in row] for t, row in zip(tests, answers, strict=True)]
            else:
                identifier = identifier or language_identifier(data, task)
                written = languages_written(identifier, answers)
            rows.append(verdict_row(task, result, answers, written, tests, modes, prompts=[t["prompt"] for t in tests]))
    spoken = list((out / SPOKEN).glob("*-steps/*/results.json"))
    return rows + spoken_verdicts(out, spoken, spoken_data or out / SPOKEN / "data") if spoken else rows


def spoken_verdicts(out: Path, results: list[Path], data: Path) -> list[dict]:
    """The rows of the spoken-translation runs ``results`` (``spoken_budgets``' results.json), on the recipe's
    ``data``: an answer's language by the recipe's identifier (``report.train_identifier``), English one of the two
    modes (the transcript); no prompts, the clips' audio (nothing to copy)."""
    from benchmarks.studies.spoken_budgets import NOT_MODES, check_data
    from loramcl.recipes.spoken_translation.messages import read_rows
    from loramcl.recipes.spoken_translation.report import train_identifier

    if not (data / "test.jsonl").exists():
        raise SystemExit(f"{data}: no test.jsonl for the {SPOKEN} runs of {out}: give --spoken_data, the recipe's "
                         "data (`loramcl spoken-translation --recipes DIR --stop_after data` builds it in its "
                         "out/data)")
    check_data(out, data)
    tests = read_rows(data / "test.jsonl")
    identifier, _ = train_identifier(read_rows(data / "train.jsonl"), tests)
    return [verdict_row(SPOKEN, result, answers, languages_written(identifier, answers), tests,
                        [t["reference_modes"] for t in tests], not_a_mode=NOT_MODES)
            for result, answers in mcl_runs(results)]


def mcl_runs(results: list[Path]):
    """(results, greedy answers [N][K]) of each MCL run among the results.json files ``results``, in path order (the
    one LoRA's and the ensemble's left out)."""
    from benchmarks.studies.budget_study import ENSEMBLE

    for path in sorted(results):
        result = json.loads(path.read_text())
        if not is_mle(result["setting"]) and result["setting"] != ENSEMBLE:
            yield result, json.loads((path.parent / "candidates.json").read_text())["greedy"]


def languages_written(identifier, answers: list[list[str]]) -> list[list[str]]:
    """Each answer's language by ``identifier`` [N][K], "empty" for a blank one."""
    written = [identifier.predict([a if a.strip() else "-" for a in row]) for row in answers]
    return [[lang if a.strip() else "empty" for lang, a in zip(row, answers_row, strict=True)]
            for row, answers_row in zip(written, answers, strict=True)]


def verdict_row(task: str, result: dict, answers: list[list[str]], written: list[list[str]], tests: list[dict],
                modes: list[list[str]], prompts: list[str] | None = None, not_a_mode=NOT_A_MODE) -> dict:
    """One run's row: the split by mode of what it ``written`` (each answer's mode), its NLL verdict, the output
    verdict on its test ``answers`` and the one it gave itself in training."""
    from benchmarks.studies.budget_study import LEARNING_RATE, rate_suffix

    split, majority, purity = split_by_mode(written, not_a_mode)
    steps = result.get("best_step", result.get("steps"))  # the budget study decodes its best checkpoint
    verdict = output_verdict(answers, [t["references"] for t in tests], modes,
                             examples_seen=steps * EXAMPLES_PER_STEP, prompts=prompts)
    return {"task": task, "setting": result["setting"] + rate_suffix(result.get("learning_rate", LEARNING_RATE)),
            "seed": result["seed"], "split": split, "budget": result.get("budget"),
            "trained_verdict": (result.get("output_verdict") or {}).get("kind"),
            "majority": majority, "purity": [round(p, 2) for p in purity],
            "nll_verdict": (result.get("verdict") or {}).get("kind"), "output_verdict": verdict.kind,
            "output_majority": verdict.majority, "same_rate": verdict.same_rate, "copy_rate": verdict.copy_rate}


def table(rows: list[dict]) -> str:
    """Per run, then how often each verdict's "split" agrees with the split by mode."""
    budgets = any(r.get("budget") for r in rows)  # the budget study's runs: their steps and own verdict too
    lines = ["| task | setting | seed | " + ("steps | " if budgets else "") + "split by mode (most written, share) | "
             "NLL verdict | output verdict (most written by chrF; same answer; copies) |"
             + (" in training (validation prompts) |" if budgets else ""),
             "|---|---|---|---|---|---|" + ("---|---|" if budgets else "")]
    for r in rows:
        written = ", ".join(f"{m} {p:.2f}" for m, p in zip(r["majority"], r["purity"], strict=True))
        lines.append(f"| {r['task']} | {r['setting']} | {r['seed']} | " + (f"{r.get('budget')} | " if budgets else "")
                     + f"{'yes' if r['split'] else 'no'} ({written}) | {r['nll_verdict']} | {r['output_verdict']} "
                     f"({', '.join(r['output_majority'] or [])}; {r['same_rate']:.2f}; "
                     f"{'-' if r['copy_rate'] is None else format(r['copy_rate'], '.2f')}) |"
                     + (f" {r.get('trained_verdict')} |" if budgets else ""))
    agree_nll = sum((r["nll_verdict"] == "split") == r["split"] for r in rows)
    agree_out = sum((r["output_verdict"] == "split by mode") == r["split"] for r in rows)
    said_nll = sum(r["nll_verdict"] == "split" and not r["split"] for r in rows)
    said_out = sum(r["output_verdict"] == "split by mode" and not r["split"] for r in rows)
    lines += ["", f"{len(rows)} runs, {sum(r['split'] for r in rows)} split by mode. The NLL verdict agrees on "
              f"{agree_nll} (said \"split\" on {said_nll} that did not split by mode); the output verdict agrees on "
              f"{agree_out} (said \"split by mode\" on {said_out} that did not)."]
    split = [r for r in rows if r["split"]]
    if split:
        lines[-1] += (f" Of the {len(split)} that split by mode, the output verdict said \"split by mode\" on "
                      f"{sum(r['output_verdict'] == 'split by mode' for r in split)}, the NLL verdict \"split\" on "
                      f"{sum(r['nll_verdict'] == 'split' for r in split)}.")
    trained = [r for r in rows if r.get("trained_verdict")]
    if trained:
        agree = sum((r["trained_verdict"] == "split by mode") == r["split"] for r in trained)
        said = sum(r["trained_verdict"] == "split by mode" and not r["split"] for r in trained)
        lines[-1] += (f" The verdict the {len(trained)} budget-study runs gave themselves in training agrees on "
                      f"{agree} (said \"split by mode\" on {said} that did not).")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the defaults or budget study's --out, or a record")
    parser.add_argument("--data", type=Path, help="the tasks' data (default: OUT/data)")
    parser.add_argument("--spoken_data", type=Path, help="the spoken-translation recipe's data, read where OUT has "
                        "its runs (default: OUT/spoken-translation/data)")
    args = parser.parse_args()
    print(table(run_verdicts(args.out, args.data, args.spoken_data)))


if __name__ == "__main__":
    main()
