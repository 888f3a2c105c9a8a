"""Which MCLConfig defaults specialise: the first `loramcl train` of docs/guide/cli.md, shortened, on an ambiguous task.

Every candidate setting trains K = 3 hypotheses (LoRA r = 8 on q_proj and v_proj, the docs' first command) through
`loramcl train`'s own code (`finetune.train`, its TrainConfig defaults: 200 steps of 16, lr 5e-4, cosine) on 200
prompts whose target is in one of three languages, drawn at random and never indicated:

    translate dog :  ->  the dog  |  le chien  |  der hund

so the data has three modes and K = 3 hypotheses can each take one. Two bases, both a tiny Llama (2 layers, width
64) with a word-level tokenizer:
  pretrained  first trained (all weights) on the same words with the language given ("translate dog to french :"),
              so it knows every word, as a real pretrained model does, and only the choice of language is left;
  random      random weights (std 0.02, transformers' default), as a user's tiny random Qwen2: the adapters must
              learn everything.
  smollm2     (--smollm2 FOLDER) the model of the docs' command itself, SmolLM2-135M-Instruct: minutes a run on CPU.

Per setting, over the seeds (seed s: the base's weights and pretraining, the data set's draws, and the training seed:
adapter initialisation, data order, tie draws): the final logged
win rates (win_rate_h{k} of train_log.json, sorted, mean over seeds), the runs where one hypothesis won more than
95% (collapsed) or one won less than 1% (idle: MCLTrainer's collapse warning), the runs where the three languages
went to three different hypotheses each winning at least 90% of its language's prompts (split, from the trained
hypotheses' NLLs on the training prompts) and the oracle NLL there (mean over prompts of min_k NLL, nats/token).

    python -m benchmarks.studies.default_settings --seeds 5   # both bases, every setting (about 15 min, 1 thread)
    python -m benchmarks.studies.default_settings --bases pretrained --settings "wta, random" --hypotheses 5

The results are in docs/guide/scores.md ("Default settings that specialise").
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

# word -> (French, German); the article carries the language from the first target token on
WORDS = {"dog": ("chien", "hund"), "cat": ("chat", "katze"), "house": ("maison", "haus"), "tree": ("arbre", "baum"),
         "car": ("voiture", "auto"), "book": ("livre", "buch"), "water": ("eau", "wasser"), "bread": ("pain", "brot"),
         "sun": ("soleil", "sonne"), "moon": ("lune", "mond"), "fish": ("poisson", "fisch"),
         "bird": ("oiseau", "vogel"), "door": ("porte", "tuer"), "hand": ("main", "hand_de"),
         "road": ("route", "strasse"), "milk": ("lait", "milch")}
LANGUAGES, ARTICLES = ("english", "french", "german"), ("the", "le", "der")

# name -> the MCLConfig fields that make the setting (every field the defaults could change is given)
SETTINGS = {
    "wta, lowest (the paper's)": {"loss": "wta", "tie_break": "lowest"},
    "wta, random": {"loss": "wta", "tie_break": "random"},
    "relaxed 0.05, lowest": {"loss": "relaxed", "epsilon": 0.05, "tie_break": "lowest"},
    "relaxed 0.05, random": {"loss": "relaxed", "epsilon": 0.05, "tie_break": "random"},
    "annealed tau0 1 (rho 0.999)": {"loss": "annealed", "temperature0": 1.0, "temperature_decay": 0.999,
                                    "temperature_min": 1e-6, "tie_break": "lowest"},
    "annealed tau0 1 (auto)": {"loss": "annealed", "temperature0": 1.0, "temperature_decay": "auto",
                               "temperature_min": 1e-6, "tie_break": "lowest"},
}
SETTINGS = {name: {"dropout": 0.0, **fields} for name, fields in SETTINGS.items()} | {
    f"{name}, dropout 0.1": {**SETTINGS[name], "dropout": 0.1} for name in
    ("wta, lowest (the paper's)", "wta, random", "relaxed 0.05, lowest", "relaxed 0.05, random")}


def word_tokenizer():
    """A whitespace word-level tokenizer over the task's words, with <pad>, <s>, </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "translate", "to", ":", *LANGUAGES, *ARTICLES]
    words += [word for english, (french, german) in WORDS.items() for word in (english, french, german)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(dict.fromkeys(words))}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def target(english: str, language: int) -> str:
    return f"{ARTICLES[language]} {(english, *WORDS[english])[language]}"


def ambiguous_task(folder: str | Path, pretrain_steps: int = 300, examples: int = 200, seed: int = 0,
                   model: str | Path | None = None) -> tuple[Path, Path, list[int]]:
    """(model folder, train.jsonl, the language of each example) in ``folder``: a tiny Llama with its tokenizer,
    first trained for ``pretrain_steps`` full-batch steps on every word with its language given (0: random
    weights), or the model folder ``model`` as it is; and ``examples`` prompts whose target language is drawn at
    random and not given."""
    folder = Path(folder)
    base = Path(model) if model is not None else build_base(folder / "base", pretrain_steps, seed)
    draw = random.Random(seed)
    rows = []
    for _ in range(examples):
        english, language = draw.choice(list(WORDS)), draw.randrange(3)
        rows.append({"prompt": f"translate {english} :", "target": target(english, language), "language": language})
    folder.mkdir(parents=True, exist_ok=True)
    train_file = folder / "train.jsonl"
    train_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return base, train_file, [row["language"] for row in rows]


