"""Run by test_distributed.py under `torchrun --nproc_per_node 2`: MCLTrainer under accelerate's FSDP2, set as a user
sets it (``TrainingArguments(fsdp=True, fsdp_config={"version": 2})``), on 2 CPU processes (gloo). It trains 4 steps
with a checkpoint at step 2 (OUT/run) and saves the adapters (OUT/final); a second trainer on a fresh model resumes
from OUT/run/checkpoint-2 and saves its adapters (OUT/resumed). This twice, under OUT/<state dict type>: with
transformers' default FULL_STATE_DICT on a float32 base model, and with SHARDED_STATE_DICT (accelerate's default)
on a bfloat16 base (``LEGS``). Rank 0 writes each trainer's losses (OUT/losses.json). Last, ``fit`` trains a K = 1 run
under FSDP2 set as ``accelerate launch`` sets it (OUT/fit, ``fit_as_launched``).

What is forced, and only that: accelerate 1.15 chooses FSDP in ``AcceleratorState.__init__`` only when the process
group's ``distributed_type`` is a GPU-like one (MULTI_GPU, MULTI_NPU, MULTI_XPU, ...); on CPU processes it is
MULTI_CPU, and a version-2 FSDP plugin is silently dropped (the run is DDP). This script sets the process group's
``distributed_type`` to MULTI_GPU once ``PartialState`` exists, before the trainer builds its ``Accelerator`` (for
``fit``, which makes the process group anew, just before: ``fit_as_launched``): the devices stay the CPU and the
backend gloo, and ``AcceleratorState`` takes its FSDP branch with the plugin Trainer made from the arguments (or
accelerate from the environment). From there on the code is what runs on GPUs: Trainer's FSDP2 path (accelerate's
``fsdp2_prepare_model``: ``fully_shard`` on each class of the model's ``_no_split_modules``, then the root; FSDP2's
gradient clipping and optimizer state dict; resuming through ``load_fsdp_optimizer``) and ours. One more thing is set
by hand, as no launch would need it: the second leg runs in the processes of the first, whose FSDP plugin (a
process-wide state) is the first trainer's, so its state dict type is set to the one the second leg's arguments name.
"""

import json
import os
import sys

import torch
from accelerate import PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import TrainingArguments, default_data_collator
from transformers.utils import logging

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import build_model  # noqa: E402

from loramcl import MCLConfig, MCLTrainer, get_mcl_model  # noqa: E402
from loramcl.training.config import TrainConfig  # noqa: E402
from loramcl.training.fit import fit  # noqa: E402

# Ties to the lowest hypothesis (the first step is all ties: B = 0), no dropout: 2 ranks on half a batch each draw
# nothing one process on the whole batch would draw otherwise.
CONFIG = MCLConfig(num_hypotheses=2, r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], loss="wta",
                   tie_break="lowest")
STEPS, BATCH = 4, 8  # BATCH examples per optimizer step, over all processes
LEGS = {"FULL_STATE_DICT": torch.float32, "SHARDED_STATE_DICT": torch.bfloat16}  # state dict type: base weights


def dataset() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": ids, "attention_mask": torch.ones(8, dtype=torch.long), "labels": ids}
            for ids in torch.randint(3, 80, (STEPS * BATCH, 8), generator=g)]


def arguments(out: str, processes: int, **extra) -> TrainingArguments:
    """The same run on ``processes`` processes: in order (a rank takes the next BATCH / processes rows), Adam at 1e-2
    with Trainer's clipping, a checkpoint at step 2."""
    return TrainingArguments(output_dir=out, per_device_train_batch_size=BATCH // processes, max_steps=STEPS,
                             learning_rate=1e-2, train_sampling_strategy="sequential", save_strategy="steps",
                             save_steps=2, report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=1, seed=0,
                             **extra)


