"""The memory plan of the paper-scale recipes, with no GPU: each recipe's model is built on the meta device (shapes,
no memory) and its training and decoding peaks on one GPU are estimated from its YAML files, part by part:

- weights: the frozen base in bf16 and the adapters in float32 (counted on the meta model, as loaded);
- gradients and AdamW's two moments: float32, adapters only;
- saved activations: bytes per token and layer of each trained stack (the language model; Qwen2-Audio's encoder,
  which holds adapters too), measured on tiny models of the same classes at two widths (the ratios of the real
  model kept) and extrapolated linearly in the width; times the rows that carry a gradient (relaxed and annealed MCL:
  K x the micro-batch; two-pass WTA and LoRA-MLE: the micro-batch) and the tokens of an example. With activation
  checkpointing each layer keeps its input only, and one layer is recomputed at a time;
- the output layer: chunks of 256 label tokens over the vocabulary (float32 logits, their log-softmax, the gradient);
- decoding: the weights, the KV cache of every row (examples x budget) over prompt and new tokens, the last
  step's float32 logits (three copies: logits, processed scores, output), one layer's prefill working set.

The estimate is checked against a measured CPU run at a small shape (tests/recipes/test_memory_plan.py): the
bytes the tensors held at the training peak occupy, counted as autograd saves them.

    python -m benchmarks.studies.memory_plan                  # the table of docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

GB = 1e9
GPU_BYTES = 80 * GB
# A plan fits when it leaves 10% of the card free: the CUDA context, the caching allocator's fragmentation and
# kernels' workspaces take a few GB that no tensor count sees.
FITS = 0.9 * GPU_BYTES
LOGITS_CHUNK = 256  # MCLConfig.logits_chunk_size's default
CALIBRATION_TOKENS = 16
RECIPES = Path(__file__).resolve().parents[2] / "src" / "loramcl" / "recipes"


def _llama2(**extra) -> dict:  # Llama-2-7B's shape: ALMA-7B and LLaVA-1.6-Vicuna-7B's language model
    return dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
                **extra)


_QWEN2_AUDIO_TEXT = dict(model_type="qwen2", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32, vocab_size=156032,
                         max_position_embeddings=8192)
_QWEN2_AUDIO_ENCODER = dict(d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
                            num_mel_bins=128, max_source_positions=1500)
_CLIP_L336 = dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                  num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768)


def build_meta(family: str) -> nn.Module:
    """The recipe's model on the meta device, in bf16 (its config as the real checkpoint's config.json has it)."""
    import transformers as tf

    if family == "llama2":
        config = tf.LlamaConfig(**_llama2())
        model_class = tf.LlamaForCausalLM
    elif family == "qwen2_audio":
        config = tf.Qwen2AudioConfig(audio_config=_QWEN2_AUDIO_ENCODER, text_config=_QWEN2_AUDIO_TEXT,
                                     audio_token_index=151646)
        model_class = tf.Qwen2AudioForConditionalGeneration
    else:  # llava_next: LLaVA-1.6-Vicuna-7B
        config = tf.LlavaNextConfig(text_config=_llama2(), vision_config=_CLIP_L336, image_token_index=32000,
                                    image_grid_pinpoints=[[336, 672], [672, 336], [672, 672], [1008, 336],
                                                          [336, 1008]])
        model_class = tf.LlavaNextForConditionalGeneration
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            return model_class(config)
    finally:
        torch.set_default_dtype(previous)


@dataclass(frozen=True)
class Workload:
    """What one example of a paper-scale recipe puts through the model, and how it is decoded."""

    recipe: str  # its folder under src/loramcl/recipes
    family: str  # build_meta's
    lm_tokens: int  # tokens of one training example in the language model (prompt, image/audio tokens, target)
    label_tokens: int  # of which the target's
    encoder_positions: int  # positions of the trained audio encoder (0: no encoder holds adapters)
    note: str


WORKLOADS = {w.recipe: w for w in [
    Workload("translation/alma", "llama2", 150, 50, 0,
             "ALMA's prompt and a WMT'22 sentence pair: about 150 tokens"),
    Workload("image_captioning/textcaps", "llava_next", 2500, 20, 0,
             "LLaVA-NeXT's any-resolution image: up to 5 x 576 patches (about 2.4k after unpadding), and a caption"),
    Workload("image_captioning/textcaps-bilingual", "llava_next", 2500, 30, 0,
             "as textcaps; captions in English or French"),
    Workload("audio_captioning/audiocaps", "qwen2_audio", 290, 20, 1500,
             "a 10 s clip: 250 audio tokens; the encoder always reads 30 s of features (1500 positions)"),
    Workload("audio_captioning/clotho", "qwen2_audio", 800, 25, 1500,
             "a 30 s clip: 750 audio tokens, and a caption"),
]}


# ---- the recipe's settings --------------------------------------------------------------------------------------

def recipe_runs(recipe: str) -> dict[str, dict]:
    """Every training run of a recipe folder: its file name -> the merged settings of common.yaml and the run's."""
    import yaml

    folder = RECIPES / recipe
    common = yaml.safe_load((folder / "common.yaml").read_text())
    runs = {}
    for path in sorted(folder.glob("*.yaml")):
        if path.name in ("common.yaml", "experiment.yaml"):
            continue
        own = yaml.safe_load(path.read_text())
        runs[path.stem] = {**common, **own, "training": {**common.get("training", {}), **own.get("training", {})}}
    return runs


