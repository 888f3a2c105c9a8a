"""What ``MCLTrainer`` does differently on several processes or devices: the layouts it refuses (DataParallel, FSDP
version 1, each with what to use instead), and under FSDP2 the checkpoints without the frozen base
(``AdaptersOnlyStateDict``). docs/guide/reliability.md, "Several GPUs: DDP and FSDP2", says how each is launched
and tested."""

from __future__ import annotations

from torch import nn
from transformers import TrainerCallback, TrainingArguments


def refuse_data_parallel(args: TrainingArguments) -> None:
    """Several GPUs seen by one process (no torchrun): Trainer would wrap the model in ``nn.DataParallel``, whose
    replicas run in threads on one shared routing object with hooks bound to the original model, so the K copies of
    the batch are never made and the forward fails or misroutes. One process per GPU (DDP) is what works."""
    if args.n_gpu > 1:
        raise ValueError(
            f"{args.n_gpu} GPUs are visible to this one process: Trainer would train with torch.nn.DataParallel, "
            "which LoRA-MCL's shared hypothesis routing does not support. Launch one process per GPU: torchrun "
            f"--nproc_per_node {args.n_gpu} -m loramcl.cli train ... (or accelerate launch --num_processes "
            f"{args.n_gpu} -m loramcl.cli ...), or show this process one GPU (CUDA_VISIBLE_DEVICES=0)")


def refuse_fsdp1(version: int | None) -> None:
    """FSDP version 1 flattens the parameters of each wrapped unit into one flat tensor of one dtype, and an adapted
    layer holds the frozen bf16 base beside float32 adapters: refused, with the FSDP2 settings that shard each
    parameter on its own."""
    if version == 1:
        raise ValueError(
            "FSDP version 1 flattens each wrapped unit into one tensor of one dtype, and LoRA-MCL's layers hold a "
            "bf16/fp16 base beside float32 adapters: use FSDP2, TrainingArguments(fsdp=True, fsdp_config="
            "{'version': 2}) (transformers' default version), or fsdp_version: 2 in the accelerate config "
            "(accelerate launch --use_fsdp --fsdp_version 2)")


class AdaptersOnlyStateDict(TrainerCallback):
    """Under FSDP, while ``train()`` runs (from ``on_train_begin``, once the model is sharded, until ``remove``), the
    MCL model's ``state_dict()`` holds its adapters only. Each checkpoint Trainer writes under FSDP holds its model's
    state dict (accelerate's ``save_fsdp_model``, after ``save_model``), and leaves the frozen base out only for a PEFT
    ``PeftModel``: without this, every checkpoint would gather and write the whole base model. Our adapter files
    (``MCLTrainer.save_model``) are what resuming reads; sharding itself (``fully_shard``, and accelerate's
    ``cpu_ram_efficient_loading``, which loads the base through the state dict) runs before and sees it whole."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.handle = None

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        if trainer.is_fsdp_enabled and self.handle is None:
            mcl = trainer._mcl_model()
            kept = {f"base_model.{name}.{part}" for name, layer in mcl.mcl_layers() for part in layer.adapter_tensors()}
            if mcl.scoring_head is not None:
                kept |= {f"scoring_head.{part}" for part, _ in mcl.scoring_head.named_parameters()}

            def adapters_only(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
                for key in [key for key in state_dict if key.startswith(prefix) and key[len(prefix):] not in kept]:
                    del state_dict[key]

            self.handle = mcl.register_state_dict_post_hook(adapters_only)

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
