"""The method's configuration (MCLConfig), validated on construction."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Literal

from loramcl.utils.validate import names_its_options, require, require_int, require_real

LossName = Literal["wta", "relaxed", "annealed"]
LOSS_NAMES: tuple[str, ...] = ("wta", "relaxed", "annealed")
ADAPTER_DTYPES: tuple[str, ...] = ("float32", "base")
TIE_BREAKS: tuple[str, ...] = ("lowest", "random")
EPSILON_FORMS: tuple[str, ...] = ("paper", "mean")
BALANCES: tuple[str, ...] = ("none", "bias")
# The adapter output is scaled by alpha / r (rsLoRA: alpha / sqrt(r)); the paper and the packaged recipes use 1 to 4.
# After one AdamW step (about the learning rate on every B entry) the output moves by about scaling x r x lr: past
# 100 the first steps already throw the model far from the base, and at 1e30 every gradient norm is infinite.
MAX_SCALING = 100.0
# beta, the scoring loss' weight in the total loss: AdamW's step hardly depends on the scale of a gradient, so beta
# acts on the logged total, where the scoring loss (nats per token, like the hypotheses' loss) weighs beta times;
# past 100 that total is the scoring loss alone, and at 1e30 the head's gradient norm overflows.
MAX_SCORING_WEIGHT = 100.0
# epsilon 'auto' for relaxed WTA (`loramcl train`'s default loss, issue 53): measured over three tasks at a first-try
# budget (docs/benchmarks.md, "Which defaults split on a first try"), relaxed WTA left no hypothesis idle in 12 runs,
# vanilla WTA one in 4 of 6; epsilon 0.05 is the paper's translation value.
AUTO_EPSILON = 0.05
# Fields added after adapter files and run records were first written, each with its default: saved only when set, so
# that with them at their default a file is written as before (tests/fixtures/saved_run) and reads back the same.
SAVED_WHEN_SET: dict[str, object] = {"epsilon_form": "paper", "loraplus_lr_ratio": None, "shared_r": 0,
                                     "balance": "none", "balance_rate": 0.01, "split_after": 0.0, "split_noise": 0.1,
                                     "output_verdict": 0, "mode_column": "mode"}


@names_its_options
@dataclass
class MCLConfig:
    """K LoRA hypotheses on a frozen model, trained with a winner-takes-all loss (paper §3.3).

    Defaults follow the paper where it has one value; the loss defaults to vanilla WTA (eq. 2), with one exception
    chosen by measurement: exact ties (every example at initialisation) go to a random hypothesis
    (``tie_break="random"``), since the paper's rule, ties to hypothesis 0, collapsed a short run on a small model
    (docs/guide/scores.md, "Default settings that specialise"); ``tie_break="lowest"`` is the paper's method exactly.
    The paper's settings are: audio r=alpha=8, dropout 0.1, K=5, relaxed epsilon in
    {0.0005, 0.05} or annealed; vision r=8 alpha=32, K=3, relaxed epsilon=0.1; translation
    r=16 alpha=32, K=3, relaxed epsilon=0.05.
    """

    num_hypotheses: int = 2
    """K, the number of hypotheses (LoRA adapter sets). K=1 is plain LoRA fine-tuning (LoRA-MLE)."""

    r: int = 8
    """LoRA rank of every hypothesis. For a LoRA-MLE baseline with the same trainable count, use rank K*r."""

    alpha: float = 8.0
    """LoRA scaling numerator: the adapter output is multiplied by alpha / r, in training and inference alike."""

    dropout: float = 0.0
    """Dropout on the adapter input (the frozen branch is not affected), active in training mode only."""

    target_modules: list[str] | str | None = None
    """Layers that get adapters, matched as PEFT matches them: a list of names (a layer matches if its full
    name equals an entry or ends with '.' + entry), a regular expression string (full match), or 'all-linear'
    (every linear layer but the output layer). None takes PEFT's default for the architecture."""

    loss: LossName = "wta"
    """Training loss over the per-hypothesis NLLs: 'wta' (eq. 2, only the winner learns), 'relaxed'
    (eq. 4: 1-epsilon on the winner, epsilon/(K-1) on each other) or 'annealed' (eq. 5: softmax(-nll/tau))."""

    epsilon: float | Literal["auto"] = 0.0
    """Relaxed-WTA weight shared by the non-winning hypotheses, in [0, (K-1)/K]; used when loss='relaxed'. 'auto'
    (`loramcl train`'s default): AUTO_EPSILON for relaxed WTA with K >= 2, none otherwise (another loss, or K = 1:
    plain LoRA), so that the command's relaxed default leaves `--mcl.loss wta` or one hypothesis valid as given."""

    epsilon_form: Literal["paper", "mean"] = "paper"
    """How relaxed WTA weighs the losers with epsilon: 'paper' (eq. 4: 1 - epsilon on the winner, epsilon/(K-1) on
    each other, summing to 1; the released LoRA-MCL code's weights too) or 'mean' (the released code's multi-head
    audio model: (1 - epsilon - epsilon/(K-1)) min_k + epsilon/(K-1) mean_k, i.e. 1 - epsilon - epsilon/K on the
    winner and epsilon/(K(K-1)) on each other, summing to 1 - epsilon: the losers share epsilon/K, K times less). The
    same epsilon is another loss in each form (docs/guide/scores.md, "Two forms of epsilon"); loss='relaxed' only."""

    temperature0: float = 1.0
    """Annealed MCL: initial temperature tau(0)."""

    temperature_decay: float | Literal["auto"] = 0.999
    """Annealed MCL: tau(t) = temperature0 * temperature_decay**t, t counting optimizer steps (default: the paper's
    0.999). 'auto' (`loramcl train`'s default): the decay that brings tau to temperature_min at 90% of the run's
    optimizer steps (MCLTrainer's max_steps), so a run of any length anneals and ends in vanilla WTA; 0.999 takes
    13,800 steps from 1 to 1e-6 and left tau at 0.94 after a 60-step run (docs/guide/scores.md, "How much training
    until the hypotheses split")."""

    temperature_min: float = 1e-6
    """Annealed MCL: once tau(t) < temperature_min the loss is vanilla WTA."""

    adapter_dtype: Literal["float32", "base"] = "float32"
    """dtype of the adapter tensors: 'float32' (as PEFT does by default, so bf16/fp16 bases still train stable
    adapters: their master weights are float32) or 'base' (the frozen layer's dtype). The adapters' matmuls run in
    the activations' dtype either way."""

    tie_break: Literal["lowest", "random"] = "random"
    """Which hypothesis wins an example on which several have exactly the same NLL: one of them at random ('random',
    the default: seeded by the trainer) or the 'lowest' k (the paper's eq. 2). Ties are certain at initialisation
    (LoRA's B = 0 makes every hypothesis the base model), where 'lowest' gives hypothesis 0 every example of the
    first step, and the others may never win one (measured in docs/guide/scores.md). Only exact ties are drawn; with
    K = 1 nothing is."""

    balance: Literal["none", "bias"] = "none"
    """Balanced assignment (an extension, off by default): 'bias' picks each example's winner as
    argmin_k (nll_k - b_k) with a bias b per hypothesis that the trainer moves by balance_rate after every optimizer
    step toward equal win shares (DeepSeek-V3's auxiliary-loss-free load balancing, applied to WTA): b_k rises while
    hypothesis k wins less than 1/K of a step's examples, so an idle hypothesis is handed the examples it nearly wins,
    without relaxed WTA's pull toward the mean. Training state only: saved with checkpoints, never used to evaluate or
    decode (docs/guide/scores.md, "Balanced assignment and a staged split")."""

    balance_rate: float = 0.01
    """balance='bias': the bias step in nats per token per optimizer step, b_k += balance_rate * sign(1/K - share_k).
    0.01 lets a bias cross 0.6 nats in a 60-step run, about the distance an idle hypothesis fell behind the others in
    the defaults study, while its step-to-step jitter (one balance_rate) stays below most examples' margins."""

    split_after: float = 0.0
    """A staged split (an extension, off at 0): for the first ceil(split_after * T) of the run's T optimizer steps
    every hypothesis learns from every example (q = 1/K: the mean of the K NLLs), then the configured loss takes over,
    after a one-time symmetry break (split_noise). A fraction in [0, 1); needs the run's length (MCLTrainer's
    max_steps)."""

    split_noise: float = 0.1
    """With split_after: at the switch, each layer's lora_B [K, r, d_out] gets seeded Gaussian noise of this standard
    deviation relative to that tensor's RMS, so the hypotheses, trained alike until then, start the split apart."""

    scoring: bool = False
    """Hypothesis scores p(k | c) (an extension, off by default): a linear score per hypothesis from its own hidden
    state at the last context position, softmax over K, trained to maximise the mixture likelihood
    sum_k p(k | c) p_k(x | c) on detached hidden states and NLLs, so the hypotheses train exactly as without it."""

    scoring_weight: float = 1.0
    """beta: weight of the scoring loss (the mixture NLL per token with the hypotheses' NLLs detached) in the total
    loss; it reaches only the scoring head."""

    use_rslora: bool = False
    """Rank-stabilised LoRA (as PEFT's ``use_rslora``): scale the adapter output by alpha / sqrt(r) instead of
    alpha / r, so that larger ranks keep learning at the same rate."""

    logits_chunk_size: int | None = 256
    """Label tokens whose vocabulary logits are computed at once when the NLL is (training, the scoring pass of
    two-pass WTA, evaluation): the output layer and the cross-entropy run chunk by chunk, so no [N, V] float32 logits
    of all K*N label tokens are ever alive (V is 152k for Qwen2-Audio), with the same NLL and gradients. None computes
    them whole, as before. A computation setting: the hypotheses do not depend on it."""

    exclude_modules: list[str] | str | None = None
    """Layers that never get adapters even when ``target_modules`` matches them, matched as PEFT matches
    ``exclude_modules``: a list of names (exact or '.'-suffix) or a regular expression string (full match)."""

    layers_to_transform: list[int] | int | None = None
    """Only the transformer blocks with these indices get adapters (PEFT's ``layers_to_transform``): the index is
    the number after the blocks' list name in the layer path (e.g. 'model.layers.3.self_attn.q_proj' is block 3)."""

    layers_pattern: list[str] | str | None = None
    """With ``layers_to_transform``: the name of the blocks' list (e.g. 'layers', 'h') when the default
    search for it is ambiguous, as PEFT's ``layers_pattern``."""

    adapt_context: bool = True
    """Whether the hypotheses' adapters act on the context too (True: the paper's method, every position). False
    (an extension, "activated LoRA", Greenewald et al. 2025): they act only from the first position whose output
    predicts a label on (a causal LM: the last prompt token; an encoder-decoder: the decoder), so the context's hidden
    states are the base model's, the same for every hypothesis: the context runs once on B rows and only the target
    positions run on K*B rows (docs/architecture.md). Such adapters are not standard PEFT LoRA: export and merge
    refuse them."""

    shared_r: int = 0
    """Rank s of the shared adapter (an extension, off by default: 0, the paper's model). With s > 0 every adapted
    layer has one more LoRA pair, A [d_in, s] and B [s, d_out], applied to every row whatever its hypothesis, so that
    every example trains it (its gradient is sum_k q[b,k] times a row's, weights that sum to 1). Hypothesis k with the
    shared pair is ONE LoRA of rank s + r: both pairs are scaled by alpha / (s + r) (alpha / sqrt(s + r) with
    ``use_rslora``), read the same dropped-out input, and export as one PEFT LoRA of rank s + r. A LoRA-MLE of the
    same trainable count has rank K*r + s."""

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, tuple | set):
            self.target_modules = sorted(self.target_modules)
        require_int("num_hypotheses", self.num_hypotheses)
        require_int("r", self.r, what="(LoRA rank)")
        require_real("alpha", self.alpha, low=0.0, low_open=True, hint=" (the adapter output is scaled by alpha/r)")
        require_int("shared_r", self.shared_r, minimum=0, what="(the shared adapter's rank; 0: none)")
        rank = "(shared_r + r)" if self.shared_r else "r"
        divisor, said = (math.sqrt(self.lora_rank), f"alpha/sqrt{rank}" if self.shared_r else "alpha/sqrt(r)") if (
            self.use_rslora is True) else (self.lora_rank, f"alpha/{rank}")
        require(self.alpha / divisor <= MAX_SCALING, f"alpha {self.alpha:g} scales the adapter output by {said} = "
                f"{self.alpha / divisor:g}, more than {MAX_SCALING:g}: set alpha at most {MAX_SCALING * divisor:g} "
                "(the paper and the recipes use alpha/r from 1 to 4)", "alpha")
        require_real("dropout", self.dropout, low=0.0, high=1.0, high_open=True)
        require(self.loss in LOSS_NAMES, f"loss must be one of {LOSS_NAMES}, got {self.loss!r}")
        require(isinstance(self.scoring, bool), f"scoring must be True or False, got {self.scoring!r}")
        require_real("scoring_weight", self.scoring_weight, low=0.0, high=MAX_SCORING_WEIGHT, low_open=True,
                     hint=" (beta, the scoring loss' weight: 0 would leave the scores untrained)")
        require(self.scoring or self.scoring_weight == 1.0, f"scoring_weight {self.scoring_weight!r} weighs the "
                "hypothesis scores' loss, and scoring is off: set scoring true, or leave scoring_weight out",
                "scoring_weight")
        require(self.tie_break in TIE_BREAKS, f"tie_break must be one of {TIE_BREAKS}, got {self.tie_break!r}")
        require(self.balance in BALANCES, f"balance must be one of {BALANCES}, got {self.balance!r}", "balance")
        require_real("balance_rate", self.balance_rate, low=0.0, low_open=True,
                     hint=" (the balancing bias's step in nats per optimizer step)")
        require(self.balance == "bias" or self.balance_rate == 0.01, f"balance_rate {self.balance_rate!r} is the "
                "balancing bias's step, and balance is 'none': set balance bias, or leave balance_rate out",
                "balance_rate")
        require_real("split_after", self.split_after, low=0.0, high=1.0, high_open=True,
                     hint=" (the share of the run's optimizer steps before the split; 0: none)")
        require_real("split_noise", self.split_noise, low=0.0, hint=" (relative to the RMS of lora_B)")
        require(self.split_after > 0 or self.split_noise == 0.1, f"split_noise {self.split_noise!r} breaks the "
                "symmetry at a staged split, and split_after is 0 (no split): set split_after, or leave split_noise "
                "out", "split_noise")
        require(self.adapter_dtype in ADAPTER_DTYPES,
               f"adapter_dtype must be one of {ADAPTER_DTYPES}, got {self.adapter_dtype!r}")
        if self.epsilon != "auto":
            require_real("epsilon", self.epsilon, low=0.0, hint=" ('auto': relaxed WTA's measured default)")
        require(self.epsilon in (0, "auto") or self.loss == "relaxed", f"epsilon {self.epsilon!r} is relaxed WTA's "
                f"weight, and loss is {self.loss!r}: set loss relaxed, or leave epsilon out", "epsilon")
        require(self.epsilon_form in EPSILON_FORMS, f"epsilon_form must be one of {EPSILON_FORMS}, got "
                f"{self.epsilon_form!r}", "epsilon_form")
        require(self.epsilon_form == "paper" or self.loss == "relaxed", f"epsilon_form {self.epsilon_form!r} is how "
                f"relaxed WTA weighs epsilon, and loss is {self.loss!r}: set loss relaxed, or leave epsilon_form out",
                "epsilon_form")
        if self.loss == "relaxed" and self.epsilon != "auto":
            k = self.num_hypotheses
            upper = (k - 1) / k
            hint = (" With one hypothesis there is no other hypothesis to share epsilon: set epsilon=0 "
                    "(or loss='wta'), which is plain LoRA fine-tuning." if k == 1 else
                    " Above that bound a losing hypothesis would weigh more than the winner.")
            # The bound printed in full (repr), so that the largest accepted value can be copied from the message. It
            # is the same in both epsilon forms: at (K-1)/K the winner weighs what a loser does in each (1/K; 1/K^2).
            require(self.epsilon <= upper,
                    f"epsilon must be in [0, (K-1)/K] = [0, {k - 1}/{k}] for K={k} (at most {upper!r}), "
                    f"got {self.epsilon!r}.{hint}", "epsilon")
        require_real("temperature0", self.temperature0, low=0.0, low_open=True)
        if self.temperature_decay != "auto":
            require_real("temperature_decay", self.temperature_decay, low=0.0, high=1.0, low_open=True,
                         hint=" (1 keeps the temperature constant; 'auto' fits it to the run's steps)")
        require_real("temperature_min", self.temperature_min, low=0.0)
        require(self.temperature_decay != "auto" or self.temperature_min > 0, "temperature_decay 'auto' brings tau "
                "to temperature_min, which is 0 (never reached): set temperature_min > 0 (default 1e-6), or give "
                "temperature_decay a number", "temperature_min")
        require(self.temperature_min < self.temperature0, f"temperature_min {self.temperature_min!r} is not below "
                f"temperature0 {self.temperature0!r}: annealing would be vanilla WTA from the first step (set loss "
                "wta for that), or lower temperature_min", "temperature_min")
        require(self.target_modules is None or isinstance(self.target_modules, str)
               or (isinstance(self.target_modules, list) and self.target_modules
                   and all(isinstance(t, str) and t for t in self.target_modules)),
               "target_modules must be None, a non-empty list of layer names, a regular expression string or "
               f"'all-linear', got {self.target_modules!r}")

        for name in ("exclude_modules", "layers_pattern"):
            value = getattr(self, name)
            if isinstance(value, tuple | set):
                value = sorted(value)
                setattr(self, name, value)
            require(value is None or (isinstance(value, str) and value) or (
                isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)),
                f"{name} must be None, a non-empty list of names or a regular expression string, got {value!r}")
        layers = self.layers_to_transform
        if isinstance(layers, tuple | set):
            self.layers_to_transform = layers = sorted(layers)
        require(layers is None or _is_index(layers) or (
            isinstance(layers, list) and layers and all(_is_index(i) for i in layers)),
            f"layers_to_transform must be None, a block index >= 0 or a non-empty list of them, got {layers!r}",
            "layers_to_transform")
        require(layers is None or not isinstance(self.target_modules, str) or self.target_modules == "all-linear",
               "layers_to_transform cannot be used with a regular expression target_modules (as in PEFT): "
               "write the block indices into the expression, or give target_modules as a list of names")
        require(self.layers_pattern is None or layers is not None,
               "layers_pattern names the list of blocks that layers_to_transform indexes: set layers_to_transform "
               "too, or leave layers_pattern out")
        if self.logits_chunk_size is not None:
            require_int("logits_chunk_size", self.logits_chunk_size, what="(label tokens; None: no chunks)")
        require(isinstance(self.use_rslora, bool), f"use_rslora must be True or False, got {self.use_rslora!r}")
        require(isinstance(self.adapt_context, bool),
                f"adapt_context must be True or False, got {self.adapt_context!r}")

    @property
    def relaxed_epsilon(self) -> float:
        """epsilon as the relaxed loss uses it: 'auto' resolved (AUTO_EPSILON for relaxed WTA with K >= 2, else 0)."""
        if self.epsilon != "auto":
            return self.epsilon
        return AUTO_EPSILON if self.loss == "relaxed" and self.num_hypotheses > 1 else 0.0

    @property
    def lora_rank(self) -> int:
        """The rank of one hypothesis as a plain LoRA: r, plus the shared adapter's shared_r."""
        return self.r + self.shared_r

    @property
    def scaling(self) -> float:
        rank = self.lora_rank
        return self.alpha / math.sqrt(rank) if self.use_rslora else self.alpha / rank

    def to_dict(self) -> dict:
        return without_defaults_added_later(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, values: dict) -> MCLConfig:
        _refuse_peft_only_options(values)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        require(not unknown, f"unknown MCLConfig fields {unknown}; known fields are {sorted(known)}")
        return cls(**values)


