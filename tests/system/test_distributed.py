"""2-process CPU runs (torchrun, gloo): MCLTrainer under DDP ends with identical adapters on both ranks, without DDP's
unused-parameter search, and its checkpoint holds both ranks' RNG states; an MCLModel sharded by hand with FSDP2, and
MCLTrainer under accelerate's FSDP2, train to the adapters of one process; the balancing bias counts every rank's
wins."""

import json
import os
import subprocess
import sys
from pathlib import Path

import safetensors.torch
import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the training scripts the processes run


def run_on_two_processes(script: str, out) -> subprocess.CompletedProcess:
    """``tests/<script>`` on 2 CPU processes (torchrun, one thread each), writing into ``out``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
               os.path.join(TESTS, script), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)


def test_two_process_training_keeps_ranks_identical(tmp_path):
    """Two-pass WTA under DDP: both ranks end with the same adapters and a checkpoint holds both ranks' RNG states;
    then (the same launch) MCLConfig(balance="bias", split_after=0.25) on 2 ranks, batches of 2 accumulated over 2,
    8 steps: each update of the bias sees the 8 wins of its optimizer step (both micro-batches of both ranks), none
    is made in the 2 steps of the shared phase, and both ranks end with the same bias and adapters (the symmetry
    break, drawn from the run's seed, included)."""
    result = run_on_two_processes("distributed_train.py", tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [safetensors.torch.load_file(tmp_path / f"rank{r}.safetensors") for r in (0, 1)]
    assert ranks[0].keys() == ranks[1].keys() and ranks[0]
    for key in ranks[0]:
        assert torch.equal(ranks[0][key], ranks[1][key]), key
    # published once every rank had written into it: the rank-1 RNG state is inside, no staging folder is left
    assert sorted(os.listdir(tmp_path / "checkpoint-2")) == sorted([
        "mcl_adapters.safetensors", "mcl_config.json", "optimizer.pt", "rng_state_0.pth", "rng_state_1.pth",
        "scheduler.pt", "trainer_state.json", "training_args.json"])
    assert sorted(os.listdir(tmp_path)) == ["balance", "checkpoint-2", "checkpoint-3", "rank0.safetensors",
                                            "rank1.safetensors"]
    ranks = [json.loads((tmp_path / "balance" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    assert [sum(wins) for wins in ranks[0]["wins"]] == [8] * 6
    assert ranks[0]["biases"][:2] == [[0.0] * 3] * 2 and any(any(bias) for bias in ranks[0]["biases"])


def test_fsdp2_sharded_training_equals_one_process_and_saves_whole_adapters(tmp_path):
    """PyTorch's FSDP2 (`fully_shard`, gloo): 2 ranks, each on half of every batch, end with the adapters of one
    process on the whole batches; save_pretrained and export_hypothesis gather the shards (rank 0 writes) and the files
    load back."""
    sys.path.insert(0, TESTS)
    from fsdp_train import CONFIG, train
    from tiny_models import build_model

    from loramcl import get_mcl_model, load_mcl_model

    result = run_on_two_processes("fsdp_train.py", tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    torch.manual_seed(0)
    reference = get_mcl_model(build_model("llama"), CONFIG)
    train(reference, slice(None))
    expected = reference.adapter_state_dict()
    saved = safetensors.torch.load_file(tmp_path / "fsdp" / "mcl_adapters.safetensors")
    gathered = safetensors.torch.load_file(tmp_path / "dcp.safetensors")
    assert saved.keys() == expected.keys() and len(gathered) == len(expected)
    for key, value in expected.items():
        assert saved[key].shape == value.shape, key  # whole tensors, not one rank's shard
        torch.testing.assert_close(saved[key], value, rtol=0, atol=1e-5)
        torch.testing.assert_close(gathered[f"base_model.{key}"], saved[key], rtol=0, atol=0)
    assert any(v.abs().sum() > 0 for k, v in saved.items() if k.endswith("lora_B"))  # it trained
    torch.manual_seed(0)
    loaded = load_mcl_model(build_model("llama"), tmp_path / "fsdp")  # checksum verified
    assert all(torch.equal(loaded.adapter_state_dict()[k], saved[k]) for k in saved)
    exported = safetensors.torch.load_file(tmp_path / "peft-h1" / "adapter_model.safetensors")
    expected = safetensors.torch.load_file(Path(reference.export_hypothesis(1, tmp_path / "reference-h1"))
                                           / "adapter_model.safetensors")
    assert exported.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(exported[key], value, rtol=0, atol=1e-5)
    # the fingerprint of a sharded base model, read by every rank, is that of the base model whole
    assert json.loads((tmp_path / "fingerprints.json").read_text()) == [reference.frozen_base.fingerprint] * 2
    assert reference.frozen_base.fingerprint is not None


def test_trainer_under_accelerate_fsdp2_checkpoints_adapters_only_resumes_and_equals_one_process(tmp_path):
    """MCLTrainer under accelerate's FSDP2 path (tests/fsdp_trainer_train.py says the one thing forced on the CPU),
    with either state dict type (a float32 base with FULL_STATE_DICT, a bfloat16 one with SHARDED_STATE_DICT): the
    adapters and losses of 2 ranks equal those of one process on the same batches (to float32's or bfloat16's
    precision), a run resumed from the step-2 checkpoint ends exactly where the uninterrupted one did, and each
    checkpoint holds our adapter files, gathered whole and written once, and of the model only the adapters (not the
    frozen base). So does `fit` (loramcl train's stage) under FSDP2 set as `accelerate launch` sets it."""
    from torch.distributed.checkpoint import FileSystemReader

    sys.path.insert(0, TESTS)
    from fsdp_trainer_train import LEGS, losses, train
    from tiny_models import build_model

    from loramcl import load_mcl_model

    result = run_on_two_processes("fsdp_trainer_train.py", tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    recorded = json.loads((tmp_path / "losses.json").read_text())
    ours = {"mcl_adapters.safetensors", "mcl_config.json", "rng_state_0.pth", "rng_state_1.pth", "scheduler.pt",
            "trainer_state.json", "training_args.json"}
    for kind, trainers in {"FULL_STATE_DICT": {"pytorch_model_fsdp.bin", "optimizer.bin"},
                           "SHARDED_STATE_DICT": {"pytorch_model_fsdp_0", "optimizer_0"}}.items():
        # one process on the ranks' micro-batches (BATCH / 2 rows each, accumulated): a bfloat16 matmul of 8 rows can
        # round otherwise than two of 4 (seen on a CPU without AVX-512, 2026-11-29), and the hypotheses' NLLs are
        # within bfloat16's step here, so a whole batch flipped near-tie winners (v_proj's lora_B 0.010 apart)
        reference = train(str(tmp_path / "one-process" / kind), 2, dtype=LEGS[kind], gradient_accumulation_steps=2)
        expected = reference._mcl_model().adapter_state_dict()
        assert any(v.abs().sum() > 0 for k, v in expected.items() if k.endswith("lora_B"))  # it trained
        model_keys = {f"base_model.{key}" for key in expected}  # of the adapters only
        # a bfloat16 base: the adapters' matmuls run in bfloat16 too, and round otherwise on half the rows (measured:
        # 1.8e-3 at most after 4 Adam steps at lr 1e-2, for values up to 0.19); float32: 8.5e-7
        atol = 1e-5 if LEGS[kind] == torch.float32 else 4e-3
        saved = {run: safetensors.torch.load_file(tmp_path / kind / run / "mcl_adapters.safetensors")
                 for run in ("final", "resumed")}
        assert saved["final"].keys() == saved["resumed"].keys() == expected.keys(), kind
        for key, value in expected.items():
            torch.testing.assert_close(saved["final"][key], value, rtol=0, atol=atol, msg=f"{kind} {key}")
            assert torch.equal(saved["resumed"][key], saved["final"][key]), (kind, key)
        torch.testing.assert_close(recorded[kind]["run"], losses(reference), rtol=0, atol=atol / 4)
        assert recorded[kind]["resumed"] == recorded[kind]["run"]
        checkpoint = tmp_path / kind / "run" / "checkpoint-2"
        assert set(os.listdir(checkpoint)) == ours | trainers, kind
        if kind == "FULL_STATE_DICT":
            assert torch.load(checkpoint / "pytorch_model_fsdp.bin").keys() == model_keys
        else:
            metadata = FileSystemReader(str(checkpoint / "pytorch_model_fsdp_0")).read_metadata()
            assert set(metadata.state_dict_metadata) == {f"model.{key}" for key in model_keys}
    torch.manual_seed(0)
    final = tmp_path / "FULL_STATE_DICT" / "final"
    loaded = load_mcl_model(build_model("llama"), final, strict=True).adapter_state_dict()  # checksum, fingerprint
    saved = safetensors.torch.load_file(final / "mcl_adapters.safetensors")
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], v) for k, v in saved.items())
    # loramcl train's stage (fit), FSDP2 from the launcher's environment: the finished run of K = 1, its PEFT export
    # gathered by every process like the adapters
    run = tmp_path / "fit"
    assert {"run.json", "train_log.json", "mcl_adapters.safetensors", "mcl_config.json", "peft"} <= set(os.listdir(run))
    adapters = safetensors.torch.load_file(run / "mcl_adapters.safetensors")
    peft = safetensors.torch.load_file(run / "peft" / "adapter_model.safetensors")
    assert len(peft) == len(adapters) == 8 and any(v.abs().sum() > 0 for k, v in adapters.items() if "lora_B" in k)
    for key, value in adapters.items():
        layer, part = key.rsplit(".", 1)
        assert torch.equal(peft[f"base_model.model.{layer}.{part}.weight"], value[0].T), key
    assert set(os.listdir(run / "checkpoints" / "checkpoint-2")) == ours | {"pytorch_model_fsdp_0", "optimizer_0"}
