"""A 2-process CPU run of MCLTrainer (torchrun, gloo) ends with identical adapters on both ranks."""

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
