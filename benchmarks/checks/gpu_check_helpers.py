"""What the GPU check's steps run in processes of their own (``python -m benchmarks.checks.gpu_check --internal NAME
-- ARGS``: ``internal_NAME``): the loramcl commands under a helper that prints the GPU's peaks, the model folders at
full size (random weights made on the GPU) or tiny in the dry run, the recipe copies and data that read them, and the
numbers read back from what a step wrote. A helper prints its numbers on a line ``GPU_CHECK {...}`` (``MARK``), which
the runner (benchmarks/checks/gpu_check.py) gathers into the summary.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.checks.gpu_check import Context

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "src" / "loramcl" / "recipes"
MARK = "GPU_CHECK "  # a line a step prints with its numbers: GPU_CHECK {"name": value, ...}
H100_GB = 80.0


def _report(**numbers) -> None:
    print(MARK + json.dumps(numbers), flush=True)


def _report_model(model, started: float) -> None:
    """A model folder's numbers: its parameters (billions) and the seconds it took to make and save."""
    _report(model_parameters_b=round(sum(p.numel() for p in model.parameters()) / 1e9, 2),
            model_folder_s=round(time.perf_counter() - started, 1))


def _gpu_peaks() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {}
    gb = 1e9
    return {"peak_allocated_gb": round(torch.cuda.max_memory_allocated() / gb, 2),
            "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / gb, 2)}


def internal_environment(ctx: Context, args: list[str]) -> None:
    import peft
    import torch
    import transformers

    numbers = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        numbers |= {"gpu": torch.cuda.get_device_name(), "gpu_memory_gb": round(total / 1e9, 1)}
    _report(**numbers)


def _accelerator(ctx: Context):
    """The dry run's commands run on a fake accelerator (benchmarks/checks/fake_accelerator.py: a second device
    computing on the CPU, where a tensor left on the CPU fails as it would beside a GPU's); the real run on the GPU as
    it is."""
    if not ctx.dry:
        return contextlib.nullcontext()
    from benchmarks.checks.fake_accelerator import fake_accelerator

    return fake_accelerator()


def internal_cli(ctx: Context, args: list[str]) -> None:
    """``loramcl ARGS`` in this process, then the GPU's peaks and the run's last logged step (train_log.json)."""
    from loramcl.cli import main

    with _accelerator(ctx):
        try:
            main(args)
        except SystemExit as exit:
            if exit.code not in (0, None):
                raise
    if args[0] in ("generate", "nll", "evaluate", "export"):  # training resets the peaks at each log: train_log
        _report(**{f"{args[0]}_{k}": v for k, v in _gpu_peaks().items()})


def internal_tiny_llama(ctx: Context, args: list[str]) -> None:
    """A tiny Llama (the real class, random weights) with a word-level tokenizer, and prompt/completion rows."""
    import torch

    from benchmarks.tiny import tiny_llama, word_tokenizer

    model_folder, data = Path(args[0]), Path(args[1])
    torch.manual_seed(0)
    tiny_llama().save_pretrained(model_folder)
    word_tokenizer().save_pretrained(model_folder)
    data.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", 32), ("test", 4)):
        with (data / f"{split}.jsonl").open("w") as f:
            for i in range(count):
                prompt = " ".join(f"w{3 + (i * 7 + j) % 40}" for j in range(5))
                answers = [f"w{50 + i % 5} w{60 + i % 3}", f"w{70 + i % 4}"]
                row = {"prompt": prompt, "completion": answers[i % 2]} if split == "train" else {
                    "id": str(i), "prompt": prompt, "references": answers}
                f.write(json.dumps(row) + "\n")


def internal_llama_model(ctx: Context, args: list[str]) -> None:
    """A Llama-2-7B-shaped folder (ALMA-7B's architecture) with random bf16 weights made on the GPU, and a word-level
    tokenizer standing in for its own; tiny on the CPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.common import build_model
    from benchmarks.studies.memory_plan import _llama2
    from benchmarks.tiny import VOCAB, word_tokenizer

    shape = _llama2() if not ctx.dry else dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=4)
    config = LlamaConfig(**{**shape, "vocab_size": 32000 if not ctx.dry else VOCAB, "bos_token_id": 1,
                            "eos_token_id": 2, "pad_token_id": 0})
    started = time.perf_counter()
    model = build_model(LlamaForCausalLM, config, ctx.host_device, getattr(torch, ctx.dtype))
    model.save_pretrained(args[0])
    word_tokenizer().save_pretrained(args[0])
    _report_model(model, started)


def internal_alma_data(ctx: Context, args: list[str]) -> None:
    """ALMA's prompt shape at its lengths (about 150 tokens an example, 50 of them the target) in prompt/completion
    rows of the stand-in tokenizer's words."""
    words = [f"w{i}" for i in range(3, 90)]
    with open(args[1], "w") as f:
        for i in range(64):
            source = " ".join(words[(i * 3 + j) % len(words)] for j in range(90))
            target = " ".join(words[(i * 5 + j) % len(words)] for j in range(50))
            f.write(json.dumps({"prompt": f"Translate this from English to German: {source}", "completion": target})
                    + "\n")


def internal_qwen2_audio_model(ctx: Context, args: list[str]) -> None:
    """A Qwen2-Audio-7B-shaped folder with random bf16 weights made on the GPU and a processor reading 30 s clips
    (128 mel bins, 750 audio tokens), its tokenizer a word-level stand-in; the tiny model on the CPU."""
    import torch
    from transformers import (
        GenerationConfig,
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    from loramcl.models import tiny_qwen2_audio
    from loramcl.recipes.audio_captioning.reproduce import SYNTHETIC_WORDS

    folder = Path(args[0])
    tiny_qwen2_audio(folder, SYNTHETIC_WORDS)  # the tokenizer and, on the CPU, the model
    if ctx.dry:
        return
    from benchmarks.common import build_model
    from benchmarks.speed.suite_shapes import SHAPES

    processor = Qwen2AudioProcessor.from_pretrained(folder)
    processor = Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128, chunk_length=30),
                                    tokenizer=processor.tokenizer, chat_template=processor.chat_template)
    config = Qwen2AudioConfig(**SHAPES["qwen2-audio"].config)
    config.audio_token_index = processor.tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    started = time.perf_counter()
    model = build_model(Qwen2AudioForConditionalGeneration, config, "cuda", torch.bfloat16)
    model.generation_config = GenerationConfig.from_pretrained(folder)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    _report_model(model, started)


