"""Text <-> token ids at the edge of the mesh (router, offline CLI).

Reads a Hugging Face model folder with the `tokenizers` library and renders chat templates
with jinja2 the way transformers does, so prompts get the same ids as
`AutoTokenizer.from_pretrained(folder)` without depending on transformers.
`IncrementalDetokenizer` turns a stream of generated ids into text deltas.

Chat messages are user text inside a prompt the template writes: `encode_chat` lets only the
template produce control (special) tokens, so a message holding `<|im_end|>` cannot end its turn.
Encoding releases the GIL (the `tokenizers` batch call), so a caller may run it in a thread
while other work goes on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as _Backend

from kvmesh.params import InvalidRequest

# The named special tokens transformers reads from tokenizer_config.json and passes to chat
# templates as variables of the same name.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# The roles of OpenAI's chat API that chat templates are written for; any other is refused, since
# templates print the role verbatim and an unknown one would be a turn the model never saw.
CHAT_ROLES = ("system", "user", "assistant", "tool")


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
        self._control_tokens = _ControlTokens(backend)
        # The same tokenizer reading special-token strings as plain text: for user text in chats.
        self._text_backend = _Backend.from_str(backend.to_str())
        self._text_backend.encode_special_tokens = True
        self._chat_template = _compile_chat_template(chat_template) if chat_template is not None else None
        self._byte_level = "ByteLevel" in json.dumps(json.loads(backend.to_str()).get("decoder"))

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
        """Ids of `text`; `add_special_tokens` adds what the post-processor adds (usually BOS).
        Special-token strings in `text` become their tokens: the caller writes the whole prompt."""
        # The batch call releases the GIL (the single one does not), so threads can run meanwhile.
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Ids outside the vocabulary are dropped; broken UTF-8 becomes "\\ufffd"."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for, alone: a token that holds part of a UTF-8 character gives
        that part (byte-level BPE, byte-fallback `<0xNN>` pieces), not U+FFFD. b"" outside the vocabulary."""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in _BYTE_DECODER for c in piece):
            return bytes(_BYTE_DECODER[c] for c in piece)
        if (byte := _BYTE_FALLBACK.fullmatch(piece)) is not None:
            return bytes([int(byte.group(1), 16)])
        return piece.replace("\u2581", " ").encode()  # SentencePiece marks a space with U+2581

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """Render `messages` (dicts with "role" and "content") with the model's chat template.

        Output equals transformers' `apply_chat_template(messages, tokenize=False, ...)`.
        Raises InvalidRequest naming `messages[i].role` for a role outside CHAT_ROLES, and
        ValueError when the folder has no chat template, when `messages` is empty or holds a
        non-dict, or when the template rejects the conversation (`raise_exception`).
        """
        return self._render(_checked_chat(messages), add_generation_prompt)

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """Ids of the rendered chat (no BOS beyond what the template writes), where control tokens
        come only from the template: a special-token string inside any message field is encoded
        as the plain text it is. For messages without such strings the ids are transformers'
        `apply_chat_template(tokenize=True)`. Raises as `apply_chat_template`.
        """
        control = self._control_tokens
        rendered = self._render([control.escape(m) for m in _checked_chat(messages)], add_generation_prompt)
        pieces = control.split(rendered)
        texts = [control.unescape(piece) for piece in pieces if isinstance(piece, str)]
        encoded = iter(self._text_backend.encode_batch(texts, add_special_tokens=False)) if texts else iter(())
        return [i for piece in pieces for i in ([piece] if isinstance(piece, int) else next(encoded).ids)]

    def _render(self, chat: list[dict], add_generation_prompt: bool) -> str:
        if self._chat_template is None:
            raise ValueError(
                "this model has no chat template (no chat_template in tokenizer_config.json and no "
                "chat_template.jinja); send a plain prompt instead of messages"
            )
        try:
            return self._chat_template.render(
                messages=chat, tools=None, documents=None,
                add_generation_prompt=add_generation_prompt, **self._special_tokens,
            )
        except (jinja2.TemplateError, TypeError) as error:  # TypeError: e.g. content of the wrong type
            raise ValueError(f"chat template rejected the messages: {error}") from error

    def _special_token_id(self, key: str) -> int | None:
        token = self._special_tokens.get(key)
        return None if token is None else self._backend.token_to_id(token)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character each byte is written as -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_DECODER = _byte_decoder()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


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


