"""What the K hypotheses' decoding costs over the bare base model decoding the same K*B rows (issue 40's physical
limit), and what the candidates' log-probabilities cost (issues 40 and 41).

On a real model folder (SmolLM2-135M-Instruct: `loramcl convert-smollm2 --out models/SmolLM2-135M-Instruct`), K
hypotheses (untrained: B = 0, so every side decodes the same tokens, which the script checks) of PEFT's default
targets, B chat prompts, greedy: the sides take turns repeat by repeat, and the median of each is kept.

- bare: the unwrapped base model's ``generate`` on the K*B rows (no adapters, no log-probabilities);
- loramcl: ``generate_hypotheses`` with its defaults (log_probs=True: the chosen tokens' log-probabilities recorded
  step by step);
- log_probs=False;
- step logits: log_probs=True as it was before issue 41 (transformers' ``output_logits``, an fp32 [rows, V] kept
  per step, read back after generate);
- PEFT mixed batch: the same hypotheses as PEFT adapters (``loramcl.to_peft``), row group k named ``h{k}`` in one
  ``generate(..., adapter_names=...)`` (issue 40's peer).

Times are the process's CPU time (one thread: the machine's other processes do not count), and peak resident memory
above the model's (glibc told to return freed memory at once). Then the teacher-forced re-scoring of the candidates
(diverse beam search's log-probabilities): peak memory of the full [N, T, V] log-softmax against the chosen tokens'
only, in blocks.

    python -m benchmarks.speed.decoding_cost --model models/SmolLM2-135M-Instruct --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import peak_mib, restart_releasing_freed_memory
from loramcl import MCLConfig, get_mcl_model
from loramcl.decoding import generate_hypotheses, strategies
from loramcl.mcl.export import to_peft
from loramcl.mcl.nll import token_log_probs

TOPICS = ["the sea", "a quiet library", "autumn leaves", "a train station", "coffee", "mountains at dawn",
          "a city at night", "an old bridge", "the first snow", "a market"]


def chat_prompts(tokenizer, count: int) -> dict:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Write one sentence about {topic}."}],
                                           tokenize=False, add_generation_prompt=True)
             for topic in (TOPICS * count)[:count]]
    tokenizer.padding_side = "left"
    return dict(tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False))


def sides(bare, mcl, peft, tokenizer, inputs: dict, k: int, new_tokens: int, beams: int) -> dict:
    rows = {name: value.repeat(k, 1) for name, value in inputs.items()}  # the K*B rows, hypothesis-major
    settings = dict(max_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id, num_beams=beams,
                    strategy="beam" if beams > 1 else "greedy")
    keeping = strategies._generate_kwargs

    def bare_side():
        with torch.no_grad():
            sequences = bare.generate(**rows, do_sample=False, max_new_tokens=new_tokens, num_beams=beams,
                                      pad_token_id=tokenizer.pad_token_id)
        return sequences[:, rows["input_ids"].shape[1]:]

    def peft_side():
        names = [f"h{h}" for h in range(k) for _ in range(len(rows["input_ids"]) // k)]  # hypothesis-major
        with torch.no_grad():
            sequences = peft.generate(**rows, adapter_names=names, do_sample=False, max_new_tokens=new_tokens,
                                      num_beams=beams, pad_token_id=tokenizer.pad_token_id)
        return sequences[:, rows["input_ids"].shape[1]:]

    def step_logits():
        strategies._generate_kwargs = lambda *args: {**keeping(*args), "output_logits": True}
        try:
            return generate_hypotheses(mcl, None, inputs, **settings)
        finally:
            strategies._generate_kwargs = keeping

    return {"bare": bare_side,
            "loramcl": lambda: generate_hypotheses(mcl, None, inputs, **settings),
            "log_probs=False": lambda: generate_hypotheses(mcl, None, inputs, log_probs=False, **settings),
            "step logits (before)": step_logits, "PEFT mixed batch": peft_side}


def cpu_medians(runs: dict, repeats: int) -> dict:
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.process_time()
            run()
            times[name].append(time.process_time() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def check_same_tokens(outputs: dict, eos: int) -> None:
    bare = [[t for t in row if t != eos] for row in outputs["bare"].tolist()]
    for name, candidates in outputs.items():
        if torch.is_tensor(candidates):  # a plain generate's tokens [K*B, L], hypothesis-major
            if not torch.equal(candidates, outputs["bare"]):
                raise RuntimeError(f"{name}: other tokens than the bare model's")
            continue
        k = len(candidates[0])
        decoded = [candidates[i][c].token_ids for c in range(k) for i in range(len(candidates))]  # hypothesis-major
        same = sum(a == b[:len(a)] and all(t == eos for t in b[len(a):]) for a, b in zip(decoded, bare, strict=True))
        if same != len(bare):
            raise RuntimeError(f"{name}: {same}/{len(bare)} candidates decoded the bare model's tokens")
    print(f"same tokens on every side: {len(bare)}/{len(bare)}\n")


def rescoring_memory(mcl, rows: int, length: int) -> dict:
    """Peak MiB of the log-probabilities of ``length`` chosen tokens of ``rows`` sequences from their logits
    [rows, T, V]: the full log-softmax then a gather (before) against ``token_log_probs`` in blocks (now)."""
    vocabulary = mcl.base_model.config.vocab_size
    logits = torch.randn(rows, length, vocabulary)
    tokens = torch.randint(0, vocabulary, (rows, length))

    def full():
        return logits.float().log_softmax(-1).gather(2, tokens.unsqueeze(2)).squeeze(2)

    def blocks():
        return token_log_probs(logits.flatten(0, 1), tokens.flatten()).view(rows, length)

    if not torch.allclose(full(), blocks(), atol=1e-5):
        raise RuntimeError("the re-scoring in blocks differs from the full log-softmax")
    return {"full log-softmax (before)": peak_mib("cpu", full), "chosen tokens in blocks": peak_mib("cpu", blocks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct", help="a causal LM folder")
    parser.add_argument("--hypotheses", type=int, default=5, help="K")
    parser.add_argument("--batch", type=int, default=8, help="prompts (B)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--beams", type=int, default=1, help="beams per hypothesis (1: greedy)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    restart_releasing_freed_memory(__spec__.name)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    bare = AutoModelForCausalLM.from_pretrained(args.model).eval()
    mcl = get_mcl_model(AutoModelForCausalLM.from_pretrained(args.model),
                        MCLConfig(num_hypotheses=args.hypotheses)).eval()
    peft = to_peft(get_mcl_model(AutoModelForCausalLM.from_pretrained(args.model),
                                 MCLConfig(num_hypotheses=args.hypotheses)), inplace=True).eval()
    inputs = chat_prompts(tokenizer, args.batch)
    runs = sides(bare, mcl, peft, tokenizer, inputs, args.hypotheses, args.new_tokens, args.beams)
    k, b = args.hypotheses, args.batch
    decoding = "greedy" if args.beams == 1 else f"beam {args.beams}"
    print(f"{args.model}: K={k}, B={b} prompts of up to {inputs['input_ids'].shape[1]} tokens, {args.new_tokens} new "
          f"tokens, {decoding}; torch {torch.__version__}, {torch.get_num_threads()} thread(s); median of "
          f"{args.repeats} repeats of process CPU time\n")
    check_same_tokens({name: run() for name, run in runs.items()}, tokenizer.eos_token_id)  # also the warm-up
    seconds = cpu_medians(runs, args.repeats)
    memory = {name: peak_mib("cpu", run) for name, run in runs.items()}  # warm: no first-call allocations
    print("| side | CPU s | / bare | peak MiB above the model |")
    print("|---|---|---|---|")
    for name, value in seconds.items():
        print(f"| {name} | {value:.2f} | {value / seconds['bare']:.3f} | {memory[name]:.0f} |")
    rows, length = k * b, args.new_tokens
    print(f"\nre-scoring {rows} candidates of {length} tokens from their logits [{rows}, {length}, V]:\n")
    print("| log-probabilities | peak MiB |")
    print("|---|---|")
    for name, value in rescoring_memory(mcl, rows, length).items():
        print(f"| {name} | {value:.0f} |")


if __name__ == "__main__":
    main()