def internal_clotho_recipe(ctx: Context, args: list[str]) -> None:
    """A copy of the Clotho recipe reading ``model`` and 8 clips of 30 s (4 on the CPU, 2 s) in Clotho's layout:
    one epoch of the recipe's batch of 2."""
    import numpy as np
    import yaml
    from scipy.io import wavfile

    model, recipe = Path(args[0]).absolute(), Path(args[1]).absolute()  # written into the copy: absolute paths
    shutil.copytree(RECIPES / "audio_captioning" / ("clotho" if not ctx.dry else "tiny"), recipe, dirs_exist_ok=True)
    root, clips, seconds = recipe / "clotho-data", 8 if not ctx.dry else 4, 30.0 if not ctx.dry else 1.0
    rng = np.random.default_rng(0)
    for split in ("development", "validation", "evaluation"):
        (root / split).mkdir(parents=True, exist_ok=True)
        rows = ["file_name,caption_1,caption_2,caption_3,caption_4,caption_5"]
        for n in range(clips):
            name = f"{split}_{n}.wav"
            wavfile.write(root / split / name, 44_100,
                          (rng.standard_normal(int(44_100 * seconds)) * 3000).astype(np.int16))
            rows.append(f"{name}," + ",".join(f"a low tone number {n} {i}" for i in range(5)))
        (root / f"clotho_captions_{split}.csv").write_text("\n".join(rows) + "\n")
    experiment = yaml.safe_load((recipe / "experiment.yaml").read_text())
    experiment |= {"out": str(recipe / "out"), "root": str(root), "synthetic": False, "epochs": 1}
    experiment.pop("packaged_model", None)
    (recipe / "experiment.yaml").write_text(yaml.safe_dump(experiment))
    common = yaml.safe_load((recipe / "common.yaml").read_text())
    common |= {"model": str(model), "eval_examples": 2}
    common["training"] |= {"logging_steps": 1, "eval_every": 0, "save_every": 0}
    (recipe / "common.yaml").write_text(yaml.safe_dump(common))


