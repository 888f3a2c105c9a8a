"""Which MCL defaults make K hypotheses split on a user's first-try budget, measured on three real tasks (issue 53).

Every run trains SmolLM2-135M-Instruct through `loramcl train`'s own code (`finetune.train`: LoRA r = 8 on q_proj and
v_proj, the docs' first command; 16 examples a step; one CPU thread) on a task with several right answers per prompt,
K = the task's number of modes, and decodes the test prompts at an equal forward budget of K rows:

  markov     the paper's three-chain Markov mixture (``--preset three``: forward cycle, backward cycle, stay, each
             transition 0.8) written as letters: "Sequence: a" -> " b c a b c c a b" (8 states). K = 3. A candidate
             is valid when it is 8 states whose chain-typical transitions (probability 0.8 under its best chain) are
             at least 6 of the 8; its mode is that best chain.
  markov-skewed  the same chains drawn 60% / 30% / 10% (``MARKOV_WEIGHTS``): modes of unequal size, where a loss
             that balances the hypotheses' wins (``bias``) must not take the rare chain's hypothesis away from it.
  bilingual  English UI messages of the gettext catalogs -> French or German (the bilingual recipe's data, its
             shorter messages: 15-40 characters; the language drawn per example, never said). K = 2. Quality: chrF
             against every reference of both languages (oracle: best of K; mean over K); mode: the candidate's
             language (a character n-gram identifier trained on the task's own text).
  short      short English UI words of the catalogs (1-12 characters: "Save", "Open file") -> French, German or
             Spanish, the language drawn per example. K = 3. Valid: the candidate equals one of the catalogs'
             translations in any of the three languages (SQuAD normalisation); mode: its language.

Settings (the candidate defaults; every one with random tie-breaking, `loramcl train`'s):
  wta               vanilla winner-takes-all (the paper's loss; `loramcl train`'s default before this study)
  relaxed-0.05/0.1  relaxed WTA, epsilon 0.05 (the paper's translation value) / 0.1 (the README's quickstart)
  annealed-auto     annealed WTA, tau0 1, `temperature_decay: auto` (tau reaches its floor at 90% of the run)
and the baselines at equal trainable parameters (one LoRA of rank 8K, `mle`): beam search of K beams, K samples and
its greedy answer. Issue 63's options, each beside today's default (relaxed-0.05) at the same trainable parameters:
  shared            half of each hypothesis's rank moved into one shared adapter (r 4 each + shared 4K: K r + s = 8K)
  bias              balanced WTA (MCLConfig balance "bias": the winner is argmin_k nll_k - b_k, b toward equal shares)
                    at balance_rate 0.01 (the default) and 0.1 (bias-0.1)
  staged            every hypothesis learns from every example for the first quarter, then relaxed WTA (split_after)
  loraplus          LoRA+: B learns 16x faster than A (--training.loraplus_lr_ratio); mle-loraplus: the one LoRA so
  eps-mean          relaxed WTA with epsilon as the released code's audio model weighs it (epsilon_form "mean")
  combined          a shared adapter, balanced WTA and LoRA+ together; shared-loraplus: the shared adapter and LoRA+

Per run: the trainer's logs every 5 steps (win shares sorted, split gap over what training gained, i.e. against
steps), its verdict, the win table by mode on 96 training examples after training (the share of examples whose
winner is the hypothesis that wins most of their mode: 1 for a clean split by mode, and for a collapse too), and on
the test prompts: valid share (markov, short) or chrF, oracle and mean over K, distinct answers and modes covered.

    python -m benchmarks.studies.defaults_study --model models/SmolLM2-135M-Instruct --out /tmp/defaults \
        --tasks markov bilingual short --settings wta relaxed-0.05 relaxed-0.1 annealed-auto mle --seeds 0 1
    python -m benchmarks.studies.defaults_study --out /tmp/defaults --table   # the tables of what has finished

Finished runs (a results.json) are kept and skipped, so the command can be stopped and started again.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch

STATES = "abc"
SHARED = "shared share"  # the share of each hypothesis's rank moved into a shared adapter (MCLConfig.shared_r)
DEFAULT = {"loss": "relaxed", "epsilon": 0.05}  # `loramcl train`'s default (epsilon "auto")
SETTINGS = {
    "wta": {"loss": "wta"},
    "relaxed-0.05": DEFAULT,
    "relaxed-0.1": {"loss": "relaxed", "epsilon": 0.1},
    "annealed-auto": {"loss": "annealed", "temperature0": 1.0, "temperature_decay": "auto"},
    "mle": {},  # one LoRA of rank 8K: LoRA-MLE at K hypotheses' trainable parameters
    # issue 63's options, each beside today's default, at the same trainable parameters
    "shared": DEFAULT | {SHARED: 0.5},  # half of each hypothesis's rank moved into one shared adapter of rank K r / 2
    "bias": {"loss": "wta", "balance": "bias"},  # balanced WTA: no epsilon pull, no idle hypothesis
    "bias-0.1": {"loss": "wta", "balance": "bias", "balance_rate": 0.1},  # a bias 10x as fast
    "staged": DEFAULT | {"split_after": 0.25},  # every hypothesis on every example for the first quarter
    "loraplus": DEFAULT | {"loraplus_lr_ratio": 16.0},
    "eps-mean": DEFAULT | {"epsilon_form": "mean"},  # epsilon as the released code's audio model weighs it
    "combined": {"loss": "wta", "balance": "bias", SHARED: 0.5, "loraplus_lr_ratio": 16.0},
    "shared-loraplus": DEFAULT | {SHARED: 0.5, "loraplus_lr_ratio": 16.0},  # the two that helped alone (seed 0)
    "mle-loraplus": {"loraplus_lr_ratio": 16.0},  # LoRA+ for the one LoRA too
}
TRAINING_KEYS = ("loraplus_lr_ratio",)  # settings of TrainConfig; the others are MCLConfig's
TASKS = {"markov": 3, "markov-skewed": 3, "bilingual": 2, "short": 3}  # task -> K, its number of modes
MAIN_TASKS = ("markov", "bilingual", "short")  # run unless --tasks names others
CEILING = {"markov": 1.0, "markov-skewed": 1.0, "bilingual": 100.0, "short": 1.0}  # the best: valid share, chrF
MARKOV_WEIGHTS = {"markov": None, "markov-skewed": (0.6, 0.3, 0.1)}  # the Markov tasks' chain weights (None: equal)
SHORT_LANGUAGES = ("fr", "de", "es")
PROMPT = "Translate: {source}\n"  # the bilingual recipe's prompt


# ---- the tasks' data -----------------------------------------------------------------------------------------

def is_markov(task: str) -> bool:
    return task in MARKOV_WEIGHTS


def markov_rows(count: int, seed: int, length: int = 8, weights: tuple[float, ...] | None = None) -> list[dict]:
    """``count`` rows: prompt "Sequence: x0", target the next ``length`` states of the drawn chain, mode its index;
    the chains drawn with ``weights`` (equal when None)."""
    from dataclasses import replace

    from loramcl.recipes.markov.chains import preset_mixture

    mixture = preset_mixture("three")
    if weights is not None:
        mixture = replace(mixture, weights=np.array(weights))
    mixture.seq_len = length + 1
    states, chains = mixture.sample(count, seed)
    return [{"prompt": f"Sequence: {STATES[s[0]]}", "target": "".join(f" {STATES[x]}" for x in s[1:]),
             "mode": int(c)} for s, c in zip(states, chains, strict=True)]


def markov_prompts() -> list[dict]:
    return [{"prompt": f"Sequence: {state}", "references": []} for state in STATES]


def gettext_items(languages: tuple[str, ...], min_chars: int, max_chars: int, max_words: int | None = None
                  ) -> list[dict]:
    """English messages with a usable translation in every language: {source, <lang>: [translations]}."""
    from loramcl.data.gettext_pairs import read_catalogs, usable

    catalogs = {lang: read_catalogs("/usr/share/locale", lang) for lang in languages}
    items = []
    for source in sorted(set.intersection(*(set(c) for c in catalogs.values()))):
        if not (min_chars <= len(source) <= max_chars and usable(source)) or not source[0].isalpha():
            continue
        if max_words is not None and len(source.split()) > max_words:
            continue
        item = {"source": source}
        for lang, catalog in catalogs.items():
            item[lang] = [t for t, _ in sorted(catalog[source].items(), key=lambda tc: (-tc[1], tc[0]))
                          if usable(t) and t.strip().lower() != source.strip().lower() and len(t) <= 4 * max_chars]
        if all(item[lang] for lang in languages):
            items.append(item)
    return items


def translation_task(languages: tuple[str, ...], items: list[dict], train: int, test: int, seed: int):
    """Split by English message (normalised); train rows draw one language per example; test rows keep all."""
    from loramcl.data.gettext_pairs import normalise

    groups: dict[str, list[dict]] = {}
    for item in items:
        groups.setdefault(normalise(item["source"]), []).append(item)
    keys = sorted(groups)
    random.Random(seed).shuffle(keys)
    rng = random.Random(seed + 1)
    train_rows, test_rows = [], []
    for key in keys[test:test + train]:
        item = groups[key][0]
        mode = rng.randrange(len(languages))
        train_rows.append({"prompt": PROMPT.format(source=item["source"]), "target": item[languages[mode]][0],
                           "mode": mode})
    for key in keys[:test]:
        item = groups[key][0]
        test_rows.append({"prompt": PROMPT.format(source=item["source"]),
                          "references": [t for lang in languages for t in item[lang]],
                          "reference_modes": [m for m, lang in enumerate(languages) for _ in item[lang]]})
    return train_rows, test_rows


def build_task(task: str, folder: Path, train: int, test: int) -> None:
    """train.jsonl (prompt, target, mode) and test.jsonl (prompt, references, reference_modes) in ``folder``."""
    if (folder / "test.jsonl").exists():
        return
    if is_markov(task):
        train_rows, test_rows = markov_rows(train, seed=0, weights=MARKOV_WEIGHTS[task]), markov_prompts()
    elif task == "bilingual":
        train_rows, test_rows = translation_task(("fr", "de"), gettext_items(("fr", "de"), 15, 40), train, test, 0)
    else:
        train_rows, test_rows = translation_task(SHORT_LANGUAGES, gettext_items(SHORT_LANGUAGES, 1, 12, 2),
                                                 train, test, 0)
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train_rows), ("test", test_rows)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# ---- training ------------------------------------------------------------------------------------------------

def is_mle(setting: str) -> bool:
    return setting.startswith("mle")


def run_configs(setting: str, hypotheses: int, rank: int) -> tuple[dict, dict]:
    """(MCLConfig keywords, TrainConfig keywords) of ``setting``: K hypotheses of rank ``rank`` (alpha = r: the scale
    alpha / r stays 1, MCLConfig's default at r = 8) or, for LoRA-MLE, one LoRA of rank ``rank`` * K; a shared
    adapter takes ``SHARED`` of each hypothesis's rank, so K r + s stays K * ``rank`` (alpha = s + r: the scale 1)."""
    chosen = dict(SETTINGS[setting])
    training = {key: chosen.pop(key) for key in TRAINING_KEYS if key in chosen}
    if is_mle(setting):
        return {"num_hypotheses": 1, "r": rank * hypotheses, "alpha": float(rank * hypotheses)}, training
    share = chosen.pop(SHARED, 0.0)
    r = rank - round(rank * share)
    shared = (rank - r) * hypotheses
    if shared:
        chosen["shared_r"] = shared
    return {"num_hypotheses": hypotheses, "r": r, "alpha": float(r + shared)} | chosen, training


def train_run(model: Path, data: Path, out: Path, setting: str, hypotheses: int, seed: int, steps: int,
              learning_rate: float, rank: int = 8) -> None:
    """One `loramcl train` run (finetune.train) of ``setting`` (``run_configs``)."""
    from loramcl.mcl.config import MCLConfig
    from loramcl.training import fit as finetune
    from loramcl.training.config import DataConfig, TrainConfig

    mcl, training = run_configs(setting, hypotheses, rank)
    mcl = MCLConfig(target_modules=["q_proj", "v_proj"], **mcl)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        finetune.train(model=str(model), out=str(out), data=DataConfig(train_file=str(data / "train.jsonl")),
                       mcl=mcl, training=TrainConfig(steps=steps, seed=seed, learning_rate=learning_rate,
                                                     logging_steps=5, save_every=0, **training), threads=1)


# ---- decoding and scoring ------------------------------------------------------------------------------------

MAX_NEW_TOKENS = {"markov": 20, "markov-skewed": 20, "bilingual": 48, "short": 12}


def decode(model: Path, run: Path, task: str, rows: list[dict], hypotheses: int, strategy: str) -> list[list[str]]:
    """K candidates per test prompt: MCL greedy per hypothesis; MLE beam search of K beams or K samples."""
    from transformers import AutoTokenizer

    from loramcl.decoding import generate_hypotheses
    from loramcl.models import load_model

    tokenizer = AutoTokenizer.from_pretrained(run)
    net = load_model(str(model), adapters=str(run))
    options = {"strategy": strategy, "max_new_tokens": MAX_NEW_TOKENS[task]}
    if strategy != "greedy":
        options |= {"num_sequences": hypotheses, "seed": 0} | ({"num_beams": hypotheses} if strategy == "beam" else {})
    outs = []
    for start in range(0, len(rows), 20):
        prompts = [r["prompt"] for r in rows[start:start + 20]]
        outs += [[c.text for c in cands] for cands in generate_hypotheses(net, tokenizer, prompts, log_probs=False,
                                                                          **options)]
    return outs


def markov_score(prompt: str, text: str) -> tuple[bool, int | None]:
    """(valid, mode): 8 states of which at least 6 transitions are their best chain's typical (0.8) ones."""
    from loramcl.recipes.markov.chains import PRESET_CHAINS

    states = [STATES.index(prompt[-1])] + [STATES.index(w) if w in STATES else -1 for w in text.split()]
    if len(states) != 9 or min(states) < 0:
        return False, None
    typical = [sum(PRESET_CHAINS["three"][k][a][b] > 0.5 for a, b in zip(states, states[1:])) for k in range(3)]
    best = max(range(3), key=typical.__getitem__)
    return typical[best] >= 6, best


def score(task: str, rows: list[dict], candidates: list[list[str]], identifier,
          no_mode: tuple[str, ...] = ("empty", "en")) -> dict:
    """Valid share (markov, short) or chrF (bilingual, and any other task): best of K and mean over K; distinct
    answers and modes covered per prompt: the identified languages but ``no_mode`` (here English copies the prompt;
    spoken translation's English transcript is one of its modes)."""
    from sacrebleu.metrics import CHRF

    from loramcl.metrics.short_answers import normalise_answer

    chrf = CHRF()
    quality, modes = [], []
    for row, cands in zip(rows, candidates, strict=True):
        if is_markov(task):
            scored = [markov_score(row["prompt"], c) for c in cands]
            quality.append([float(valid) for valid, _ in scored])
            modes.append([mode for valid, mode in scored if valid])
        elif task == "short":
            refs = {normalise_answer(r): m for r, m in zip(row["references"], row["reference_modes"], strict=True)}
            quality.append([float(normalise_answer(c) in refs) for c in cands])
            modes.append(identifier.predict([c for c in cands if c.strip()]))
        else:
            quality.append([chrf.sentence_score(c, row["references"]).score for c in cands])
            modes.append(identifier.predict([c for c in cands if c.strip()]))
    return {"oracle": statistics.mean(max(q) for q in quality), "mean": statistics.mean(np.mean(q) for q in quality),
            "distinct": statistics.mean(len({normalise_answer(c) for c in cands}) for cands in candidates),
            "modes_covered": statistics.mean(len(set(m) - set(no_mode)) for m in modes)}


def language_identifier(data: Path, task: str):
    """A character n-gram language identifier trained on the task's own training targets and English sources."""
    from loramcl.analysis.language import LanguageIdentifier

    languages = ("fr", "de") if task == "bilingual" else SHORT_LANGUAGES
    rows = read_rows(data / "train.jsonl")
    texts = [r["target"] for r in rows] + [r["prompt"].split(": ", 1)[1].strip() for r in rows]
    labels = [languages[r["mode"]] for r in rows] + ["en"] * len(rows)
    return LanguageIdentifier().fit(texts, labels)


def wins_by_mode(model: Path, run: Path, data: Path, hypotheses: int, examples: int = 96) -> list[list[int]]:
    """[mode][k]: training examples of each mode (the first ``examples``) that hypothesis k wins after training."""
    from transformers import AutoTokenizer

    from loramcl.data.prompts import collate, encode_pairs, pad_token_id
    from loramcl.models import load_model

    rows = read_rows(data / "train.jsonl")[:examples]
    tokenizer = AutoTokenizer.from_pretrained(run)
    net = load_model(str(model), adapters=str(run))
    batch = collate(encode_pairs(tokenizer, [r["prompt"] for r in rows], [r["target"] for r in rows]),
                    pad_token_id(tokenizer))
    with torch.no_grad():
        winners = net(**batch).nll.argmin(dim=1).tolist()  # nll: [N, K]
    modes = max(r["mode"] for r in rows) + 1
    return [[sum(w == k and r["mode"] == m for w, r in zip(winners, rows, strict=True)) for k in range(hypotheses)]
            for m in range(modes)]


def mode_purity(table: list[list[int]]) -> float:
    """Share of examples won by their mode's most frequent winner: 1 when each mode has its own hypothesis... or
    when one hypothesis wins everything, so read it with the win shares (a collapsed run has one share near 1)."""
    return sum(max(row) for row in table) / max(sum(map(sum, table)), 1)


def logged_curve(run: Path) -> list[dict]:
    """The trainer's logs (read as its verdict reads them, ``specialisation.records_of``): step, sorted win shares,
    split gap and the gap as a share of what training gained (the first step's NLL minus the oracle NLL)."""
    from loramcl.training.specialisation import records_of

    logs = json.loads((run / "train_log.json").read_text())
    hypotheses = max((sum(name.startswith("win_rate_h") for name in entry) for entry in logs), default=0)
    curve = []
    for record in records_of(logs, hypotheses):
        gained = None
        if record.initial is not None and record.nll is not None:
            gained = record.initial - (statistics.mean(record.nll) - record.gap)  # initial - oracle NLL
        curve.append({"step": record.last, "shares": [round(s, 3) for s in sorted(record.shares, reverse=True)],
                      "gap": record.gap, "gap_share": record.gap / gained if gained and gained > 0 else None})
    return curve


# ---- the study -----------------------------------------------------------------------------------------------

def one_run(args, task: str, setting: str, seed: int) -> dict:
    data, run = args.out / "data" / task, args.out / task / f"{setting}-s{seed}"
    hypotheses = TASKS[task]
    rows = read_rows(data / "test.jsonl")
    # one LoRA: beam search of K beams and K samples, and its greedy answer (the quality a hypothesis is held to)
    strategies = ["beam", "sample", "greedy"] if is_mle(setting) else ["greedy"]
    if (run / "results.json").exists():
        result = json.loads((run / "results.json").read_text())
        missing = [s for s in strategies if s not in result["test"]]  # a strategy added since the run finished
        if missing:
            identifier = None if is_markov(task) else language_identifier(data, task)
            decoded = json.loads((run / "candidates.json").read_text())
            for strategy in missing:
                decoded[strategy] = decode(args.model, run, task, rows, hypotheses, strategy)
                result["test"][strategy] = score(task, rows, decoded[strategy], identifier)
            (run / "candidates.json").write_text(json.dumps(decoded, ensure_ascii=False, indent=0) + "\n")
            (run / "results.json").write_text(json.dumps(result, indent=1) + "\n")
        return result
    started = time.perf_counter()
    if not (run / "run.json").exists():
        train_run(args.model, data, run, setting, hypotheses, seed, args.steps, args.learning_rate, args.rank)
    trained = time.perf_counter() - started
    identifier = None if is_markov(task) else language_identifier(data, task)
    decoded = {s: decode(args.model, run, task, rows, hypotheses, s) for s in strategies}
    record = json.loads((run / "run.json").read_text())
    result = {"task": task, "setting": setting, "seed": seed, "K": hypotheses, "steps": args.steps,
              "learning_rate": args.learning_rate, "rank": args.rank, "train_seconds": round(trained),
              "trainable_parameters": record.get("trainable_parameters"),
              "test": {s: score(task, rows, c, identifier) for s, c in decoded.items()}}
    if not is_mle(setting):
        table = wins_by_mode(args.model, run, data, hypotheses)
        result |= {"verdict": record.get("specialisation"),
                   "curve": logged_curve(run), "wins_by_mode": table, "mode_purity": mode_purity(table)}
    (run / "candidates.json").write_text(json.dumps(decoded, ensure_ascii=False, indent=0) + "\n")
    (run / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/SmolLM2-135M-Instruct"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tasks", nargs="+", default=list(MAIN_TASKS), choices=list(TASKS))
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank of each hypothesis (LoRA-MLE: rank * K)")
    parser.add_argument("--train_examples", type=int, default=2000)
    parser.add_argument("--test_prompts", type=int, default=60)
    parser.add_argument("--table", action="store_true", help="only print the table of the finished runs")
    args = parser.parse_args()
    if args.table:
        print(table(args.out) + "\n\n" + curves(args.out) + "\n\n" + goal_table(args.out))
        return
    torch.set_num_threads(1)
    from transformers.utils import logging

    logging.set_verbosity_error()
    for task in args.tasks:
        build_task(task, args.out / "data" / task, args.train_examples, args.test_prompts)
    for seed in args.seeds:
        for task in args.tasks:
            for setting in args.settings:
                result = one_run(args, task, setting, seed)
                print(json.dumps({k: result[k] for k in ("task", "setting", "seed", "train_seconds", "test")}),
                      flush=True)


def split_step(curve: list[dict], threshold: float = 0.10) -> int | None:
    """The first logged step from which the split gap stays at or above ``threshold`` of what training gained (the
    trainer's test for 'split'), or None."""
    step = None
    for point in curve:
        if point["gap_share"] is None or point["gap_share"] < threshold:
            step = None
        elif step is None:
            step = point["step"]
    return step


def curves(out: Path, every: int = 10) -> str:
    """Per task and MCL setting, against steps (every ``every``-th logged step, mean over the finished seeds): the split
    gap as a share of what training gained, and the smallest hypothesis's win share."""
    results = [json.loads(p.read_text()) for p in sorted(out.glob("*/*/results.json"))]
    results = [r for r in results if not is_mle(r["setting"]) and r.get("curve")]
    steps = sorted({p["step"] for r in results for p in r["curve"] if p["step"] % every == 0})
    head = " | ".join(str(step) for step in steps)
    lines = [f"| task | setting | measure | {head} |", "|---|---|---|" + "---|" * len(steps)]
    for task in TASKS:
        for setting in SETTINGS:
            runs = [r for r in results if r["task"] == task and r["setting"] == setting]
            if not runs:
                continue
            at = [{p["step"]: p for p in r["curve"]} for r in runs]

            def mean(step, value):
                values = [value(points[step]) for points in at if step in points and value(points[step]) is not None]
                return f"{statistics.mean(values):.2f}" if values else "-"

            gaps = " | ".join(mean(step, lambda p: p["gap_share"]) for step in steps)
            shares = " | ".join(mean(step, lambda p: p["shares"][-1]) for step in steps)
            lines.append(f"| {task} | {setting} | split gap / gain | {gaps} |")
            lines.append(f"| {task} | {setting} | smallest win share | {shares} |")
    return "\n".join(lines)


def means(results: list[dict], task: str, setting: str, strategy: str) -> dict | None:
    """The test scores of ``setting`` on ``task`` decoded by ``strategy``, averaged over its finished seeds."""
    done = [r["test"][strategy] for r in results if r["task"] == task and r["setting"] == setting
            and strategy in r["test"]]
    return {key: statistics.mean(d[key] for d in done) for key in done[0]} if done else None


def goal_table(out: Path, mle: str = "mle") -> str:
    """Issue 63's goal, per MCL setting and task: beats beam search of K with one LoRA (``mle``) on best of K and modes
    covered, with its mean over K at least 80% of the one LoRA's greedy quality; "yes" on two tasks of three meets it.
    Best of K at the task's ceiling for both (every Markov prompt has a valid candidate: ``CEILING``) cannot be beaten:
    the tie counts, and the cell says so. A cell: yes / no and what fell short (best of K, modes, mean)."""
    results = [json.loads(p.read_text()) for p in sorted(out.glob("*/*/results.json"))]
    lines = ["| setting | " + " | ".join(MAIN_TASKS) + " | tasks met |", "|---|" + "---|" * (len(MAIN_TASKS) + 1)]
    for setting in (s for s in SETTINGS if not is_mle(s)):
        cells, met = [], 0
        for task in MAIN_TASKS:
            mcl, beam, greedy = (means(results, task, name, strategy) for name, strategy in
                                 ((setting, "greedy"), (mle, "beam"), (mle, "greedy")))
            if not (mcl and beam and greedy):
                cells.append("-")
                continue
            ceiling = mcl["oracle"] == beam["oracle"] == CEILING[task]
            short = [what for what, ok in (("best of K", mcl["oracle"] > beam["oracle"] or ceiling),
                                           ("modes", mcl["modes_covered"] > beam["modes_covered"]),
                                           ("mean", mcl["mean"] >= 0.8 * greedy["oracle"])) if not ok]
            met += not short
            cells.append(("yes" if not short else "no: " + ", ".join(short)) + (" (best of K tied at its ceiling)"
                                                                               if ceiling else ""))
        if any(cell != "-" for cell in cells):
            lines.append(f"| {setting} | " + " | ".join(cells) + f" | {met} |")
    return "\n".join(lines)


def table(out: Path) -> str:
    """One markdown line per task and setting, over the finished seeds."""
    results = [json.loads(p.read_text()) for p in sorted(out.glob("*/*/results.json"))]
    lines = ["| task | K | system | seeds | win shares (sorted) | split gap / gain | split at step | mode purity | "
             "verdicts (split / not / partly) | valid or chrF: best of K | mean over K | distinct | modes covered |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for task in TASKS:
        for setting in SETTINGS:
            runs = [r for r in results if r["task"] == task and r["setting"] == setting]
            for strategy in ("greedy", "beam", "sample"):
                done = [r for r in runs if strategy in r["test"]]
                if not done:
                    continue
                test = {key: statistics.mean(r["test"][strategy][key] for r in done)
                        for key in ("oracle", "mean", "distinct", "modes_covered")}
                scale = "{:.1f}" if task == "bilingual" else "{:.2f}"
                if is_mle(setting):
                    training = "| | | | |"
                else:
                    last = [r["curve"][-1] for r in done if r["curve"]]  # none in a run shorter than one log
                    shares = " / ".join(f"{statistics.mean(c):.2f}" for c in zip(*(x["shares"] for x in last),
                                                                                   strict=True)) or "-"
                    gaps = [x["gap_share"] for x in last if x["gap_share"] is not None]
                    verdicts = " / ".join(str(sum((r["verdict"] or {}).get("kind") == kind for r in done))
                                          for kind in ("split", "not split", "partly collapsed"))
                    splits = " / ".join(str(split_step(r["curve"]) or "-") for r in done)
                    training = (f"| {shares} | {statistics.mean(gaps) if gaps else float('nan'):.2f} | {splits} | "
                                f"{statistics.mean(r['mode_purity'] for r in done):.2f} | {verdicts}")
                rank = done[0].get("rank", 8) * TASKS[task]
                name = (f"LoRA-MLE r{rank}{setting[3:]}, {strategy} {TASKS[task] if strategy != 'greedy' else 1}"
                        if is_mle(setting) else setting)
                lines.append(f"| {task} | {TASKS[task]} | {name} | {len(done)} {training} | "
                             f"{scale.format(test['oracle'])} | {scale.format(test['mean'])} | "
                             f"{test['distinct']:.2f} | {test['modes_covered']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
