"""The output layer and cross-entropy of N label tokens, whole or in chunks: time and peak memory side by side.

How the gradient of a chunked cross-entropy is obtained decides its speed; the variants:
  whole           F.cross_entropy(lm_head(h).float()): [N, V] logits, their float32 log-softmax kept for backward
  checkpoint      torch.utils.checkpoint around each chunk: every chunk's logits computed again in the backward
  recompute       an autograd Function keeping [N] log-sum-exps, recomputing each chunk's logits in the backward
  grad-in-forward loramcl's (scoring.chunked_token_nll): each chunk's d nll / d h computed in the forward, [N, d] kept
and, for each chunked variant, several chunk sizes. Each step is a forward, a backward of a weighted sum of the
token NLLs (as the MCL losses are) into the hidden states (the output layer is frozen, as in LoRA-MCL), and a
no-grad forward (the scoring pass of two-pass WTA). Before timing, every variant is checked against `whole`.

    python -m benchmarks.speed.chunked_cross_entropy --threads 1           # CPU: N 1024, d 576, V 32768
    python -m benchmarks.speed.chunked_cross_entropy --vocab 151936        # Qwen2's vocabulary

Peak memory: as benchmarks/speed/training_step.py (peak resident set of the step in a fresh process per variant, above
the resident set before it; on CUDA, max_memory_allocated).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from benchmarks.common import RELEASE_FREED_MEMORY, in_fresh_process, peak_mib, synchronize
from loramcl.mcl.nll import chunked_token_nll


def whole(hidden, targets, head, chunk_size):
    return F.cross_entropy(head(hidden).float(), targets, reduction="none")  # [N]


def checkpointed(hidden, targets, head, chunk_size):
    def chunk_nll(states, chunk_targets):
        return F.cross_entropy(head(states).float(), chunk_targets, reduction="none")

    return torch.cat([checkpoint(chunk_nll, hidden[start:start + chunk_size], targets[start:start + chunk_size],
                                 use_reentrant=False) for start in range(0, hidden.shape[0], chunk_size)])


class Recomputed(torch.autograd.Function):
    """Forward keeps the log-sum-exp of each token; backward recomputes each chunk's logits:
    d nll / d h = (softmax - onehot) W, with softmax = exp(logits - lse)."""

    @staticmethod
    def forward(ctx, hidden, targets, weight, chunk_size):
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        target_logit = torch.empty_like(lse)
        for start in range(0, hidden.shape[0], chunk_size):
            logits = (hidden[start:start + chunk_size] @ weight.T).float()  # [n, V]
            lse[start:start + chunk_size] = logits.logsumexp(dim=1)
            target_logit[start:start + chunk_size] = logits.gather(1, targets[start:start + chunk_size, None])[:, 0]
        ctx.save_for_backward(hidden, targets, weight, lse)
        ctx.chunk_size = chunk_size
        return lse - target_logit

    @staticmethod
    def backward(ctx, grad_nll):
        hidden, targets, weight, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            chunk = slice(start, start + ctx.chunk_size)
            probabilities = ((hidden[chunk] @ weight.T).float() - lse[chunk, None]).exp_()  # [n, V]
            probabilities[torch.arange(probabilities.shape[0]), targets[chunk]] -= 1.0
            probabilities *= grad_nll[chunk, None]
            grad_hidden[chunk] = (probabilities.to(weight.dtype) @ weight).to(hidden.dtype)
        return grad_hidden, None, None, None


def recomputed(hidden, targets, head, chunk_size):
    return Recomputed.apply(hidden, targets, head.weight, chunk_size)


def grad_in_forward(hidden, targets, head, chunk_size):
    return chunked_token_nll(hidden, targets, head, chunk_size)


METHODS = {"whole": whole, "checkpoint": checkpointed, "recompute": recomputed, "grad-in-forward": grad_in_forward}


def variants(args) -> list[tuple[str, int | None]]:
    return [("whole", None)] + [(method, size) for method in ("checkpoint", "recompute", "grad-in-forward")
                                for size in args.chunks]


def build(args):
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False).to(args.device, dtype).requires_grad_(False)
    hidden = torch.randn(args.tokens, args.hidden, device=args.device, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, args.vocab, (args.tokens,), device=args.device)
    weights = torch.rand(args.tokens, device=args.device)  # per-token loss weights (q / number of tokens)
    return head, hidden, targets, weights


def step(method, chunk_size, head, hidden, targets, weights):
    nll = METHODS[method](hidden, targets, head, chunk_size)
    (nll * weights).sum().backward()
    hidden.grad = None
    with torch.no_grad():  # the scoring pass
        METHODS[method](hidden, targets, head, chunk_size)


def check(args) -> None:
    head, hidden, targets, weights = build(args)
    results = {}
    for method, size in variants(args):
        nll = METHODS[method](hidden, targets, head, size)
        (nll * weights).sum().backward()
        results[method, size] = (nll.detach(), hidden.grad)
        hidden.grad = None
    reference = results["whole", None]
    tolerance = 1e-5 if args.dtype == "float32" else 2e-2
    for key, (nll, grad) in results.items():
        torch.testing.assert_close(nll, reference[0], atol=tolerance, rtol=tolerance, msg=f"{key}: nll")
        torch.testing.assert_close(grad, reference[1], atol=tolerance, rtol=tolerance, msg=f"{key}: gradient")


def time_all(args) -> dict:
    built = build(args)
    keys = variants(args)
    for key in keys:
        step(*key, *built)  # warm-up
    times = {key: [] for key in keys}
    for _ in range(args.steps):
        for key in keys:  # interleaved, so that drifts of the machine hit every variant alike
            synchronize(args.device)
            started = time.perf_counter()
            step(*key, *built)
            synchronize(args.device)
            times[key].append(time.perf_counter() - started)
    return {key: statistics.median(values) for key, values in times.items()}


def peak_memory_mib(method: str, size: int | None) -> float:
    arguments = ["--memory-of", method, str(size or 0), *sys.argv[1:]]
    return in_fresh_process(__spec__.name, arguments, RELEASE_FREED_MEMORY)["peak_mib"]


def measure_memory_here(args, method: str, size: int | None) -> None:
    built = build(args)
    step(method, size, *built)  # warm-up
    print(json.dumps({"peak_mib": peak_mib(args.device, lambda: step(method, size, *built))}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=1024, help="N label tokens (K * label tokens of a batch)")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunks", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--memory-of", nargs=2, metavar=("METHOD", "CHUNK"), help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_of:
        measure_memory_here(args, args.memory_of[0], int(args.memory_of[1]) or None)
        return
    check(args)
    print(f"N {args.tokens} label tokens, hidden {args.hidden}, vocab {args.vocab}; {args.device} {args.dtype}, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; median of {args.steps} steps (forward + backward "
          "+ no-grad forward)")
    seconds = time_all(args)
    memory = {key: peak_memory_mib(*key) for key in variants(args)}
    reference = ("whole", None)
    print(f"\nwhole: {seconds[reference] * 1000:.0f} ms, peak {memory[reference]:.0f} MiB; [N, V] float32 logits are "
          f"{args.tokens * args.vocab * 4 / 2**20:.0f} MiB\n")
    print("| variant | chunk | time / whole | peak memory / whole |")
    print("|---|---|---|---|")
    for key in variants(args):
        print(f"| {key[0]} | {key[1] or 'N'} | {seconds[key] / seconds[reference]:.2f} | "
              f"{memory[key] / memory[reference]:.2f} |")


if __name__ == "__main__":
    main()
