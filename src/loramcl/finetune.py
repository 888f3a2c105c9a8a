"""`loramcl train` and `loramcl nll`: fine-tune K LoRA hypotheses on prompt -> target JSONL, and score references.

Each function's signature and docstring are its CLI (jsonargparse); `--config recipe.yaml` reads the same
arguments from a file (recipes/ holds the paper's). torch and transformers load inside the functions.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from loramcl.config import MCLConfig

PEFT_FOLDER = "peft"  # where a K = 1 run also exports its adapter as a standard PEFT LoRA


def train(
    model: str,
    train_file: str,
    out: str,
    mcl: MCLConfig,
    validation_file: str | None = None,
    prompt_key: str = "prompt",
    target_key: str = "target",
    chat_template: bool = False,
    max_length: int = 128,
    steps: int = 200,
    batch_size: int = 16,
    learning_rate: float = 5e-4,
    weight_decay: float = 0.0,
    warmup_steps: int = 10,
    scheduler: str = "cosine",
    eval_every: int = 50,
    eval_examples: int | None = 128,
    logging_steps: int = 10,
    seed: int = 0,
    threads: int | None = None,
    dtype: str = "float32",
) -> str:
    """Fine-tune LoRA hypotheses (MCLConfig; K = 1 is plain LoRA, the LoRA-MLE baseline) with MCLTrainer.

    Writes to `out`: the adapters and tokenizer (MCLModel.save_pretrained: load with `--adapters OUT` in `loramcl
    generate`), `peft/` for K = 1 (a standard PEFT LoRA adapter, for single-model decoders such as diverse beam
    search), `train_log.json` (every logged loss, win rate and validation NLL) and `run.json` (the arguments,
    threads, trainable parameters, seconds).

    Args:
        model: local folder of a causal LM (transformers format).
        train_file: JSONL {"prompt": ..., "target": ...} per line.
        out: output folder.
        mcl: the hypotheses and loss (--mcl.num_hypotheses, --mcl.r, --mcl.loss, --mcl.epsilon, ...).
        validation_file: JSONL like train_file, scored every eval_every steps (vanilla WTA loss, NLL and win rate
            per hypothesis).
        prompt_key: field holding the prompt.
        target_key: field holding the target text.
        chat_template: wrap the prompt as a user message with the tokenizer's chat template (then decode with
            `loramcl generate --chat_template true`).
        max_length: pairs longer than this (tokens) lose the end of their target.
        steps: optimizer steps.
        batch_size: examples per step.
        learning_rate: AdamW peak learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warm-up steps.
        scheduler: transformers learning-rate schedule after warm-up (cosine, linear, constant, ...).
        eval_every: validation every this many steps (0: only at the end).
        eval_examples: validation examples used (the first ones; None: all).
        logging_steps: training loss and win rates logged every this many steps.
        seed: model init, data order and dropout seed.
        threads: torch CPU threads (default: torch's choice).
        dtype: the frozen model's dtype: float32, bfloat16 or float16 (adapters stay float32 by default).
    """
    import torch
    from transformers import AutoTokenizer, PrinterCallback, TrainingArguments, set_seed

    from loramcl.data.prompts import PairDataset, collate, encode_pairs, pad_token_id, read_pairs
    from loramcl.generation.cli import load_model
    from loramcl.model import get_mcl_model
    from loramcl.trainer import MCLTrainer

    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got steps={steps}, batch_size={batch_size}")
    if threads is not None:
        torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model)
    pad_id = pad_token_id(tokenizer)

    def dataset(path: str, limit: int | None = None) -> PairDataset:
        _, prompts, targets = read_pairs(path, prompt_key, target_key)
        prompts, targets = prompts[:limit], targets[:limit]
        bad = [i for i, t in enumerate(targets) if not isinstance(t, str) or not t]
        if bad:
            raise ValueError(f'{path}: "{target_key}" must be a non-empty string (line {bad[0] + 1}); a training '
                             "target is one text, not a list")
        return PairDataset(encode_pairs(tokenizer, prompts, targets, chat_template, max_length))

    train_set = dataset(train_file)
    eval_set = dataset(validation_file, eval_examples) if validation_file else None
    set_seed(seed)
    mcl_model = get_mcl_model(load_model(model, dtype=dtype), mcl)
    mcl_model.train()
    out_dir = Path(out)
    evaluating = eval_set is not None and eval_every > 0
    args = TrainingArguments(
        output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size, learning_rate=learning_rate, weight_decay=weight_decay,
        warmup_steps=warmup_steps, lr_scheduler_type=scheduler, logging_steps=logging_steps,
        eval_strategy="steps" if evaluating else "no", eval_steps=eval_every if evaluating else None,
        save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), seed=seed, data_seed=seed,
        remove_unused_columns=False, disable_tqdm=False)
    trainer = MCLTrainer(mcl_model, args=args, train_dataset=train_set, eval_dataset=eval_set,
                         data_collator=lambda rows: collate(rows, pad_id))
    trainer.remove_callback(PrinterCallback)
    started = time.perf_counter()
    trainer.train()
    if eval_set is not None and not (evaluating and steps % eval_every == 0):
        trainer.evaluate()  # the final validation point
    seconds = time.perf_counter() - started

    mcl_model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if mcl.num_hypotheses == 1:
        mcl_model.export_hypothesis(0, out_dir / PEFT_FOLDER)
    trainable, total = mcl_model.parameter_counts()
    (out_dir / "train_log.json").write_text(json.dumps(trainer.state.log_history, indent=1) + "\n")
    arguments = {"model": model, "train_file": train_file, "out": out, "mcl": mcl.to_dict(),
                 "validation_file": validation_file, "prompt_key": prompt_key, "target_key": target_key,
                 "chat_template": chat_template, "max_length": max_length, "steps": steps, "batch_size": batch_size,
                 "learning_rate": learning_rate, "weight_decay": weight_decay, "warmup_steps": warmup_steps,
                 "scheduler": scheduler, "eval_every": eval_every, "eval_examples": eval_examples,
                 "logging_steps": logging_steps, "seed": seed, "dtype": dtype}
    run = {"arguments": arguments, "threads": torch.get_num_threads(), "train_examples": len(train_set),
           "trainable_parameters": trainable, "total_parameters": total, "seconds": round(seconds, 1)}
    (out_dir / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    print(f"trained {trainable:,} of {total:,} parameters in {seconds:.0f} s: {out_dir}")
    return str(out_dir)


def nll(
    model: str,
    adapters: str,
    input: str,
    out: str = "nll.jsonl",
    prompt_key: str = "prompt",
    references_key: str = "references",
    chat_template: bool = False,
    batch_size: int = 16,
    dtype: str = "float32",
    device: str = "cpu",
) -> str:
    """NLL of every reference under every hypothesis (nats per target token, end-of-sequence included), as
    `loramcl evaluate --nll` reads it: the oracle NLL and perplexity of paper App. E.1.

    Args:
        model: local folder of the base causal LM.
        adapters: MCL adapters folder (K hypotheses; a K = 1 run is LoRA-MLE).
        input: JSONL {"id", "prompt", "references": [R texts]} (or a single text) per line.
        out: output JSONL {"id", "nll": [[K floats] per reference]}.
        prompt_key: field holding the prompt.
        references_key: field holding the reference text(s).
        chat_template: the prompt format used in training.
        batch_size: (prompt, reference) pairs per forward (x K hypotheses).
        dtype: float32, bfloat16 or float16.
        device: e.g. cpu, cuda.
    """
    import torch
    from transformers import AutoTokenizer

    from loramcl.data.prompts import collate, encode_pairs, pad_token_id, read_pairs
    from loramcl.generation.cli import load_model
    from loramcl.model import MCLModel

    decoder = load_model(model, adapters, dtype, device)
    if not isinstance(decoder, MCLModel):
        raise ValueError(f"{adapters} is not an MCL adapters folder: `loramcl nll` scores the K hypotheses of an "
                         "MCL (or K = 1 MLE) run of `loramcl train`")
    tokenizer = AutoTokenizer.from_pretrained(model)
    pad_id = pad_token_id(tokenizer)
    ids, prompts, references = read_pairs(input, prompt_key, references_key)
    references = [[r] if isinstance(r, str) else list(r) for r in references]
    owner = [i for i, refs in enumerate(references) for _ in refs]
    rows = encode_pairs(tokenizer, [prompts[i] for i in owner], [r for refs in references for r in refs],
                        chat_template)
    scores = []
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = {k: v.to(device) for k, v in collate(rows[start:start + batch_size], pad_id).items()}
            scores.append(decoder(**batch).nll.float().cpu())  # [b, K]
    table = torch.cat(scores).tolist()
    per_item: list[list] = [[] for _ in ids]
    for i, row in zip(owner, table, strict=True):
        per_item[i].append(row)
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("w", encoding="utf-8") as f:
        for item_id, values in zip(ids, per_item, strict=True):
            f.write(json.dumps({"id": item_id, "nll": values}) + "\n")
    print(f"NLL of {len(rows)} references under {decoder.num_hypotheses} hypotheses: {out_path}")
    return str(out_path)
