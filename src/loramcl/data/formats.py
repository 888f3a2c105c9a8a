"""The dataset formats users already have, as TRL's ``SFTTrainer`` reads them, and MCL's own multi-reference rows,
turned into training examples: ``input_ids`` and ``labels`` (-100 where no loss is computed).

- prompt/completion: ``{"prompt": str, "completion": str}`` (``"target"``: ours); the loss on the completion and
  end-of-sequence.
- conversational prompt/completion: ``{"prompt": [messages], "completion": [assistant message]}``; the loss on the
  assistant's tokens and the end-of-turn token the template writes.
- messages: ``{"messages": [system?, user, assistant, user, assistant, ...]}``; the loss on every assistant turn (and
  its end-of-turn token), system and user turns masked.
- text: ``{"text": str}``; the loss on every token (end-of-sequence appended).
- multi-reference: ``"completion"`` or ``"references"`` a list of texts (or of assistant messages: TRL's
  conversational completion is a list of one); one example per reference.

A conversation is rendered whole by the tokenizer's own chat template (``apply_chat_template``). Which tokens are the
assistant's is found without ``{% generation %}`` markers, which most templates lack (SmolLM2's, Llama's): the
conversation up to an assistant turn, rendered with ``add_generation_prompt=True``, is a prefix of the whole text;
the turn's characters run from there to the end of the conversation rendered up to that turn; tokens overlapping
those characters are labelled, up to the last special token among them (the end-of-turn token: SmolLM2's
``<|im_end|>``, Llama 3's ``<|eot_id|>``), so the new line a template writes after it, which decoding never produces,
is not. That is what ``loramcl generate`` decodes from: the same template, ``add_generation_prompt=True``.

Multi-reference rows (several valid answers per prompt, paper App. H.2: "duplicated the image as many times as the
number of its captions") become one example per reference; each example's ``row`` is its source row (the group).
Packing is refused: winner-takes-all picks a winner per example, and a packed row would mix examples.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

PROMPT_COMPLETION = "prompt/completion"
CONVERSATIONAL = "conversational prompt/completion"
MESSAGES = "messages"
TEXT = "text"
COMPLETION_FIELDS = ("completion", "references")  # besides the target_key (ours: "target")
ROLES = ("system", "user", "assistant")
PACKING_REFUSED = ("packing is not supported: winner-takes-all picks one winning hypothesis per example (paper "
                   "eq. 2), and a packed row would hold several examples, one winner for all of them; leave packing "
                   "off (rows are padded per batch)")
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Format:
    """What a dataset's rows hold: ``kind`` (one of the four formats), the fields of the prompt and completion
    (None for messages / text) and whether a row holds several references."""

    kind: str
    prompt: str | None = None
    completion: str | None = None
    multi_reference: bool = False

    @property
    def fields(self) -> tuple[str, ...]:
        return {MESSAGES: ("messages",), TEXT: ("text",)}.get(self.kind, (self.prompt, self.completion))

    def describe(self) -> str:
        """One line for the run's log: the format and where the loss is."""
        loss = {PROMPT_COMPLETION: f'the loss on "{self.completion}" and end-of-sequence',
                CONVERSATIONAL: f'the loss on the assistant turns of "{self.completion}"',
                MESSAGES: "the loss on the assistant turns", TEXT: "the loss on every token"}[self.kind]
        fields = " + ".join(f'"{field}"' for field in self.fields)
        many = ", several references per row: one example per reference" if self.multi_reference else ""
        return f"format {self.kind} ({fields}; {loss}{many})"