def method_config(settings: dict):
    """The run's MCLConfig (LoRA-MCL and LoRA-MLE runs; None for the baselines)."""
    from loramcl import MCLConfig

    return MCLConfig(**settings["mcl"]) if "mcl" in settings else None


def gradient_rows(config, micro_batch: int) -> int:
    """Rows of one micro-batch that run forward and backward: all K copies for relaxed and annealed MCL; the winners
    only for vanilla WTA (two-pass, MCLTrainer's default); the batch for LoRA-MLE (K = 1)."""
    if config.num_hypotheses > 1 and config.loss != "wta":
        return config.num_hypotheses * micro_batch
    return micro_batch


# ---- saved activations, measured on tiny models --------------------------------------------------------------

def saved_bytes(module: nn.Module, run) -> int:
    """Bytes of the tensors autograd saves for the backward pass while ``run()`` runs, each storage counted once
    (views share it), the module's parameters left out (they are held anyway)."""
    held = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in held and tensor.device.type != "meta":
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(storages.values())


def add_adapters(module: nn.Module, targets: list[str], config) -> None:
    """MCL adapters (stacked routing: the rows are K copies of the batch) on ``module``'s linear layers named in
    ``targets``, as get_mcl_model puts them, for a stack that is not a whole model."""
    from loramcl.mcl.layers import HypothesisRouting, MCLLoraLinear

    routing = HypothesisRouting()
    for name, child in list(module.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in targets and isinstance(child, nn.Linear):
            parent = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
            setattr(parent, leaf, MCLLoraLinear(child, routing, config.num_hypotheses, config.r, config.alpha,
                                                config.dropout, adapter_dtype=torch.float32))


def _tiny_stack(stack: str, real: dict, width: int, layers: int, positions: int) -> tuple[nn.Module, callable]:
    """A tiny ``stack`` ("lm": the config ``real`` of a language model; "encoder": Qwen2-Audio's encoder of config
    ``real``) at hidden size ``width`` with ``layers`` layers, the real model's ratios kept (MLP / hidden; heads of
    16): (module, a function of (rows, tokens) running it; the encoder runs its ``positions``)."""
    import transformers as tf

    if stack == "encoder":
        config = tf.Qwen2AudioEncoderConfig(**dict(real, d_model=width, encoder_layers=layers,
                                                   encoder_attention_heads=width // 16, num_mel_bins=16,
                                                   encoder_ffn_dim=width * real["encoder_ffn_dim"] // real["d_model"],
                                                   max_source_positions=positions))
        config._attn_implementation = "sdpa"
        module = tf.Qwen2AudioEncoder(config)

        def run(rows, tokens):  # the encoder's positions: every max_source_positions, from two mel frames each
            return module(torch.randn(rows, 16, 2 * config.max_source_positions, dtype=torch.bfloat16))
        return module, run
    heads = width // 16
    config = tf.AutoConfig.for_model(**dict(real, hidden_size=width, num_hidden_layers=layers, vocab_size=64,
                                            intermediate_size=width * real["intermediate_size"] // real["hidden_size"],
                                            num_attention_heads=heads,
                                            num_key_value_heads=heads * real["num_key_value_heads"]
                                            // real["num_attention_heads"]))
    config._attn_implementation = "sdpa"
    module = tf.AutoModel.from_config(config)

    def run(rows, tokens):
        return module(inputs_embeds=torch.randn(rows, tokens, width, dtype=torch.bfloat16))
    return module, run


def layer_bytes_per_token(stack: str, real: dict, targets: list[str], config, widths=(64, 128)) -> float:
    """Saved bytes per token of one layer of ``stack`` at the real model's width, measured on tiny bf16 stacks: the
    difference between two layers and one is a layer (the first holds less: nothing before it needs a gradient),
    the difference between two lengths is per token (the bf16 copies of the adapter weights are per layer, not per
    token), and two widths give the line extrapolated to the real width."""
    per_width = []
    torch.manual_seed(0)
    rows = config.num_hypotheses
    for width in widths:
        measured = {}
        for layers in (1, 2):
            for tokens in (1, 2):
                module, run = _tiny_stack(stack, real, width, layers, tokens * CALIBRATION_TOKENS)
                module = module.to(torch.bfloat16).requires_grad_(False)
                add_adapters(module, targets, config)
                measured[layers, tokens] = saved_bytes(module, lambda: run(rows, tokens * CALIBRATION_TOKENS))
        per_layer = [measured[2, tokens] - measured[1, tokens] for tokens in (1, 2)]
        per_width.append((per_layer[1] - per_layer[0]) / (rows * CALIBRATION_TOKENS))
    slope = (per_width[1] - per_width[0]) / (widths[1] - widths[0])
    return per_width[0] + slope * (real["d_model" if stack == "encoder" else "hidden_size"] - widths[0])


# ---- the plan ----------------------------------------------------------------------------------------------------

@dataclass
class Plan:
    recipe: str
    run: str
    micro_batch: int
    accumulation: int
    rows: int
    checkpointing: bool
    weights: float
    optimizer: float  # gradients and AdamW's moments
    activations: float
    logits: float
    decoding: float

    @property
    def training(self) -> float:
        return self.weights + self.optimizer + self.activations + self.logits


def stack_configs(family: str) -> dict[str, dict]:
    """The config of each stack of ``family`` that can hold adapters: the language model, Qwen2-Audio's encoder."""
    if family == "qwen2_audio":
        return {"lm": _QWEN2_AUDIO_TEXT, "encoder": _QWEN2_AUDIO_ENCODER}
    return {"lm": _llama2()}


def training_parts(model: nn.Module, config, micro_batch: int, checkpointing: bool, label_tokens: int,
                   trained_stacks: list[tuple[int, int, int, float]]) -> dict[str, float]:
    """Bytes of a training step's peak, by part, for ``model`` (on the meta device, adapters on) trained with
    ``config``: ``trained_stacks`` holds (layers, hidden size, positions per example, saved bytes per token and
    layer) of each stack with adapters."""
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    rows = gradient_rows(config, micro_batch)
    activations = 0.0
    for layers, hidden, positions, per_token in trained_stacks:
        one_layer = per_token * rows * positions
        if checkpointing:  # each layer's input kept (bf16); one layer recomputed at a time
            activations += layers * rows * positions * hidden * 2 + one_layer
        else:
            activations += layers * one_layer
    vocabulary = model.config.get_text_config().vocab_size
    logits = min(rows * label_tokens, LOGITS_CHUNK) * vocabulary * 4 * 3  # float32 logits, log-softmax, gradient
    return {"weights": every, "optimizer": 3 * trained, "activations": activations, "logits": logits, "rows": rows}


def decoding_rows(recipe: str) -> tuple[int, int]:
    """(rows decoded at once, new tokens) of a recipe's experiment.yaml: its decoding batch of examples times its
    largest budget (LoRA-MLE: beams; LoRA-MCL: K hypotheses x beams), and decoding.max_new_tokens."""
    import yaml

    experiment = yaml.safe_load((RECIPES / recipe / "experiment.yaml").read_text())
    decoding = experiment.get("decoding", {})
    return decoding["batch_size"] * max(experiment["budgets"]), decoding["max_new_tokens"]


def decoding_bytes(model: nn.Module, workload: Workload) -> float:
    """Decoding peak: weights, every row's KV cache, the last step's logits, one layer's prefill working set."""
    text = model.config.get_text_config()
    rows, new_tokens = decoding_rows(workload.recipe)
    head_dim = text.hidden_size // text.num_attention_heads
    kv = (rows * (workload.lm_tokens + new_tokens) * text.num_hidden_layers * 2
          * text.num_key_value_heads * head_dim * 2)
    prefill = rows * workload.lm_tokens * (2 * text.intermediate_size + 4 * text.hidden_size) * 2
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return weights + kv + prefill + rows * text.vocab_size * 4 * 3


def plan_run(workload: Workload, run: str, settings: dict, calibration: dict) -> Plan | None:
    """The training and decoding peak of one run of a recipe on one GPU (None: a baseline: its rows are the
    micro-batch's, fewer than LoRA-MCL's K copies, so the recipe's MCL runs bound it)."""
    from loramcl import get_mcl_model

    config = method_config(settings)
    if config is None:
        return None
    training = settings["training"]
    batch, accumulation = training.get("batch_size", 16), training.get("gradient_accumulation_steps", 1)
    checkpointing = training.get("activation_checkpointing", False)
    model = get_mcl_model(build_meta(workload.family), config)
    text = model.config.get_text_config()
    trained_stacks = [(text.num_hidden_layers, text.hidden_size, workload.lm_tokens, calibration["lm", run])]
    if workload.encoder_positions:
        audio = model.config.audio_config
        trained_stacks.append((audio.encoder_layers, audio.d_model, workload.encoder_positions,
                               calibration["encoder", run]))
    parts = training_parts(model, config, batch // accumulation, checkpointing, workload.label_tokens, trained_stacks)
    return Plan(workload.recipe, run, batch // accumulation, accumulation, parts["rows"], checkpointing,
                parts["weights"], parts["optimizer"], parts["activations"], parts["logits"],
                decoding_bytes(model, workload))


def calibrate(workload: Workload, runs: dict[str, dict]) -> dict:
    """Saved bytes per token and layer of every (stack, run) the recipe trains."""
    found = {}
    for run, settings in runs.items():
        config = method_config(settings)
        if config is None:
            continue
        for stack in ("lm", "encoder") if workload.encoder_positions else ("lm",):
            found[stack, run] = _calibration(stack, workload.family, tuple(_target_leaves(config.target_modules)),
                                             config.num_hypotheses, config.r, config.dropout)
    return found


@functools.cache
def _calibration(stack: str, family: str, targets: tuple[str, ...], hypotheses: int, r: int, dropout: float) -> float:
    """layer_bytes_per_token, once per setting that changes it (runs differing in their loss share it)."""
    from loramcl import MCLConfig

    config = MCLConfig(num_hypotheses=hypotheses, r=r, alpha=r, dropout=dropout, target_modules=list(targets))
    return layer_bytes_per_token(stack, stack_configs(family)[stack], list(targets), config)


def _target_leaves(targets) -> list[str]:
    """The layer names a target list or regular expression adapts (the regex's alternatives)."""
    if isinstance(targets, str):
        inner = targets[targets.rindex("(") + 1:targets.rindex(")")]
        return inner.split("|")
    return list(targets)


def plan_recipe(recipe: str) -> list[Plan]:
    workload = WORKLOADS[recipe]
    runs = recipe_runs(recipe)
    calibration = calibrate(workload, runs)
    return [plan for run, settings in runs.items() if (plan := plan_run(workload, run, settings, calibration))]


def table(plans: list[Plan]) -> str:
    lines = ["| recipe | run | micro-batch x accumulation | rows with gradient | act. ckpt | weights | adapters' "
             "grads + AdamW | activations | logits | training peak | decoding peak |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in plans:
        lines.append(f"| {p.recipe} | {p.run} | {p.micro_batch} x {p.accumulation} | {p.rows} | "
                     f"{'yes' if p.checkpointing else 'no'} | {p.weights / GB:.1f} | {p.optimizer / GB:.2f} | "
                     f"{p.activations / GB:.1f} | {p.logits / GB:.2f} | **{p.training / GB:.1f}** | "
                     f"{p.decoding / GB:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", choices=list(WORKLOADS), action="append",
                        help="a paper-scale recipe (default: all of them)")
    args = parser.parse_args()
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.set_num_threads(1)
    plans = [plan for recipe in args.recipe or WORKLOADS for plan in plan_recipe(recipe)]
    print(f"GB = 1e9 bytes; a plan fits one 80 GB GPU under {FITS / GB:.0f} GB")
    print(table(plans))
    over = [f"{p.recipe}/{p.run}" for p in plans if max(p.training, p.decoding) > FITS]
    print("every run fits" if not over else f"over {FITS / GB:.0f} GB: {', '.join(over)}")


if __name__ == "__main__":
    main()