def build_base(folder: Path, pretrain_steps: int, seed: int) -> Path:
    """The tiny Llama and its word tokenizer, saved in ``folder``; trained first on the unambiguous pairs."""
    from benchmarks.tiny import tiny_llama
    from loramcl.data.prompts import collate, encode_pairs

    tokenizer = word_tokenizer()
    torch.manual_seed(seed)
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2)
    if pretrain_steps:
        pairs = [(f"translate {english} to {LANGUAGES[language]} :", target(english, language))
                 for english in WORDS for language in range(3)]
        batch = collate(encode_pairs(tokenizer, *zip(*pairs, strict=True)), tokenizer.pad_token_id)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(pretrain_steps):
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def final_win_rates(run: str | Path) -> list[float]:
    """win_rate_h{k} of the last training log of a `loramcl train` run."""
    last = [entry for entry in json.loads((Path(run) / "train_log.json").read_text()) if "loss" in entry][-1]
    return [last[f"win_rate_h{k}"] for k in range(sum(key.startswith("win_rate_h") for key in last))]


def languages_won(base: Path, run: Path, train_file: Path, languages: list[int]) -> tuple[list[list[int]], float]:
    """([language][k] prompts of that language that hypothesis k wins, the oracle NLL), on the training prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loramcl.data.prompts import collate, encode_pairs, pad_token_id
    from loramcl.models.mcl import load_mcl_model

    tokenizer = AutoTokenizer.from_pretrained(base)
    rows = [json.loads(line) for line in train_file.read_text().splitlines()]
    batch = collate(encode_pairs(tokenizer, [r["prompt"] for r in rows], [r["target"] for r in rows]),
                    pad_token_id(tokenizer))
    model = load_mcl_model(AutoModelForCausalLM.from_pretrained(base), run).eval()
    with torch.no_grad():
        nll = model(**batch).nll  # [N, K]
    winners, k = nll.argmin(dim=1).tolist(), nll.shape[1]
    table = [[sum(1 for w, lang in zip(winners, languages, strict=True) if w == h and lang == m) for h in range(k)]
             for m in range(3)]
    return table, nll.min(dim=1).values.mean().item()


def is_split(table: list[list[int]], purity: float = 0.9) -> bool:
    """Each language won by its own hypothesis, which wins at least ``purity`` of that language's prompts."""
    owners = [max(range(len(row)), key=row.__getitem__) for row in table]
    return len(set(owners)) == len(table) and all(row[h] >= purity * sum(row) for row, h in zip(table, owners,
                                                                                                  strict=True))


def train_setting(base: Path, train_file: Path, out: Path, fields: dict, hypotheses: int, seed: int,
                  steps: int) -> None:
    from loramcl.mcl.config import MCLConfig
    from loramcl.training import fit as finetune
    from loramcl.training.config import DataConfig, TrainConfig

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        finetune.train(model=str(base), out=str(out), data=DataConfig(train_file=str(train_file)),
                       mcl=MCLConfig(num_hypotheses=hypotheses, target_modules=["q_proj", "v_proj"], **fields),
                       training=TrainConfig(steps=steps, seed=seed, save_every=0), threads=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--hypotheses", type=int, default=3)
    parser.add_argument("--bases", nargs="+", default=["pretrained", "random"],
                        choices=["pretrained", "random", "smollm2"])
    parser.add_argument("--smollm2", help="base 'smollm2': a SmolLM2-135M-Instruct folder (loramcl convert-smollm2)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers.utils import logging

    logging.set_verbosity_error()
    results = []
    with tempfile.TemporaryDirectory() as work:
        for base_kind in args.bases:
            tasks = [ambiguous_task(Path(work) / f"{base_kind}-{seed}", seed=seed,  # a base and data set per seed
                                    pretrain_steps=300 if base_kind == "pretrained" else 0,
                                    model=args.smollm2 if base_kind == "smollm2" else None)
                     for seed in range(args.seeds)]
            for name in args.settings:
                runs = []
                for seed, (base, train_file, languages) in enumerate(tasks):
                    out = Path(work) / f"{base_kind}-{seed}" / f"run-{len(results)}"
                    started = time.perf_counter()
                    train_setting(base, train_file, out, SETTINGS[name], args.hypotheses, seed, args.steps)
                    table, oracle = languages_won(base, out, train_file, languages)
                    verdict = json.loads((out / "run.json").read_text())["specialisation"]
                    runs.append({"seed": seed, "win_rates": final_win_rates(out), "languages": table,
                                 "oracle_nll": oracle, "verdict": verdict, "seconds": time.perf_counter() - started})
                results.append({"base": base_kind, "setting": name, "fields": SETTINGS[name], "runs": runs})
                print(row(results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


def row(result: dict) -> str:
    """One markdown table line: base | setting | win rates | collapsed | idle | split | oracle NLL | the trainer's
    verdicts (split / not split / partly collapsed: MCLTrainer's own, from its training logs alone)."""
    runs = result["runs"]
    shares = [sorted(r["win_rates"], reverse=True) for r in runs]
    mean = " / ".join(f"{statistics.mean(column):.2f}" for column in zip(*shares, strict=True))
    collapsed = sum(max(s) > 0.95 for s in shares)
    idle = sum(min(s) < 0.01 for s in shares)
    split = sum(is_split(r["languages"]) for r in runs)
    oracle = statistics.mean(r["oracle_nll"] for r in runs)
    n = len(runs)
    verdicts = " / ".join(str(sum(r["verdict"]["kind"] == kind for r in runs))
                          for kind in ("split", "not split", "partly collapsed"))
    return (f"| {result['base']} | {result['setting']} | {mean} | {collapsed}/{n} | {idle}/{n} | {split}/{n} | "
            f"{oracle:.3f} | {verdicts} |")


if __name__ == "__main__":
    main()
