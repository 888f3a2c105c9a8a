"""The benchmark suite (issue 18): every speed and memory measurement of LoRA-MCL for one model shape, in one run.

For a named shape (a transformers config with random weights: a small Llama on the CPU, Llama-3.2-1B,
Llama-3.1-8B or Qwen2-Audio-7B sizes on a GPU), all measured side by side in one process, as ratios to the K=1 step
of the same run:
  training   one step (forward, backward, AdamW) of MCL at K in {1, 3, 5}, relaxed WTA (epsilon=0.05) so that
             every hypothesis gets a gradient: stacked (ours) vs loop (K forwards) vs the paper's grouped conv;
             vanilla WTA one-pass vs two-pass (scoring pass whole or in blocks of
             examples, as MCLTrainer runs it); peak memory and tokens/s of each, at each sequence length
  context    the context computed once (MCLConfig(adapt_context=False)) vs the full sequence, context:target 8:1
  decoding   one batched K-hypothesis generate vs a loop of K generates, batch 1, greedy and beam search, and with
             the context once; tokens/s
  peers      generate_hypotheses (with its default log-probabilities, and without) vs PEFT's mixed-adapter generate
             on the same K hypotheses (loramcl.to_peft), with the bare base model decoding the same K*B rows with no
             adapters beside them: the physical limit; K in {3, 5}, greedy and beam 2, batch 1 and 8
  compiled   generate_hypotheses K=5 eager and compiled (compile=True), beside the bare base eager and compiled the
             same way (benchmarks/speed/compiled_decoding.py); by default with --device cuda only
then prints which of the issue's targets are met. Writes <out>/suite-<shape>-<device>.json and .md.

    python -m benchmarks.speed.suite --shape cpu-small --threads 1                      # CPU, a few minutes
    python -m benchmarks.speed.suite --shape llama-1b --device cuda --dtype bfloat16    # on a GPU: llama-1b, llama-8b,
    python -m benchmarks.speed.suite --shape qwen2-audio --device cuda --dtype bfloat16 #   qwen2-audio
    python -m benchmarks.speed.suite --shape cpu-small --threads 1 --quantized          # quantized bases (issue 39)
    python -m benchmarks.speed.suite --shape llama-8b --device cuda --dtype bfloat16 --sections compiled  # issue 54

Models share one frozen base (every variant wraps a twin of its modules, no copy of the weights). Peak memory: on
CUDA torch.cuda.max_memory_allocated during one step; on the CPU the resident set sampled during one step (the
script restarts itself with glibc told to unmap freed tensors), in both cases minus what was in use before it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.common import (
    TARGETS,
    decoding_sides,
    interleaved_medians,
    peak_mib,
    perturb_adapters,
    restart_releasing_freed_memory,
    same_tokens,
    start,
    train_step,
    use_grouped_conv,
)
from benchmarks.speed import compiled_decoding
from benchmarks.speed.suite_shapes import AUDIO_TARGETS, SHAPES, Suite, check_request
from loramcl import MCLConfig, get_mcl_model

KS = (1, 3, 5)
TRAINING = [(variant, k) for k in KS for variant in ("stacked", "loop", "grouped-conv")]
TRAINING += [(variant, k) for k in KS[1:] for variant in ("wta-one-pass", "wta-two-pass", "wta-two-pass-blocks")]
DECODING = [(3, "greedy", 1, True), (5, "greedy", 1, True), (5, "beam", 2, True), (5, "greedy", 1, False)]
PEERS = [(k, strategy, beams, batch) for k in (3, 5) for strategy, beams in (("greedy", 1), ("beam", 2))
         for batch in (1, 8)]


def peer_name(setting: tuple) -> str:
    """A PEERS setting as --peers names it: K/decoding/batch, e.g. 5/beam2/8."""
    k, strategy, beams, batch = setting
    return f"{k}/{strategy if beams == 1 else f'beam{beams}'}/{batch}"


PEER_SIDES = ("bare", "loramcl", "loramcl-no-log-probs", "peft")
SECTIONS = ("training", "context", "decoding", "peers", "compiled")  # compiled: by default on a GPU only



def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2  # bfloat16: 8 bits of mantissa
    if not torch.allclose(a.float(), b.float(), atol=tolerance, rtol=tolerance):
        raise RuntimeError(f"{what}: NLLs differ by {(a.float() - b.float()).abs().max():.3g} (> {tolerance})")


def ratio(value: float, reference: float) -> float | None:
    """``value / reference``; None where the reference is under 1 MiB (a tiny shape's step: no meaningful ratio)."""
    return value / reference if reference >= 1 else None


def measure_memory(runs: dict, device: str) -> dict:
    """Peak memory (MiB) of one more step of each run, one run at a time."""
    import gc

    peak_mib(device, next(iter(runs.values())))  # the first measurement also counts the sampler's own start-up
    memory = {}
    for key, run in runs.items():
        gc.collect()
        memory[key] = peak_mib(device, run)
    return memory


def training(suite: Suite, args) -> list[dict]:
    models = {("relaxed", k): suite.wrap(k) for k in KS}
    models |= {("grouped-conv", k): suite.wrap(k) for k in KS}
    models |= {("wta", k): suite.wrap(k, loss="wta") for k in KS[1:]}
    for k in KS:
        use_grouped_conv(models[("grouped-conv", k)][0])
    batches = {seq: suite.batch(seq, seq - seq // 4, args.batch) for seq in args.seqs}
    for batch in batches.values():  # the paper's layer computes our function (checked before any step changes them)
        with torch.no_grad():
            close(models[("relaxed", 3)][0](**batch).nll, models[("grouped-conv", 3)][0](**batch).nll, suite.dtype,
                  "grouped conv vs stacked")
    rows = []
    for seq, batch in batches.items():

        def run(variant, k, batch=batch):
            model = ("relaxed" if variant in ("stacked", "loop") else "wta" if variant.startswith("wta") else
                     variant, k)
            mcl, optimizer = models[model]
            return lambda: train_step(variant, mcl, batch, optimizer)

        runs = {key: run(*key) for key in TRAINING}
        seconds = interleaved_medians(runs, args.steps, suite.device)
        memory = measure_memory(runs, suite.device)
        tokens = batch["input_ids"].numel()
        one = ("stacked", 1)
        for variant, k in TRAINING:
            key = (variant, k)
            rows.append(dict(seq=seq, variant=variant, k=k, ms=seconds[key] * 1000, time_ratio=seconds[key] /
                             seconds[one], peak_mib=memory[key], memory_ratio=ratio(memory[key], memory[one]),
                             tokens_per_s=tokens / seconds[key]))
        print(f"training at {seq} tokens: done", flush=True)
    return rows


def context_once(suite: Suite, args) -> list[dict] | str:
    if suite.shape.family != "llama":
        return ("not measured: the context computed once splits causal LMs given input_ids only; audio inputs are "
                "refused (loramcl.mcl.context.check_split_inputs)")
    context, target = suite.shape.context_target
    batch = suite.batch(context + target, target, args.batch)
    models = {("full", k): suite.wrap(k) for k in KS} | {("once", k): suite.wrap(k, adapt_context=False) for k in KS}
    once = models[("once", 3)][0]
    with torch.no_grad():  # once equals its naive computation, the full forward with the adapters masked on the context
        fast = once(**batch).nll
        once.context_once = False
        close(fast, once(**batch).nll, suite.dtype, "context once vs masked")
        once.context_once = True
    runs = {key: (lambda mcl=mcl, optimizer=optimizer: train_step("stacked", mcl, batch, optimizer))
            for key, (mcl, optimizer) in models.items()}
    seconds = interleaved_medians(runs, args.steps, suite.device)
    memory = measure_memory(runs, suite.device)
    one = ("full", 1)
    return [dict(context=context, target=target, variant=kind, k=k, ms=seconds[(kind, k)] * 1000,
                 time_ratio=seconds[(kind, k)] / seconds[one], peak_mib=memory[(kind, k)],
                 memory_ratio=ratio(memory[(kind, k)], memory[one]), tokens_per_s=batch["input_ids"].numel() /
                 seconds[(kind, k)]) for kind, k in models]


def decoding(suite: Suite, args) -> list[dict]:
    inputs = {name: value for name, value in suite.batch(suite.shape.prompt, 0, 1, seed=2).items() if name != "labels"}
    rows = []
    for k, strategy, beams, adapt_context in DECODING:
        if not adapt_context and suite.shape.family != "llama":
            continue  # refused for audio inputs, see context_once
        mcl = suite.wrap(k, adapt_context=adapt_context)[0].eval()
        sides = decoding_sides(mcl, inputs, strategy, beams, args.new_tokens)
        batched, looped = sides["batched"](), sides["loop"]()  # also the warm-up
        agreement = same_tokens(batched, looped)
        if agreement < 1 and suite.device == "cpu" and suite.dtype == torch.float32:
            raise RuntimeError(f"K={k} {strategy}: the batched and the looped hypotheses decoded different tokens")
        seconds = interleaved_medians(sides, args.repeats, suite.device, warmup=0)
        tokens = k * args.new_tokens
        rows.append(dict(k=k, strategy=strategy if beams == 1 else f"beam {beams}/hypothesis",
                         context="full" if adapt_context else "once", batched_ms=seconds["batched"] * 1000,
                         loop_ms=seconds["loop"] * 1000, speedup=seconds["loop"] / seconds["batched"],
                         batched_tokens_per_s=tokens / seconds["batched"], loop_tokens_per_s=tokens / seconds["loop"],
                         same_tokens=agreement))
    print("decoding: done", flush=True)
    return rows


QUANTIZED_BASES = (None, "nf4", "int8", "torchao-int8")


def quantized(suite: Suite, args) -> list[dict]:
    """QLoRA-MCL (issue 39): on each base (unquantized, nf4, int8, torchao int8, loaded from a saved copy of the
    shape's weights as users load them), a K=5 two-pass hard-WTA step (as MCLTrainer runs it) next to PEFT's K=1 LoRA
    step (same rank and layers, AdamW) on its own copy of the same base: the model's memory (weights and adapters),
    each step's peak memory and time."""
    import tempfile

    from peft import LoraConfig, get_peft_model

    from loramcl.models import load_model

    targets = AUDIO_TARGETS if suite.shape.family == "qwen2_audio" else TARGETS
    seq = args.seqs[0]
    batch = suite.batch(seq, seq - seq // 4, args.batch)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        suite.base.save_pretrained(folder)
        for quantization in QUANTIZED_BASES:
            def base():
                return load_model(folder, dtype=args.dtype, device=suite.device, quantization=quantization).train()

            torch.manual_seed(0)
            mcl = get_mcl_model(base(), MCLConfig(num_hypotheses=5, r=8, alpha=8, loss="wta", target_modules=targets))
            perturb_adapters(mcl)
            peft = get_peft_model(base(), LoraConfig(r=8, lora_alpha=8, target_modules=targets)).train()
            sides = {name: (model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4))
                     for name, model in (("mcl", mcl), ("peft", peft))}
            runs = {"mcl": lambda sides=sides: train_step("wta-two-pass-blocks", sides["mcl"][0], batch,
                                                          sides["mcl"][1]),
                    "peft": lambda sides=sides: _peft_step(*sides["peft"], batch)}
            seconds = interleaved_medians(runs, args.steps, suite.device)
            memory = measure_memory(runs, suite.device)
            size = {name: sum(map(_stored_bytes, (*model.parameters(), *model.buffers()))) / 2**20
                    for name, (model, _) in sides.items()}
            rows.append(dict(base=quantization or "unquantized", seq=seq, model_mib=size["mcl"],
                             peft_model_mib=size["peft"], model_ratio=size["mcl"] / size["peft"],
                             ms=seconds["mcl"] * 1000, peft_ms=seconds["peft"] * 1000,
                             time_ratio=seconds["mcl"] / seconds["peft"], peak_mib=memory["mcl"],
                             peft_peak_mib=memory["peft"], memory_ratio=ratio(memory["mcl"], memory["peft"])))
            del sides, runs, mcl, peft
            print(f"quantized base {quantization}: done", flush=True)
    return rows


def _stored_bytes(tensor: torch.Tensor) -> int:
    """The bytes ``tensor`` holds: a torchao tensor subclass reports its dequantized dtype, its parts are stored."""
    if hasattr(tensor, "__tensor_flatten__"):
        return sum(_stored_bytes(getattr(tensor, part)) for part in tensor.__tensor_flatten__()[0])
    return tensor.numel() * tensor.element_size()


def _peft_step(model, optimizer, batch: dict) -> None:
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def quantized_markdown(results: dict) -> str:
    env, shape = results["environment"], results["shape"]
    lines = [f"Shape `{shape['name']}` ({shape['note']}), device {env['device']} ({env['device_name']}), "
             f"{env['dtype']}, {env['threads']} threads, load average at the end {env['load_average'][0]:.1f}: a K=5 "
             "two-pass hard-WTA step of LoRA-MCL vs PEFT's K=1 LoRA step on the same base, r=8, median of "
             f"{results['settings']['steps']} steps after a warm-up.", "",
             "| base | tokens | model MiB (MCL K=5 / PEFT K=1) | ratio | step ms (MCL / PEFT) | ratio | "
             "peak MiB (MCL / PEFT) | ratio |", "|---" * 8 + "|"]
    for row in results["quantized"]:
        memory = "n/a" if row["memory_ratio"] is None else f"{row['memory_ratio']:.2f}"
        lines.append(f"| {row['base']} | {row['seq']} | {row['model_mib']:.1f} / {row['peft_model_mib']:.1f} | "
                     f"{row['model_ratio']:.3f} | {row['ms']:.0f} / {row['peft_ms']:.0f} | {row['time_ratio']:.2f} | "
                     f"{row['peak_mib']:.0f} / {row['peft_peak_mib']:.0f} | {memory} |")
    return "\n".join(lines) + "\n"


def peers(suite: Suite, args) -> list[dict] | str:
    """Each PEERS setting timed side by side: generate_hypotheses, PEFT's mixed-adapter generate of the same
    hypotheses (row group k named adapter h{k}), and the base model alone on the same K*B rows."""
    if suite.shape.family != "llama":
        return "not measured: PEFT's mixed-adapter rows are measured on the text model"
    from loramcl.decoding import generate_hypotheses
    from loramcl.mcl.copies import repeat_examples
    from loramcl.mcl.export import to_peft

    rows, settings = [], [p for p in PEERS if args.peers is None or peer_name(p) in args.peers]
    for k in sorted({k for k, *_ in settings}):
        mcl = suite.wrap(k)[0].eval()
        peft = to_peft(suite.wrap(k)[0].eval(), inplace=True)  # the same hypotheses, on a twin of the base
        for _, strategy, beams, batch in [p for p in settings if p[0] == k]:
            inputs = {name: value for name, value in suite.batch(suite.shape.prompt, 0, batch, seed=2).items()
                      if name != "labels"}
            copies = repeat_examples(inputs, k, batch)  # hypothesis-major, as generate_hypotheses lays them out
            names = [f"h{h}" for h in range(k) for _ in range(batch)]
            generation = dict(num_beams=beams, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                              repetition_penalty=1.1, do_sample=False)

            def ours(log_probs: bool, inputs=inputs, strategy=strategy, beams=beams):
                return generate_hypotheses(mcl, None, inputs, strategy=strategy, num_beams=beams, log_probs=log_probs,
                                           max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                           repetition_penalty=1.1)

            sides = {"bare": lambda copies=copies, generation=generation: bare_generate(suite.base, copies, generation),
                     "loramcl": lambda: ours(True), "loramcl-no-log-probs": lambda: ours(False),
                     "peft": lambda copies=copies, names=names, generation=generation: peft.generate(
                         **copies, adapter_names=names, **generation)}
            candidates, theirs = sides["loramcl"](), sides["peft"]()  # also the warm-up
            width = copies["input_ids"].shape[1]
            agreement = sum(row[h].token_ids == theirs[h * batch + i, width:].tolist()
                            for i, row in enumerate(candidates) for h in range(k)) / (k * batch)
            if agreement < 1 and suite.device == "cpu" and suite.dtype == torch.float32:
                raise RuntimeError(f"K={k} {strategy} batch {batch}: loramcl and PEFT decoded different tokens")
            seconds = interleaved_medians(sides, args.repeats, suite.device, warmup=0)
            rows.append(dict(k=k, strategy=strategy if beams == 1 else f"beam {beams}/hypothesis", batch=batch,
                             **{f"{side}_ms": seconds[side] * 1000 for side in PEER_SIDES},
                             **{f"{side}_over_bare": seconds[side] / seconds["bare"] for side in PEER_SIDES[1:]},
                             peft_over_loramcl=seconds["peft"] / seconds["loramcl"], same_tokens=agreement))
    print("peers: done", flush=True)
    return rows


def bare_generate(base, inputs: dict, generation: dict):
    """The base alone, at its best: its output layer reads the prefill's last position as a contiguous tensor. The
    suite's base is frozen (its weights shared with the wrapped twins), and on a weight that does not require grad
    torch multiplies the strided [rows, 1, d] slice by the weight expanded per row (8x slower on SmolLM2's head),
    which a base loaded with `from_pretrained` (weights requiring grad) does not do, and loramcl's generate avoids
    (``contiguous_head_input``)."""
    from loramcl.mcl.generate import contiguous_head_input

    with contiguous_head_input(base):
        return base.generate(**inputs, **generation)


def targets(results: dict) -> list[dict]:
    """The issue's targets, each with what was measured."""
    found = []

    def add(name: str, measured: float, limit: float, at_most: bool = True) -> None:
        met = measured <= limit if at_most else measured >= limit
        found.append(dict(target=name, measured=round(measured, 3), limit=round(limit, 3), met=met))

    train = {(row["seq"], row["variant"], row["k"]): row for row in results["training"]}
    for seq in sorted({row["seq"] for row in results["training"]}):
        for k in KS[1:]:
            for variant in ("wta-two-pass", "wta-two-pass-blocks"):
                add(f"{seq} tokens, K={k}: hard WTA {variant[4:]} / K=1 <= (K+2)/2 + 5%",
                    train[(seq, variant, k)]["time_ratio"], (k + 2) / 2 * 1.05)
            add(f"{seq} tokens, K={k}: relaxed (stacked) / K=1 <= 1.05 K", train[(seq, "stacked", k)]["time_ratio"],
                1.05 * k)
        for k in KS[1:]:  # at K=1 both run the same computation
            add(f"{seq} tokens, K={k}: stacked / loop <= 1 (never slower)", train[(seq, "stacked", k)]["ms"] /
                train[(seq, "loop", k)]["ms"], 1.0)
    if isinstance(results["context_once"], list):
        row = next(row for row in results["context_once"] if row["variant"] == "once" and row["k"] == 5)
        add(f"context once {row['context']}:{row['target']}, K=5 relaxed / K=1 full <= 2", row["time_ratio"], 2.0)
    gpu = results["environment"]["device"].startswith("cuda")
    for row in results["peers"] if isinstance(results["peers"], list) else []:  # issue 40
        where = f"K={row['k']} {row['strategy']} batch {row['batch']}"
        add(f"{where}: loramcl (defaults) / bare base <= 1.05", row["loramcl_over_bare"], 1.05)
        floor = 1.5 if gpu and row["k"] == 5 and row["batch"] == 1 else 1.0  # the GPU aim, else never slower
        add(f"{where}: PEFT mixed batch / loramcl (defaults) >= {floor:g}", row["peft_over_loramcl"], floor,
            at_most=False)
    for row in results.get("compiled") if gpu and isinstance(results.get("compiled"), list) else []:  # issue 54
        if row["k"] == 5 and row["strategy"] == "greedy":
            add("compiled K=5 greedy batch 1: loramcl / bare base, both compiled <= 1.10",
                row["compiled_over_bare_compiled"], 1.10)
    for row in results["decoding"]:
        if row["k"] == 5 and row["strategy"] == "greedy" and row["context"] == "full":
            add(f"decoding K=5 greedy batch 1: batched / loop throughput >= {2.5 if gpu else 1.5}", row["speedup"],
                2.5 if gpu else 1.5, at_most=False)
    return found


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def environment(args) -> dict:
    device = args.device
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else cpu_name()
    import transformers

    return dict(device=device, device_name=name, threads=torch.get_num_threads(), cpu_count=os.cpu_count(),
                load_average=list(os.getloadavg()), torch=torch.__version__, transformers=transformers.__version__,
                dtype=args.dtype, python=platform.python_version())


def run(args) -> dict:
    """Every measurement of the suite for ``args.shape`` (see ``parse``); the results as a dict."""
    shape = SHAPES[args.shape]
    check_request(shape, args.device, args.dtype, args.allow_cpu)
    suite = Suite(shape, args.device, getattr(torch, args.dtype))
    parameters = sum(p.numel() for p in suite.base.parameters())
    results = dict(shape=asdict(shape) | dict(parameters=parameters),
                   settings=dict(seqs=list(args.seqs), batch=args.batch, steps=args.steps, repeats=args.repeats,
                                 new_tokens=args.new_tokens))
    if args.quantized:  # issue 39's rows alone: they load the base four more times
        results["quantized"] = quantized(suite, args)
        results["environment"] = environment(args)
        return results
    skipped = "not measured: not among --sections"
    results["training"] = training(suite, args) if "training" in args.sections else []
    results["context_once"] = context_once(suite, args) if "context" in args.sections else skipped
    results["decoding"] = decoding(suite, args) if "decoding" in args.sections else []
    results["peers"] = peers(suite, args) if "peers" in args.sections else skipped
    if getattr(args, "backend", None):
        from loramcl.decoding import compiled

        compiled.BACKEND = args.backend  # the decoding rows' and the training rows'
    results["compiled"] = compiled_decoding.compiled_rows(suite, args) if "compiled" in args.sections else skipped
    results["environment"] = environment(args)
    results["targets"] = targets(results)
    return results


def _step_row(row: dict) -> str:
    memory = "n/a" if row["memory_ratio"] is None else f"{row['memory_ratio']:.2f}"
    return (f"| {row['variant']} | {row['k']} | {row['ms']:.0f} | {row['time_ratio']:.2f} | {row['peak_mib']:.0f} | "
            f"{memory} | {row['tokens_per_s']:.0f} |")


def markdown(results: dict) -> str:
    env, shape, settings = results["environment"], results["shape"], results["settings"]
    lines = [f"Shape `{shape['name']}`: {shape['note']}; {shape['parameters'] / 1e6:,.1f}M parameters, random weights. "
             f"Device {env['device']} ({env['device_name']}), {env['dtype']}, torch {env['torch']}, transformers "
             f"{env['transformers']}, {env['threads']} threads of {env['cpu_count']} cores, load average at the end "
             f"{env['load_average'][0]:.1f}. Batch {settings['batch']}; median of {settings['steps']} steps "
             "(decoding: of {} repeats) after a warm-up; LoRA r=8.".format(settings["repeats"]), ""]
    for seq in settings["seqs"]:
        rows = [row for row in results["training"] if row["seq"] == seq]
        if not rows:  # not among --sections
            continue
        one = next(row for row in rows if row["variant"] == "stacked" and row["k"] == 1)
        lines += [f"Training step, {seq} tokens per example (labels on the last {seq - seq // 4}). K=1: "
                  f"{one['ms']:.0f} ms, peak {one['peak_mib']:.0f} MiB, {one['tokens_per_s']:.0f} tokens/s.", "",
                  "| variant | K | ms | time / K=1 | peak MiB | peak / K=1 | tokens/s |", "|---" * 7 + "|"]
        lines += [_step_row(row) for row in rows]
        lines.append("")
    if isinstance(results["context_once"], list):
        rows = results["context_once"]
        one = next(row for row in rows if row["variant"] == "full" and row["k"] == 1)
        lines += [f"Context once vs full, context:target {one['context']}:{one['target']}, relaxed WTA. K=1 full: "
                  f"{one['ms']:.0f} ms, peak {one['peak_mib']:.0f} MiB.", "",
                  "| context | K | ms | time / K=1 full | peak MiB | peak / K=1 full | tokens/s |",
                  "|---" * 7 + "|"]
        lines += [_step_row(row) for row in sorted(rows, key=lambda row: (row["k"], row["variant"]))]
    else:
        lines.append(f"Context once: {results['context_once']}.")
    if results["decoding"]:
        lines += ["", f"Decoding, batch 1, {settings['new_tokens']} new tokens per candidate:", "",
                  "| K | decoding | context | batched (ms) | loop of K (ms) | loop / batched | batched tokens/s | "
                  "same tokens |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {row['k']} | {row['strategy']} | {row['context']} | {row['batched_ms']:.0f} | {row['loop_ms']:.0f} "
              f"| {row['speedup']:.2f} | {row['batched_tokens_per_s']:.0f} | {row['same_tokens']:.0%} |"
              for row in results["decoding"]]
    if isinstance(results["peers"], list):
        lines += ["", f"Against PEFT's mixed-adapter batches (issue 40), {settings['new_tokens']} new tokens per "
                  "candidate, the K*B rows of each side decoding the same tokens; time / bare base:", "",
                  "| K | decoding | batch | bare base (ms) | loramcl | loramcl, no log-probs | PEFT mixed | "
                  "PEFT / loramcl | same tokens |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {row['k']} | {row['strategy']} | {row['batch']} | {row['bare_ms']:.0f} | "
                  f"{row['loramcl_over_bare']:.2f} | {row['loramcl-no-log-probs_over_bare']:.2f} | "
                  f"{row['peft_over_bare']:.2f} | {row['peft_over_loramcl']:.2f} | {row['same_tokens']:.0%} |"
                  for row in results["peers"]]
    else:
        lines.append(f"Against PEFT's mixed-adapter batches: {results['peers']}.")
    lines += compiled_decoding.markdown(results.get("compiled", "not measured"), settings["new_tokens"])
    if results["targets"]:  # none when the sections that have targets were not measured
        lines += ["", "| issue 18 target | measured | limit | met |", "|---|---|---|---|"]
        lines += [f"| {t['target']} | {t['measured']:.2f} | {t['limit']:.2f} | {'yes' if t['met'] else '**no**'} |"
                  for t in results["targets"]]
    return "\n".join(lines) + "\n"


def write(results: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (f"suite-{results['shape']['name']}-{results['environment']['device'].replace(':', '')}"
                  f"{'-quantized' if 'quantized' in results else ''}")
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    stem.with_suffix(".md").write_text(quantized_markdown(results) if "quantized" in results else markdown(results))
    return stem.with_suffix(".json"), stem.with_suffix(".md")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", required=True, choices=list(SHAPES),
                        help="; ".join(f"{name}: {shape.note}" for name, shape in SHAPES.items()))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--allow-cpu", action="store_true", help="build a GPU shape on the CPU anyway")
    parser.add_argument("--seqs", type=int, nargs="+", help="training-step lengths (default: the shape's)")
    parser.add_argument("--batch", type=int, help="training examples per step (default: the shape's)")
    parser.add_argument("--new-tokens", type=int, help="decoded tokens per candidate (default: the shape's)")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per variant, after a warm-up")
    parser.add_argument("--repeats", type=int, default=3, help="timed decoding repeats per side")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=Path("runs/benchmarks"), help="folder of the JSON and markdown")
    parser.add_argument("--quantized", action="store_true", help="only the quantized bases' rows (issue 39): K=5 "
                        "two-pass MCL vs PEFT's K=1 LoRA on unquantized, nf4, int8 and torchao int8 bases")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS,
                        help="what to measure (default: all; compiled only with --device cuda)")
    parser.add_argument("--peers", nargs="+", choices=[peer_name(p) for p in PEERS],
                        help="only these peer settings, K/decoding/batch (default: all; one a run keeps each short)")
    parser.add_argument("--backend", help="torch.compile's backend for the compiled rows (default: inductor; "
                        "aot_eager: the same graphs without inductor's C++ build, as the GPU check's dry run)")
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape]
    args.seqs = tuple(args.seqs or shape.seqs)
    args.batch = args.batch or shape.batch
    args.new_tokens = args.new_tokens or shape.new_tokens
    args.sections = args.sections or [s for s in SECTIONS if s != "compiled" or args.device.startswith("cuda")]
    try:
        check_request(shape, args.device, args.dtype, args.allow_cpu)
    except ValueError as error:
        parser.error(str(error))
    return args


def main() -> None:
    args = parse()
    if args.device == "cpu":
        restart_releasing_freed_memory(__spec__.name)
    start(args)
    results = run(args)
    print(quantized_markdown(results) if args.quantized else markdown(results))
    for path in write(results, args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
