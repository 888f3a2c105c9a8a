"""Train LoRA-MLE and LoRA-MCL on a Markov mixture with the paper's toy model (App. D), through MCLTrainer.

One run = one model (K=1 for MLE, K hypotheses for MCL) and one seed. Each run records the validation loss
(vanilla WTA, per token, first token excluded) every ``eval_every`` steps and, at the end, the transition
matrix each hypothesis has learned.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np
import torch
from transformers import GPTNeoConfig, GPTNeoForCausalLM, PrinterCallback, TrainerCallback

from loramcl.mcl.build import get_mcl_model
from loramcl.mcl.config import MCLConfig
from loramcl.mcl.model import MCLModel
from loramcl.recipes.markov.chains import MarkovMixture
from loramcl.recipes.markov.theory import optimal_nll
from loramcl.training.config import TrainConfig
from loramcl.training.fit import training_arguments
from loramcl.training.trainer import MCLTrainer
from loramcl.utils.validate import require, require_int, require_real

TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]
TOY_MAX_POSITIONS = 1024  # positions of the toy model: the longest sequence it reads
EVAL_SEED_OFFSET = 10_000  # validation sequences never share a seed with training sequences


# The paper's optimisation (App. D): AdamW (betas 0.9, 0.95), lr 1e-4, weight decay 1e-3, cosine schedule without
# warm-up, 500 steps of 128 sequences; no checkpoints; validation every 10 steps.
PAPER_TRAINING = TrainConfig(steps=500, batch_size=128, learning_rate=1e-4, weight_decay=1e-3, adam_beta2=0.95,
                             warmup_steps=0, scheduler="cosine", eval_every=10, save_every=0)
TRAINING_FIELDS = frozenset(f.name for f in fields(TrainConfig))


@dataclass
class RunSettings:
    """Model and optimisation of one run; the defaults are the paper's (App. D)."""

    hypotheses: int = 2  # K of the MCL model; MLE is K = 1
    rank: int = 32  # LoRA rank (and alpha) of each MCL hypothesis; MLE gets rank K*rank: the same trainable count
    loss: str = "wta"  # MCL loss: wta (the paper's), relaxed or annealed
    epsilon: float = 0.0  # relaxed WTA
    temperature0: float = 1.0  # annealed MCL: tau(t) = temperature0 * temperature_decay ** t
    temperature_decay: float = 0.99
    temperature_min: float = 1e-3  # vanilla WTA below this temperature
    tie_break: str = "lowest"  # MCL: who wins an exact tie (every sequence at initialisation): lowest k or random
    scoring: bool = False  # MCL: hypothesis scores p(k | c) (issue 17), checked against the chain's posterior
    training: TrainConfig = PAPER_TRAINING  # optimisation and validation schedule (a log line per validation)
    eval_sequences: int = 1000
    hidden_size: int = 64
    layers: int = 2
    heads: int = 2
    window: int = 5  # local attention window of every layer
    # std of the frozen random weights. transformers' default, 0.02, is the paper's; it caps the logit gaps the
    # frozen tied output layer can produce (docs/experiments/markov.md): `loramcl markov`'s own presets raise it.
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        for name in ("hypotheses", "rank", "eval_sequences", "hidden_size", "layers", "heads", "window"):
            require_int(name, getattr(self, name))
        for name in ("temperature0", "initializer_range"):
            require_real(name, getattr(self, name), low=0.0, low_open=True)
        require_real("epsilon", self.epsilon, low=0.0, high=1.0)
        require(self.epsilon == 0 or self.loss == "relaxed", f"epsilon {self.epsilon!r} is relaxed WTA's weight, and "
                f"loss is {self.loss!r}: set loss relaxed, or leave epsilon out", "epsilon")
        require_real("temperature_decay", self.temperature_decay, low=0.0, high=1.0, low_open=True)
        require_real("temperature_min", self.temperature_min, low=0.0)
        require(self.training.eval_every > 0, f"eval_every must be >= 1 (the validation curve), got "
               f"{self.training.eval_every}")

    def with_values(self, **values) -> RunSettings:
        """These settings with ``values`` replaced; TrainConfig's names (steps, learning_rate, eval_every, ...) go to
        ``training``."""
        training = {name: value for name, value in values.items() if name in TRAINING_FIELDS}
        rest = {name: value for name, value in values.items() if name not in TRAINING_FIELDS}
        return replace(self, **rest, training=replace(self.training, **training))

    def loss_options(self) -> dict:
        """The MCLConfig options of an MCL run's loss."""
        return {"loss": self.loss, "epsilon": self.epsilon, "temperature0": self.temperature0,
                "temperature_decay": self.temperature_decay, "temperature_min": self.temperature_min,
                "tie_break": self.tie_break, "scoring": self.scoring}

    def to_dict(self) -> dict:
        return asdict(self)

    def check_fits(self, mixture: MarkovMixture) -> None:
        """Fail now, not after the first training minutes, if the toy model cannot read the mixture's sequences."""
        if mixture.seq_len > TOY_MAX_POSITIONS:
            raise ValueError(f"seq_len {mixture.seq_len} is longer than the toy model's {TOY_MAX_POSITIONS} positions: "
                             f"use sequences of at most {TOY_MAX_POSITIONS} tokens")


