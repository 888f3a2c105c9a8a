"""A training run's configuration, validated on construction: its data (DataConfig) and its schedule (TrainConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from loramcl.utils.inputs import LocalPath
from loramcl.utils.validate import names_its_options, require, require_int, require_real, require_seed

# AdamW moves every weight by about the learning rate at each step, whatever the gradient's scale: past 1 an adapter
# weight (about 0.1 at initialisation) is thrown around by more than its own size every step. LoRA recipes use 1e-5 to
# 1e-3 (the packaged ones: 1e-5 to 1e-3; the Markov scores head 1e-2), far below.
MAX_LEARNING_RATE = 1.0
_LEARNING_RATE_HINT = (" (AdamW moves every adapter weight by about the learning rate at each step: past 1 training "
                       "diverges; LoRA recipes use 1e-5 to 1e-3)")
# AdamW's decoupled decay multiplies every weight by 1 - learning_rate x weight_decay at each step; the packaged
# recipes use 0 to 0.05 (the paper's Markov runs 1e-3). Past 1 (with a learning rate up to 1) the decay can wipe or
# flip every weight in one step.
MAX_WEIGHT_DECAY = 1.0
# The most optimizer steps a run may take: 10^8 steps take over 115 days at 10 steps a second. A count past it cannot
# finish (10^18 was accepted and ran 5,900 steps showing an ETA of 2e13 hours, issue 61); the packaged recipes' longest
# run is 13,721 steps.
MAX_STEPS = 10**8


@names_its_options
@dataclass(frozen=True)
class DataConfig:
    """Where a run's examples come from and how they are tokenized (`loramcl train --data.*`; docs/guide/data.md)."""

    train_file: LocalPath
    """A local JSONL, JSON, Parquet, CSV or Arrow file, or a save_to_disk folder, in one of TRL's formats: prompt +
    completion (or target; texts, or conversations), messages, text; a list of completions (or "references") gives
    one example per reference. The format is read from the first row and stated in the log."""

    validation_file: LocalPath | None = None
    """Like train_file, scored every `training.eval_every` steps (WTA loss, NLL and win rate per hypothesis)."""

    split: str | None = None
    """The split to read from a folder holding several (e.g. train); a file is one split."""

    prompt_key: str = "prompt"
    """Field holding the prompt (prompt/completion rows)."""

    target_key: str = "target"
    """Field holding the target (prompt/completion rows; "completion" and "references" are read too)."""

    chat_template: bool = False
    """Render prompt/completion rows of text as a user turn and an assistant turn with the tokenizer's chat template
    (decoding then does the same); conversations (messages, conversational rows) always are."""

    max_length: int = 128
    """Examples longer than this (tokens) lose their end (an encoder-decoder: prompt and target each at most this
    long); one whose prompt leaves no target token is refused. At most the positions the model reads
    (`loramcl train` checks its config.json)."""

    eval_examples: int | None = 128
    """Validation examples used (the first ones; None: all)."""

    def __post_init__(self) -> None:
        for name in ("train_file", "prompt_key", "target_key"):
            value = getattr(self, name)
            require(isinstance(value, str) and value, f"{name} must be a non-empty string, got {value!r}")
        require(self.validation_file is None or (isinstance(self.validation_file, str) and self.validation_file),
               f"validation_file must be a path or None, got {self.validation_file!r}")
        require(self.split is None or (isinstance(self.split, str) and self.split),
                f"split must be a split's name or None, got {self.split!r}")
        require(isinstance(self.chat_template, bool),
                f"chat_template must be true or false, got {self.chat_template!r}")
        require_int("max_length", self.max_length, minimum=2)
        if self.eval_examples is not None:
            require_int("eval_examples", self.eval_examples)


