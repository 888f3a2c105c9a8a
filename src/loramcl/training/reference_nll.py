"""`loramcl nll`: every reference's NLL under every hypothesis of a trained run (paper App. E.1), for
`loramcl evaluate --nll` and the recipes' NLL tables (Table 1)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from loramcl.utils.inputs import (
    MCL_CONFIG,
    Dtype,
    LocalPath,
    ModelPath,
    Quantization,
    check_device,
    check_file,
    check_model_options,
    check_output,
    is_encoder_decoder,
    model_positions,
    prompt_format,
    record_line,
    record_names,
)
from loramcl.utils.threads import check_threads, use_threads
from loramcl.utils.validate import require_int


def read_references(path: str, prompt_key: str, references_key: str) -> tuple[list, list[dict], str]:
    """(ids, rows {"prompt", key: [...]}, key) of a file of prompts and their references: the prompt a text or a
    conversation, the references a text, a list of texts or of assistant messages, under ``references_key`` (else
    "completion", as a training file holds them: docs/guide/data.md); key is the field read, so the log names it."""
    from loramcl.data.formats import prompt_of
    from loramcl.utils.files import json_lines, read_jsonl

    first = next((record for _, _, record in json_lines(path)), {})
    key = "completion" if isinstance(first, dict) and references_key not in first and "completion" in first else \
        references_key
    records = read_jsonl(path, prompt_key, number_missing_ids=True, hint=" (choose the field with --prompt_key)")
    rows, name = [], record_names(path)  # the file's line table read once, not once per record
    for index, record in enumerate(records.values()):
        where = name(index)
        if key not in record:
            has = ", ".join(f'"{k}"' for k in list(record)[:10] if k != "id")
            raise ValueError(f'{where} has no "{references_key}" field; its fields are {has} (choose the field with '
                             "--references_key)")
        references = record[key] if isinstance(record[key], list) else [record[key]]
        if not references or not all(isinstance(r, str) and r.strip() or isinstance(r, dict) for r in references):
            raise ValueError(f'{where}: "{key}" must be a non-empty text or list of non-empty texts')
        rows.append({"prompt": prompt_of(record[prompt_key], where, prompt_key), key: references})
    if len({isinstance(row["prompt"], str) for row in rows}) > 1:
        raise ValueError(f"{path}: some prompts are texts and others conversations: one format per file")
    return list(records), rows, key


def nll(
    model: ModelPath,
    adapters: LocalPath,
    input: LocalPath,
    out: LocalPath = "nll.jsonl",
    prompt_key: str = "prompt",
    references_key: str = "references",
    chat_template: bool | None = None,
    batch_size: int = 16,
    dtype: Dtype = "float32",
    device: str = "cpu",
    threads: int | None = None,
    progress: bool = True,
    strict: bool = False,
    quantization: Quantization | None = None,
) -> str:
    """Score every reference under every hypothesis: its mean NLL per target token, for `loramcl evaluate --nll`.

    Nats per target token, end-of-sequence included: the oracle NLL and perplexity of paper App. E.1. The prompt
    and reference are tokenized as `loramcl train` tokenized prompt and target (an encoder-decoder reads the prompt
    in its encoder and scores the reference as its labels).

    Args:
        model: local folder of the base model (a causal or a sequence-to-sequence LM).
        adapters: MCL adapters folder (K hypotheses; a K = 1 run is LoRA-MLE).
        input: JSONL {"id", "prompt", "references": [R texts]} (or a single text) per line; the prompt may be a
            conversation and the references assistant messages, and a training file's "completion" list is read
            when there is no "references" (docs/guide/data.md). Each reference is tokenized as `loramcl train`
            tokenizes that row.
        out: output JSONL {"id", "nll": [[K floats] per reference]} (+ "mixture_nll": [a float per reference],
            -log sum_k p(k|c) p_k(x|c) per token, for adapters with hypothesis scores).
        prompt_key: field holding the prompt.
        references_key: field holding the reference text(s).
        chat_template: wrap each prompt with the tokenizer's chat template (default: as the training run of
            `adapters` did, from its run.json; without one, no).
        batch_size: (prompt, reference) pairs per forward (x K hypotheses).
        dtype: float32, bfloat16 or float16.
        device: e.g. cpu, cuda.
        threads: torch CPU threads (default: the cores that are free when the command starts).
        progress: a progress bar (references scored) on stderr.
        strict: refuse adapters saved on a base model with other weights (their recorded fingerprint differs from
            the model's), and adapter files that cannot be verified (no checksum, no fingerprint) or whose tensors
            were converted after save; by default each is a warning.
        quantization: the base model quantized as it loads (nf4, fp4, int8, torchao-int8:
            docs/guide/quantization.md); default: as the training run of `adapters` did (its run.json), else none.
    """
    from loramcl.data.prompts import collate, first_too_long, pad_token_id

    require_int("batch_size", batch_size)
    check_threads(threads)
    check_model_options(model, dtype, adapters)
    if not (Path(adapters) / MCL_CONFIG).is_file():
        raise ValueError(f"{adapters} is not an MCL adapters folder: `loramcl nll` scores the K hypotheses of an "
                         "MCL (or K = 1 MLE) run of `loramcl train`")
    check_output(out, folder=False, example="nll.jsonl")
    check_file(input, "input file")
    ids, rows, field = read_references(input, prompt_key, references_key)
    chat_template = prompt_format(adapters, chat_template)
    encoder_decoder = is_encoder_decoder(model)

    import torch
    from datasets import Dataset
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from loramcl.data.formats import prepare_dataset
    from loramcl.models.load import load_model

    check_device(device)
    use_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model)
    pad_id = pad_token_id(tokenizer)
    # one example per reference, tokenized as `loramcl train` tokenized the same row (loramcl.data.formats)
    examples = prepare_dataset(Dataset.from_list(rows), tokenizer, None, "prompt", field, chat_template,
                               encoder_decoder, source=input, where=record_names(input))
    owner = examples["row"]
    rows = examples.select_columns(["input_ids", "labels"]).to_list()
    if (too_long := first_too_long(rows, model_positions(model), encoder_decoder)) is not None:
        raise ValueError(f"{input}:{record_line(input, owner[too_long[0]])}: the prompt and reference need "
                         f"{too_long[1]}: shorten them (a reference is scored whole)")
    decoder = load_model(model, adapters, dtype, device, strict=strict, quantization=quantization)
    nlls, mixtures = [], []
    bar = tqdm(total=len(rows), unit="reference", desc="nll", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    with bar, torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = {k: v.to(device) for k, v in collate(rows[start:start + batch_size], pad_id).items()}
            output = decoder(**batch)
            nlls.append(output.nll.float().cpu())  # [b, K]
            if output.mixture_nll is not None:  # a model with hypothesis scores
                mixtures.append(output.mixture_nll.float().cpu())  # [b]
            bar.update(len(batch["input_ids"]))
    table = torch.cat(nlls).tolist()
    mixture = torch.cat(mixtures).tolist() if mixtures else None
    per_item: list[dict] = [{"nll": []} | ({"mixture_nll": []} if mixture else {}) for _ in ids]
    for n, i in enumerate(owner):
        per_item[i]["nll"].append(table[n])
        if mixture:
            per_item[i]["mixture_nll"].append(mixture[n])
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("w", encoding="utf-8") as f:
        for item_id, values in zip(ids, per_item, strict=True):
            f.write(json.dumps({"id": item_id, **values}) + "\n")
    k = decoder.num_hypotheses
    print(f"NLL of {len(rows)} reference{'s' * (len(rows) != 1)} under {k} hypothes{'is' if k == 1 else 'es'}: "
          f"{out_path}")
    return str(out_path)