@dataclass
class RunResult:
    name: str  # "mle" or "mcl"
    seed: int
    eval_steps: list[int]
    eval_losses: list[float]  # vanilla WTA validation loss per token
    final_loss: float
    win_rates: list[float]  # on the validation set, at the end
    transitions: list[list[list[float]]]  # [K][V][V] learned by each hypothesis, on the sequences it wins (None: a
    # state never seen in them)
    transitions_all: list[list[list[float]]]  # [K][V][V] on all validation sequences
    trainable_parameters: int
    total_parameters: int
    seconds: float
    extra: dict = field(default_factory=dict)


def toy_model(settings: RunSettings, num_states: int, seed: int) -> GPTNeoForCausalLM:
    """The paper's frozen random base: GPT-Neo, hidden 64, 2 layers, 2 heads, local attention over 5 tokens."""
    torch.manual_seed(seed)
    config = GPTNeoConfig(
        vocab_size=num_states, hidden_size=settings.hidden_size, num_layers=settings.layers,
        num_heads=settings.heads, attention_types=[[["local"], settings.layers]], window_size=settings.window,
        max_position_embeddings=TOY_MAX_POSITIONS, embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0,
        initializer_range=settings.initializer_range, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return GPTNeoForCausalLM(config)


class SequenceDataset(torch.utils.data.Dataset):
    def __init__(self, sequences: np.ndarray) -> None:
        self.sequences = torch.from_numpy(sequences)  # [N, T]

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.sequences[i]
        return {"input_ids": x, "labels": x}


class _Progress(TrainerCallback):
    """One tqdm bar per run, showing the latest validation loss."""

    def __init__(self, description: str, total: int) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc=description, leave=True, dynamic_ncols=True)

    def on_step_end(self, args, state, control, **kwargs):
        self.bar.update(1)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if metrics and "eval_loss" in metrics:
            self.bar.set_postfix(val_loss=f"{metrics['eval_loss']:.4f}")

    def on_train_end(self, args, state, control, **kwargs):
        self.bar.close()


