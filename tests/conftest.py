import os
import shutil
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Tiny models run fastest on one thread, and two threads slow down up to 100x when another process holds a core. Set
# before torch loads, so that the commands the tests run in this process (and the processes they start) keep it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A command that asks for more threads must not spin beside another job: measured, the bilingual quick recipe with
# two threads took 504 s beside one busy process with OpenMP's default waits, 95 s with passive ones (its test now
# runs it on one thread: the other core is the other xdist worker's).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers.utils import logging  # noqa: E402

logging.set_verbosity_error()
torch.set_num_threads(1)


# The tests mirror src/loramcl/; two folders are marked so that a run can leave them out (`make test-fast`):
# tests/recipes/ (the tasks' readers and their end-to-end `--quick` runs) and tests/system/ (the wheel, several
# processes, the docs run as written, the package's layout).
FOLDER_MARKERS = {"recipes": "recipe", "system": "system"}


# The test files that take longest (seconds of a core in a whole run on 2 cores, 2026-11-29), longest first: `make
# test` hands whole files to its two workers in this order (`--dist loadfile --no-loadscope-reorder`: a module's
# fixtures, such as a recipe's quick run, are made once), so these start first and the short files fill in around
# them; a long file handed out last would keep one core busy while the other waits.
LONGEST_FIRST = ("system/test_docs_run.py", "system/test_gpu_check.py", "recipes/test_markov.py",
                 "recipes/test_bilingual_recipe.py", "system/test_distributed.py", "system/test_benchmark_suite.py",
                 "test_cli.py", "system/test_wheel.py", "recipes/test_spoken_translation.py",
                 "recipes/test_translation_recipe.py", "metrics/test_metrics_quality.py", "training/test_trainer.py",
                 "mcl/test_compile.py", "training/test_checkpoints.py", "training/test_keep_best.py",
                 "training/test_trainer_compile.py", "recipes/test_audio_captioning_recipe.py")


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        folder = os.path.relpath(str(item.path), here).split(os.sep)[0]
        if folder in FOLDER_MARKERS:
            item.add_marker(FOLDER_MARKERS[folder])
    rank = {name: number for number, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.relpath(str(item.path), here).replace(os.sep, "/"), len(rank)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def wrapped_model(name: str, num_hypotheses: int = 3, targets=None, **config):
    """(mcl, pristine copy of the base model, inputs, labels) for a tiny ``name`` model with random adapters."""
    import copy

    from tiny_models import CASES, build_batch, build_model

    from loramcl import MCLConfig, get_mcl_model

    base = build_model(name).eval()
    pristine = copy.deepcopy(base)
    mcl = get_mcl_model(base, MCLConfig(num_hypotheses=num_hypotheses, r=4, alpha=8,
                                        target_modules=targets or CASES[name].targets, **config)).eval()
    randomize_adapters(mcl)
    inputs, labels = build_batch(name, pristine)
    return mcl, pristine, inputs, labels


def randomize_adapters(mcl, std: float = 0.1, seed: int = 0) -> None:
    """B is zero at init (every hypothesis equals the base model); give each hypothesis its own non-zero B."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in mcl.mcl_layers():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g) * std)


def peft_reference(model, mcl):
    """A PEFT model on ``model`` with one LoRA adapter 'h{k}' per hypothesis of ``mcl``, weights copied."""
    from peft import LoraConfig, get_peft_model

    cfg = mcl.mcl_config
    names = mcl.layer_names

    def lora_config():
        return LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=names)

    peft = get_peft_model(model, lora_config(), adapter_name="h0")
    for k in range(1, cfg.num_hypotheses):
        peft.add_adapter(f"h{k}", lora_config())
    with torch.no_grad():
        for name, layer in mcl.mcl_layers():
            module = peft.base_model.model.get_submodule(name)
            for k in range(cfg.num_hypotheses):
                module.lora_A[f"h{k}"].weight.copy_(layer.lora_A[k].T)
                module.lora_B[f"h{k}"].weight.copy_(layer.lora_B[k].T)
    return peft


@pytest.fixture(scope="session")
def smollm2_folder(tmp_path_factory):
    """SmolLM2-135M-Instruct converted once per test run (about 20 s of a core) for the recipes' end-to-end tests:
    under pytest-xdist into the run's folder that every worker shares (the first worker converts it, the others wait
    for it), else into this session's own."""
    from filelock import FileLock

    from loramcl.models import convert_smollm2

    if "PYTEST_XDIST_WORKER" not in os.environ:
        return convert_smollm2(tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct")
    shared = tmp_path_factory.getbasetemp().parent  # pytest-N/, above each worker's popen-gwK/
    folder = shared / "smollm2" / "SmolLM2-135M-Instruct"
    with FileLock(str(shared / "smollm2.lock")):
        if not (shared / "smollm2" / "converted").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            convert_smollm2(folder)
            (shared / "smollm2" / "converted").touch()  # written last: a conversion cut short is redone
    return folder
