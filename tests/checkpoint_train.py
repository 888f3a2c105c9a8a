"""A short MCLTrainer run saving a checkpoint every 2 steps, shared by test_checkpoints.py and run by it as a child
process (`python checkpoint_train.py OUT`) that is killed with SIGKILL while it writes a checkpoint.

With PAUSE_IN_SAVE_AT_STEP=N in the environment, the write of checkpoint N stops after the adapters, optimizer,
scheduler and RNG state and before the trainer state, touches the file PAUSE_MARKER and waits to be killed.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from transformers import TrainingArguments
from transformers.utils import logging

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import build_model  # noqa: E402

from loramcl import MCLConfig, MCLTrainer, get_mcl_model  # noqa: E402


class PausingTrainer(MCLTrainer):
    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        if os.environ.get("PAUSE_IN_SAVE_AT_STEP") == str(self.state.global_step):
            open(os.environ["PAUSE_MARKER"], "w").close()
            time.sleep(600)  # the test kills this process here


def trainer(out: str, max_steps: int = 6, eval_examples: int = 0, **overrides) -> MCLTrainer:
    """A trainer whose runs are bit-for-bit reproducible: fixed seeds, one thread, dropout drawn from the RNG
    state that a checkpoint must restore. ``eval_examples``: evaluate on that many training examples."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    mcl = get_mcl_model(build_model("llama"), MCLConfig(num_hypotheses=3, r=4, alpha=8, dropout=0.1,
                                                        target_modules=["q_proj", "v_proj"], loss="relaxed",
                                                        epsilon=0.1))
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "attention_mask": torch.ones(8, dtype=torch.long), "labels": ids}
            for ids in torch.randint(3, 80, (48, 8), generator=g)]
    values = dict(output_dir=out, per_device_train_batch_size=4, max_steps=max_steps, learning_rate=1e-2,
                  report_to=[], use_cpu=True, save_strategy="steps", save_steps=2, disable_tqdm=True,
                  logging_steps=1, seed=0, data_seed=0)
    values.update(overrides)
    return PausingTrainer(mcl, args=TrainingArguments(**values), train_dataset=data,
                          eval_dataset=data[:eval_examples] or None)


def adapters(trainer: MCLTrainer) -> dict[str, torch.Tensor]:
    return trainer.accelerator.unwrap_model(trainer.model).adapter_state_dict()


if __name__ == "__main__":
    logging.set_verbosity_error()
    trainer(sys.argv[1]).train()
