"""Files of `loramcl evaluate`: predictions / references JSONL in, a JSON + a markdown report out.

    preds.jsonl  {"id": ..., "candidates": [K strings]}          one line per item
    refs.jsonl   {"id": ..., "references": [R_i strings] or one string, ...}   other fields (e.g. "lang") may
                                                                  name groups, e.g. the test file of `generate`
    nll.jsonl    {"id": ..., "nll": [[K floats] per reference]}  optional, for the oracle NLL

"id" is optional in each: a line without one is numbered by its position among the file's records (0, 1, ...),
as `loramcl generate` and `loramcl nll` number the lines of the test file they read, so the three files align.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from loramcl.utils.files import read_json, read_jsonl, shown_ids


def align(predictions: dict[object, dict], references: dict[object, dict], what=("predictions", "references")) -> list:
    """Ids in the predictions' order; an error naming the ids found in only one of the two files."""
    only_pred = [i for i in predictions if i not in references]
    only_ref = [i for i in references if i not in predictions]
    if only_pred or only_ref:
        message = []
        if only_pred:
            message.append(f"ids in {what[0]} but not in {what[1]}: {shown_ids(only_pred)}")
        if only_ref:
            message.append(f"ids in {what[1]} but not in {what[0]}: {shown_ids(only_ref)}")
        hint = ""
        if {str(i) for i in only_pred} & {str(i) for i in only_ref}:
            hint = ' (some differ only in type, e.g. 1 vs "1": use the same JSON type in both files)'
        raise ValueError("; ".join(message) + hint)
    return list(predictions)


def load_run(predictions_path: str | Path, references_path: str | Path, group_key: str | None = None):
    """(ids, candidates [N][K], references [N][R], groups [N] or None) from the two JSONL files."""
    from loramcl.utils.files import json_lines

    predictions = read_jsonl(predictions_path, "candidates", number_missing_ids=True)
    head = next((record for _, _, record in json_lines(references_path)), {})
    field = "completion" if isinstance(head, dict) and "references" not in head and "completion" in head else \
        "references"  # a training file's references (docs/guide/data.md)
    references = read_jsonl(references_path, field, number_missing_ids=True)
    ids = align(predictions, references)
    candidates = [predictions[i]["candidates"] for i in ids]
    refs = [references[i][field] for i in ids]
    refs = [[row] if isinstance(row, str | dict) else row for row in refs]  # one reference, as `loramcl nll` reads it
    refs = [[r.get("content") if isinstance(r, dict) else r for r in row] if isinstance(row, list) else row
            for row in refs]  # assistant messages: their text
    bad = [i for i, row in zip(ids, candidates, strict=True)
           if not isinstance(row, list) or not row or not all(isinstance(t, str) for t in row)]
    if bad:
        raise ValueError(f'"candidates" must be a non-empty list of strings; not so for ids {shown_ids(bad)}')
    order = {item: index for index, item in enumerate(references)}
    bad = [i for i, row in zip(ids, refs, strict=True)
           if not isinstance(row, list) or not row or not all(isinstance(t, str) and t.strip() for t in row)]
    if bad:  # an empty reference would score every candidate 0 (or crash a metric's tokenizer)
        from loramcl.utils.inputs import record_line

        first = min(bad, key=order.get)
        raise ValueError(f'{references_path}:{record_line(references_path, order[first])}: "{field}" must be a '
                         "non-empty text or list of non-empty texts")
    groups = None
    if group_key:
        def label(i):
            for record in (references[i], predictions[i]):
                if group_key in record:
                    return str(record[group_key])
            raise ValueError(f'id {i!r} has no "{group_key}" field in the references or predictions file (group_key)')

        groups = [label(i) for i in ids]
    return ids, candidates, refs, groups


def candidate_positions(predictions_path: str | Path) -> str:
    """What candidate k of a predictions file is: "hypothesis" where its lines say which hypothesis decoded each
    candidate (an MCL model's, `loramcl generate`'s "hypotheses"), else "beam position" (a single model's candidates
    in its output order)."""
    records = read_jsonl(predictions_path, "candidates", number_missing_ids=True)
    def by_hypothesis(record: dict) -> bool:  # one hypothesis's K beams ("hypotheses": [2, 2, 2]) are positions
        hypotheses = record.get("hypotheses")
        return isinstance(hypotheses, list) and len(set(map(str, hypotheses))) == len(hypotheses)

    return "hypothesis" if all(map(by_hypothesis, records.values())) else "beam position"