def detect_format(first: dict, prompt_key: str = "prompt", target_key: str = "target",
                  where: str = "row 1", options: str = "prompt_key / target_key") -> Format:
    """The format of a dataset from its first row (the fields it holds, and whether they hold text or messages);
    ``where``: that row, named in the error when no format fits; ``options``: those naming the fields."""
    present = [field for field, value in first.items() if value is not None]
    if "messages" in present:
        return Format(MESSAGES)
    if prompt_key in present:
        completion = next((f for f in (target_key, *COMPLETION_FIELDS) if f in present), None)
        if completion is None:
            raise ValueError(f'{where} has "{prompt_key}" but no completion ("completion", "{target_key}" or, several '
                             f'references, "references"); its fields are {_fields(first)} (choose the fields with '
                             f"{options})")
        value = first[completion]
        conversational = isinstance(first[prompt_key], list) or _is_message_list(value)
        # TRL's conversational completion is a list of one assistant message; several are several references
        multi = isinstance(value, list) and (not _is_message_list(value) or len(value) > 1
                                             or completion == "references")
        return Format(CONVERSATIONAL if conversational else PROMPT_COMPLETION, prompt_key, completion, multi)
    if "text" in present:
        return Format(TEXT)
    raise ValueError(f'{where} has none of the fields of a dataset format ("{prompt_key}" + "completion" or '
                     f'"{target_key}", "messages", "text"); its fields are {_fields(first)} (choose the fields with '
                     f"{options})")


def _fields(row: dict) -> str:
    return ", ".join(f'"{k}"' for k, v in list(row.items())[:10] if v is not None) or "none"


