"""A 2-process CPU run of MCLTrainer (torchrun, gloo) ends with identical adapters on both ranks, without DDP's
unused-parameter search, and its checkpoint holds both ranks' RNG states."""

import os
import subprocess
import sys

import safetensors.torch
import torch


def test_two_process_training_keeps_ranks_identical(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "distributed_train.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", script,
               str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [safetensors.torch.load_file(tmp_path / f"rank{r}.safetensors") for r in (0, 1)]
    assert ranks[0].keys() == ranks[1].keys() and ranks[0]
    for key in ranks[0]:
        assert torch.equal(ranks[0][key], ranks[1][key]), key
    # published once every rank had written into it: the rank-1 RNG state is inside, no staging folder is left
    assert sorted(os.listdir(tmp_path / "checkpoint-2")) == sorted([
        "mcl_adapters.safetensors", "mcl_config.json", "optimizer.pt", "rng_state_0.pth", "rng_state_1.pth",
        "scheduler.pt", "trainer_state.json", "training_args.json"])
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-3", "rank0.safetensors", "rank1.safetensors"]
