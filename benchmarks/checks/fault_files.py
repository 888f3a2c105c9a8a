"""The adapter-file families of benchmarks/checks/fault_injection.py (its docstring says what each injects and counts).

Each trial copies a saved folder, injects one fault (into the folder's files, or into the base model the folder is
loaded onto) and loads it, once as a user would and once with ``strict=True``. Written against the public API only
(``load_mcl_model``, the files' JSON and safetensors), so that it also measures an earlier version: where that version
lacks ``AdapterFilesWarning``, its ``BaseWeightsMismatch`` (or nothing) is what "said" means.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import print_table
from benchmarks.tiny import tiny_llama

TARGETS = ["q_proj", "v_proj", "down_proj"]
TRAINING_EDITS = {"dropout": 0.0, "loss": "annealed", "epsilon": 0.0, "temperature0": 2.0, "temperature_decay": 0.99,
                  "temperature_min": 1e-3, "tie_break": "random", "scoring_weight": 0.5, "logits_chunk_size": None}
OUTPUT_EDITS = {"alpha": 16.0, "r": 8, "use_rslora": True, "adapt_context": False, "adapter_dtype": "base",
                "num_hypotheses": 2, "scoring": True, "target_modules": ["q_proj", "v_proj"],
                "exclude_modules": ["down_proj"], "layers_to_transform": [0]}
REORDERED = (TARGETS[::-1], TARGETS[1:] + TARGETS[:1])  # the same set of targets in other orders
# The model used as load_mcl_model returns it (every other family calls .eval() first): its mode is what is measured.
AS_RETURNED = "decoded as loaded (no .eval())"
OLD_SAMPLE_ROWS = 8  # the earlier fingerprint hashed 8 evenly spaced rows of each tensor


def _warning_classes() -> tuple[type[Warning], ...]:
    import loramcl.utils.inputs as inputs

    return tuple(getattr(inputs, name) for name in ("AdapterFilesWarning", "BaseWeightsMismatch")
                 if hasattr(inputs, name)) or (Warning,)


def _edit_json(folder: Path, edit: Callable[[dict], object]) -> None:
    meta = json.loads((folder / "mcl_config.json").read_text())
    edit(meta)
    (folder / "mcl_config.json").write_text(json.dumps(meta, indent=2))


def _rechecksum(folder: Path) -> None:
    digest = hashlib.sha256((folder / "mcl_adapters.safetensors").read_bytes()).hexdigest()
    _edit_json(folder, lambda meta: meta.__setitem__("weights_sha256", digest))


def _damage(folder: Path, rng: random.Random) -> str:
    """One random damage of the weights file; returns what was done. The draws do not depend on the file's size, so
    two versions of loramcl (whose headers differ in length) get the same damages at the same relative places."""
    weights = folder / "mcl_adapters.safetensors"
    data = bytearray(weights.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    kind, where, bit = rng.choice(["flip", "zero 4 KB", "truncate", "header"]), rng.random(), rng.randrange(8)
    if kind == "flip":
        data[start + int(where * (len(data) - start))] ^= 1 << bit
    elif kind == "zero 4 KB":
        at = start + int(where * (len(data) - start))
        data[at:at + 4096] = bytes(len(data[at:at + 4096]))
    elif kind == "truncate":
        del data[8 + int(where * (len(data) - 8)):]
    else:
        data[8 + int(where * (start - 8))] = b"{}[]\",:0123456789abcdefxyz "[bit * 3]
    weights.write_bytes(bytes(data))
    return kind


def _converted(dtype_name: str):
    def convert(folder: Path, rng: random.Random, base):
        import torch
        from safetensors.torch import load_file, save_file

        weights = folder / "mcl_adapters.safetensors"
        save_file({k: v.to(getattr(torch, dtype_name)) for k, v in load_file(weights).items()}, weights)
        _rechecksum(folder)
        return f"re-saved in {dtype_name}, checksum updated", base
    return convert


def _row_outside_old_sample(rng: random.Random, base):
    """+0.5 on one row of a random floating-point base tensor, a row the earlier sample (8 evenly spaced rows of the
    tensor viewed as [shape[0], -1]) did not hash."""
    import torch

    names = [n for n, p in base.named_parameters() if p.is_floating_point() and p.dim() >= 1 and p.shape[0] > 8]
    name = rng.choice(names)
    param = base.get_parameter(name)
    sampled = set(torch.linspace(0, param.shape[0] - 1, OLD_SAMPLE_ROWS).round().long().tolist())
    row = rng.choice([r for r in range(param.shape[0]) if r not in sampled])
    with torch.no_grad():
        param[row] += 0.5
    return f"{name}[{row}] + 0.5", base


def families(trials: int) -> dict[str, list[Callable]]:
    """{family: [fault(folder, rng, base) -> (what was done, base to load onto)]}."""
    def damaged(folder, rng, base):
        return _damage(folder, rng), base

    def damaged_without_checksum(folder, rng, base):
        removed = rng.choice(["deleted", "null"])
        _edit_json(folder, lambda m: m.pop("weights_sha256") if removed == "deleted" else m.update(weights_sha256=None))
        return f"weights_sha256 {removed}, {_damage(folder, rng)}", base

    def edit(field, value, legacy=False):
        def fault(folder, rng, base):
            def change(meta):
                (meta if field == "weights_dtypes" else meta["mcl_config"])[field] = value
                if legacy:
                    meta.pop("settings_sha256", None)
                    meta.pop("weights_dtypes", None)
            _edit_json(folder, change)
            return f"{field} = {value!r}" + (" in a file without settings_sha256" if legacy else ""), base
        return fault

    def checksum(value):
        def fault(folder, rng, base):
            _edit_json(folder, lambda m: m.update(settings_sha256=value))
            return f"settings_sha256 = {value[:8]}...", base
        return fault

    def fingerprint_removed(how, other_seed):
        def fault(folder, rng, base):
            _edit_json(folder, lambda m: m.pop("base_fingerprint") if how == "deleted" else
                       m.update(base_fingerprint=None))
            if other_seed:
                import torch

                torch.manual_seed(1)
                base = tiny_llama(max_position_embeddings=64)
            return f"base_fingerprint {how}, {'another seed' if other_seed else 'the right'} base", base
        return fault

    return {
        "damaged weights": [damaged] * trials,
        "damaged weights, weights_sha256 removed": [damaged_without_checksum] * trials,
        "edited output settings": [edit(f, v) for f, v in OUTPUT_EDITS.items()] + [
            edit("weights_dtypes", ["bfloat16"]), edit("alpha", 16.0, legacy=True)],
        "edited training settings (allowed)": [edit(f, v) for f, v in TRAINING_EDITS.items()],
        "tensors converted after save": [_converted(d) for d in ("float16", "bfloat16", "float64")],
        "base edited outside the old sample": [lambda folder, rng, base: _row_outside_old_sample(rng, base)] * trials,
        "base_fingerprint removed": [fingerprint_removed(how, other) for how in ("deleted", "null")
                                     for other in (False, True)],
        "target_modules reordered (allowed)": [edit("target_modules", order) for order in REORDERED],
        "settings_sha256 edited": [checksum(value) for value in ("0" * 64, "f" * 64)],
        AS_RETURNED: [lambda folder, rng, base: ("the folder as saved (dropout 0.1), decoded without .eval()", base)],
    }


def file_trials(root: Path, trials: int, seed: int) -> list[dict]:
    """Every family's trials; one record per trial."""
    import torch

    from loramcl import MCLConfig, get_mcl_model, load_mcl_model

    torch.manual_seed(0)
    pristine = tiny_llama(max_position_embeddings=64).eval()
    mcl = get_mcl_model(copy.deepcopy(pristine), MCLConfig(num_hypotheses=3, r=4, alpha=8, dropout=0.1,
                                                           loss="relaxed", epsilon=0.1, target_modules=TARGETS))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, layer in mcl.mcl_layers():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g) * 0.5)
    saved = root / "original"
    mcl.save_pretrained(saved)
    ids = torch.randint(3, 90, (2, 12), generator=g)
    said_by = _warning_classes()

    def logits(model) -> torch.Tensor:
        with torch.no_grad():
            out = []
            for k in range(model.num_hypotheses):
                with model.use_hypotheses(k):
                    out.append(model.base_model(input_ids=ids).logits)
            return torch.stack(out)

    reference = logits(mcl.eval())
    rng = random.Random(seed)
    records = []
    for family, faults in families(trials).items():
        for i, fault in enumerate(faults):
            folder = root / f"{len(records)}"
            shutil.copytree(saved, folder)
            done, base = fault(folder, rng, copy.deepcopy(pristine))
            record = {"family": family, "trial": i, "fault": done}
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    loaded = load_mcl_model(copy.deepcopy(base), folder)
                    loaded = loaded if family == AS_RETURNED else loaded.eval()
                except (ValueError, OSError) as error:
                    record.update(outcome="refused", message=str(error)[:300])
                    loaded = None
            said = [str(w.message) for w in caught if issubclass(w.category, said_by)]
            if loaded is not None:
                try:
                    difference = (logits(loaded) - reference).abs().max().item() if \
                        loaded.num_hypotheses == reference.shape[0] else float("inf")
                except Exception as error:  # e.g. a forward that fails on edited settings
                    difference, record["forward_error"] = float("inf"), str(error)[:300]
                record["max_logit_difference"] = difference
                record["outcome"] = "said" if said else "silent, same outputs" if difference == 0 else \
                    "silent, other outputs"
                if said:
                    record["message"] = said[0][:300]
            try:
                load_mcl_model(copy.deepcopy(base), folder, strict=True)
                record["strict_refused"] = False
            except (ValueError, OSError):
                record["strict_refused"] = True
            except Exception:  # noqa: BLE001 - an earlier version may fail otherwise
                record["strict_refused"] = False
            records.append(record)
            print(f"{family:<42} {done:<58} {record['outcome']:<22} strict: "
                  f"{'refused' if record['strict_refused'] else 'loaded'}", flush=True)
    return records


OUTCOMES = ("refused", "said", "silent, same outputs", "silent, other outputs")


def file_table(records: list[dict]) -> list[dict]:
    rows = []
    for family in dict.fromkeys(r["family"] for r in records):
        mine = [r for r in records if r["family"] == family]
        rows.append({"family": family, "trials": len(mine), **{o: sum(r["outcome"] == o for r in mine)
                                                               for o in OUTCOMES},
                     "strict refused": sum(r["strict_refused"] for r in mine)})
    return rows


def print_file_table(records: list[dict]) -> list[dict]:
    rows = file_table(records)
    print_table(["family", "trials", *OUTCOMES, "strict=True refused"],
                [[row["family"], row["trials"], *(row[o] for o in OUTCOMES), row["strict refused"]] for row in rows])
    return rows