LLAVA_GRIDS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]  # LLaVA-1.6's anyres grids
LLAVA_IMAGE_TOKEN = 32000


def llava_next_processor():
    """LLaVA-1.6-Vicuna-7B's processor, built offline: LLaVA-NeXT's image processor from its defaults at 336 pixels
    with the model's grids (the PIL one: the GPU machine has no torchvision), and a word-level tokenizer standing in
    for Vicuna's (loramcl.models.tiny_llava_next_processor's, over the synthetic captions' words) with '<image>' at
    the model's image token and LLaVA's chat template."""
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

    from loramcl.models import tiny_llava_next_processor
    from loramcl.recipes.image_captioning.textcaps import SYNTHETIC_WORDS

    words = tiny_llava_next_processor(SYNTHETIC_WORDS, image_token_id=LLAVA_IMAGE_TOKEN)
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                                                 image_grid_pinpoints=LLAVA_GRIDS)
    return LlavaNextProcessor(image_processor=image_processor, tokenizer=words.tokenizer, patch_size=14,
                              vision_feature_select_strategy="default", chat_template=words.chat_template,
                              num_additional_image_tokens=1)


def llava_next_config():
    """LLaVA-1.6-Vicuna-7B's config: benchmarks/studies/memory_plan.py's shape (Llama-2-7B beside CLIP ViT-L/14 at 336
    pixels), its text vocabulary of 32,064 as the checkpoint's (the image token 32000 inside it)."""
    from transformers import LlavaNextConfig

    from benchmarks.studies.memory_plan import _CLIP_L336, _llama2

    return LlavaNextConfig(text_config={**_llama2(), "vocab_size": 32064}, vision_config=_CLIP_L336,
                           image_token_index=LLAVA_IMAGE_TOKEN, image_grid_pinpoints=LLAVA_GRIDS)


def internal_llava_next_model(ctx: Context, args: list[str]) -> None:
    """A LLaVA-NeXT-7B-shaped folder (llava_next_config) with random bf16 weights made on the GPU and the offline
    processor (llava_next_processor); on the CPU the tiny LLaVA-NeXT of the CPU recipe (loramcl.models)."""
    import torch

    from loramcl.models import tiny_llava_next
    from loramcl.recipes.image_captioning.textcaps import SYNTHETIC_WORDS

    folder = Path(args[0])
    if ctx.dry:
        tiny_llava_next(folder, SYNTHETIC_WORDS)
        return
    from transformers import LlavaNextForConditionalGeneration

    from benchmarks.common import build_model

    processor = llava_next_processor()
    tokenizer = processor.tokenizer
    started = time.perf_counter()
    model = build_model(LlavaNextForConditionalGeneration, llava_next_config(), "cuda", torch.bfloat16)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, name, getattr(tokenizer, name))
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    _report_model(model, started)


