"""kvmesh.tokenizer gives transformers' ids and chat prompts, and streams text without broken characters."""

import json
import random
import shutil

import jinja2
import pytest
from transformers import AutoTokenizer

from kvmesh.modelgen import SIZES, make_model, synthetic_corpus
from kvmesh.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world",
    "The cache holds 1234 pages, and 56.78% are shared!",
    "café naïve résumé über — ½ €",
    "日本語のテキスト and 中文 mixed with English",
    "emoji 😀🚀 and skin tones 👍🏽👍🏿, flags 🇯🇵",
    "  leading, trailing   and\tmixed\n\nwhitespace  ",
    "don't I'll we've THEY'RE",
    "special tokens inline: <s> </s> <|im_start|>user<|im_end|>",
    "",
]

SYSTEM_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi in 日本語 😀"},
    {"role": "assistant", "content": "こんにちは"},
    {"role": "user", "content": "Again?"},
]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory):
    # llama and mistral share a tokenizer layout; qwen2 splits words differently.
    return make_model(tmp_path_factory.mktemp(request.param), request.param, **SIZES["small"])


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def _write_tokenizer_folder(source, target, **config_changes):
    """A copy of `source`'s tokenizer files with tokenizer_config.json keys changed (None deletes)."""
    target.mkdir()
    shutil.copy(source / "tokenizer.json", target / "tokenizer.json")
    shutil.copy(source / "config.json", target / "config.json")
    config = json.loads((source / "tokenizer_config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("text", TEXTS)
def test_encode_gives_transformers_ids(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode(text) == hf_tokenizer(text)["input_ids"]
    assert tokenizer.encode(text, add_special_tokens=False) == hf_tokenizer(text, add_special_tokens=False)["input_ids"]


def test_encode_starts_with_bos(tokenizer):
    assert tokenizer.encode("hello")[0] == tokenizer.bos_token_id == 1
    assert tokenizer.encode("hello", add_special_tokens=False)[0] != tokenizer.bos_token_id


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips_and_matches_transformers(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text)

    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)
    if "<s>" not in text and "<|im" not in text:
        assert tokenizer.decode(ids) == text


def test_special_token_ids_and_vocab_size_match_transformers(tokenizer, hf_tokenizer):
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id
    assert tokenizer.vocab_size == len(hf_tokenizer)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(tokenizer, hf_tokenizer, add_generation_prompt):
    ours = tokenizer.apply_chat_template(SYSTEM_CHAT, add_generation_prompt=add_generation_prompt)

    assert ours == hf_tokenizer.apply_chat_template(
        SYSTEM_CHAT, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_encode_chat_gives_transformers_ids_without_an_extra_bos(tokenizer, hf_tokenizer):
    ids = tokenizer.encode_chat(SYSTEM_CHAT)

    assert ids == hf_tokenizer.apply_chat_template(
        SYSTEM_CHAT, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert ids[0] == tokenizer.encode("<|im_start|>", add_special_tokens=False)[0]


# A Llama-2-style template that uses what transformers provides: special-token variables,
# raise_exception, tojson, loop controls and trim/lstrip of blocks.
STRICT_TEMPLATE = """
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}
    {% set messages = messages[1:] %}
{% endif %}
{{ bos_token }}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {% if loop.first and system is defined %}[SYS]{{ system | tojson }}[/SYS]{% endif %}
[INST] {{ message['content'] | trim }} [/INST]
    {% else %}
 {{ message['content'] | trim }}{{ eos_token }}
    {% endif %}
    {% if message.get('stop') %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<unk-free>{{ unk_token }}{% endif %}
"""


def test_template_variables_and_helpers_behave_like_transformers(model_dir, tmp_path):
    folder = _write_tokenizer_folder(model_dir, tmp_path / "strict", chat_template=STRICT_TEMPLATE)
    ours, theirs = Tokenizer.from_dir(folder), AutoTokenizer.from_pretrained(folder)
    chats = [
        SYSTEM_CHAT,
        [{"role": "user", "content": "  quoted \"json\" 😀  "}],
        [{"role": "user", "content": "first", "stop": True}, {"role": "assistant", "content": "never shown"}],
    ]
    for chat in chats:
        for add_generation_prompt in (True, False):
            assert ours.apply_chat_template(chat, add_generation_prompt) == theirs.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=add_generation_prompt
            )


def test_template_raise_exception_becomes_value_error(model_dir, tmp_path):
    folder = _write_tokenizer_folder(model_dir, tmp_path / "strict", chat_template=STRICT_TEMPLATE)
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]

    with pytest.raises(jinja2.TemplateError, match="must alternate"):
        AutoTokenizer.from_pretrained(folder).apply_chat_template(two_users, tokenize=False)
    with pytest.raises(ValueError, match="must alternate"):
        Tokenizer.from_dir(folder).apply_chat_template(two_users)


def test_chat_template_jinja_file_wins_over_tokenizer_config(model_dir, tmp_path):
    folder = _write_tokenizer_folder(model_dir, tmp_path / "file")
    (folder / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    chat = [{"role": "user", "content": "hi"}]

    assert Tokenizer.from_dir(folder).apply_chat_template(chat) == "<user>hi"
    assert AutoTokenizer.from_pretrained(folder).apply_chat_template(chat, tokenize=False) == "<user>hi"


def test_missing_chat_template_is_a_clear_value_error(model_dir, tmp_path):
    folder = _write_tokenizer_folder(model_dir, tmp_path / "plain", chat_template=None)

    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(folder).apply_chat_template([{"role": "user", "content": "hi"}])


def test_empty_conversation_is_a_value_error(tokenizer):
    with pytest.raises(ValueError, match="at least one message"):
        tokenizer.apply_chat_template([])


@pytest.mark.parametrize(
    "config_changes",
    [
        # transformers 5 ignores these two when tokenizer.json exists: its post-processor decides.
        {"add_bos_token": False},
        {"add_bos_token": True, "add_eos_token": True},
        # Special tokens written as AddedToken dicts, as older transformers saved them.
        {"eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True}},
        {"bos_token": {"__type": "AddedToken", "content": "<|im_start|>", "lstrip": False, "special": True}},
    ],
)
def test_bos_eos_settings_in_tokenizer_config_act_as_in_transformers(model_dir, tmp_path, config_changes):
    folder = _write_tokenizer_folder(model_dir, tmp_path / "bos", **config_changes)
    ours, theirs = Tokenizer.from_dir(folder), AutoTokenizer.from_pretrained(folder)

    for text in ("hello world", ""):
        assert ours.encode(text) == theirs(text)["input_ids"]
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)


def test_special_token_missing_from_the_vocabulary_is_added_like_transformers(model_dir, tmp_path):
    folder = _write_tokenizer_folder(model_dir, tmp_path / "pad", pad_token="<pad>")
    ours, theirs = Tokenizer.from_dir(folder), AutoTokenizer.from_pretrained(folder)

    assert ours.encode("a<pad>b") == theirs("a<pad>b")["input_ids"]
    assert ours.vocab_size == len(theirs)


def _stream(tokenizer, prompt_ids, output_ids):
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detokenizer.push(token_id) for token_id in output_ids]
    return deltas, detokenizer.flush()


def _random_text(rng):
    sentences = list(synthetic_corpus(rng.randint(1, 4), seed=rng.randrange(10**6)))
    extras = ["日本語", "😀", "👍🏽", "🇯🇵", "naïve", "  ", "\n", "🚀🚀", "€½", "東京タワー"]
    words = " ".join(sentences).split(" ")
    for _ in range(rng.randint(0, 6)):
        words.insert(rng.randrange(len(words) + 1), rng.choice(extras))
    return " ".join(words)


def test_deltas_concatenate_to_the_decoded_output(tokenizer):
    rng = random.Random(1234)
    prompt_ids = tokenizer.encode_chat([{"role": "user", "content": "Tell me something."}])
    for _ in range(200):
        output_ids = tokenizer.encode(_random_text(rng), add_special_tokens=False)

        deltas, tail = _stream(tokenizer, prompt_ids, output_ids)

        assert "".join(deltas) + tail == tokenizer.decode(output_ids)
        assert tail == ""


def test_no_delta_holds_a_broken_character_when_tokens_split_one(tokenizer):
    text = "👍🏽 日本語 🇯🇵 東京タワー 😀 €"
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    # The case under test: some tokens carry only part of a character's UTF-8 bytes.
    assert any("\ufffd" in tokenizer.decode([token_id]) for token_id in output_ids)

    deltas, tail = _stream(tokenizer, tokenizer.encode("Prompt:"), output_ids)

    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) + tail == text


def test_first_delta_keeps_its_leading_space(tokenizer):
    prompt_ids = tokenizer.encode("hello")
    output_ids = tokenizer.encode(" world, again", add_special_tokens=False)

    deltas, _ = _stream(tokenizer, prompt_ids, output_ids)

    assert deltas[0].startswith(" ")
    assert "".join(deltas) == " world, again"


def test_special_tokens_add_no_text(tokenizer):
    hello = tokenizer.encode("hello", add_special_tokens=False)
    im_end = tokenizer.encode("<|im_end|>", add_special_tokens=False)

    deltas, tail = _stream(tokenizer, [], hello + im_end + [tokenizer.eos_token_id])

    assert "".join(deltas) + tail == "hello"
    assert deltas[-2:] == ["", ""]


def test_flush_releases_an_unfinished_character(tokenizer):
    emoji_ids = tokenizer.encode("🦙", add_special_tokens=False)  # not in the training corpus
    assert len(emoji_ids) > 1, "test needs an emoji split over several tokens"

    detokenizer = IncrementalDetokenizer(tokenizer, [])
    held = detokenizer.push(emoji_ids[0])

    assert held == ""
    assert detokenizer.flush() == tokenizer.decode(emoji_ids[:1])
    assert detokenizer.flush() == ""