@names_its_options
@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, evaluation and checkpoint schedule of a training run (`loramcl train --training.*`)."""

    steps: int = 200
    """Optimizer steps. At most 10^8 (MAX_STEPS: over 115 days at 10 steps a second)."""

    batch_size: int = 16
    """Examples per optimizer step (per process), in ``gradient_accumulation_steps`` micro-batches."""

    gradient_accumulation_steps: int = 1
    """Micro-batches of ``batch_size / gradient_accumulation_steps`` examples whose gradients make one optimizer
    step: the same update as the whole batch at once (each example's winner is its own), at the activation memory
    of one micro-batch. Must divide batch_size."""

    activation_checkpointing: bool = False
    """Recompute the frozen model's layer activations in the backward pass instead of keeping them (about one more
    forward of compute; the saved activations drop to each layer's input)."""

    bf16: bool = False
    """bfloat16 autocast of the forward (Trainer's ``bf16``). A bfloat16 base (``dtype: bfloat16``) with float32
    adapters needs none: the adapters' matmuls already run in the activations' dtype."""

    tf32: bool = False
    """TensorFloat-32 for the float32 matmuls on an Ampere or newer GPU (Trainer's ``tf32``): about 10 bits of
    mantissa instead of 23, several times faster. The CPU has no such mode: there it changes nothing."""

    compile: bool = False
    """``torch.compile`` the MCL forward (Trainer's ``torch_compile``, inductor): the forward reads nothing on the host
    and compiles without graph breaks (docs/architecture.md, "Compiling the forward"); the first steps of each new
    batch shape pay the compilation. Losses equal the eager forward's to float rounding."""

    learning_rate: float = 5e-4
    """AdamW peak learning rate, in (0, 1]. It depends on the model and the task more than on MCL: the paper's
    recipes used 1e-5 to 2e-4 on 7-8B models, and on SmolLM2-135M at 200 steps both LoRA-MCL and one LoRA had their
    lowest validation loss at 2e-3 to 8e-3 (docs/guide/when-mcl-pays.md). Tune it on the validation loss, for MCL
    and for the one LoRA you compare it with, and watch the split: a higher rate split the hypotheses less there."""

    weight_decay: float = 0.0
    """AdamW weight decay."""

    adam_beta2: float = 0.999
    """AdamW β2 (the paper's audio runs: 0.98)."""

    min_learning_rate: float = 0.0
    """Floor of the cosine schedule (scheduler 'cosine' only; the paper's audio runs: 1e-6); 0: decay to zero."""

    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (0: none)."""

    warmup_steps: int = 10
    """Linear warm-up steps. A warm-up as long as the run or longer never reaches learning_rate: training warns,
    saying the rate its last step trains at."""

    scheduler: str = "cosine"
    """transformers learning-rate schedule after warm-up (cosine, linear, constant, inverse_sqrt, ...)."""

    eval_every: int = 50
    """Validation every this many steps (0: only at the end)."""

    logging_steps: int = 10
    """Training loss and win rates logged every this many steps."""

    save_every: int = 50
    """A resumable checkpoint (adapters, optimizer, scheduler, RNG) every this many steps (0: none)."""

    keep_checkpoints: int = 2
    """Checkpoints kept (the newest ones)."""

    keep_best: bool = False
    """Keep the adapters of the validation with the lowest ``eval_loss`` (the oracle NLL min_k for K >= 2) in
    ``OUT/best`` beside the last ones, with ``best.json`` saying its step and loss (``training.best``); needs a
    validation file. A resumed run carries the best of the steps before it over."""

    seed: int = 0
    """Model init, data order and dropout seed."""

    scoring_learning_rate: float | None = None
    """Learning rate of the hypothesis-scores head (MCLConfig(scoring=True)); None: learning_rate."""

    loraplus_lr_ratio: float | None = None
    """LoRA+ (Hayou et al., ICML 2024): LoRA's B matrices learn at this many times learning_rate (A and the LoRA-MoE
    routers at learning_rate), under the same schedule; the paper recommends about 16 with Adam, with a learning rate
    about half of plain LoRA's. None (or 1): one rate. For LoRA-MCL, LoRA-MLE (K = 1) and LoRA-MoE alike; the
    multi-head baseline has no B and refuses it."""

    output_verdict: int = 0
    """Prompts each hypothesis decodes greedily at each validation and when training ends (validation prompts, else
    training ones; 0: off): the run says whether the hypotheses write different answers, and with ``mode_column`` each
    hypothesis's mode (docs/guide/scores.md, "Do the hypotheses write different things"). Logged as ``outputs_*``,
    the answers in ``OUT/outputs.jsonl``, the verdict in run.json's "outputs". Changes no adapter."""

    mode_column: str = "mode"
    """The data file's field naming each example's mode (e.g. its language), read by the output verdict when the
    file has it (a list, one per reference, in rows of several references)."""

    def __post_init__(self) -> None:
        require_int("steps", self.steps, maximum=MAX_STEPS,
                    hint=" (MAX_STEPS: 10^8 optimizer steps take over 115 days at 10 steps a second; an epoch of the "
                         "training file is its examples / batch_size steps)")
        if self.scoring_learning_rate is not None:
            require_real("scoring_learning_rate", self.scoring_learning_rate, low=0.0, high=MAX_LEARNING_RATE,
                         low_open=True, hint=_LEARNING_RATE_HINT)
        if self.loraplus_lr_ratio is not None:
            require_real("loraplus_lr_ratio", self.loraplus_lr_ratio, low=0.0, low_open=True,
                         hint=" (LoRA+'s lr_B / lr_A: about 16; None: one rate)")
            require(self.learning_rate * self.loraplus_lr_ratio <= MAX_LEARNING_RATE, f"loraplus_lr_ratio "
                    f"{self.loraplus_lr_ratio:g} puts LoRA's B at learning_rate x ratio = "
                    f"{self.learning_rate * self.loraplus_lr_ratio:g}, past {MAX_LEARNING_RATE:g}"
                    f"{_LEARNING_RATE_HINT}: lower the ratio or learning_rate", "loraplus_lr_ratio")
        require_int("batch_size", self.batch_size)
        require_int("gradient_accumulation_steps", self.gradient_accumulation_steps)
        steps = self.gradient_accumulation_steps
        require(self.batch_size % steps == 0, f"gradient_accumulation_steps {steps} must divide batch_size "
                f"{self.batch_size} (the examples of one optimizer step): set batch_size to a multiple of it, e.g. "
                f"{-(-self.batch_size // steps) * steps}", "gradient_accumulation_steps")
        for name in ("activation_checkpointing", "bf16", "tf32", "keep_best", "compile"):
            require(isinstance(getattr(self, name), bool), f"{name} must be true or false, got {getattr(self, name)!r}")
        require_real("learning_rate", self.learning_rate, low=0.0, high=MAX_LEARNING_RATE, low_open=True,
                     hint=_LEARNING_RATE_HINT)
        require_real("weight_decay", self.weight_decay, low=0.0, high=MAX_WEIGHT_DECAY,
                     hint=" (AdamW multiplies every adapter weight by 1 - learning_rate x weight_decay at each step; "
                          "recipes use 0 to 0.05)")
        require_real("adam_beta2", self.adam_beta2, low=0.0, high=1.0, high_open=True)
        require_real("min_learning_rate", self.min_learning_rate, low=0.0, high=self.learning_rate, high_open=True)
        require(self.min_learning_rate == 0 or self.scheduler == "cosine", f"min_learning_rate floors the cosine "
               f"schedule: set scheduler: cosine, or min_learning_rate: 0 (scheduler is {self.scheduler!r})")
        require_real("max_grad_norm", self.max_grad_norm, low=0.0)
        require_int("warmup_steps", self.warmup_steps, minimum=0)
        require(isinstance(self.scheduler, str) and self.scheduler, f"scheduler must be a name, got {self.scheduler!r}")
        require_int("eval_every", self.eval_every, minimum=0)
        require_int("logging_steps", self.logging_steps)
        require_int("save_every", self.save_every, minimum=0)
        require_int("keep_checkpoints", self.keep_checkpoints)
        require_seed("seed", self.seed)
        require_int("output_verdict", self.output_verdict, minimum=0, what="(prompts decoded; 0: off)")
        require(isinstance(self.mode_column, str) and self.mode_column,
                f"mode_column must be a field's name, got {self.mode_column!r}", "mode_column")


__all__ = ["DataConfig", "TrainConfig"]
