"""`loramcl export`: a finished run's hypotheses as standard PEFT LoRA folders (OUT/h0 ... OUT/h{K-1}) and a model
card (OUT/README.md: the base model, K, the loss, the rank, the data, the run's metrics, how to load and serve them),
for PEFT's mixed-adapter batches, vLLM, SGLang, LoRAX and llama.cpp (docs/guide/serving.md).
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from loramcl.mcl.config import MCLConfig, saved_values
from loramcl.utils.inputs import (
    MCL_CONFIG,
    PEFT_CONFIG,
    LocalPath,
    ModelPath,
    check_adapters_folder,
    check_model_folder,
    check_output,
    training_record,
)
from loramcl.utils.validate import OptionError
from loramcl.utils.files import read_json

CARD_NAME = "README.md"
CARD_PROMPT = "your prompt"  # the model card's placeholder, shown as the run's prompts were (chat template or not)


def export(
    adapters: LocalPath,
    out: LocalPath | None = None,
    model: ModelPath | None = None,
    hypotheses: str | None = None,
    fold_scaling: bool = False,
    alora_invocation_tokens: str | None = None,
    strict: bool = False,
) -> str:
    """Write every hypothesis of a run as a standard PEFT LoRA adapter folder, with a model card.

    `loramcl export RUN --out DIR` writes DIR/h0 ... DIR/h{K-1} (each `adapter_config.json` +
    `adapter_model.safetensors`, the base model recorded) and DIR/README.md. Refused, with the reason, for what is not
    standard LoRA: a LoRA-MoE or multi-head model, hypotheses trained with the context computed once
    (--mcl.adapt_context false) unless --alora_invocation_tokens makes them an exact activated LoRA.

    Args:
        adapters: the `out` folder of `loramcl train` (or any folder MCLModel.save_pretrained wrote).
        out: the folder to write (new, or one this command wrote).
        model: the base model's folder (default: the one the run trained on, from its run.json, else the one
            recorded in its mcl_config.json).
        hypotheses: the hypotheses to export, e.g. 0,2 (default: all).
        fold_scaling: write the scaling into lora_B with lora_alpha = r and use_rslora false: the same adapters for
            engines that read lora_alpha only (llama.cpp's convert_lora_to_gguf.py ignores use_rslora).
        alora_invocation_tokens: context-once hypotheses (adapt_context false) as PEFT's activated LoRA: the id of
            the one token every prompt ends with, e.g. the last token of the chat template's assistant header
            (default, for a run trained with the chat template: that token, read from the run's tokenizer).
        strict: refuse adapter files that cannot be verified, or saved on a base model with other weights (by
            default each is a warning).
    """
    check_adapters_folder(adapters)
    if not (Path(adapters) / MCL_CONFIG).is_file() and (Path(adapters) / PEFT_CONFIG).is_file():
        raise ValueError(f"{adapters} already holds one PEFT adapter ({PEFT_CONFIG}): give the folder of LoRA-MCL "
                         f"hypotheses ({MCL_CONFIG}, written by loramcl train)")
    if out is None:
        raise OptionError("out", "missing --out DIR: the folder to write the hypotheses' PEFT folders into")
    check_output(out, folder=True)
    chosen = _hypothesis_list(hypotheses, "hypotheses")
    invocation = _hypothesis_list(alora_invocation_tokens, "alora_invocation_tokens")
    record = training_record(adapters)
    base = model or _base_model_of(adapters, record)
    check_model_folder(base)
    saved = read_json(Path(adapters) / MCL_CONFIG, "it was damaged or edited: save the adapters again, or restore it")
    method = saved.get("method", "mcl")
    config = MCLConfig.from_dict(saved_values(saved["mcl_config"])) if method == "mcl" else None
    chat = bool(((record[1] if record else {}).get("data") or {}).get("chat_template"))
    tokenizer_folder = str(adapters) if (Path(adapters) / "tokenizer_config.json").is_file() else base
    if config is not None and not config.adapt_context and invocation is None:
        if not chat:
            raise OptionError("alora_invocation_tokens", "these hypotheses were trained with the context computed "
                              "once (--mcl.adapt_context false): they act from the prompt's last token on, and a PEFT "
                              "LoRA acts at every position. Export them as activated LoRA with "
                              "--alora_invocation_tokens ID, ID the token every prompt of the run ends with (a run "
                              "with --data.chat_template true finds it itself); or decode them with `loramcl generate "
                              f"--adapters {adapters}`")
        invocation = _chat_invocation(tokenizer_folder)

    from loramcl.mcl.export import export_all
    from loramcl.models.load import load_model

    mcl = load_model(base, adapters, strict=strict)  # the base model's folder is recorded in each adapter_config.json
    folders = export_all(mcl, out, chosen, fold_scaling=fold_scaling, alora_invocation_tokens=invocation)
    card = Path(out) / CARD_NAME
    rendered = _rendered_prompt(tokenizer_folder) if chat else None
    card.write_text(model_card(mcl, _from_here(base), [_from_here(f) for f in folders], record, adapters,
                               fold_scaling, invocation, _from_here(tokenizer_folder), rendered), encoding="utf-8")
    print(f"{len(folders)} hypotheses as PEFT LoRA adapters ({', '.join(Path(f).name for f in folders)}) and their "
          f"model card: {out}")
    return str(out)


def _from_here(path: str) -> str:
    """``path`` relative to the folder `loramcl export` runs in when it lies inside it (the CLI makes every path
    absolute), else absolute: the model card's commands run from that folder, wherever it is."""
    relative = os.path.relpath(path)
    return str(path) if relative == os.pardir or relative.startswith(os.pardir + os.sep) else relative


def _hypothesis_list(text: str | int | None, option: str) -> list[int] | None:
    """'0,2' (or a single number) as [0, 2]."""
    if text is None:
        return None
    try:
        return [int(part) for part in str(text).strip("[] ").split(",")]
    except ValueError:
        raise OptionError(option, f"{option} must be comma-separated integers, e.g. 0,2; got {text!r}") from None


def _base_model_of(adapters: str, record: tuple[Path, dict] | None) -> str:
    if record is not None and record[1].get("model"):
        return str(record[1]["model"])
    saved = read_json(Path(adapters) / MCL_CONFIG, "it was damaged or edited: save the adapters again, or restore it")
    if saved.get("base_model_name_or_path"):
        return str(saved["base_model_name_or_path"])
    raise OptionError("model", f"{adapters} does not record its base model (no run.json, and no "
                      f"base_model_name_or_path in {MCL_CONFIG}): give --model, the folder of the base model")


def _chat_invocation(tokenizer_folder: str) -> list[int]:
    """The last token of the chat template's assistant header (the run's tokenizer, saved beside its adapters, else
    the base model's), for a run trained with the chat template: every prompt of that run ends with it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    return [int(ids[-1])]


def _rendered_prompt(tokenizer_folder: str) -> str:
    """CARD_PROMPT as a run trained with the chat template read it: one user turn and the assistant header."""
    from transformers import AutoTokenizer

    from loramcl.data.prompts import prompt_text

    return prompt_text(AutoTokenizer.from_pretrained(tokenizer_folder), CARD_PROMPT, chat_template=True)


def model_card(mcl, base: str, folders: list[str], record: tuple[Path, dict] | None, adapters: str,
               fold_scaling: bool, invocation: list[int] | None, tokenizer_folder: str, rendered: str | None) -> str:
    """The model card of an export: what the hypotheses are, the run that trained them, how to load and serve them."""
    cfg = mcl.mcl_config
    names = [Path(f).name for f in folders]
    short_names = ", ".join(sorted({name.rsplit(".", 1)[-1] for name in mcl.layer_names}))
    settings = record[1] if record else {}
    run = read_json(record[0], "it was damaged or edited: train the run again") if record else {}
    log_path = Path(adapters) / "train_log.json"
    log = read_json(log_path, "it was damaged or edited: train the run again") if log_path.is_file() else []
    form = ", mean form" if cfg.epsilon_form == "mean" else ""
    loss = cfg.loss + {"relaxed": f" (epsilon {cfg.relaxed_epsilon:g}{form})",
                       "annealed": f" (temperature {cfg.temperature0}, decay {cfg.temperature_decay})"}.get(cfg.loss, "")
    scaling = "folded into lora_B (lora_alpha = r)" if fold_scaling else \
        f"alpha {cfg.alpha}{' with rsLoRA (alpha/sqrt(r))' if cfg.use_rslora else ''}"
    shared = f" (a shared adapter of rank {cfg.shared_r} + the hypothesis' own {cfg.r})" if cfg.shared_r else ""
    rows = [("base model", f"`{base}`"), ("hypotheses", f"{len(names)} of K = {cfg.num_hypotheses}: "
                                          f"{', '.join(names)}"),
            ("method", "LoRA-MCL (multiple choice learning of LoRA adapters)"), ("loss", loss),
            ("rank", f"{cfg.lora_rank}{shared}, {scaling}"),
            ("adapted layers", f"{len(mcl.layer_names)} ({short_names})")]
    if invocation is not None:
        rows.append(("activated LoRA", f"from the invocation token {invocation} on (the context computed once)"))
    data = settings.get("data") or {}
    if data.get("train_file"):
        rows.append(("data", f"`{data['train_file']}` ({run.get('train_examples', '?')} examples; chat template "
                             f"{'on' if data.get('chat_template') else 'off'})"))
    if settings.get("training"):
        rows.append(("training", f"{settings['training'].get('steps')} steps, batch "
                                 f"{settings['training'].get('batch_size')}, learning rate "
                                 f"{settings['training'].get('learning_rate')} ({run.get('seconds', '?')} s)"))
    rows += _metrics(log)
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    rslora_note = " (export with --fold_scaling: llama.cpp ignores use_rslora)" if cfg.use_rslora and not \
        fold_scaling else ""

    return f"""# {len(names)} LoRA-MCL hypotheses of {Path(base).name}

Each folder is one hypothesis, a standard PEFT LoRA adapter of the same base model: each decodes its own answer, and
together they give {len(names)} diverse, plausible answers per prompt. Written by `loramcl export` from `{adapters}`.
The commands below run from the folder where `loramcl export` was typed (their paths are relative to it).

| | |
|---|---|
{table}

## Load them in PEFT, all hypotheses in one batch

```python
{_peft_snippet(mcl, base, folders, tokenizer_folder, rendered is not None)}
```

## Serve them

```bash
# vLLM: the prompt sent once per hypothesis, "model": "h0" ... (in Python, one LoRARequest per hypothesis)
vllm serve {shlex.quote(base)} --enable-lora --max-loras {len(names)} --max-lora-rank {_vllm_rank(cfg.lora_rank)} \\
  --lora-modules {' '.join(shlex.quote(f'{Path(f).name}={f}') for f in folders)}
{_llama_cpp(base, folders, rendered, rslora_note)}
```

More in loramcl's docs/guide/serving.md.
"""


def _peft_snippet(mcl, base: str, folders: list[str], tokenizer_folder: str, chat: bool) -> str:
    """The card's PEFT code: the exported folders loaded as named adapters, the placeholder prompt formatted as the
    run's prompts were (the chat template's user turn without special tokens added, or the bare text with them),
    one row per hypothesis decoded by PEFT's mixed-adapter batch."""
    model_class = type(mcl.base_model).__name__
    decoder_only = not getattr(mcl.config, "is_encoder_decoder", False)
    names = [Path(f).name for f in folders]
    padding = ', padding_side="left"' if decoder_only else ""
    text = json.dumps
    lines = ["from peft import PeftModel", f"from transformers import AutoTokenizer, {model_class}", "",
             f"base = {model_class}.from_pretrained({text(base)})",
             f"model = PeftModel.from_pretrained(base, {text(folders[0])}, adapter_name={text(names[0])})",
             *(f"model.load_adapter({text(f)}, adapter_name={text(n)})" for f, n in zip(folders[1:], names[1:],
                                                                                         strict=True)),
             f"tokenizer = AutoTokenizer.from_pretrained({text(tokenizer_folder)}{padding})",
             f"names = {text(names)}"]
    if chat:  # as loramcl trained it: one user turn and the assistant header, special tokens written by the template
        lines += [f'prompt = tokenizer.apply_chat_template([{{"role": "user", "content": {text(CARD_PROMPT)}}}], '
                  'tokenize=False, add_generation_prompt=True)',
                  'batch = tokenizer([prompt] * len(names), return_tensors="pt", padding=True, add_special_tokens=False)']
    else:
        lines.append(f'batch = tokenizer([{text(CARD_PROMPT)}] * len(names), return_tensors="pt", padding=True)')
    new_tokens = 'outputs[:, batch["input_ids"].shape[1]:]' if decoder_only else "outputs"
    lines += ["outputs = model.generate(**batch, adapter_names=names, max_new_tokens=64, do_sample=False)",
              f"candidates = tokenizer.batch_decode({new_tokens}, skip_special_tokens=True)  # one per hypothesis"]
    return "\n".join(lines)


def _llama_cpp(base: str, folders: list[str], rendered: str | None, rslora_note: str) -> str:
    """The card's llama.cpp recipe, from the folder where `loramcl export` was typed: the converters' environment
    and llama-server built from a source checkout, the base and every hypothesis converted (each with --base), the
    server holding the K adapters unapplied, and one request per hypothesis naming every adapter's scale, its prompt
    as the run was trained (``rendered``: the chat template's rendering of CARD_PROMPT; None: the bare prompt)."""
    q = shlex.quote
    base_gguf = str(Path(folders[0]).parent / "base.gguf")
    ggufs = [f"{folder}.gguf" for folder in folders]
    python = "llama-env/bin/python llama.cpp/"

    def request(k: int, endpoint: str, body: dict) -> str:
        body["lora"] = [{"id": i, "scale": 1.0 if i == k else 0.0} for i in range(len(folders))]
        return f"curl localhost:8080/{endpoint} -H 'Content-Type: application/json' -d {q(json.dumps(body))}"

    if rendered is None:  # trained on bare prompts: /completion, the prompt as it is
        requests = [request(k, "completion", {"prompt": CARD_PROMPT, "n_predict": 64, "temperature": 0})
                    for k in range(len(folders))]
    else:  # trained with the chat template: the server renders the model's own, or /completion takes it rendered
        chat = {"messages": [{"role": "user", "content": CARD_PROMPT}], "max_tokens": 64, "temperature": 0}
        requests = [request(k, "v1/chat/completions", dict(chat)) for k in range(len(folders))]
        requests += ["# the same on /completion: the prompt rendered with the chat template, as loramcl trained",
                     request(0, "completion", {"prompt": rendered, "n_predict": 64, "temperature": 0})]
    return "\n".join([
        "# llama.cpp: its converters run from its source checkout, in an environment of their own (its requirements:",
        "# sentencepiece, transformers < 5); llama-server built there (pip's llama-cpp-python has none), offline",
        "git clone https://github.com/ggml-org/llama.cpp",
        "python -m venv llama-env",
        "llama-env/bin/pip install -r llama.cpp/requirements/requirements-convert_hf_to_gguf.txt",
        "cmake -S llama.cpp -B llama.cpp/build -DLLAMA_USE_PREBUILT_UI=OFF",
        "cmake --build llama.cpp/build --target llama-server -j 4",
        f"# the base model, then every hypothesis, each with --base (the base model's folder){rslora_note}",
        f"{python}convert_hf_to_gguf.py {q(base)} --outfile {q(base_gguf)}",
        *(f"{python}convert_lora_to_gguf.py {q(f)} --base {q(base)} --outfile {q(g)}" for f, g in zip(folders, ggufs,
                                                                                                     strict=True)),
        "# adapter i is the i-th --lora; none applies until a request names its scale",
        f"llama.cpp/build/bin/llama-server -m {q(base_gguf)} {' '.join(f'--lora {q(g)}' for g in ggufs)} "
        "--lora-init-without-apply",
        "# one request per hypothesis, EVERY adapter's scale named: 1.0 for it, 0.0 for the others (a request without",
        '# "lora" applies all of them at 1.0 and decodes a mixture of the hypotheses)',
        *requests])


def _vllm_rank(r: int) -> int:
    from loramcl.mcl.export import VLLM_RANKS

    return next((rank for rank in VLLM_RANKS if rank >= r), r)


def _metrics(log: list[dict]) -> list[tuple[str, str]]:
    """The run's last validation (oracle NLL, each hypothesis's NLL and win rate) and its final training loss."""
    rows = []
    evaluation = next((entry for entry in reversed(log) if "eval_loss" in entry), None)
    if evaluation is not None:
        rows.append(("validation oracle NLL", f"{evaluation['eval_loss']:.4f} (step {evaluation.get('step')})"))
        per = sorted(key.removeprefix("eval_nll_") for key in evaluation if key.startswith("eval_nll_h"))
        if per:
            rows.append(("validation NLL, win rate per hypothesis", "; ".join(
                f"{h}: {evaluation[f'eval_nll_{h}']:.4f}, {evaluation.get(f'eval_win_rate_{h}', float('nan')):.2f}"
                for h in per)))
    final = next((entry for entry in reversed(log) if "train_loss" in entry), None)
    if final is not None:
        rows.append(("training loss (mean over the run)", f"{final['train_loss']:.4f}"))
    return rows
