"""Run by test_distributed.py under `torchrun --nproc_per_node 2`: an MCLModel sharded with PyTorch's FSDP2
(`fully_shard`, gloo, CPU) trains 3 steps on its half of each batch, then writes the adapters gathered from the
shards with MCLModel.save_pretrained (OUT/fsdp), hypothesis 1 as a PEFT adapter (OUT/peft-h1) and, as a cross-check,
the full state dict gathered by torch.distributed.checkpoint (OUT/dcp.safetensors). Every rank's fingerprint of the
plain base model, sharded alike, goes to OUT/fingerprints.json."""

import json
import os
import sys

import safetensors.torch
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import build_model  # noqa: E402

from loramcl import MCLConfig, get_mcl_model  # noqa: E402
from loramcl.mcl.fingerprint import base_fingerprint  # noqa: E402

# Ties to the lowest hypothesis: random ties draw from each process's RNG, so two ranks with half a batch each would
# draw other winners than one process with the whole batch (the first step is all ties: B = 0).
CONFIG = MCLConfig(num_hypotheses=3, r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                   loss="relaxed", epsilon=0.1, tie_break="lowest")
STEPS, BATCH, LR = 3, 8, 1e-2


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 80, (BATCH, 8), generator=g) for _ in range(STEPS)]


def train(mcl, rows: slice) -> None:
    """AdamW on the adapters, the relaxed-WTA loss (a mean over the batch) of rows ``rows`` of each batch."""
    optimizer = torch.optim.AdamW([p for p in mcl.parameters() if p.requires_grad], lr=LR)
    mcl.train()
    for ids in batches():
        loss = mcl(input_ids=ids[rows], labels=ids[rows]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def stage(rank: int, what: str) -> None:
    """A line on stderr per stage, so that a rank that dies says how far it got (CI's log keeps the tail)."""
    print(f"rank {rank}: {what}", file=sys.stderr, flush=True)


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    mcl = get_mcl_model(build_model("llama"), CONFIG)
    for layer in mcl.base_model.model.layers:
        fully_shard(layer)
    fully_shard(mcl)
    assert any(isinstance(p, DTensor) for p in mcl.parameters() if p.requires_grad), "nothing was sharded"
    share = BATCH // world
    train(mcl, slice(rank * share, (rank + 1) * share))  # FSDP2 averages the gradients: the whole batch's mean
    stage(rank, "trained")
    mcl.save_pretrained(os.path.join(out, "fsdp"))  # every rank: gathering the shards is collective
    mcl.export_hypothesis(1, os.path.join(out, "peft-h1"))  # likewise
    stage(rank, "saved and exported")
    state = get_model_state_dict(mcl, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    torch.manual_seed(0)
    base = build_model("llama")  # the base model under the adapters, sharded alike
    for layer in base.model.layers:
        fully_shard(layer)
    fully_shard(base)
    fingerprints = [None] * world
    dist.all_gather_object(fingerprints, base_fingerprint(base))  # each rank gathers the shards (a collective)
    if rank == 0:
        safetensors.torch.save_file({k: v for k, v in state.items() if "lora_" in k},
                                    os.path.join(out, "dcp.safetensors"))
        with open(os.path.join(out, "fingerprints.json"), "w", encoding="utf-8") as f:
            json.dump(fingerprints, f)
    dist.barrier()
    dist.destroy_process_group()
    stage(rank, "done")
    # Every file is written and the group destroyed: leave without the interpreter's teardown, where gloo's threads
    # once aborted a finished rank ("terminate called without an active exception", CI 2026-11-29; pytorch/pytorch
    # PR 179291 describes gloo work objects outliving the interpreter). The test checks the files, not the exit path.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
