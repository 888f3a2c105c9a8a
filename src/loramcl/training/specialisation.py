"""Does it split? What MCLTrainer logs about the hypotheses' specialisation, its collapse warning, and the verdict at
the end of a run (docs/guide/scores.md, "How much training until the hypotheses split").

At every training log, from the per-example NLLs nll[B, K] of the steps since the previous log: each hypothesis's
share of the wins (``win_rate_h{k}``), its mean training NLL (``nll_h{k}``) and the split gap (``split_gap``):
mean_k nll_h{k} minus the oracle NLL mean_b min_k nll[b, k], in nats per token. Identical hypotheses have a gap of 0
(each models the whole data); hypotheses that split are each poor on the others' examples, so the gap grows. It costs
one sum per step (no host read), and it is the measure docs/experiments/bilingual.md used to see when the languages
split (0.06 before, 0.36 to 0.57 after). The first log also holds ``initial_nll``, the mean NLL of the first step's
examples (the base model's, LoRA's B being 0): the gap is judged against what training gained, initial_nll minus the
oracle NLL, since a frozen base's NLL sets the scale (a tiny random base stays near 4 nats whatever it learns).
"""

from __future__ import annotations

import collections
from dataclasses import asdict, dataclass

import torch

from loramcl.mcl.config import AUTO_EPSILON, MCLConfig

SPLIT_GAP = 0.10  # a split gap under 10% of the NLL training gained: the hypotheses are nearly one model (not split)
BEHIND = 0.5  # a rarely winning hypothesis that kept less than half the others' gain has fallen behind them
LOW_SHARE = 0.25  # "rarely winning": under a quarter of a fair share, 1 / (4K) (K = 3: 8.3%)
# The fewest optimizer steps a verdict is given on: it compares the hypotheses over the run's second half with its
# first step, and under 4 steps that half is one step taken after one or two updates (a 1-step run's only log is the
# untrained first step itself, which read as "collapsed onto one")
MIN_VERDICT_STEPS = 4
NO_VERDICT = "no verdict"  # the kind of a Verdict that abstains, with its reason


@dataclass
class Record:
    """One training log: the optimizer steps it covers (first, last], each hypothesis's win share and mean NLL."""

    first: int
    last: int
    shares: list[float]  # [K]
    nll: list[float] | None  # [K]; None in logs written before loramcl logged it
    gap: float | None
    initial: float | None = None  # the first step's mean NLL (``initial_nll`` of the run's first log)


def log_values(wins: torch.Tensor, nll_sum: torch.Tensor, oracle_sum: torch.Tensor,
               initial: torch.Tensor | None = None) -> dict[str, float]:
    """The log of the steps since the previous one, from their summed wins [K], per-hypothesis NLLs [K] and oracle
    NLL (one host read): ``win_rate_h{k}``, and for K >= 2 ``nll_h{k}``, ``split_gap`` and, given the first step's
    [NLL sum, examples] ``initial``, ``initial_nll``."""
    wins, nll_sum, oracle_sum = wins.tolist(), nll_sum.tolist(), float(oracle_sum)
    total = sum(wins)
    if not total:
        return {}
    logs = {f"win_rate_h{k}": count / total for k, count in enumerate(wins)}
    if len(wins) > 1:
        nll = [value / total for value in nll_sum]
        logs |= {f"nll_h{k}": value for k, value in enumerate(nll)}
        logs["split_gap"] = sum(nll) / len(nll) - oracle_sum / total
        if initial is not None and initial[1] > 0:
            logs["initial_nll"] = float(initial[0] / initial[1])
    return logs


def records_of(log_history: list[dict], num_hypotheses: int) -> list[Record]:
    """The training logs of ``log_history`` (Trainer's, as train_log.json holds it) as records."""
    records, last = [], 0
    initial = next((log["initial_nll"] for log in log_history if "initial_nll" in log), None)
    for log in log_history:
        if "win_rate_h0" not in log or "step" not in log:
            continue
        shares = [log.get(f"win_rate_h{k}", 0.0) for k in range(num_hypotheses)]
        nll = [log[f"nll_h{k}"] for k in range(num_hypotheses)] if "nll_h0" in log else None
        records.append(Record(last, log["step"], shares, nll, log.get("split_gap"), initial))
        last = log["step"]
    return records


