"""The K hypotheses of a trained run served by vLLM, one LoRA request per hypothesis, against loramcl's own decoding:
same greedy candidates, text for text. Run by hand in two environments (vLLM pins its own transformers):

    python -m benchmarks.checks.serve_vllm ours --run RUN --prompts test.jsonl --out ours.json      # loramcl's venv
    loramcl export RUN --out exported                                                      # K PEFT folders
    vllm-env/bin/python -m benchmarks.checks.serve_vllm vllm --exported exported --ours ours.json  # vLLM's venv

`ours` decodes the first --n prompts (JSONL rows with a "prompt") with ``generate_hypotheses`` (greedy) and writes
the prompts' token ids and the K candidates; `vllm` sends each prompt's token ids K times, row k with the LoRA request
of exported/h{k}, greedy in float32, and prints how many of the K x n candidates are the same text (and the ones that
differ). The base model is the run's (read from its run.json, or --base).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def ours(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loramcl import generate_hypotheses, load_mcl_model

    base = args.base or json.loads((Path(args.run) / "run.json").read_text())["settings"]["model"]
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(base)
    model = load_mcl_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), args.run).eval()
    prompts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines()[:args.n]]
    rows = generate_hypotheses(model, tok, prompts, strategy="greedy", max_new_tokens=args.max_new_tokens)
    Path(args.out).write_text(json.dumps({
        "base": str(base), "max_new_tokens": args.max_new_tokens, "prompts": prompts,
        "prompt_ids": [tok(p)["input_ids"] for p in prompts],
        "candidates": [[c.text for c in row] for row in rows]}, ensure_ascii=False, indent=0))
    print(f"{len(prompts)} prompts x {len(rows[0])} hypotheses -> {args.out}")


def served(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    data = json.loads(Path(args.ours).read_text())
    ids, K = data["prompt_ids"], len(data["candidates"][0])
    ranks = {json.loads((Path(args.exported) / f"h{k}" / "adapter_config.json").read_text())["r"] for k in range(K)}
    # max_loras >= K: the K rows of a prompt run in one batch; the rank rounded up to one vLLM accepts
    rank = min(r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= max(ranks))
    llm = LLM(model=args.base or data["base"], dtype="float32", enable_lora=True, max_loras=K, max_lora_rank=rank,
              max_model_len=args.max_model_len)
    requests = [LoRARequest(f"h{k}", k + 1, str(Path(args.exported) / f"h{k}")) for k in range(K)]
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for _ in range(K) for p in ids],   # hypothesis-major
                        SamplingParams(temperature=0, max_tokens=data["max_new_tokens"]),
                        lora_request=[requests[k] for k in range(K) for _ in ids])
    seconds = time.perf_counter() - start
    theirs = [[outs[k * len(ids) + i].outputs[0].text.strip() for k in range(K)] for i in range(len(ids))]
    differ = [(i, k) for i in range(len(ids)) for k in range(K) if theirs[i][k] != data["candidates"][i][k].strip()]
    print(json.dumps({"candidates": K * len(ids), "same_text": K * len(ids) - len(differ),
                      "generate_seconds": round(seconds, 2)}))
    for i, k in differ:
        print(f"prompt {i}, h{k}\n  vLLM:    {theirs[i][k]!r}\n  loramcl: {data['candidates'][i][k].strip()!r}")


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("ours", help="loramcl's greedy candidates (loramcl's environment)")
    one.add_argument("--run", required=True, help="a trained run's folder (its adapters)")
    one.add_argument("--prompts", required=True, help="JSONL rows with a 'prompt'")
    one.add_argument("--out", required=True)
    one.add_argument("--n", type=int, default=32, help="the first n prompts")
    one.add_argument("--max_new_tokens", type=int, default=32)
    one.add_argument("--base", help="the base model's folder (default: the run's)")
    two = commands.add_parser("vllm", help="the exported adapters served by vLLM (vLLM's environment)")
    two.add_argument("--exported", required=True, help="`loramcl export`'s folder (h0 ... h{K-1})")
    two.add_argument("--ours", required=True, help="the JSON `ours` wrote")
    two.add_argument("--base", help="the base model's folder (default: the one `ours` used)")
    two.add_argument("--max_model_len", type=int, default=512)
    return parser


def main() -> None:
    args = arguments().parse_args()
    ours(args) if args.command == "ours" else served(args)


if __name__ == "__main__":
    main()