def internal_textcaps_recipe(ctx: Context, args: list[str]) -> None:
    """A copy of the TextCaps recipe (the tiny one on the CPU) reading ``model`` and a generated set in TextCaps 0.1's
    layout (loramcl's synthetic TextCaps: 8 training images, 5 captions each; anyres gives each up to 5 x 576
    patches at full size): 3 steps of the recipe's batch of 8."""
    import yaml

    from loramcl.recipes.image_captioning.textcaps import write_synthetic_textcaps

    model, recipe = Path(args[0]).absolute(), Path(args[1]).absolute()  # written into the copy: absolute paths
    shutil.copytree(RECIPES / "image_captioning" / ("textcaps" if not ctx.dry else "tiny"), recipe, dirs_exist_ok=True)
    data = write_synthetic_textcaps(recipe / "textcaps-data", {"train": 8, "val": 2})
    experiment = yaml.safe_load((recipe / "experiment.yaml").read_text())
    experiment |= {"out": str(recipe / "out"), "textcaps": str(data), "images": str(data / "images"),
                   "synthetic": False}
    experiment.pop("packaged_model", None)
    (recipe / "experiment.yaml").write_text(yaml.safe_dump(experiment))
    common = yaml.safe_load((recipe / "common.yaml").read_text())
    common |= {"model": str(model)}
    common["training"] |= {"steps": 3, "warmup_steps": 0, "logging_steps": 1, "eval_every": 0, "save_every": 0}
    (recipe / "common.yaml").write_text(yaml.safe_dump(common))


def internal_compiled_numbers(ctx: Context, args: list[str]) -> None:
    """The suite's compiled and peers rows (OUT/suite-*.json) as the summary's numbers: per decoding row the bare
    base and loramcl K = 5 eager and compiled (ms per generate) and their ratios, PEFT's mixed-adapter batch of the
    same rows; per training row eager and compiled (ms a step)."""
    results = json.loads(next(Path(args[0]).glob("suite-*.json")).read_text())
    numbers = {}
    for row in results["compiled"]:
        if row.get("training"):
            numbers |= {f"train_k{row['k']}_eager_ms": round(row["eager_ms"], 1),
                        f"train_k{row['k']}_compiled_ms": round(row["compiled_ms"], 1)}
            continue
        name = "greedy" if row["strategy"] == "greedy" else "beam2"
        numbers |= {f"{name}_{side}_ms": round(row[f"{side}_ms"], 1)
                    for side in ("bare", "bare-compiled", "loramcl", "loramcl-compiled")}
        numbers[f"{name}_compiled_over_bare_compiled"] = round(row["compiled_over_bare_compiled"], 2)
    for row in results["peers"] if isinstance(results["peers"], list) else []:
        name = "greedy" if row["strategy"] == "greedy" else "beam2"
        numbers |= {f"{name}_peft_ms": round(row["peft_ms"], 1),
                    f"{name}_peft_over_loramcl": round(row["peft_over_loramcl"], 2)}
    _report(**numbers)


def internal_quick_recipe(ctx: Context, args: list[str]) -> None:
    """A copy of a task's CPU recipe in bf16 on the GPU, scored with the metrics that need no Java (pycocoevalcap
    and its jars are not carried to the GPU machine)."""
    import yaml

    folder, recipe = args[0], Path(args[1]).absolute()  # written into the copy: absolute paths
    shutil.copytree(RECIPES / folder / "tiny", recipe, dirs_exist_ok=True)
    experiment = yaml.safe_load((recipe / "experiment.yaml").read_text())
    experiment |= {"out": str(recipe / "out"), "metrics": "sacrebleu,chrf"}
    (recipe / "experiment.yaml").write_text(yaml.safe_dump(experiment))
    common = yaml.safe_load((recipe / "common.yaml").read_text())
    common["dtype"] = ctx.dtype
    (recipe / "common.yaml").write_text(yaml.safe_dump(common))


