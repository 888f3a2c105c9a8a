"""The suite's compiled rows (issue 54, ``--sections compiled``): generate_hypotheses on K hypotheses eager and
compiled (``compile=True``: a static KV cache, the steps through torch.compile, CUDA graphs on a GPU), and the bare
base model decoding the same K*B rows eager and compiled the same way (``loramcl.decoding.compiled``), side by side in
one run; and a training step (stacked relaxed WTA, K = 1 and 5) eager and through ``torch.compile`` of the MCL model
with the batch's ``target_index``, as ``TrainConfig(compile=True)`` trains. The GPU goals: compiled loramcl K=5 within
1.10x the compiled bare base, Llama-8B shape, batch 1; a K = 1 training step at 1024 tokens within 2x the compute
floor:

    python -m benchmarks.speed.suite --shape llama-8b --device cuda --dtype bfloat16 --sections compiled

On the CPU the rows run only when asked for (``--sections compiled``): inductor builds C++ for minutes at a real
shape, and compiled decoding is no default there.
"""

from __future__ import annotations

import contextlib

import torch

from benchmarks.common import interleaved_medians

COMPILED = [(5, "greedy", 1), (5, "beam", 2)]  # (K, strategy, beams per hypothesis), batch 1
COMPILED_TRAINING = (1, 5)  # K of the training steps, eager and compiled
SIDES = ("bare", "bare-compiled", "loramcl", "loramcl-compiled")


def compiled_rows(suite, args) -> list[dict] | str:
    """Each COMPILED setting: the four SIDES timed in turn after one warm-up call each (which compiles)."""
    if suite.shape.family != "llama":
        return "not measured: measured on the text model"
    from loramcl.decoding import generate_hypotheses
    from loramcl.decoding.compiled import compiled_steps, generate_options
    from loramcl.mcl.copies import repeat_examples
    from loramcl.mcl.generate import contiguous_head_input

    inputs = {name: value for name, value in suite.batch(suite.shape.prompt, 0, 1, seed=2).items() if name != "labels"}
    rows = []
    for k, strategy, beams in COMPILED:
        mcl = suite.wrap(k)[0].eval()
        copies = repeat_examples(inputs, k, 1)  # the K*B rows generate_hypotheses decodes
        generation = dict(num_beams=beams, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                          do_sample=False)

        def bare(compile: bool, copies=copies, generation=generation):
            steps = compiled_steps(suite.base) if compile else contextlib.nullcontext()
            options = generate_options() if compile else {}
            with torch.no_grad(), contiguous_head_input(suite.base), steps:
                return suite.base.generate(**copies, **generation, **options)

        def ours(compile: bool, mcl=mcl, strategy=strategy, beams=beams):
            return generate_hypotheses(mcl, None, inputs, strategy=strategy, num_beams=beams, compile=compile,
                                       max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)

        sides = {"bare": lambda: bare(False), "bare-compiled": lambda: bare(True),
                 "loramcl": lambda: ours(False), "loramcl-compiled": lambda: ours(True)}
        eager, compiled = sides["loramcl"](), sides["loramcl-compiled"]()  # also their warm-ups
        agreement = sum(a.token_ids == b.token_ids for row, other in zip(eager, compiled, strict=True)
                        for a, b in zip(row, other, strict=True)) / k
        if agreement < 1 and suite.device == "cpu" and suite.dtype == torch.float32:
            raise RuntimeError(f"K={k} {strategy}: compiled decoding gave other tokens than eager decoding")
        sides["bare"](), sides["bare-compiled"]()
        seconds = interleaved_medians(sides, args.repeats, suite.device, warmup=0)
        rows.append(dict(k=k, strategy=strategy if beams == 1 else f"beam {beams}/hypothesis",
                         **{f"{side}_ms": seconds[side] * 1000 for side in SIDES},
                         compiled_over_bare_compiled=seconds["loramcl-compiled"] / seconds["bare-compiled"],
                         compiled_over_eager=seconds["loramcl-compiled"] / seconds["loramcl"],
                         bare_compiled_over_bare=seconds["bare-compiled"] / seconds["bare"], same_tokens=agreement))
    print("compiled: done", flush=True)
    return rows + training_rows(suite, args)