def train(out: str, processes: int, resume: str | None = None, dtype: torch.dtype = torch.float32,
          **extra) -> MCLTrainer:
    """``STEPS`` steps of a tiny Llama, its base weights in ``dtype`` (the adapters float32)."""
    torch.manual_seed(0)
    mcl = get_mcl_model(build_model("llama").to(dtype), CONFIG)
    trainer = MCLTrainer(mcl, args=arguments(out, processes, **extra), train_dataset=dataset())
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def losses(trainer: MCLTrainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def fit_as_launched(out: str) -> None:
    """``loramcl train``'s training stage (``fit``) of K = 1, with FSDP2 set as ``accelerate launch --use_fsdp
    --fsdp_version 2 --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP`` sets it, in the environment (accelerate's
    defaults then: SHARDED_STATE_DICT), after the same with ``--fsdp_version 1``, which is refused. ``fit`` makes its
    own arguments, whose process group is made anew, so the same one thing is forced there: just before the trainer
    builds its Accelerator."""
    os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2", FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP")
    building = MCLTrainer.create_accelerator_and_postprocess

    def gpu_like_then_build(self):
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
        building(self)
        assert self.is_fsdp_enabled, "FSDP was not chosen"

    MCLTrainer.create_accelerator_and_postprocess = gpu_like_then_build
    config = MCLConfig(num_hypotheses=1, r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    os.environ["FSDP_VERSION"] = "1"  # refused when the trainer is built, naming the FSDP2 settings
    try:
        fit(lambda: build_model("llama"), out, config, TrainConfig(steps=2, batch_size=4), {}, dataset(), None,
            default_data_collator)
        raise AssertionError("FSDP version 1 from the launcher was not refused")
    except ValueError as error:
        assert "FSDP version 1" in str(error) and "--fsdp_version 2" in str(error), error
    os.environ["FSDP_VERSION"] = "2"
    fit(lambda: build_model("llama"), out, config, TrainConfig(steps=2, batch_size=4, save_every=1), {},
        dataset(), None, default_data_collator)


def main(out: str) -> None:
    logging.set_verbosity_error()
    # the process group, made here and kept by the trainers (use_configured_state): the one thing forced (docstring)
    PartialState(cpu=True, backend="gloo")
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    recorded = {}
    for kind, dtype in LEGS.items():
        fsdp = dict(fsdp=True, fsdp_config={"version": 2, "state_dict_type": kind},
                    accelerator_config={"use_configured_state": True})
        if kind != "FULL_STATE_DICT":  # a process keeps the FSDP plugin of its first Accelerator: set as the arguments
            plugin = AcceleratorState().fsdp_plugin
            plugin.state_dict_config = plugin.optim_state_dict_config = None  # the full ones' rank-0 settings go too
            plugin.set_state_dict_type(kind)
        folder = os.path.join(out, kind)
        trainer = train(os.path.join(folder, "run"), 2, dtype=dtype, **fsdp)
        assert trainer.accelerator.distributed_type == DistributedType.FSDP and trainer.accelerator.is_fsdp2
        assert trainer.accelerator.state.fsdp_plugin.state_dict_type.name == kind
        mcl = trainer._mcl_model()
        assert isinstance(mcl, FSDPModule), type(mcl)
        assert all(isinstance(layer, FSDPModule) for layer in mcl.base_model.model.layers)  # auto-wrap found them
        assert all(isinstance(p, DTensor) for p in mcl.parameters() if p.requires_grad), "the adapters are not sharded"
        # FSDP2 shards each parameter alone: a bf16 base beside float32 adapters is fine (FSDP1 is refused for it)
        assert {p.dtype for p in mcl.parameters() if not p.requires_grad} == {dtype}
        assert {p.dtype for p in mcl.parameters() if p.requires_grad} == {torch.float32}
        assert len(mcl.state_dict()) > len(mcl.adapter_state_dict())  # whole again once train() returned
        trainer.save_model(os.path.join(folder, "final"))
        resumed = train(os.path.join(folder, "resumed-run"), 2, resume=os.path.join(folder, "run", "checkpoint-2"),
                        dtype=dtype, **fsdp)
        assert resumed.resumed_from.endswith("checkpoint-2") and resumed.state.global_step == STEPS
        resumed.save_model(os.path.join(folder, "resumed"))
        recorded[kind] = {"run": losses(trainer), "resumed": losses(resumed)}
    fit_as_launched(os.path.join(out, "fit"))
    if trainer.is_world_process_zero():
        with open(os.path.join(out, "losses.json"), "w", encoding="utf-8") as f:
            json.dump(recorded, f)


if __name__ == "__main__":
    main(sys.argv[1])