def window(records: list[Record], steps: int) -> Record | None:
    """The records of the last ``steps`` optimizer steps (at least the last record) merged, each weighted by the
    steps it covers."""
    if not records:
        return None
    end = records[-1].last
    recent = [r for r in records if r.last > end - steps] or records[-1:]
    weights = [max(r.last - r.first, 1) for r in recent]
    total = sum(weights)

    def mean(values):
        return sum(w * v for w, v in zip(weights, values, strict=True)) / total

    k = len(recent[0].shares)
    shares = [mean([r.shares[i] for r in recent]) for i in range(k)]
    known = all(r.nll is not None and r.gap is not None for r in recent)
    nll = [mean([r.nll[i] for r in recent]) for i in range(k)] if known else None
    gap = mean([r.gap for r in recent]) if known else None
    return Record(recent[0].first, end, shares, nll, gap, records[0].initial)


def fallen_behind(merged: Record, idle_share: float) -> list[int]:
    """The hypotheses of ``merged`` that have stopped taking part: each won less than ``idle_share`` of the examples,
    or less than a quarter of a fair share while keeping less than half (BEHIND) of the others' gain in training NLL
    since the first step (its NLL stays near the base model's while theirs falls)."""
    k = len(merged.shares)
    behind = []
    for i, share in enumerate(merged.shares):
        lagging = False
        if merged.nll is not None and merged.initial is not None:
            others = sum(v for j, v in enumerate(merged.nll) if j != i) / (k - 1)
            gained = merged.initial - others
            lagging = gained > 0 and merged.nll[i] - others > BEHIND * gained
        if share < idle_share or (share < LOW_SHARE / k and lagging):
            behind.append(i)
    return behind


def since(records: list[Record], hypothesis: int) -> int:
    """The first step of the trailing run of logs where ``hypothesis`` won less than a quarter of a fair share."""
    first = records[-1].first
    for record in reversed(records):
        if record.shares[hypothesis] >= LOW_SHARE / len(record.shares):
            break
        first = record.first
    return first


def remedies(config: MCLConfig, last_temperature: float | None, kind: str = "not split") -> str:
    """The changes to try on a run that did not split (``kind``: 'not split' or 'partly collapsed'), most supported
    first, from the defaults study (issue 53: three tasks, 60 steps of 16 on SmolLM2-135M, docs/benchmarks.md "Which
    defaults split on a first try") and our longer runs."""
    tries = []
    if config.tie_break == "lowest":
        tries.append("--mcl.tie_break random (with every tie at initialisation going to h0, 9 of 10 short runs "
                     "collapsed on a random base against 0 of 10, docs/guide/scores.md)")
    if config.loss == "wta":
        tries.append(f"relaxed WTA, --mcl.loss relaxed (epsilon auto: {AUTO_EPSILON:g}; in the defaults study vanilla "
                     "WTA left a hypothesis idle in 4 of 6 runs, relaxed WTA in none: a losing hypothesis keeps "
                     "learning from its epsilon share)")
    if config.loss == "relaxed" and kind == "partly collapsed":
        tries.append(f"a larger epsilon than {config.relaxed_epsilon:g} (the paper used 0.0005 to 0.1)")
    elif config.loss == "relaxed" and config.relaxed_epsilon > AUTO_EPSILON:
        tries.append(f"a smaller epsilon than {config.relaxed_epsilon:g}, e.g. --mcl.epsilon {AUTO_EPSILON:g} (in the "
                     "defaults study the trainer found relaxed WTA split in 3 of 6 runs at 0.05, 2 of 6 at 0.1: the "
                     "losers' share keeps the hypotheses close)")
    if config.loss == "annealed" and config.temperature_decay != "auto" and last_temperature is not None:
        tries.append(f"--mcl.temperature_decay auto (tau was still {last_temperature:.3g} at the last step: the "
                     "assignment never left the soft regime)")
    elif config.loss != "annealed":
        tries.append("annealed MCL, --mcl.loss annealed (temperature_decay auto fits the run; its split gap grew the "
                     "most once tau fell, but the trainer found 3 of its 6 short runs collapsed or partly collapsed)")
    tries.append("more steps: the trainer's split gap passed 10% within 5-40 steps of 16 examples, but a split by "
                 "mode took longer: our K = 2 bilingual runs split by language between steps 50 and 100 "
                 "(docs/experiments/bilingual.md), and at 60 steps 1 run of 24 split every mode of its task")
    tries.append("a higher learning rate while the training loss still falls (the defaults study: 2e-3 for 60 "
                 "steps; hypotheses split only once they have learned the task), but watch the split: on our "
                 "bilingual task at 200 steps 4 and 8 times 2e-3 lowered the validation loss and split the languages "
                 "less (docs/benchmarks.md)")
    return "Try: " + "; ".join(tries) + "."


