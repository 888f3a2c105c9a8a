"""loramcl.data.formats: each dataset format's labels checked token by token with SmolLM2's real tokenizer and chat
template, against TRL's SFTTrainer preparation of the same rows, and every malformed row refused by one line."""

from __future__ import annotations

import pytest
from datasets import Dataset

from loramcl.data.formats import MESSAGES, PACKING_REFUSED, detect_format, prepare_dataset

# SmolLM2's chat template with {% generation %} markers around each assistant turn's content and its end-of-turn
# token, and otherwise the same text: what TRL's assistant_only_loss needs (it refuses SmolLM2's own template).
MARKED_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TWO_TURNS = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "Again"},
                          {"role": "assistant", "content": "Sure thing"}]}


@pytest.fixture(scope="module")
def tokenizer(smollm2_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_folder)


def prepared(tokenizer, rows, **options):
    return list(prepare_dataset(Dataset.from_list(rows), tokenizer, **options))


def labelled(tokenizer, example) -> list[str]:
    """The labelled tokens of an example, as text, one per token."""
    return [tokenizer.decode([t]) for t, label in zip(example["input_ids"], example["labels"], strict=True)
            if label != -100]


def test_prompt_completion_labels_the_completion_and_end_of_sequence(tokenizer):
    rows = [{"prompt": "The capital of France is", "completion": " Paris."}]
    [example] = prepared(tokenizer, rows)
    prompt = tokenizer("The capital of France is")["input_ids"]
    assert example["input_ids"][:len(prompt)] == prompt  # the prompt's tokens as generate reads them
    assert example["labels"][:len(prompt)] == [-100] * len(prompt)
    assert labelled(tokenizer, example) == [" Paris", ".", "<|im_end|>"]
    [ours] = prepared(tokenizer, [{"prompt": "The capital of France is", "target": " Paris."}])  # our field name
    assert ours == example


