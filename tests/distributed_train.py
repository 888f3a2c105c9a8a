"""Run by test_distributed.py under `torchrun --nproc_per_node 2`: train with MCLTrainer (DDP over gloo, CPU),
writing checkpoints at steps 2 and 3, and write each rank's adapters to OUT/rank{r}.safetensors; the output verdict
decodes on both ranks at the end, without a deadlock, and gives both the same verdict; then, in the same processes
(one launch), the balancing-bias run of distributed_balance_train.py into OUT/balance."""

import os
import sys
import tempfile

import safetensors.torch
import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainingArguments
from transformers.utils import logging

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import build_model, token_rows  # noqa: E402

import distributed_balance_train  # noqa: E402

from loramcl import MCLConfig, MCLTrainer, get_mcl_model  # noqa: E402
from loramcl.training.outputs import OutputVerdictCallback  # noqa: E402


def main(out: str) -> None:
    logging.set_verbosity_error()
    torch.manual_seed(0)  # the same initial adapters on both ranks, as Trainer users get from a seeded script
    mcl = get_mcl_model(build_model("llama"), MCLConfig(num_hypotheses=2, r=4, alpha=8, dropout=0.1,
                                                        target_modules=["q_proj", "v_proj"], loss="wta"))
    initial = mcl.adapter_state_dict()
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "attention_mask": torch.ones(8, dtype=torch.long), "labels": ids}
            for ids in torch.randint(3, 80, (32, 8), generator=g)]
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2,
                             report_to=[], use_cpu=True, ddp_backend="gloo", save_strategy="steps", save_steps=2,
                             disable_tqdm=True, logging_steps=1, seed=0)
    # two-pass WTA: the trickiest path under DDP; the validation rows (never evaluated: eval_strategy "no") are the
    # prompts the output verdict decodes
    trainer = MCLTrainer(mcl, args=args, train_dataset=data, eval_dataset=token_rows(8, 8, seed=2, prompt=2))
    outputs = OutputVerdictCallback(trainer, prompts=4, min_examples=0,
                                    path=os.path.join(tempfile.mkdtemp(), "outputs.jsonl"))
    trainer.add_callback(outputs)
    trainer.train()
    verdicts = [None, None]
    torch.distributed.all_gather_object(verdicts, outputs.verdict.to_dict())
    assert verdicts[0] == verdicts[1] and verdicts[0]["kind"] != "no verdict", verdicts
    rank = trainer.args.process_index
    assert trainer.args.world_size == 2, trainer.args.world_size
    # every adapter tensor takes part in every MCL forward: DDP must not search the graph for unused ones
    assert isinstance(trainer.model_wrapped, DistributedDataParallel), type(trainer.model_wrapped)
    assert trainer.model_wrapped.find_unused_parameters is False
    assert args.ddp_find_unused_parameters is None  # the caller's arguments are left as they were
    final = mcl.adapter_state_dict()
    assert any(not torch.equal(initial[k], final[k]) for k in final), "the adapters did not train"
    safetensors.torch.save_file(final, os.path.join(out, f"rank{rank}.safetensors"))
    distributed_balance_train.main(os.path.join(out, "balance"))


if __name__ == "__main__":
    main(sys.argv[1])