@dataclass
class Verdict:
    """Whether the hypotheses split over the run's last steps: ``kind`` 'split', 'not split' or 'partly collapsed',
    the numbers it rests on, and ``line``, the sentence MCLTrainer logs; or 'no verdict' (NO_VERDICT) with the
    ``reason`` it abstains (K = 1, no training log, too few steps) and no numbers."""

    kind: str
    steps: list[int] | None  # [first, last]: the window the numbers are over
    win_shares: list[float] | None
    nll: list[float] | None
    split_gap: float | None
    oracle_nll: float | None
    hypotheses: list[int] | None  # the ones that fell behind ('partly collapsed', or all but one when collapsed)
    since_step: int | None
    line: str
    reason: str | None = None  # why there is no verdict (NO_VERDICT only)

    def to_dict(self) -> dict:
        """As run.json and train_log.json hold it: an abstention is {"kind": "no verdict", "reason", "line"}."""
        if self.kind == NO_VERDICT:
            return {"kind": self.kind, "reason": self.reason, "line": self.line}
        return {name: value for name, value in asdict(self).items() if name != "reason"}

    @classmethod
    def abstained(cls, reason: str) -> Verdict:
        return cls(NO_VERDICT, None, None, None, None, None, None, None, f"specialisation: no verdict: {reason}.",
                   reason)


def abstention(records: list[Record], num_hypotheses: int, steps: int | None = None,
               logging_steps: int | None = None) -> str | None:
    """Why no verdict can be given on ``records`` (a run of ``steps`` optimizer steps logging every
    ``logging_steps``), or None when one can."""
    if num_hypotheses < 2:
        return f"one hypothesis (K = {num_hypotheses}), nothing to split"
    steps = records[-1].last if steps is None and records else steps
    if not records:
        told = (f": logging_steps {logging_steps} is more than the run's {steps} steps, set --training.logging_steps "
                f"{steps} or less for one" if logging_steps and steps is not None and logging_steps > steps else "")
        return f"no training step was logged, and the verdict reads the training logs{told}"
    if steps < MIN_VERDICT_STEPS:
        return (f"the run took {steps} optimizer step{'s' if steps != 1 else ''}, and a verdict needs at least "
                f"{MIN_VERDICT_STEPS} (it compares the hypotheses over the run's second half with its first step)")
    return None


def verdict(records: list[Record], config: MCLConfig, window_steps: int, idle_share: float,
            last_temperature: float | None = None, steps: int | None = None, logging_steps: int | None = None,
            learning_rate_shortfall: str | None = None) -> Verdict:
    """The verdict on the logs ``records`` of a run with ``config`` (``steps`` optimizer steps, default the last
    log's, logged every ``logging_steps``) over its last ``window_steps`` steps; an abstention (NO_VERDICT) for
    K = 1 (nothing to split), without a log or under MIN_VERDICT_STEPS. ``learning_rate_shortfall``
    (``schedule.warmup_shortfall``): the learning rate never reached its set value, which a verdict other than
    'split' then names instead of the changes to try."""
    k = config.num_hypotheses
    reason = abstention(records, k, steps, logging_steps)
    if reason is not None:
        return Verdict.abstained(reason)
    merged = window(records, window_steps)
    steps = [merged.first, merged.last]
    shares = ", ".join(f"h{i} {100 * s:.1f}%" for i, s in enumerate(merged.shares))
    numbers = f"win shares {shares}"
    oracle = gained = None
    if merged.nll is not None:
        oracle = sum(merged.nll) / k - merged.gap
        nll = ", ".join(f"h{i} {v:.3f}" for i, v in enumerate(merged.nll))
        numbers += f"; training NLL {nll}; oracle NLL {oracle:.3f}; split gap {merged.gap:.3f} nats per token"
        if merged.initial is not None:
            gained = merged.initial - oracle
            share = f"{100 * merged.gap / gained:.0f}% of the {gained:.3f} gained" if gained > 0 else "nothing gained"
            numbers += f" ({share} since the first step's NLL {merged.initial:.3f})"
    where = f"over steps {merged.first}-{merged.last}"
    behind = fallen_behind(merged, idle_share)
    first = None
    if len(behind) == k - 1:
        kind = "not split"
        leader = next(i for i in range(k) if i not in behind)
        first = min(since(records, i) for i in behind)
        text = (f"not split: h{leader} won {100 * merged.shares[leader]:.1f}% of the examples {where} (the others "
                f"since step {first}): the hypotheses collapsed onto one")
    elif behind:
        kind = "partly collapsed"
        first = min(since(records, i) for i in behind)
        named = ", ".join(f"h{i} (since step {since(records, i)})" for i in behind)
        text = (f"partly collapsed: {named} won under {100 * LOW_SHARE / k:.1f}% of the examples {where} with a "
                f"training NLL above the others' (a hypothesis on a rare mode looks the same: check its outputs)")
    elif gained is not None and gained <= 0:
        kind = "not split"
        text = f"not split: the oracle NLL {where} is no lower than the first step's: training has not learned yet"
    elif gained is not None and merged.gap < SPLIT_GAP * gained:
        kind = "not split"
        text = (f"not split: the split gap {where} is under {100 * SPLIT_GAP:g}% of what training gained: the "
                "hypotheses are still nearly one model of the whole data")
    else:
        kind = "split"
        text = f"split {where}"
    line = f"specialisation: {text}. {numbers[0].upper() + numbers[1:]}."
    if kind != "split" and learning_rate_shortfall:  # the run never trained at its rate: no method change to try yet
        line += (f" But {learning_rate_shortfall}: train at the rate set (--training.warmup_steps below "
                 "--training.steps) before changing the method.")
    elif kind != "split":
        line += " " + remedies(config, last_temperature, kind)
    return Verdict(kind, steps, merged.shares, merged.nll, merged.gap, oracle,
                   behind, first, line)


