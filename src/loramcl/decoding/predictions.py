"""A predictions file: the K candidates of every prompt of a JSONL file, one line per prompt as `loramcl evaluate`
reads them. ``generate`` writes one (it is `loramcl generate`: its signature and docstring are the CLI, jsonargparse;
the recipes call it as a function); ``prediction_record`` is one line, for recipes that decode inputs of their own
(images, audio).

torch and transformers load inside ``generate``, so `loramcl --help` stays fast.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from loramcl.decoding.options import DecodedModel, Decoding, plan
from loramcl.utils.files import read_jsonl, write_atomically
from loramcl.utils.inputs import (
    MCL_CONFIG,
    Dtype,
    LocalPath,
    ModelPath,
    PositionLimits,
    Quantization,
    check_device,
    check_file,
    check_model_options,
    check_output,
    model_positions,
    prompt_format,
    record_line,
    record_names,
)
from loramcl.utils.threads import check_threads, use_threads
from loramcl.utils.validate import OptionError, require_int


def generate(
    model: ModelPath,
    input: LocalPath,
    out: LocalPath = "preds.jsonl",
    adapters: LocalPath | None = None,
    tokenizer: LocalPath | None = None,
    augment: str | None = None,
    batch_size: int = 8,
    prompt_key: str = "prompt",
    chat_template: bool | None = None,
    dtype: Dtype = "float32",
    device: str = "cpu",
    threads: int | None = None,
    progress: bool = True,
    sort_by_score: bool = False,
    strict: bool = False,
    quantization: Quantization | None = None,
    dedupe: bool = False,
    **decoding,
) -> str:
    """Decode K candidates per prompt of a JSONL file; write them as `loramcl evaluate` reads predictions.

    With MCL adapters, candidate k is hypothesis k's output (all hypotheses decoded in one batched generate per
    batch). With a PEFT adapter or none, the model is a single-model baseline and needs --num_sequences K.

    Args:
        model: local folder of the base model (transformers format; a causal or a sequence-to-sequence LM).
        input: JSONL, one object per prompt: {"id": ..., "prompt": "..."} ("id" optional: the line's index); the
            prompt may be a conversation (a list of {"role", "content"} messages, rendered by the chat template with
            its generation prompt), and a file of {"messages": [...]} rows is decoded from each conversation's last
            user turn (docs/guide/data.md).
        out: output JSONL, one line per prompt: {"id", "candidates": [K texts], "log_probs": [K floats]} (+
            "hypotheses" for an MCL model, + "scores": [K p(k|c)] for one with hypothesis scores). log_probs: sum of
            the generated tokens' log-probabilities under the model's raw distribution (before repetition penalty,
            temperature or filtering).
        adapters: a folder written by MCLModel.save_pretrained / MCLTrainer / `loramcl train` (MCL hypotheses, or
            a LoRA-MoE or multi-head MCL baseline), or a PEFT adapter folder (a LoRA-MLE baseline); none: the base
            model itself.
        tokenizer: tokenizer folder (default: the model folder).
        augment: tta: "package.module:function", a function (inputs, k) -> perturbed inputs.
        batch_size: prompts per generate call (an MCL model decodes K x batch_size rows at once).
        prompt_key: field of the input lines holding the prompt.
        chat_template: wrap each prompt as a user message with the tokenizer's chat template (default: as the
            training run of `adapters` did, from its run.json beside them or, for OUT/peft, in OUT; without one, no).
        dtype: float32, bfloat16 or float16.
        device: e.g. cpu, cuda, cuda:1.
        threads: torch CPU threads (default: the cores that are free when the command starts).
        sort_by_score: an MCL model with hypothesis scores: each prompt's candidates most probable first.
        progress: a progress bar (prompts decoded) on stderr.
        strict: refuse adapters saved on a base model with other weights (their recorded fingerprint differs from
            the model's), and adapter files that cannot be verified (no checksum, no fingerprint) or whose tensors
            were converted after save; by default each is a warning.
        quantization: the base model quantized as it loads (nf4, fp4, int8, torchao-int8:
            docs/guide/quantization.md); default: as the training run of `adapters` did (its run.json), else none.
        dedupe: keep each candidate text once per prompt (case, punctuation, the articles a/an/the and white space
            aside: ``loramcl.metrics.short_answers.normalise_answer``), the first, best-ranked one. Beam search of a
            single model returns all its num_beams beams and keeps the K first distinct ones, so set num_beams above
            K to have spares; other decodings have none, so a line may hold fewer than K candidates: the command
            says how many prompts have fewer, and `loramcl evaluate --dedupe true` reads such lines.
        decoding: the options of ``loramcl.decoding.Decoding`` (strategy, num_beams or budget, num_sequences,
            hypotheses, max_new_tokens, repetition_penalty, temperature, top_k, top_p, typical_p, seed,
            num_beam_groups, diversity_penalty); seed + b seeds batch b.
    """
    from loramcl.data.prompts import prompt_text

    # Mistakes in the options, the files and the folders are reported before torch loads (seconds).
    options = Decoding(**decoding)
    require_int("batch_size", batch_size)
    check_threads(threads)
    check_model_options(model, dtype, adapters)
    if tokenizer is not None and not os.path.isdir(tokenizer):
        raise FileNotFoundError(f"tokenizer folder {tokenizer} does not exist")
    check_output(out, folder=False, example="preds.jsonl")
    ids, prompts = read_prompts(input, prompt_key)
    chat_template = prompt_format(adapters, chat_template) or isinstance(prompts[0], list)
    limits = model_positions(model)
    check_generated_positions(limits, options.max_new_tokens)

    from tqdm import tqdm
    from transformers import AutoTokenizer

    from loramcl.decoding.strategies import generate_hypotheses, tokenize_prompts
    from loramcl.models.load import load_model

    check_device(device)
    use_threads(threads)
    tok = AutoTokenizer.from_pretrained(tokenizer or model)
    texts = [prompt_text(tok, p, chat_template) for p in prompts]
    lengths = [len(tokens) for tokens in tok(texts, add_special_tokens=not chat_template)["input_ids"]]
    check_generated_positions(limits, options.max_new_tokens, input, lengths)
    wanted = None  # candidates per prompt, with dedupe
    if (decoded := decoded_model_of(adapters)) is not None:  # the decoding against the adapters' kind and K
        planned = plan(options, decoded, augment=augment is not None, sort_by_score=sort_by_score)
        wanted = len(planned.selected) if planned.mcl else options.num_sequences
        if dedupe and options.strategy == "beam" and not planned.mcl and planned.num_beams > wanted:
            # every beam returned: the spares replace the duplicates
            options = dataclasses.replace(options, num_beams=planned.num_beams, budget=None,
                                          num_sequences=planned.num_beams)
    decoder = load_model(model, adapters, dtype, device, strict=strict, quantization=quantization)
    augment_fn = _import_function(augment) if augment else None

    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(prompts), unit="prompt", desc="generate", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    candidates_per_prompt = []
    from loramcl.metrics.short_answers import deduplicate

    def write(path: str) -> None:
        with bar, open(path, "w", encoding="utf-8") as f:
            for b, start in enumerate(range(0, len(prompts), batch_size)):
                chunk = prompts[start:start + batch_size]
                # as training tokenized them (loramcl.data.prompts): the chat template writes its own special tokens
                texts = [prompt_text(tok, p, chat_template) for p in chunk]
                batch = tokenize_prompts(decoder, tok, texts, add_special_tokens=not chat_template)
                seed = None if options.seed is None else options.seed + b
                outs = generate_hypotheses(decoder, tok, batch, decoding=options, seed=seed, augment=augment_fn,
                                           sort_by_score=sort_by_score)
                for item_id, candidates in zip(ids[start:start + batch_size], outs, strict=True):
                    if dedupe:
                        candidates = [candidates[i] for i in deduplicate([c.text for c in candidates])][:wanted]
                        candidates_per_prompt.append(len(candidates))
                    record = prediction_record(item_id, candidates, strip=False, scores=True)
                    f.write(json.dumps(record, ensure_ascii=False) + "\n")
                if not dedupe:
                    candidates_per_prompt.append(len(outs[0]))
                bar.update(len(chunk))

    # under a temporary name until every prompt is decoded: a failure leaves an existing file as it was
    write_atomically(out_path, write)
    per_prompt = max(candidates_per_prompt)
    print(f"{len(prompts)} prompts x {per_prompt} candidates ({options.strategy}): {out_path}")
    if dedupe:
        fewer = [n for n in candidates_per_prompt if n < (wanted or per_prompt)]
        print(f"--dedupe: {len(fewer)} of {len(prompts)} prompts have fewer than {wanted or per_prompt} distinct "
              f"candidates" + (f" (as few as {min(fewer)}); `loramcl evaluate --dedupe true` reads them" if fewer
                               else ""))
    return str(out_path)


def decoded_model_of(adapters: str | None) -> DecodedModel | None:
    """What ``generate`` decodes with ``adapters`` (MCL adapters and their K, a baseline, a PEFT adapter, or none),
    read from their mcl_config.json before the model loads; None when that file cannot be read (loading it says
    why)."""
    if adapters is None:
        return DecodedModel(None, name="the base model (no adapters)")
    path = Path(adapters) / MCL_CONFIG
    if not path.is_file():
        return DecodedModel(None, name="a PEFT adapter")
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        method = saved.get("method", "mcl")
        config = saved[f"{method}_config"]
        k = 1 if method == "moe" else config["num_hypotheses"]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        return None
    names = {"moe": "the LoRA-MoE model", "multihead": "the multi-head model"}
    return DecodedModel(k, router=method == "moe", scoring=config.get("scoring") is True,
                        name=names.get(method, "the model"), context_once=config.get("adapt_context") is False)


def prediction_record(item_id, candidates: Sequence, strip: bool = True, scores: bool = False) -> dict:
    """One line of a predictions file as `loramcl evaluate` reads it, from an input's ``Candidate``s: {"id",
    "candidates", "log_probs"} (+ "hypotheses" for an MCL model's candidates; + "scores", p(k | c), with ``scores``
    for a model with hypothesis scores). ``strip``: the texts without surrounding white space."""
    record = {"id": item_id, "candidates": [c.text.strip() if strip else c.text for c in candidates],
              "log_probs": [c.log_prob for c in candidates]}
    if candidates and candidates[0].hypothesis is not None:
        record["hypotheses"] = [c.hypothesis for c in candidates]
    if scores and candidates and candidates[0].score is not None:
        record["scores"] = [c.score for c in candidates]
    return record


def read_prompts(path: str, prompt_key: str) -> tuple[list, list[str | list[dict]]]:
    """(ids, prompts) of a JSONL file of prompts: each line's "id" (else its index) and its ``prompt_key`` field, a
    text or a conversation (a list of {"role", "content"} messages ending on a user turn); a file of "messages" rows
    (a training file: docs/guide/data.md) gives each conversation up to its last user turn."""
    from loramcl.data.formats import prompt_of
    from loramcl.utils.files import json_lines

    check_file(path, "input file")
    first = next((record for _, _, record in json_lines(path)), None)
    field = "messages" if isinstance(first, dict) and prompt_key not in first and "messages" in first else prompt_key
    records = read_jsonl(path, field, number_missing_ids=True, hint=" (choose the field with --prompt_key)")
    name = record_names(path)  # the file's line table read once, not once per record
    prompts = [prompt_of(record[field], name(index), field) for index, record in enumerate(records.values())]
    if len({isinstance(p, str) for p in prompts}) > 1:
        index = next(i for i, p in enumerate(prompts) if isinstance(p, str) != isinstance(prompts[0], str))
        kind = "a text" if isinstance(prompts[index], str) else "a conversation"
        raise ValueError(f'{path}:{record_line(path, index)}: "{field}" is {kind}, and on the first line it is not: '
                         "one format per file")
    return list(records), prompts


def check_generated_positions(limits: PositionLimits, max_new_tokens: int, path: str | None = None,
                              lengths: list[int] | None = None) -> None:
    """Before decoding: each prompt of ``path`` (``lengths``: its tokens; None: a prompt of one token, before the
    tokenizer is read) and ``max_new_tokens`` new tokens fit the model's positions. A prompt of no token is refused
    (there is nothing to continue), and so is one that alone fills the positions."""
    for index, length in enumerate([1] if lengths is None else lengths):
        where = "a one-token prompt" if lengths is None else f"{path}:{record_line(path, index)}: the prompt"
        if length == 0:
            raise ValueError(f"{where} has no token once tokenized: give it some text")
        excess = limits.excess(length, max_new_tokens)
        if excess is None:
            continue
        alone = limits.excess(length, 1 if limits.shared else 0)  # a causal LM's prompt and one new token
        if alone is not None:
            raise ValueError(f"{where} ({length} tokens) is too long: {'with one new token ' if limits.shared else ''}"
                             f"it needs {alone}: shorten it")
        room = limits.prompt - length if limits.shared else limits.target
        prompt = where if lengths is None else f"{where} ({length} tokens)"
        raise OptionError("max_new_tokens", f"max_new_tokens {max_new_tokens} does not fit: {prompt} and "
                          f"{max_new_tokens} new tokens need {excess}: set "
                          f"--max_new_tokens {room} or less" + ("" if lengths is None else ", or shorten the prompt"))


def _import_function(path: str):
    module_name, _, name = path.partition(":")
    if not module_name or not name:
        raise ValueError(f'augment must be "package.module:function", got {path!r}')
    function = getattr(importlib.import_module(module_name), name, None)
    if not callable(function):
        raise ValueError(f"{path} is not a function")
    return function