def learned_transitions(model: MCLModel, sequences: torch.Tensor, num_states: int) -> tuple[np.ndarray, np.ndarray]:
    """The transition matrix each hypothesis has learned: its next-token distribution averaged by current token.

    Returns two [K, V, V] arrays: averaged over the validation sequences each hypothesis wins (its cluster in
    the hard-EM reading of WTA, Prop. 1 (i): the data it is trained to model), and over all of them. The two
    agree for K = 1; for K > 1 a hypothesis is never trained on the sequences it loses, so its predictions there
    (on another chain's sequences, where its context tells it so) say little about the chain it models.
    """
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=sequences).logits  # [N, K, T, V]
    log_probs = logits[:, :, :-1].double().log_softmax(-1)  # [N, K, T-1, V]: predictions of x_2..x_T
    targets = sequences[:, None, 1:, None].expand(-1, log_probs.shape[1], -1, -1)  # [N, K, T-1, 1]
    winners = log_probs.gather(-1, targets).squeeze(-1).sum(-1).argmax(1)  # [N]: the lowest NLL
    current = torch.nn.functional.one_hot(sequences[:, :-1], num_states).double()  # [N, T-1, V]
    probs = log_probs.exp()

    def average(weights: torch.Tensor) -> np.ndarray:  # weights [N, K] -> [K, V, V]
        sums = torch.einsum("nk,nti,nktj->kij", weights, current, probs)
        counts = torch.einsum("nk,nti->ki", weights, current)[:, :, None]  # [K, V, 1]
        # on the host first: the model (and so these sums) is on the GPU once Trainer has moved it
        return (sums / counts).cpu().numpy()  # a state a hypothesis never sees gives a NaN row: it learned nothing

    k = log_probs.shape[1]
    return average(torch.nn.functional.one_hot(winners, k).double()), average(torch.ones(len(sequences), k, dtype=torch.float64, device=sequences.device))


def _json_matrices(matrices: np.ndarray) -> list:
    """Nested lists with None for NaN (a state a hypothesis never saw), which JSON can hold."""
    return np.where(np.isnan(matrices), None, matrices).tolist()


def transition_error(learned: np.ndarray, true: np.ndarray) -> tuple[float, list[int]]:
    """max |learned - true| with the hypotheses matched to the chains by the best permutation.

    learned: [K, V, V]; true: [C, V, V] with C <= K. Returns (error, hypothesis matched to each chain). A row a
    hypothesis never saw (NaN) counts as the largest possible error, 1. The best permutation minimises the largest
    error (a bottleneck assignment): the smallest threshold under which every chain can get its own hypothesis.
    """
    learned = np.asarray(learned, dtype=np.float64)
    k, c = len(learned), len(true)
    if c > k:
        raise ValueError(f"{c} chains cannot be matched with {k} hypotheses")
    gaps = np.abs(learned[None] - np.asarray(true)[:, None])  # [C, K, V, V]
    errors = np.where(np.isnan(gaps), 1.0, gaps).max(axis=(2, 3))  # [C, K]
    thresholds = np.unique(errors)
    low, high = 0, len(thresholds) - 1  # the largest threshold always admits a matching (C <= K)
    while low < high:
        middle = (low + high) // 2
        if _matching(errors <= thresholds[middle]) is None:
            low = middle + 1
        else:
            high = middle
    return float(min(thresholds[low], 1.0)), _matching(errors <= thresholds[low])


def _matching(allowed: np.ndarray) -> list[int] | None:
    """A hypothesis for every chain using only allowed [C, K] pairs (augmenting paths), or None."""
    owner = [-1] * allowed.shape[1]  # chain holding each hypothesis

    def place(chain: int, seen: set[int]) -> bool:
        for h in np.flatnonzero(allowed[chain]):
            if h not in seen:
                seen.add(h)
                if owner[h] < 0 or place(owner[h], seen):
                    owner[h] = chain
                    return True
        return False

    if not all(place(chain, set()) for chain in range(allowed.shape[0])):
        return None
    assignment = [0] * allowed.shape[0]
    for h, chain in enumerate(owner):
        if chain >= 0:
            assignment[chain] = h
    return assignment