def _is_message_list(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def check_packing(packing: bool) -> None:
    if packing:
        raise ValueError(PACKING_REFUSED)


def prepare_dataset(dataset, tokenizer, max_length: int | None = None, prompt_key: str = "prompt",
                    target_key: str = "target", chat_template: bool = False, encoder_decoder: bool = False,
                    source: str = "the dataset", where: Callable[[int], str] | None = None, packing: bool = False,
                    num_proc: int | None = None):
    """A ``datasets.Dataset`` of rows in any of the formats -> one of ``input_ids``, ``labels`` and ``row`` (the source
    row of each example; several examples share it in a multi-reference dataset), through ``Dataset.map`` (batched:
    its progress bar and its cache). The format is detected from the first row and logged.

    max_length: examples longer than this lose their end (counted and logged); one whose prompt leaves no target
        token within it is an error.
    chat_template: prompt/completion rows of strings are rendered as one user turn and one assistant turn by the
        tokenizer's chat template (conversational rows always are).
    source: the dataset's name in the log and errors (``loramcl train``: its file); where(i): row i (0-based) as the
        errors name it (default "<source> row <i + 1>"; ``loramcl train`` gives a JSONL file's line). A row that does
        not fit the format is one error naming it and its field; nothing is dropped silently.
    """
    check_packing(packing)
    where = where or (lambda i: f"{source} row {i + 1}")
    if len(dataset) == 0:
        raise ValueError(f"{source} holds no row")
    fmt = detect_format(dataset[0], prompt_key, target_key, where(0))
    if fmt.kind in (CONVERSATIONAL, MESSAGES) or chat_template:
        if encoder_decoder:
            raise ValueError(f"{source}: conversations and chat templates train a causal LM; an encoder-decoder "
                             "reads prompt/completion rows of text")
        if getattr(tokenizer, "chat_template", None) is None:
            what = f"the rows are conversations ({fmt.kind})" if fmt.kind in (CONVERSATIONAL, MESSAGES) else \
                "chat_template is on"
            raise ValueError(f"{source}: {what} but the tokenizer has no chat template: use a model folder whose "
                             "tokenizer has one, or rows of text without chat_template")
    if fmt.kind == TEXT and encoder_decoder:
        raise ValueError(f"{source}: text rows train a causal LM; an encoder-decoder reads prompt/completion rows")
    logger.info(f"{source}: {fmt.describe()}")
    encode = _BatchEncoder(tokenizer, fmt, max_length, chat_template, encoder_decoder, where)
    prepared = dataset.map(encode, batched=True, with_indices=True, remove_columns=dataset.column_names,
                           num_proc=num_proc, desc=f"tokenizing {source}")
    cut = sum(prepared["cut"])
    if cut:
        logger.info(f"{source}: {cut} of {len(prepared)} examples are longer than max_length {max_length} and lost "
                    "their end")
    return prepared.remove_columns("cut")


def check_rows(dataset, fmt: Format, chat_template: bool = False, where: Callable[[int], str] = "row {}".format,
               batch_size: int = 1000) -> int:
    """Every row of ``dataset`` checked against ``fmt`` without tokenizing (``loramcl train`` does it before torch
    loads, so that a bad row is reported in seconds); the number of examples they make (one per reference)."""
    count = 0
    for start in range(0, len(dataset), batch_size):
        batch = dataset[start:start + batch_size]
        count += len(examples_of(batch, range(start, start + len(next(iter(batch.values())))), fmt, chat_template,
                                 where)[2])
    return count


def examples_of(batch: dict[str, list], indices: Sequence[int], fmt: Format, chat_template: bool,
                where: Callable[[int], str]) -> tuple[str, list, list[int]]:
    """A batch of rows checked and turned into examples: (TEXT, texts, rows), (PROMPT_COMPLETION, [(prompt,
    completion)], rows) for pairs of strings tokenized as such, or (MESSAGES, [(messages, first target message)],
    rows) for what the chat template renders; rows: each example's source row."""
    for field in fmt.fields:
        missing = next((j for j, v in enumerate(batch.get(field, [None] * len(indices))) if v is None), None)
        if missing is not None:
            row = {k: v[missing] for k, v in batch.items()}
            raise ValueError(f'{where(indices[missing])}: no "{field}" field, which the dataset\'s {fmt.kind} rows '
                             f"have (as its first row); its fields are {_fields(row)}: one format per file")
    if fmt.kind == TEXT:
        return TEXT, [_text(t, where(i), "text") for t, i in zip(batch["text"], indices, strict=True)], list(indices)
    if fmt.kind == MESSAGES:
        return MESSAGES, [(_conversation(m, where(i), "messages"), 0)
                          for m, i in zip(batch["messages"], indices, strict=True)], list(indices)
    items, rows = [], []
    for prompt, completion, i in zip(batch[fmt.prompt], batch[fmt.completion], indices, strict=True):
        for reference in _references(completion, fmt, where(i)):
            if fmt.kind == PROMPT_COMPLETION and not chat_template:
                items.append((_text(prompt, where(i), fmt.prompt), reference))
            else:
                turns = (_conversation(prompt, where(i), fmt.prompt, prompt_only=True) if isinstance(prompt, list)
                         else [{"role": "user", "content": _text(prompt, where(i), fmt.prompt)}])
                answer = ([{"role": "assistant", "content": reference}] if isinstance(reference, str)
                          else _assistant_turns(reference, where(i), fmt.completion))
                items.append((turns + answer, len(turns)))
            rows.append(i)
    return (PROMPT_COMPLETION if fmt.kind == PROMPT_COMPLETION and not chat_template else MESSAGES), items, rows


def _no_examples() -> dict[str, list]:
    return {"input_ids": [], "labels": [], "row": [], "cut": []}


class _BatchEncoder:
    """``Dataset.map``'s function: a batch of rows -> their examples (checked row by row, tokenized by batch)."""

    def __init__(self, tokenizer, fmt: Format, max_length, chat_template, encoder_decoder, where) -> None:
        self.tokenizer, self.fmt, self.max_length = tokenizer, fmt, max_length
        self.chat_template, self.encoder_decoder, self.where = chat_template, encoder_decoder, where

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        kind, items, rows = examples_of(batch, indices, self.fmt, self.chat_template, self.where)
        if kind == TEXT:
            return self._texts(items, rows)
        if kind == MESSAGES:
            return self._conversations(*zip(*items, strict=True), rows) if items else _no_examples()
        return self._pairs(*zip(*items, strict=True), rows) if items else _no_examples()

    def _pairs(self, prompts, completions, rows) -> dict[str, list]:
        """As ``loramcl.data.prompts.encode_pairs`` (prompt tokens as ``loramcl generate`` reads them, then the
        completion and end-of-sequence)."""
        from loramcl.data.prompts import encode_pairs

        fmt, where = self.fmt, self.where
        prompts, completions = list(prompts), list(completions)
        if self.encoder_decoder:  # each side cut on its own (encode_pairs)
            encoded = encode_pairs(self.tokenizer, prompts, completions, max_length=self.max_length,
                                   encoder_decoder=True, where=lambda j: f'{where(rows[j])}: "{fmt.prompt}"')
            return {"input_ids": [e["input_ids"] for e in encoded], "labels": [e["labels"] for e in encoded],
                    "row": rows, "cut": [False] * len(rows)}
        encoded = encode_pairs(self.tokenizer, prompts, completions)
        input_ids, labels, cut = [], [], []
        for j, example in enumerate(encoded):
            prompt = example["labels"].count(-100)
            if self.max_length is not None and prompt >= self.max_length:
                raise ValueError(f"{where(rows[j])}: the prompt alone has {prompt} tokens, max_length is "
                                 f"{self.max_length} (and the target needs one more): shorten it, or raise max_length")
            input_ids.append(self._cut(example["input_ids"]))
            labels.append(self._cut(example["labels"]))
            cut.append(len(input_ids[-1]) < len(example["input_ids"]))
        return {"input_ids": input_ids, "labels": labels, "row": rows, "cut": cut}

    def _texts(self, texts, rows) -> dict[str, list]:
        tokenizer = self.tokenizer
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no end-of-sequence token: a text could never end")
        whole = [t + [tokenizer.eos_token_id] for t in tokenizer(texts)["input_ids"]]
        ids = [self._cut(t) for t in whole]
        return {"input_ids": ids, "labels": [list(t) for t in ids], "row": list(rows),
                "cut": [len(a) < len(b) for a, b in zip(ids, whole, strict=True)]}

    def _conversations(self, conversations, first_target, rows) -> dict[str, list]:
        encoded = encode_conversations(self.tokenizer, list(conversations), list(first_target),
                                       where=lambda j: self.where(rows[j]))
        input_ids, labels, cut = [], [], []
        for j, (ids, lab) in enumerate(encoded):
            input_ids.append(self._cut(ids))
            labels.append(self._cut(lab))
            cut.append(len(input_ids[-1]) < len(ids))
            if all(label == -100 for label in labels[-1][1:]):
                raise ValueError(f"{self.where(rows[j])}: its first assistant turn starts after max_length "
                                 f"{self.max_length} tokens: shorten the turns before it, or raise max_length")
        return {"input_ids": input_ids, "labels": labels, "row": list(rows), "cut": cut}

    def _cut(self, tokens: list[int]) -> list[int]:
        return tokens if self.max_length is None else tokens[:self.max_length]


def _text(value, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f'{where}: "{field}" must be a text, got {type(value).__name__} {str(value)[:60]}')
    if not value.strip():
        raise ValueError(f'{where}: "{field}" is empty: give it some text (or remove the row)')
    return value


def _references(completion, fmt: Format, where: str) -> list:
    """The completions of one row: one, or each of its references (texts, or assistant messages)."""
    if not fmt.multi_reference:
        if isinstance(completion, str):
            return [_text(completion, where, fmt.completion)]
        if fmt.kind == CONVERSATIONAL and _is_message_list(completion):
            return [[message] for message in completion]  # each assistant message an answer
        shape = "a text" if fmt.kind == PROMPT_COMPLETION else "a list of assistant messages"
        raise ValueError(f'{where}: "{fmt.completion}" must be {shape} (the {fmt.kind} format of the first row), '
                         f"got {type(completion).__name__} {str(completion)[:60]}: one format per file")
    if not isinstance(completion, list) or not completion:
        raise ValueError(f'{where}: "{fmt.completion}" must be a non-empty list of references (texts or assistant '
                         f"messages), got {str(completion)[:60]}")
    return [[r] if isinstance(r, dict) else r if isinstance(r, list) else _text(r, where, f"{fmt.completion}[{n}]")
            for n, r in enumerate(completion)]


def _conversation(messages, where: str, field: str, prompt_only: bool = False) -> list[dict]:
    """``messages`` checked: {"role", "content": text} each, roles in order (system first if any, then user and
    assistant turns alternating from user), an assistant turn somewhere (a prompt: none, ending on a user turn)."""
    if not _is_message_list(messages):
        raise ValueError(f'{where}: "{field}" must be a non-empty list of {{"role", "content"}} messages, got '
                         f"{str(messages)[:60]}")
    turns = []
    for n, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f'{where}: "{field}"[{n}] has role {role!r}: roles are {", ".join(ROLES)}')
        if not isinstance(content, str):
            raise ValueError(f'{where}: "{field}"[{n}] ("{role}") must have a text "content", got '
                             f"{type(content).__name__} {str(content)[:60]}")
        expected = ("system", "user") if n == 0 else ("assistant",) if turns[-1]["role"] in ("user",) else ("user",)
        if role not in expected:
            raise ValueError(f'{where}: "{field}"[{n}] is a "{role}" turn after '
                             f'{"the start" if n == 0 else repr(turns[-1]["role"])}: the roles go system (first, '
                             "optional), then user and assistant in turn")
        turns.append({"role": role, "content": content})
    if prompt_only and turns[-1]["role"] != "user":
        raise ValueError(f'{where}: "{field}" must end with a user turn (the completion answers it)')
    if not prompt_only and not any(t["role"] == "assistant" for t in turns):
        raise ValueError(f'{where}: "{field}" has no assistant turn: nothing to learn from (the loss is on the '
                         "assistant's turns)")
    return turns