# PEFT LoraConfig options that MCLConfig does not take, with what to do instead: a PEFT user's habit gets an
# answer, not "unexpected keyword argument".
PEFT_ONLY_OPTIONS: dict[str, str] = {
    "use_dora": "DoRA (weight-decomposed LoRA) is not supported: LoRA-MCL hypotheses are plain LoRA adapters",
    "modules_to_save": "modules_to_save is not supported: only the K LoRA hypotheses train, every base weight "
                       "stays frozen (a fully trained module would be shared by all hypotheses)",
    "trainable_token_indices": "trainable token embeddings are not supported: adapters wrap linear layers only",
    "target_parameters": "target_parameters (LoRA on raw parameters, e.g. MoE experts) is not supported: "
                         "adapters wrap nn.Linear and Conv1D layers",
    "rank_pattern": "per-layer ranks are not supported: every adapted layer has rank r",
    "alpha_pattern": "per-layer alphas are not supported: every adapted layer has alpha",
    "layer_replication": "layer_replication is not supported",
    "lora_bias": "a trainable LoRA bias is not supported",
    "bias": "bias training is not supported: the base biases stay frozen (PEFT's bias='none')",
    "use_qalora": "QA-LoRA is not supported, nor are quantized base layers",
    "loftq_config": "LoftQ initialisation is not supported, nor are quantized base layers",
    "init_lora_weights": "only PEFT's default LoRA initialisation is supported (A Kaiming-uniform, B zero)",
    "fan_in_fan_out": "fan_in_fan_out is not needed: transformers Conv1D layers are recognised by their class",
    "task_type": "task_type is not needed: the model class decides (export_hypothesis writes the task type "
                 "that suits it)",
    "lora_alpha": "the LoRA scaling numerator is called alpha in MCLConfig",
    "lora_dropout": "the adapter dropout is called dropout in MCLConfig",
}