def load_nll(path: str | Path, ids: list, references: list[list[str]] | None = None,
             candidates: list[list[str]] | None = None) -> list[np.ndarray]:
    """Per-item [R_i, K] NLL arrays in the order of `ids`, checked: one row per reference of the item (when
    `references` is given), one column per hypothesis that decoded the candidates (when `candidates` is given;
    ``check_nll_columns``), finite and >= 0 (a mean NLL is never negative). Errors name the file and the item."""
    from loramcl.metrics.nll import check_nll_columns

    records = read_jsonl(path, "nll", number_missing_ids=True)
    align(records, {i: None for i in ids}, what=("the NLL file", "the predictions"))
    arrays = []
    for n, item in enumerate(ids):
        rows = records[item]["nll"]
        where = f"{path}: id {item!r}"
        if not (isinstance(rows, list) and rows and all(isinstance(row, list) and row for row in rows)):
            raise ValueError(f'{where}: "nll" must be a non-empty list with one list of K numbers per reference, '
                             f"got {str(rows)[:80]}")
        widths = sorted({len(row) for row in rows})
        if len(widths) > 1:
            raise ValueError(f"{where}: its references have NLL rows of different lengths {widths}; every row needs "
                             "one number per hypothesis")
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for row in rows for v in row):
            raise ValueError(f'{where}: "nll" must hold numbers only')
        array = np.asarray(rows, dtype=float)  # [R_i, K]
        if references is not None and array.shape[0] != len(references[n]):
            raise ValueError(f"{where}: {array.shape[0]} NLL rows for {len(references[n])} references: one row per "
                             "reference, in the references file's order (was it scored on another references file?)")
        if candidates is not None:
            check_nll_columns(array.shape[1], len(candidates[n]), where)
        if not np.isfinite(array).all() or (array < 0).any():
            raise ValueError(f"{where}: NLL values must be finite and >= 0 (a mean negative log-likelihood), got "
                             f"{rows}")
        if arrays and array.shape[1] != arrays[0].shape[1]:
            raise ValueError(f"{where}: NLL under {array.shape[1]} hypotheses, and id {ids[0]!r} under "
                             f"{arrays[0].shape[1]}: every item's NLL comes from the one model that decoded the "
                             "candidates (one column per hypothesis)")
        arrays.append(array)
    return arrays


def load_scores(path: str | Path, ids: list, candidates: list[list[str]]) -> np.ndarray | None:
    """The [N, K] p(k | c) of the candidates from a predictions file's "scores" (written for models with hypothesis
    scores), or None when no line has them. Checked: every line or none, one probability per candidate, each item's
    summing to 1. Errors name the file and the item."""
    records = read_jsonl(path, "candidates", number_missing_ids=True)
    present = [i for i in ids if "scores" in records[i]]
    if not present:
        return None
    if len(present) != len(ids):
        missing = [i for i in ids if "scores" not in records[i]]
        raise ValueError(f'{path}: "scores" on some lines but not on ids {shown_ids(missing)}: write the predictions '
                         "of one model in one file")
    rows = []
    for n, item in enumerate(ids):
        row = records[item]["scores"]
        ok = (isinstance(row, list) and len(row) == len(candidates[n])
              and all(isinstance(v, int | float) and not isinstance(v, bool) for v in row))
        if not ok or not np.isfinite(row).all() or min(row) < 0 or abs(sum(row) - 1.0) > 1e-3:
            raise ValueError(f'{path}: id {item!r}: "scores" must be {len(candidates[n])} probabilities p(k|c) '
                             f"summing to 1, one per candidate, got {str(row)[:80]}")
        rows.append(row)
    return np.asarray(rows, dtype=float)


def load_mixture_nll(path: str | Path, ids: list, references: list[list[str]]) -> list[np.ndarray] | None:
    """Per-item [R_i] mixture NLLs from an NLL file's "mixture_nll" (models with hypothesis scores), or None when
    no line has them; one finite, non-negative value per reference."""
    records = read_jsonl(path, "nll", number_missing_ids=True)
    if not any("mixture_nll" in records[i] for i in ids):
        return None
    values = []
    for n, item in enumerate(ids):
        row = records[item].get("mixture_nll")
        ok = (isinstance(row, list) and len(row) == len(references[n])
              and all(isinstance(v, int | float) and not isinstance(v, bool) for v in row))
        if not ok or not np.isfinite(row).all() or min(row) < 0:
            raise ValueError(f'{path}: id {item!r}: "mixture_nll" must be {len(references[n])} finite numbers >= 0, '
                             f"one per reference, got {str(row)[:80]}")
        values.append(np.asarray(row, dtype=float))
    return values


def to_jsonable(value):
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def read_report(path: str | Path) -> dict:
    """An `evaluate` JSON report; a clear error if the file is not one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (expected a JSON written by `loramcl evaluate`)")
    report = read_json(path, "write it again with `loramcl evaluate`")
    if not isinstance(report, dict) or "metrics" not in report:
        raise ValueError(f'{path} is not an evaluation report: no "metrics" field')
    return report
