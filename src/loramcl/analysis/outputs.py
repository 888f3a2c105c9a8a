"""Do the hypotheses write different things? The output verdict: read from each hypothesis's greedy answers to a few
prompts, where the specialisation verdict (``training.specialisation``) reads NLLs only (docs/guide/scores.md, "Do
the hypotheses write different things").

Plain Python data in, plain data out (no torch): ``answers[i][k]`` is hypothesis k's answer to prompt i,
``references[i]`` the right answers of prompt i (optional), ``modes[i][r]`` the mode (e.g. the language) of
reference r of prompt i (optional), ``prompts[i]`` the text of prompt i (optional: then an answer that copies its
prompt is told apart, as an undertrained translation model's answers often are). The trainer's ``OutputVerdictCallback`` calls it on the answers it decodes; a
study calls it post hoc on its decoded candidates.

Answers are compared after SQuAD's normalisation (``metrics.short_answers.normalise_answer``: case, punctuation,
articles, white space). Quality is sacrebleu's sentence chrF (0-100) of an answer against each reference, the best
one kept; exact match after the same normalisation is the second number. An answer's mode is the mode of the
reference it is closest to by chrF when it is that close (NEAR: a near-right answer), otherwise the mode whose
references its character n-grams resemble most (``analysis.language.LanguageIdentifier`` fit on every reference given,
labelled by its mode; the closest reference's mode when the references name one mode only, none when it shares no
character n-gram with any), or, with the prompts, "prompt" when it copies its prompt (its words, normalised, are words
of the prompt, and it is no reference): the defaults study's hypotheses mostly copied the English source after 60
steps, which chrF would call the closest language.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from itertools import combinations

from loramcl.metrics.short_answers import normalise_answer

# Two hypotheses "write the same" when half or more of the hypothesis pairs give the same normalised answer to a
# prompt, on average: K hypotheses that agree that often return on most prompts fewer distinct answers than K, for K
# times the decoding of one; beam search of one LoRA returns K different beams at that budget (issue 64: a run called
# "split" by its NLLs wrote one language in every hypothesis and covered fewer languages than beam search).
SAME_RATE = 0.5
# "Split by mode": each hypothesis writes its own mode, at least 70% of its answers closest to a reference of that
# mode: well above what a hypothesis writing every mode gets (1/M of M equally frequent modes: 0.5 for two, 0.33
# for three), and below the 90% of a clean split, which the bilingual benchmark's check asks of the NLL winners.
MODE_PURITY = 0.7
# The fewest training examples per hypothesis before a verdict is given (K = 3: 300). The defaults study (issue 53,
# 16 examples a step) saw the split gap pass 10% of training's gain after 80 to 640 examples, the bilingual K = 2
# runs split by language after 800 to 1,600; before about 100 examples each hypothesis has won only a few dozen to
# learn from, and its answers are the base model's (issue 64: a verdict after 4 steps of 2 clips, 8 examples).
MIN_EXAMPLES_PER_HYPOTHESIS = 100
# An answer at least this close to a reference (sentence chrF) is of that reference's mode; a farther one is of the
# mode whose references it resembles. By the closest reference alone, an imperfect French answer to a spoken English
# message is English (it keeps the message's names and technical words): on the study's spoken translation runs that
# split by language (one hypothesis 85-89% French by the recipe's language identifier), every hypothesis was "en".
NEAR = 50.0
NO_VERDICT = "no verdict"
NO_MODE = "none"  # the mode of an answer sharing no character n-gram with any reference
COPY = "prompt"  # the mode of an answer that copies its prompt (``prompts`` given)
QUALITY = "chrf"  # what best_of_k / mean_over_k measure: sentence chrF (0-100), the best over the references
# What to try when they write the same, beside the changes the specialisation verdict names for the run's settings
# (``training.specialisation.remedies``): issue 63's options, each off by default (docs/guide/scores.md)
OPTIONS = ("issue 63's options (docs/guide/scores.md): a shared adapter every example trains, --mcl.shared_r 8, so "
           "the hypotheses need not each relearn the task; balanced assignment, --mcl.balance bias; a staged split, "
           "--mcl.split_after 0.3")
REMEDIES = ("Try: the changes the specialisation verdict names (relaxed or annealed WTA, more steps, a higher "
            "learning rate), or " + OPTIONS + ".")


@dataclass
class OutputVerdict:
    """What the hypotheses' answers say: ``kind`` 'differ', 'write the same', 'split by mode' (modes given), or
    'no verdict' (NO_VERDICT) with its ``reason``; the numbers it rests on (None where not measured), and ``line``,
    the sentence the trainer logs."""

    kind: str
    line: str
    prompts: int
    hypotheses: int
    distinct: float | None = None  # mean over prompts of the distinct normalised answers among the K
    same_rate: float | None = None  # mean over prompts of the share of hypothesis pairs giving the same answer
    quality: str | None = None  # QUALITY where references were given
    best_of_k: float | None = None  # mean over prompts of the best hypothesis's chrF
    mean_over_k: float | None = None  # mean over prompts and hypotheses of chrF
    exact_best_of_k: float | None = None  # share of prompts where some hypothesis is exactly right
    exact_mean_over_k: float | None = None  # share of answers exactly right
    copy_rate: float | None = None  # share of answers that copy their prompt (``prompts`` given)
    modes: list[str] | None = None  # the table's columns (COPY, then NO_MODE last, when some answer is so)
    mode_table: list[list[int]] | None = None  # [K][M] answers of hypothesis k closest to mode m
    majority: list[str] | None = None  # [K] each hypothesis's most written mode
    purity: list[float] | None = None  # [K] the share of its answers in that mode
    reason: str | None = None  # why there is no verdict (NO_VERDICT only)

    def to_dict(self) -> dict:
        """As run.json holds it: the fields measured (an abstention: kind, reason, line and any numbers)."""
        return {name: value for name, value in asdict(self).items() if value is not None}


def output_verdict(answers: Sequence[Sequence[str]], references: Sequence[Sequence[str]] | None = None,
                   modes: Sequence[Sequence[str]] | None = None, examples_seen: int | None = None,
                   min_examples: int | None = None, remedies: str | None = None,
                   prompts: Sequence[str] | None = None, classifier=None) -> OutputVerdict:
    """The verdict on ``answers`` [N][K] (hypothesis k's answer to prompt i), with ``references`` [N][R_i] and their
    ``modes`` [N][R_i] when known, and the ``prompts`` [N] (their text: answers that copy them are counted).
    ``examples_seen``: the training examples the hypotheses had seen (None: not checked); under ``min_examples``
    (default MIN_EXAMPLES_PER_HYPOTHESIS x K) the numbers are given, no verdict.
    ``remedies``: what the line says to try when they write the same (default REMEDIES). ``classifier``: what
    names the mode of an answer far from its references (``predict(texts) -> modes``, e.g. a ``LanguageIdentifier``
    fit on more text of each mode than the references given; default one fit on the references, ``mode_classifier``)."""
    answers = [list(row) for row in answers]
    k = len(answers[0]) if answers else 0
    _check(answers, references, modes, prompts)
    if k < 2:
        return _abstained(f"one hypothesis (K = {k}), nothing to compare" if answers else "no prompt was decoded",
                          len(answers), k)
    normalised = [[normalise_answer(a) for a in row] for row in answers]
    pairs = list(combinations(range(k), 2))
    found = OutputVerdict("", "", len(answers), k,
                          distinct=_mean([len(set(row)) for row in normalised]),
                          same_rate=_mean([_mean([row[a] == row[b] for a, b in pairs]) for row in normalised]))
    numbers = (f"{found.distinct:.2f} distinct answers of {k} per prompt, the same answer from "
               f"{100 * found.same_rate:.0f}% of hypothesis pairs over {len(answers)} prompts")
    copied = [[False] * k for _ in answers]
    if prompts is not None:
        copied = [[_copies(a, f" {normalise_answer(prompt)} ", {normalise_answer(r) for r in refs}) for a in row]
                  for row, prompt, refs in zip(normalised, prompts, references or [[]] * len(answers), strict=True)]
        found.copy_rate = _mean([_mean(row) for row in copied])
        numbers += f"; {100 * found.copy_rate:.0f}% of the answers copy their prompt"
    if references is not None:
        scores = [[[_chrf(a, ref) for ref in refs] for a in row] for row, refs in zip(answers, references, strict=True)]
        best = [[max(s) for s in row] for row in scores]  # [N][K]
        exact = [[float(a in {normalise_answer(r) for r in refs}) for a in row]
                 for row, refs in zip(normalised, references, strict=True)]
        found.quality = QUALITY
        found.best_of_k, found.mean_over_k = _mean([max(r) for r in best]), _mean([_mean(r) for r in best])
        found.exact_best_of_k = _mean([max(r) for r in exact])
        found.exact_mean_over_k = _mean([_mean(r) for r in exact])
        numbers += (f"; chrF best of {k} {found.best_of_k:.1f}, mean over {k} {found.mean_over_k:.1f}; exact match "
                    f"best of {k} {100 * found.exact_best_of_k:.0f}%, mean over {k} "
                    f"{100 * found.exact_mean_over_k:.0f}%")
        if modes is not None:
            classifier = classifier if classifier is not None else mode_classifier(references, modes)
            numbers += "; " + _mode_table(found, answers, scores, modes, copied, classifier)
    minimum = min_examples if min_examples is not None else MIN_EXAMPLES_PER_HYPOTHESIS * k
    if examples_seen is not None and examples_seen < minimum:
        found.kind, found.reason = NO_VERDICT, (f"{examples_seen} training examples seen, fewer than {minimum} "
                                               f"({MIN_EXAMPLES_PER_HYPOTHESIS} per hypothesis): before that the "
                                               "hypotheses' answers are mostly the base model's")
        found.line = f"outputs: no verdict: {found.reason}. {numbers[0].upper() + numbers[1:]}."
        return found
    owned = found.majority is not None and _split_by_mode(found)
    if owned:
        found.kind, text = "split by mode", "split by mode: " + ", ".join(
            f"h{i} writes {mode} ({100 * p:.0f}%)" for i, (mode, p) in enumerate(zip(found.majority, found.purity)))
    elif found.same_rate >= SAME_RATE:
        found.kind, text = "write the same", (f"the hypotheses write the same: {100 * found.same_rate:.0f}% of "
                                              f"hypothesis pairs gave one answer ({100 * SAME_RATE:g}% or more: "
                                              "SAME_RATE)")
    else:
        found.kind, text = "differ", "the hypotheses write different answers"
    if found.majority is not None and not owned:
        most = ", ".join(f"h{i} {m} ({100 * p:.0f}%)" for i, (m, p) in enumerate(zip(found.majority, found.purity)))
        text += (f"; not split by mode: most written {most} (a split needs a mode of its own per hypothesis, at "
                 f"{100 * MODE_PURITY:g}% of its answers or more)")
    found.line = f"outputs: {text}. {numbers[0].upper() + numbers[1:]}."
    if found.kind == "write the same":
        found.line += " " + (remedies or REMEDIES)
    return found


def _split_by_mode(found: OutputVerdict) -> bool:
    """Each hypothesis owns a mode: their majority modes cover min(K, M) modes (all differ when K <= M; with more
    hypotheses than modes, every mode has one), none is NO_MODE or COPY, and each has purity MODE_PURITY or more."""
    named = [m for m in found.modes if m not in (NO_MODE, COPY)]
    return (not {NO_MODE, COPY} & set(found.majority) and len(set(found.majority)) == min(found.hypotheses, len(named))
            and min(found.purity) >= MODE_PURITY)


def _copies(answer: str, prompt: str, references: set[str]) -> bool:
    """Whether a normalised ``answer`` copies ``prompt`` (normalised, between spaces): its words are a run of the
    prompt's words, and it is none of the normalised ``references`` (a right answer found in the prompt is no copy)."""
    return bool(answer) and f" {answer} " in prompt and answer not in references


def mode_classifier(references: Sequence[Sequence[str]], modes: Sequence[Sequence[str]]):
    """A character n-gram classifier (``analysis.language.LanguageIdentifier``) fit on the ``references`` [N][R_i]
    labelled by their ``modes``, or None when they name fewer than two modes (or the identifier's reserved label)."""
    texts = [(r, str(m)) for refs, row in zip(references, modes, strict=True) for r, m in zip(refs, row, strict=True)
             if r.strip()]
    from loramcl.analysis.language import EMPTY, LanguageIdentifier

    labels = {m for _, m in texts}
    if len(labels) < 2 or EMPTY in labels:
        return None
    return LanguageIdentifier().fit([t for t, _ in texts], [m for _, m in texts])


def _mode_table(found: OutputVerdict, answers: list, scores: list, modes: Sequence[Sequence[str]], copied: list,
                classifier) -> str:
    """Fill ``found``'s hypothesis x mode table, majority modes and purity from each answer's mode (``_answer_modes``;
    an answer ``copied`` [N][K] from its prompt: COPY); the table as text."""
    written = [Counter() for _ in range(found.hypotheses)]  # [K] mode -> answers
    for row, row_copied in zip(_answer_modes(answers, scores, modes, classifier), copied, strict=True):
        for k, mode in enumerate(row):
            written[k][COPY if row_copied[k] else mode] += 1
    names = sorted({str(m) for row in modes for m in row})
    names += sorted({m for c in written for m in c} - set(names) - {COPY, NO_MODE})  # a given classifier's own modes
    names += [m for m in (COPY, NO_MODE) if any(c[m] for c in written) and m not in names]
    found.modes = names
    found.mode_table = [[c[m] for m in names] for c in written]
    found.majority = [max(names, key=lambda m, c=c: (c[m], m not in (NO_MODE, COPY))) for c in written]
    found.purity = [c[m] / found.prompts for c, m in zip(written, found.majority, strict=True)]
    return "modes written " + ", ".join(
        f"h{k} " + " / ".join(f"{m} {n}" for m, n in zip(names, row, strict=True) if n)
        for k, row in enumerate(found.mode_table))


def _answer_modes(answers: list, scores: list, modes: Sequence[Sequence[str]], classifier) -> list[list[str]]:
    """Each answer's mode [N][K]: its closest reference's (chrF ``scores`` [N][K][R_i]) when within NEAR, else the
    mode ``classifier`` gives it; without one, the closest reference's; NO_MODE for an empty answer, or one sharing
    no n-gram with any reference when there is no classifier."""
    found = []
    for row, row_scores, row_modes in zip(answers, scores, modes, strict=True):
        predicted = classifier.predict(row) if classifier is not None else [None] * len(row)
        found.append([])
        for answer, per_reference, guess in zip(row, row_scores, predicted, strict=True):
            best = max(range(len(per_reference)), key=per_reference.__getitem__)  # the first of equals
            if not answer.strip():
                found[-1].append(NO_MODE)
            elif per_reference[best] >= NEAR or guess is None:
                found[-1].append(str(row_modes[best]) if per_reference[best] > 0 else NO_MODE)
            else:
                found[-1].append(guess)
    return found


def _abstained(reason: str, prompts: int, k: int) -> OutputVerdict:
    return OutputVerdict(NO_VERDICT, f"outputs: no verdict: {reason}.", prompts, k, reason=reason)


def _check(answers: list, references, modes, prompts) -> None:
    k = len(answers[0]) if answers else 0
    if prompts is not None and (len(prompts) != len(answers) or not all(isinstance(p, str) for p in prompts)):
        raise ValueError(f"prompts must hold one string per prompt ({len(answers)}), got {prompts!r}")
    for i, row in enumerate(answers):
        if len(row) != k or not all(isinstance(a, str) for a in row):
            raise ValueError(f"answers[{i}] must hold {k} strings (one per hypothesis, as answers[0]), got {row!r}")
    for name, given in (("references", references), ("modes", modes)):
        if given is not None and len(given) != len(answers):
            raise ValueError(f"{name} must have one list per prompt ({len(answers)}), got {len(given)}")
    if modes is not None and references is None:
        raise ValueError("modes name the mode of each reference: give the references too")
    for i, refs in enumerate(references or []):
        if not refs or not all(isinstance(r, str) for r in refs):
            raise ValueError(f"references[{i}] must be a non-empty list of strings, got {refs!r}")
        if modes is not None and len(modes[i]) != len(refs):
            raise ValueError(f"modes[{i}] must name the mode of each of the {len(refs)} references, got {modes[i]!r}")


def _chrf(answer: str, reference: str) -> float:
    return _chrf_scorer().sentence_score(answer, [reference]).score


@lru_cache(maxsize=1)
def _chrf_scorer():
    from sacrebleu.metrics import CHRF

    return CHRF()  # character 6-grams, beta 2: metrics.translation.chrf_sentence's


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


__all__ = ["COPY", "MIN_EXAMPLES_PER_HYPOTHESIS", "MODE_PURITY", "NEAR", "NO_VERDICT", "OPTIONS", "REMEDIES",
           "SAME_RATE", "OutputVerdict", "mode_classifier", "output_verdict"]