class CollapseWatch:
    """A warning (once) when a hypothesis has stopped taking part: it won less than ``share`` of the examples over
    the last ``window`` optimizer steps, or (sooner, over the last quarter of that window) less than a quarter of a
    fair share with a training NLL FAR_ABOVE the others' (a partial collapse: ``fallen_behind``)."""

    def __init__(self, window: int, share: float) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"collapse_window must be a number of steps >= 1, got {window!r}")
        if not 0.0 <= share < 1.0:
            raise ValueError(f"collapse_share must be in [0, 1), got {share!r}")
        self.window, self.share = window, share
        self._recent: collections.deque[Record] = collections.deque()
        self._since_step = 0  # where the first record starts
        self._initial: float | None = None  # initial_nll of the first log
        self._warned = False

    def observe(self, step: int, logs: dict, loss: str) -> str | None:
        """Record a training log (``log_values``) ending at ``step``; the warning to give, once, or None. ``loss``:
        the training loss's name, named in the warning."""
        if "win_rate_h0" not in logs:
            return None
        k = sum(1 for name in logs if name.startswith("win_rate_h"))
        first = self._recent[-1].last if self._recent else self._since_step
        nll = [logs[f"nll_h{i}"] for i in range(k)] if "nll_h0" in logs else None
        self._initial = logs.get("initial_nll", self._initial)
        self._recent.append(Record(first, step, [logs[f"win_rate_h{i}"] for i in range(k)], nll,
                                   logs.get("split_gap"), self._initial))
        while self._recent and self._recent[0].last <= step - self.window:
            self._recent.popleft()  # entirely before the window
        if self._warned or k < 2:
            return None
        covered = step - self._recent[0].first
        message = None
        if covered >= self.window:
            merged = window(list(self._recent), self.window)
            idle = [i for i, share in enumerate(merged.shares) if share < self.share]
            if idle:
                message = (f"{self._named(merged, idle)} won less than {100 * self.share:g}% of the examples over "
                           f"steps {merged.first}-{step}")
        quarter = max(1, self.window // 4)
        if message is None and covered >= quarter:
            merged = window(list(self._recent), quarter)
            behind = fallen_behind(merged, 0.0)
            if behind:
                message = (f"{self._named(merged, behind)} won less than {100 * LOW_SHARE / k:.1f}% of the examples "
                           f"over steps {merged.first}-{step} and kept less than {100 * BEHIND:g}% of the others' "
                           "gain in training NLL (a partial collapse)")
        if message is None:
            return None
        self._warned = True
        return (f"hypothesis collapse: {message} (loss={loss!r}); a hypothesis that never wins gets no gradient under "
                "vanilla WTA and stays where it is. Remedies: relaxed WTA (MCLConfig(loss='relaxed', epsilon=0.05)), "
                "annealed MCL (loss='annealed'), random tie-breaking at initialisation (tie_break='random'), more "
                "steps, or fewer hypotheses than the data has modes.")

    @staticmethod
    def _named(merged: Record, hypotheses: list[int]) -> str:
        return ", ".join(f"h{i} ({100 * merged.shares[i]:.1f}%" + (
            f", NLL {merged.nll[i]:.3f}" if merged.nll is not None else "") + ")" for i in hypotheses)


def verdict_window(collapse_window: int, total_steps: int) -> int:
    """The steps the final verdict is over: the collapse warning's window, at most the second half of the run."""
    return max(1, min(collapse_window, total_steps // 2))


__all__ = ["MIN_VERDICT_STEPS", "NO_VERDICT", "CollapseWatch", "Verdict", "abstention", "log_values", "records_of",
           "verdict", "verdict_window"]