def test_messages_label_every_assistant_turn_and_its_end_of_turn_token_only(tokenizer):
    [example] = prepared(tokenizer, [TWO_TURNS])
    text = tokenizer.apply_chat_template(TWO_TURNS["messages"], tokenize=False)
    assert example["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]  # rendered whole
    tokens = [tokenizer.decode([t]) for t in example["input_ids"]]
    on = [label != -100 for label in example["labels"]]
    # system and user turns, the role headers and the new line after <|im_end|> are masked
    spans = [(i, tokens[i]) for i in range(len(tokens)) if on[i]]
    assert [t for _, t in spans] == ["Hello", " there", "<|im_end|>", "Sure", " thing", "<|im_end|>"]
    first, second = spans[0][0], spans[3][0]
    assert tokens[first - 3:first] == ["ass", "istant", "\n"] and tokens[second - 3:second] == ["ass", "istant", "\n"]
    assert tokens[spans[2][0] + 1] == "\n" and not on[spans[2][0] + 1]
    assert all(label == t for label, t in zip(example["labels"], example["input_ids"], strict=True) if label != -100)


def test_conversational_prompt_completion_labels_the_assistant_answer(tokenizer):
    row = {"prompt": [{"role": "user", "content": "Say hi"}], "completion": [{"role": "assistant", "content": "Hi!"}]}
    [example] = prepared(tokenizer, [row])
    prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert example["input_ids"][:len(prompt_ids)] == prompt_ids  # what generate decodes from
    assert labelled(tokenizer, example) == ["Hi", "!", "<|im_end|>"]
    # a string prompt/completion row with chat_template: the same conversation, the same labels
    [wrapped] = prepared(tokenizer, [{"prompt": "Say hi", "completion": "Hi!"}], chat_template=True)
    assert wrapped == example


def test_text_labels_every_token_and_end_of_sequence(tokenizer):
    [example] = prepared(tokenizer, [{"text": "just some text"}])
    assert example["input_ids"] == tokenizer("just some text")["input_ids"] + [tokenizer.eos_token_id]
    assert example["labels"] == example["input_ids"]


def test_multi_reference_rows_become_one_example_per_reference_with_their_row(tokenizer):
    rows = [{"prompt": "Translate cat:", "references": [" chat", " Katze", " gatto"]},
            {"prompt": "Translate dog:", "references": [" chien"]}]
    examples = prepared(tokenizer, rows)
    assert [e["row"] for e in examples] == [0, 0, 0, 1]
    assert ["".join(labelled(tokenizer, e)) for e in examples] == [" chat<|im_end|>", " Katze<|im_end|>",
                                                                   " gatto<|im_end|>", " chien<|im_end|>"]
    conversational = [{"prompt": [{"role": "user", "content": "Translate cat:"}],
                       "completion": ["chat", "Katze"]}]
    assert ["".join(labelled(tokenizer, e)) for e in prepared(tokenizer, conversational)] == [
        "chat<|im_end|>", "Katze<|im_end|>"]


def test_max_length_cuts_the_end_and_refuses_a_prompt_that_fills_it(tokenizer):
    [example] = prepared(tokenizer, [{"prompt": "one two", "completion": " three four five six"}], max_length=4)
    assert len(example["input_ids"]) == 4 and example["labels"][:2] == [-100, -100]
    with pytest.raises(ValueError, match=r"the dataset row 1: the prompt alone has 2 tokens, max_length is 2"):
        prepared(tokenizer, [{"prompt": "one two", "completion": " three"}], max_length=2)


def _sft_prepared(tokenizer, rows, **config):
    """TRL's SFTTrainer's own preparation of ``rows`` (its train_dataset: input_ids and labels)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=8, intermediate_size=16,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    args = SFTConfig(output_dir="unused", report_to=[], max_length=None, use_cpu=True, bf16=False, **config)
    return list(SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                           processing_class=tokenizer).train_dataset)


PAIRS = [{"prompt": "The capital of France is", "completion": " Paris."}, {"prompt": "2 + 2 =", "completion": " 4"},
         {"prompt": "Translate to French: good morning\n", "completion": "bonjour"}]


def test_prompt_completion_equals_trl_completion_only_loss(tokenizer):
    trl = _sft_prepared(tokenizer, PAIRS, completion_only_loss=True)
    ours = prepared(tokenizer, PAIRS)
    assert [e["input_ids"] for e in ours] == [e["input_ids"] for e in trl]
    assert [e["labels"] for e in ours] == [e["labels"] for e in trl]


def test_messages_equal_trl_assistant_only_loss(tokenizer):
    """TRL needs {% generation %} markers for assistant_only_loss and refuses SmolLM2's template, which has none (it
    patches only the templates it knows); we find the assistant's tokens without markers. Given SmolLM2's template
    with markers around each answer and its <|im_end|>, TRL's input_ids and loss mask equal ours on the unmarked
    template."""
    rows = [TWO_TURNS, {"messages": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]}]
    with pytest.raises(ValueError, match="not training-compatible"):
        _sft_prepared(tokenizer, rows, assistant_only_loss=True)
    marked = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    marked.chat_template = MARKED_TEMPLATE
    trl = _sft_prepared(marked, rows, assistant_only_loss=True)
    ours = prepared(tokenizer, rows)
    assert [e["input_ids"] for e in ours] == [e["input_ids"] for e in trl]
    assert [e["labels"] for e in ours] == [e["labels"] for e in trl]


def test_conversational_completion_differs_from_trl_by_the_new_line_after_the_end_of_turn(tokenizer):
    """By design: TRL's completion_only_loss labels everything after the prompt, the new line the template writes
    after <|im_end|> included; decoding stops at <|im_end|> and never produces it, so we leave it out of the loss."""
    rows = [{"prompt": [{"role": "user", "content": "Say hi"}],
             "completion": [{"role": "assistant", "content": "Hi!"}]}]
    [trl] = _sft_prepared(tokenizer, rows, completion_only_loss=True)
    [ours] = prepared(tokenizer, rows)
    assert ours["input_ids"] == trl["input_ids"]
    assert ours["labels"][:-1] == trl["labels"][:-1]
    assert tokenizer.decode(trl["labels"][-1:]) == "\n" and ours["labels"][-1] == -100


def test_format_detection(tokenizer):
    assert detect_format(TWO_TURNS).kind == MESSAGES
    assert detect_format({"prompt": "a", "completion": ["b", "c"]}).multi_reference
    assert not detect_format({"prompt": [{"role": "user", "content": "a"}],
                              "completion": [{"role": "assistant", "content": "b"}]}).multi_reference


USER, ANSWER = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}
BAD_ROWS = [
    ("missing field", [{"prompt": "a", "completion": "b"}, {"prompt": "c"}],
     r'^the dataset row 2: no "completion" field, .*its fields are "prompt": one format per file$'),
    ("empty completion", [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": " "}],
     r'^the dataset row 2: "completion" is empty'),
    ("non-string content", [{"messages": [USER, {"role": "assistant", "content": None}]}],
     r'^the dataset row 1: "messages"\[1\] \("assistant"\) must have a text "content", got NoneType'),
    ("no assistant turn", [{"messages": [USER]}], r'^the dataset row 1: "messages" has no assistant turn'),
    ("roles out of order", [{"messages": [ANSWER, USER]}],
     r'^the dataset row 1: "messages"\[0\] is a "assistant" turn after the start'),
    ("two user turns", [{"messages": [USER, USER, ANSWER]}], r'"messages"\[1\] is a "user" turn after \'user\''),
    ("unknown role", [{"messages": [{"role": "bot", "content": "a"}]}], r"has role 'bot': roles are"),
    ("mixed formats", [{"text": "a"}, {"messages": [USER, ANSWER]}], r'^the dataset row 2: no "text" field'),
    ("empty references", [{"prompt": "a", "completion": ["b"]}, {"prompt": "c", "completion": []}],
     r'^the dataset row 2: "completion" must be a non-empty list of references'),
    ("no known field", [{"question": "a", "answer": "b"}],
     r'^the dataset row 1 has none of the fields of a dataset format .* its fields are "question", "answer" '
     r"\(choose the fields with prompt_key / target_key\)$"),
]


@pytest.mark.parametrize("case,rows,message", BAD_ROWS, ids=[case[0] for case in BAD_ROWS])
def test_a_bad_row_is_one_line_naming_it_and_its_field(tokenizer, case, rows, message):
    with pytest.raises(ValueError, match=message) as error:
        prepared(tokenizer, rows)
    assert "\n" not in str(error.value)


def test_packing_and_conversations_without_a_template_are_refused(tokenizer):
    with pytest.raises(ValueError, match="packing is not supported: winner-takes-all picks one winning hypothesis"):
        prepared(tokenizer, PAIRS, packing=True)
    assert "a packed row would hold several examples" in PACKING_REFUSED
    bare = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    bare.chat_template = None
    with pytest.raises(ValueError, match="the rows are conversations .* but the tokenizer has no chat template"):
        prepared(bare, [TWO_TURNS])


def test_the_detected_format_and_cut_examples_are_logged(tokenizer, caplog):
    whole = len(prepared(tokenizer, [TWO_TURNS])[0]["input_ids"])
    with caplog.at_level("INFO", logger="loramcl.data.formats"):
        [cut] = prepared(tokenizer, [TWO_TURNS], max_length=whole - 2, source="chat.jsonl")
    assert caplog.messages == ['chat.jsonl: format messages ("messages"; the loss on the assistant turns)',
                               f"chat.jsonl: 1 of 1 examples are longer than max_length {whole - 2} and lost their end"]
    assert labelled(tokenizer, cut) == ["Hello", " there", "<|im_end|>", "Sure", " thing"]  # "<|im_end|>\n" cut


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_row(tokenizer):
    """As Qwen3's drops the thinking of earlier answers: an answer's tokens in the whole conversation are not those
    the conversation up to it renders, so its labels cannot be found."""
    rewriting = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    rewriting.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<|im_start|>assistant\n<|im_end|>\n"
        "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ValueError, match=r"^the dataset row 1: the chat template renders message 2 \(an assistant "
                                         r"turn\) or those before it differently once later turns follow"):
        prepared(rewriting, [TWO_TURNS])


def test_smollm2s_default_system_prompt_costs_16_tokens_and_a_system_message_of_ones_own_replaces_it(tokenizer):
    """docs/guide/data.md, "What the chat template adds": SmolLM2's template writes its default system prompt into
    every prompt that has no system message (16 tokens); a conversational row with its own system message, empty
    included, replaces it, in training and in `loramcl generate`'s rendering alike."""
    from loramcl.data.prompts import prompt_text

    question = "Name a word that means: put money in a bank"
    user = [{"role": "user", "content": question}]
    answer = [{"role": "assistant", "content": "deposit"}]

    def prompt_tokens(prompt) -> int:
        return len(tokenizer(prompt_text(tokenizer, prompt, True), add_special_tokens=False).input_ids)

    plain = len(tokenizer(question).input_ids)
    default, empty = prompt_tokens(question), prompt_tokens([{"role": "system", "content": ""}, *user])
    assert (plain, default, empty) == (11, 41, 25)
    assert "You are a helpful AI assistant named SmolLM" in prompt_text(tokenizer, question, True)
    rows = [{"prompt": [{"role": "system", "content": ""}, *user], "completion": answer}]
    trained = prepared(tokenizer, rows)[0]
    rendered = tokenizer(prompt_text(tokenizer, rows[0]["prompt"], True), add_special_tokens=False).input_ids
    assert trained["input_ids"][:empty] == rendered  # the prompt as generate renders it, without the default
    with_default = prepared(tokenizer, [{"prompt": user, "completion": answer}])[0]
    assert len(with_default["input_ids"]) - len(trained["input_ids"]) == default - empty == 16
