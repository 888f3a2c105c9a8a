"""Run by distributed_train.py (test_distributed.py, `torchrun --nproc_per_node 2`) after its own run: MCLTrainer (DDP over gloo, CPU) with a balancing
bias and a staged split, batches of 2 accumulated over 2 on each rank; writes each rank's view to OUT/rank{r}.json:
the wins each bias update saw, the final bias and the adapters."""

import json
import os
import sys

import torch
from transformers import TrainingArguments
from transformers.utils import logging

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import build_model  # noqa: E402

from loramcl import MCLConfig, MCLTrainer, get_mcl_model  # noqa: E402
from loramcl.training import balance  # noqa: E402


def main(out: str) -> None:
    logging.set_verbosity_error()
    torch.manual_seed(0)
    mcl = get_mcl_model(build_model("llama"), MCLConfig(num_hypotheses=3, r=4, alpha=8, dropout=0.1, loss="wta",
                                                        target_modules=["q_proj", "v_proj"], balance="bias",
                                                        balance_rate=0.05, split_after=0.25, split_noise=0.5))
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "attention_mask": torch.ones(8, dtype=torch.long), "labels": ids}
            for ids in torch.randint(3, 80, (64, 8), generator=g)]
    seen, step = [], balance.bias_step
    balance.bias_step = lambda wins, rate: (seen.append(wins.tolist()), step(wins, rate))[1]
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=8, learning_rate=1e-2, report_to=[], use_cpu=True, ddp_backend="gloo",
                             save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0)
    trainer = MCLTrainer(mcl, args=args, train_dataset=data)
    trainer.train()
    assert trainer.args.world_size == 2, trainer.args.world_size
    record = {"wins": seen, "bias": trainer.log_store.balance_bias.tolist(),
              "biases": [[log[f"bias_h{k}"] for k in range(3)] for log in trainer.state.log_history if "loss" in log],
              "adapters": {k: v.flatten().tolist() for k, v in mcl.adapter_state_dict().items()}}
    with open(os.path.join(out, f"rank{trainer.args.process_index}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1])