def training_rows(suite, args) -> list[dict]:
    """A training step (forward, backward, AdamW) of K stacked relaxed hypotheses at the suite's first length,
    eager and compiled, after a warm-up step each (which compiles); the losses of the first step compared."""
    from benchmarks.common import train_step
    from loramcl.decoding import compiled as decoding_compiled
    from loramcl.mcl.batch import checked_target_index

    seq = args.seqs[0]
    batch = suite.batch(seq, seq - seq // 4, args.batch)
    rows = []
    for k in COMPILED_TRAINING:
        (eager, eager_opt), (model, opt) = suite.wrap(k), suite.wrap(k)
        model.load_state_dict(eager.state_dict())
        inputs = {name: value for name, value in batch.items() if name != "labels"}
        index = checked_target_index(eager, inputs, batch["labels"])
        compiled = torch.compile(model, backend=decoding_compiled.BACKEND)  # the decoding rows' backend
        losses = [eager(**batch, target_index=index).loss.item(), compiled(**batch, target_index=index).loss.item()]
        if abs(losses[0] - losses[1]) > 1e-3 * max(abs(losses[0]), 1):
            raise RuntimeError(f"K={k}: the compiled training forward gave loss {losses[1]}, eager {losses[0]}")
        steps = {"eager": lambda m=eager, o=eager_opt: train_step("stacked", m, {**batch, "target_index": index}, o),
                 "compiled": lambda m=compiled, o=opt: train_step("stacked", m, {**batch, "target_index": index}, o)}
        for step in steps.values():
            step()  # warm-up (compiles)
        seconds = interleaved_medians(steps, args.steps, suite.device, warmup=0)
        rows.append(dict(k=k, strategy=f"training step, {seq} tokens", training=True, eager_ms=seconds["eager"] * 1000,
                         compiled_ms=seconds["compiled"] * 1000,
                         compiled_over_eager=seconds["compiled"] / seconds["eager"]))
    print("compiled training: done", flush=True)
    return rows


def markdown(rows: list[dict] | str, new_tokens: int) -> list[str]:
    if isinstance(rows, str):
        return [f"Compiled decoding: {rows}."]
    lines = ["", f"Compiled decoding (static KV cache, steps compiled), batch 1, {new_tokens} new tokens per candidate:",
             "", "| K | decoding | bare (ms) | bare compiled (ms) | loramcl (ms) | loramcl compiled (ms) | "
             "compiled / bare compiled | loramcl compiled / eager | bare compiled / eager | same tokens |",
             "|---" * 10 + "|"]
    lines += [f"| {row['k']} | {row['strategy']} | {row['bare_ms']:.0f} | {row['bare-compiled_ms']:.0f} | "
              f"{row['loramcl_ms']:.0f} | {row['loramcl-compiled_ms']:.0f} | {row['compiled_over_bare_compiled']:.2f} | "
              f"{row['compiled_over_eager']:.2f} | {row['bare_compiled_over_bare']:.2f} | {row['same_tokens']:.0%} |"
              for row in rows if not row.get("training")]
    training = [row for row in rows if row.get("training")]
    if training:
        lines += ["", "Training step (stacked relaxed WTA, forward + backward + AdamW), eager and compiled:", "",
                  "| K | step | eager (ms) | compiled (ms) | compiled / eager |", "|---|---|---|---|---|"]
        lines += [f"| {row['k']} | {row['strategy']} | {row['eager_ms']:.0f} | {row['compiled_ms']:.0f} | "
                  f"{row['compiled_over_eager']:.2f} |" for row in training]
    return lines