def prompt_of(value, where: str, field: str) -> str | list[dict]:
    """What a model decodes from, given a row's ``field``: a prompt of text, a conversational prompt (ending on a
    user turn), or a conversation (``messages``) without the turns after its last user turn (the answer)."""
    if isinstance(value, str):
        return _text(value, where, field)
    if not _is_message_list(value):
        raise ValueError(f'{where}: "{field}" must be a text or a list of {{"role", "content"}} messages, got '
                         f"{str(value)[:60]}")
    if field == "messages":
        users = [n for n, m in enumerate(value) if isinstance(m, dict) and m.get("role") == "user"]
        if not users:
            raise ValueError(f'{where}: "messages" has no user turn to answer')
        value = value[:users[-1] + 1]
    return _conversation(value, where, field, prompt_only=True)


def _assistant_turns(completion, where: str, field: str) -> list[dict]:
    if not (_is_message_list(completion) and all(m.get("role") == "assistant" for m in completion)):
        raise ValueError(f'{where}: "{field}" must be assistant messages ({{"role": "assistant", "content": ...}}), '
                         f"got {str(completion)[:60]}")
    for n, message in enumerate(completion):
        if not isinstance(message.get("content"), str) or not message["content"].strip():
            raise ValueError(f'{where}: "{field}"[{n}] must have a non-empty text "content"')
    return [{"role": "assistant", "content": m["content"]} for m in completion]