def internal_plan(ctx: Context, args: list[str]) -> None:
    """A recipe run's training log read back (train_log.json: the peak allocated and reserved memory over its logs,
    the last log's step time, tokens per second and MFU: the steady state after the warm-up step) beside the memory
    plan's training peak, and what is left of an H100's 80 GB."""
    recipe, run, folder = args[0], args[1], Path(args[2])
    history = json.loads((folder / "train_log.json").read_text())
    history = history.get("log_history", history) if isinstance(history, dict) else history
    speeds = [entry for entry in history if "step_time" in entry]
    if not speeds:
        raise SystemExit(f"{folder}/train_log.json has no step_time: the run logged no training step")
    last = speeds[-1]
    numbers = {"step_time_s": round(last["step_time"], 3), "tokens_per_s": round(last["tokens_per_second"]),
               "labelled_tokens_per_s": round(last["labelled_tokens_per_second"])}
    if "mfu" in last:
        numbers["mfu"] = round(last["mfu"], 3)
    for name in ("peak_allocated_gb", "peak_reserved_gb"):
        if any(name in entry for entry in speeds):
            numbers[name] = round(max(entry.get(name, 0.0) for entry in speeds), 2)
    if "peak_reserved_gb" in numbers:
        numbers["h100_margin_gb"] = round(H100_GB - numbers["peak_reserved_gb"], 1)
    if not ctx.dry:
        from benchmarks.studies.memory_plan import plan_recipe

        plan = next(p for p in plan_recipe(recipe) if p.run == run)
        numbers["plan_training_gb"] = round(plan.training / 1e9, 1)
    _report(**numbers)


def internal_qlora(ctx: Context, args: list[str]) -> None:
    """bitsandbytes nf4 and int8 bases: a training step, decoding, and hypothesis 1 exported to PEFT giving PEFT's
    logits on the same quantized base."""
    import torch
    from peft import PeftModel
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    from benchmarks.tiny import tiny_llama
    from loramcl import MCLConfig, get_mcl_model

    folder = ctx.work / "qlora-base"
    torch.manual_seed(0)
    tiny_llama(vocab_size=128, hidden_size=64, intermediate_size=128,
               max_position_embeddings=2048).save_pretrained(folder)
    compute = torch.bfloat16 if not ctx.dry else torch.float32
    kinds = {"nf4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute),
             "int8": BitsAndBytesConfig(load_in_8bit=True)}
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0)).to(ctx.host_device)
    for kind, quantization in kinds.items():
        def base():
            return LlamaForCausalLM.from_pretrained(folder, quantization_config=quantization,
                                                    device_map=ctx.host_device,
                                                    dtype=compute)

        mcl = get_mcl_model(base(), MCLConfig(num_hypotheses=2, r=4, target_modules=["q_proj", "v_proj"],
                                              loss="relaxed", epsilon=0.1))
        optimizer = torch.optim.AdamW([p for p in mcl.parameters() if p.requires_grad], lr=1e-2)
        loss = mcl(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        mcl.eval()
        with mcl.use_hypotheses(1):
            generated = mcl.generate(input_ids=ids[:, :6], max_new_tokens=4, do_sample=False)
        mcl.export_hypothesis(1, ctx.work / f"qlora-{kind}-h1")
        with torch.no_grad():
            ours = mcl(input_ids=ids, hypotheses=1).logits.float()
            theirs = PeftModel.from_pretrained(base(), ctx.work / f"qlora-{kind}-h1").eval()(input_ids=ids).logits
        gap = (ours.squeeze(1) - theirs.float()).abs().max().item()
        print(f"{kind}: loss {loss.item():.3f}, decoded {tuple(generated.shape)}, |ours - PEFT| {gap:.2e}")
        if not gap < 0.05:
            raise SystemExit(f"{kind}: hypothesis 1 exported to PEFT differs from loramcl by {gap}")
        _report(**{f"{kind}_peft_gap": float(f"{gap:.2e}")})


def internal_remove(ctx: Context, args: list[str]) -> None:
    """A model folder removed once its step is done: full-size folders are 14-17 GB of the machine's disk."""
    shutil.rmtree(args[0], ignore_errors=True)


INTERNAL = {name[len("internal_"):].replace("_", "-"): function for name, function in globals().items()
            if name.startswith("internal_")}
