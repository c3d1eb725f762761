"""Text <-> token ids at the edge of the mesh (router, offline CLI).

Reads a Hugging Face model folder with the `tokenizers` library and renders chat templates
with jinja2 the way transformers does, so prompts get the same ids as
`AutoTokenizer.from_pretrained(folder)` without depending on transformers.
`IncrementalDetokenizer` turns a stream of generated ids into text deltas.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as _Backend

# The named special tokens transformers reads from tokenizer_config.json and passes to chat
# templates as variables of the same name.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    """A model folder's tokenizer: encode, decode, and chat templates.

    Ids match transformers' `AutoTokenizer` for the same folder: the special tokens named in
    tokenizer_config.json are added to the vocabulary when missing, and BOS/EOS are added by
    tokenizer.json's post-processor alone (transformers 5 ignores `add_bos_token` and
    `add_eos_token` when a tokenizer.json exists, and so does this class).
    `decode` returns what tokenizer.json's decoder gives (transformers' only extra step,
    `clean_up_tokenization_spaces`, is one it skips for BPE models).
    """

    def __init__(self, backend: _Backend, config: dict | None = None, chat_template: str | None = None):
        """`backend` is changed in place; `config` is tokenizer_config.json's content.

        Raises ValueError when `chat_template` is not valid jinja.
        """
        config = config or {}
        self._backend = backend
        self._special_tokens = {
            key: _token_content(config[key]) for key in SPECIAL_TOKEN_KEYS if config.get(key) is not None
        }
        _add_missing_special_tokens(backend, self._special_tokens.values())
        self._bos_token_id = self._special_token_id("bos_token")
        self._eos_token_id = self._special_token_id("eos_token")
        # Whatever tokenizer.json says about truncation or padding, transformers encodes without either.
        backend.no_truncation()
        backend.no_padding()
        self._chat_template = _compile_chat_template(chat_template) if chat_template is not None else None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load `tokenizer.json` plus, when present, `tokenizer_config.json` and `chat_template.jinja`.

        Raises FileNotFoundError when the folder has no tokenizer.json.
        """
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json (kvmesh reads only `tokenizers` files)")
        config_file = model_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        return cls(_Backend.from_file(str(tokenizer_file)), config, _find_chat_template(model_dir, config))

    @property
    def vocab_size(self) -> int:
        """Number of ids this tokenizer knows, added tokens included (transformers' `len(tokenizer)`)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        """Id of tokenizer_config.json's `bos_token`; None when it names none."""
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        """Id of tokenizer_config.json's `eos_token` (generation_config.json may list more stop ids)."""
        return self._eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of `text`; `add_special_tokens` adds what the post-processor adds (usually BOS)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Ids outside the vocabulary are dropped; broken UTF-8 becomes "\\ufffd"."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """Render `messages` (dicts with "role" and "content") with the model's chat template.

        Output equals transformers' `apply_chat_template(messages, tokenize=False, ...)`.
        Raises ValueError when the folder has no chat template, when `messages` is empty or
        holds a non-dict, or when the template rejects the conversation (`raise_exception`).
        """
        if self._chat_template is None:
            raise ValueError(
                "this model has no chat template (no chat_template in tokenizer_config.json and no "
                "chat_template.jinja); send a plain prompt instead of messages"
            )
        if not messages:
            raise ValueError("messages must hold at least one message")
        for message in messages:
            if not isinstance(message, dict):
                raise ValueError(f"each message must be a dict with 'role' and 'content', got {message!r}")
        # transformers drops None-valued keys: templates test `'key' in message`, not `is none`.
        chat = [{key: value for key, value in message.items() if value is not None} for message in messages]
        try:
            return self._chat_template.render(
                messages=chat, tools=None, documents=None,
                add_generation_prompt=add_generation_prompt, **self._special_tokens,
            )
        except (jinja2.TemplateError, TypeError) as error:  # TypeError: e.g. content of the wrong type
            raise ValueError(f"chat template rejected the messages: {error}") from error

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """Ids of the rendered chat. Special tokens come only from the template itself, as in
        transformers' `apply_chat_template(tokenize=True)`."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    def _special_token_id(self, key: str) -> int | None:
        token = self._special_tokens.get(key)
        return None if token is None else self._backend.token_to_id(token)


class IncrementalDetokenizer:
    """Text deltas of a generated token stream, one `push` per token.

    Each push decodes only a short window: the tokens of the previous delta (so that
    spacing rules that depend on the left neighbour, like SentencePiece's "▁" or byte-level
    merges, come out right) followed by the tokens not yet emitted. Text is held back while
    it ends in "\\ufffd", i.e. while a multi-byte character is still split across tokens.
    For byte-level tokenizers the deltas, with `flush()`, concatenate to
    `tokenizer.decode(output_ids)`.
    """

    # Tokens of the prompt used as left context for the first delta.
    PROMPT_CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Only the window is kept: ids[:read_offset] produced the previous delta (or are prompt
        # context), ids[read_offset:] have not been emitted yet.
        self._ids = list(prompt_ids[-self.PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (often "", never a split character)."""
        self._ids.append(token_id)
        return self._emit(hold_incomplete=True)

    def flush(self) -> str:
        """Return whatever is still held back (a trailing incomplete character as "\\ufffd")."""
        return self._emit(hold_incomplete=False)

    def _emit(self, hold_incomplete: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[: self._read_offset])
        full_text = self._decode(self._ids)
        if len(full_text) <= len(prefix_text) or (hold_incomplete and full_text.endswith("\ufffd")):
            return ""
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text):]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


def _token_content(token: str | dict) -> str:
    # transformers writes special tokens either as plain strings or as AddedToken dicts.
    return token["content"] if isinstance(token, dict) else token


def _add_missing_special_tokens(backend: _Backend, tokens: Iterable[str]) -> None:
    # transformers adds every configured special token that tokenizer.json lacks, so text
    # containing one encodes to a single id (possibly a new one past the trained vocabulary).
    known = {added.content for added in backend.get_added_tokens_decoder().values()}
    missing = [token for token in dict.fromkeys(tokens) if token not in known]
    if missing:
        backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in missing])


def _find_chat_template(model_dir: Path, config: dict) -> str | None:
    # transformers prefers chat_template.jinja; tokenizer_config.json may hold a string or a
    # list of {"name", "template"} of which "default" is the one used.
    template_file = model_dir / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template


class _GenerationBlock(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (transformers marks assistant spans
    with it) and renders the body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Unlike jinja's own tojson, no HTML escaping, and non-ASCII kept as is, as in transformers.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _chat_environment() -> ImmutableSandboxedEnvironment:
    # Templates come from model folders, i.e. untrusted: hence the sandbox.
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


_CHAT_ENVIRONMENT = _chat_environment()


def _compile_chat_template(source: str) -> jinja2.Template:
    try:
        return _CHAT_ENVIRONMENT.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"the model's chat template is not valid jinja: {error}") from error