def train_run(name: str, mixture: MarkovMixture, settings: RunSettings, seed: int, out: str,
              show_progress: bool = True, model: MCLModel | None = None) -> RunResult:
    """Train one model: ``name`` 'mle' (K=1, rank K*r) or 'mcl' (K hypotheses of rank r), or ``model`` (another
    MCLModel, e.g. a baseline of loramcl.baselines, built on ``toy_model(settings, ..., seed)``) under ``name``."""
    if model is None:
        k = 1 if name == "mle" else settings.hypotheses
        rank = settings.rank * settings.hypotheses if name == "mle" else settings.rank
        config = MCLConfig(num_hypotheses=k, r=rank, alpha=rank, dropout=0.0, target_modules=TARGETS,
                           **(settings.loss_options() if k > 1 else {}))
        model = get_mcl_model(toy_model(settings, mixture.num_states, seed), config)
    k = model.num_hypotheses
    training = settings.training
    train_x, _ = mixture.sample(training.steps * training.batch_size, seed)
    eval_x, _ = mixture.sample(settings.eval_sequences, seed + EVAL_SEED_OFFSET)
    args = training_arguments(training, out, evaluating=True, per_device_eval_batch_size=settings.eval_sequences,
                              logging_steps=training.eval_every, seed=seed, data_seed=seed,
                              remove_unused_columns=True, disable_tqdm=True, dataloader_drop_last=True)
    trainer = MCLTrainer(model, args=args, train_dataset=SequenceDataset(train_x),
                         eval_dataset=SequenceDataset(eval_x), scoring_learning_rate=training.scoring_learning_rate,
                         loraplus_lr_ratio=training.loraplus_lr_ratio)
    trainer.remove_callback(PrinterCallback)
    if show_progress:
        trainer.add_callback(_Progress(f"{name.upper()} K={k} seed {seed}", training.steps))
    started = time.perf_counter()
    initial = trainer.evaluate()  # the step-0 point of the curve
    trainer.train()
    evaluations = [log for log in trainer.state.log_history if "eval_loss" in log and log["step"] > 0]
    if evaluations[-1]["step"] != training.steps:  # Trainer evaluates the last step only when eval_every divides it
        evaluations.append({**trainer.evaluate(), "step": training.steps})
    seconds = time.perf_counter() - started
    final = evaluations[-1]
    history = [(0, initial["eval_loss"])] + [(log["step"], log["eval_loss"]) for log in evaluations]
    device = next(p for p in model.parameters() if p.requires_grad).device
    transitions, transitions_all = learned_transitions(model, torch.from_numpy(eval_x).to(device),
                                                       mixture.num_states)
    model.save_pretrained(out)
    trainable, total = model.parameter_counts()
    extra = {"validation_optimum": optimal_nll(mixture, eval_x)}  # the true mixture's loss on these sequences
    if getattr(model, "scoring_head", None) is not None:
        extra |= {"scores_given_first_state": scores_given_first_state(model, mixture.num_states, device).tolist(),
                  "mixture_nll": final["eval_mixture_nll"]}
    return RunResult(
        name=name, seed=seed, eval_steps=[s for s, _ in history], eval_losses=[v for _, v in history],
        final_loss=final["eval_loss"], win_rates=[final[f"eval_win_rate_h{h}"] for h in range(k)],
        transitions=_json_matrices(transitions), transitions_all=_json_matrices(transitions_all),
        trainable_parameters=trainable, total_parameters=total,
        seconds=round(seconds, 1), extra=extra)


def scores_given_first_state(model: MCLModel, num_states: int, device: torch.device) -> np.ndarray:
    """p(k | x_1 = v) of a model with hypothesis scores: [V, K]. The context before the first prediction is the first
    state alone, so one two-token sequence per state gives it (the second token only makes a label)."""
    states = torch.arange(num_states, device=device)
    sequences = torch.stack([states, states], dim=1)  # [V, 2]
    model.eval()
    with torch.no_grad():
        return model(input_ids=sequences, labels=sequences).log_scores.exp().double().cpu().numpy()