def encode_conversations(tokenizer, conversations: Sequence[list[dict]], first_target: Sequence[int],
                         where: Callable[[int], str] = "conversation {}".format) -> list[tuple[list, list]]:
    """(input_ids, labels) of each conversation rendered whole by the tokenizer's chat template; labels on the
    assistant turns from message ``first_target[i]`` on (the module's docstring says how they are found)."""
    texts, spans = [], []
    for i, (messages, first) in enumerate(zip(conversations, first_target, strict=True)):
        whole = _render(tokenizer, messages, False)
        turns = []
        for n in range(first, len(messages)):
            if messages[n]["role"] != "assistant":
                continue
            before, through = _render(tokenizer, messages[:n], True), _render(tokenizer, messages[:n + 1], False)
            if not (whole.startswith(before) and whole.startswith(through)):
                raise ValueError(f"{where(i)}: the chat template renders message {n} (an assistant turn) or those "
                                 "before it differently once later turns follow, so its tokens cannot be told apart: "
                                 "train on conversations that end at that turn (prompt/completion rows)")
            turns.append((len(before), len(through)))
        texts.append(whole)
        spans.append(turns)
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    rows = []
    for ids, offsets, turns in zip(encoded["input_ids"], encoded["offset_mapping"], spans, strict=True):
        labels = [-100] * len(ids)
        for start, end in turns:
            inside = [t for t, (a, b) in enumerate(offsets) if b > start and a < end]
            last_special = max((t for t in inside if ids[t] in special), default=None)
            for t in inside:
                if last_special is None or t <= last_special:
                    labels[t] = ids[t]
        rows.append((list(ids), labels))
    return rows


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


__all__ = ["CONVERSATIONAL", "MESSAGES", "PROMPT_COMPLETION", "TEXT", "Format", "detect_format",
           "encode_conversations", "prepare_dataset"]