def _refuse_peft_only_options(values: dict) -> None:
    given = [name for name in values if name in PEFT_ONLY_OPTIONS]
    if given:
        raise ValueError("MCLConfig does not take these PEFT LoraConfig options: " + "; ".join(
            f"{name!r}: {PEFT_ONLY_OPTIONS[name]}" for name in given))


def _refusing_peft_only_options(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs) -> None:
        _refuse_peft_only_options(kwargs)
        init(self, *args, **kwargs)

    return __init__


MCLConfig.__init__ = _refusing_peft_only_options(MCLConfig.__init__)


# A setting that only acts beside another: (that setting, the value it needs). A configuration given for training is
# refused when it sets one without the other (the value would be ignored); a saved one reads it as its default.
ACTS_ONLY_WITH = {"epsilon": ("loss", "relaxed"), "epsilon_form": ("loss", "relaxed"),
                  "scoring_weight": ("scoring", True), "router_std": ("router_init", "normal"),
                  "balance_rate": ("balance", "bias")}


def saved_values(values: dict) -> dict:
    """The values of a configuration read from an adapters folder, less those its other settings ignore (relaxed
    WTA's epsilon under another loss, the scores' weight without scores, the router's std with a zero router): a
    folder written before they were refused, or whose loss was edited to continue training with another, loads with
    the same outputs (none of them is an output setting)."""
    return {name: value for name, value in values.items()
            if name not in ACTS_ONLY_WITH or values.get(ACTS_ONLY_WITH[name][0]) == ACTS_ONLY_WITH[name][1]}


def without_defaults_added_later(values: dict) -> dict:
    """``values`` (a configuration's fields) less the ``SAVED_WHEN_SET`` fields at their default."""
    return {name: value for name, value in values.items()
            if name not in SAVED_WHEN_SET or value != SAVED_WHEN_SET[name]}


def _is_index(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


__all__ = ["MCLConfig", "LOSS_NAMES"]