def _checked_chat(messages: Sequence[dict]) -> list[dict]:
    """`messages` as templates get them, once every one is a dict with a known role."""
    if not messages:
        raise ValueError("messages must hold at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"each message must be a dict with 'role' and 'content', got {str(message)[:40]!r}")
        if message.get("role") not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role",
                                 f"must be one of {', '.join(CHAT_ROLES)}, got {str(message.get('role'))[:40]!r}")
    # transformers drops None-valued keys: templates test `'key' in message`, not `is none`.
    return [{key: value for key, value in message.items() if value is not None} for message in messages]


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


class _ControlTokens:
    """The tokenizer's special added tokens in chat rendering.

    User text is escaped before the template sees it, so the rendered chat holds the template's
    own special tokens only; `split` finds those the way the `tokenizers` library does (leftmost,
    longest, honouring lstrip/rstrip/single_word), and `unescape` gives user text back as text.
    An escape is ESCAPE, the token's index (none for a literal ESCAPE), END: private-use
    characters, which templates pass through unchanged.
    """

    ESCAPE, END = "\ue000", "\ue001"

    def __init__(self, backend: _Backend):
        added = sorted(((i, t) for i, t in backend.get_added_tokens_decoder().items() if t.special),
                       key=lambda item: -len(item[1].content))
        self._tokens = [t.content for _, t in added]
        self._index = {token: str(k) for k, token in enumerate(self._tokens)}
        self._ids = [i for i, _ in added]
        literal = "|".join(re.escape(t) for t in [self.ESCAPE, *self._tokens])
        self._in_user_text = re.compile(literal)
        self._in_template = re.compile("|".join(f"({_match_pattern(t)})" for _, t in added)) if added else None
        self._escaped = re.compile(f"{self.ESCAPE}([0-9]*){self.END}")

    def escape(self, message):
        """`message` with every string in it (nested ones too) escaped; other values as they are."""
        if isinstance(message, str):
            return self._in_user_text.sub(self._escape, message)
        if isinstance(message, dict):
            return {key: self.escape(value) for key, value in message.items()}
        if isinstance(message, (list, tuple)):
            return [self.escape(value) for value in message]
        return message

    def split(self, rendered: str) -> list[str | int]:
        """`rendered` as text pieces and the ids of the special tokens between them."""
        if self._in_template is None:
            return [rendered] if rendered else []
        pieces, start = [], 0
        for match in self._in_template.finditer(rendered):
            if match.start() > start:
                pieces.append(rendered[start:match.start()])
            pieces.append(self._ids[match.lastindex - 1])
            start = match.end()
        if start < len(rendered):
            pieces.append(rendered[start:])
        return pieces

    def unescape(self, text: str) -> str:
        return self._escaped.sub(self._unescape, text)

    def _escape(self, match: re.Match) -> str:
        return self.ESCAPE + self._index.get(match.group(), "") + self.END

    def _unescape(self, match: re.Match) -> str:
        index = match.group(1)
        return self._tokens[int(index)] if index else self.ESCAPE


def _match_pattern(token: AddedToken) -> str:
    # As the `tokenizers` library matches an added token: lstrip/rstrip take the whitespace beside
    # it, single_word wants no word character beside it.
    pattern = re.escape(token.content)
    if token.single_word:
        pattern = rf"(?<!\w){pattern}(?!\w)"
    return (r"\s*" if token.lstrip else "") + pattern + (r"\s*" if token.rstrip else "")


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
