"""Structured output: a sequence's tokens constrained to a grammar, with xgrammar.

xgrammar was picked over llguidance and outlines-core by its per-token cost on the default
model's vocabulary (mask plus advance: docs/benchmarks.md, bench/grammar_overhead.py).

- `check(so)` (router): InvalidRequest unless the schema converts to a grammar; needs no tokenizer.
- `Grammars` (worker): the model's vocabulary, read from its folder's tokenizer.json, and a cache
  of compiled grammars; `start(so, output_ids)` gives a sequence's `GrammarState`, replayed over
  the tokens it already produced (so recompute after preemption continues the same grammar).
- `GrammarState`: the allowed next tokens as a bitmask row, and `accept(token)`. The grammar's
  stop tokens are the model's EOS ids: once the JSON is complete, only EOS is allowed, and the
  scheduler ends the sequence on it.

Whitespace between JSON tokens is fixed (`", "` and `": "`, no newlines): with free whitespace a
model could emit blanks forever and never close the value. Tokens that write a control character
(U+0000-U+001F) are never allowed: JSON needs none outside strings, and xgrammar's string rule
lets some through raw, which strict parsers (Python's json) refuse.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from kvmesh.params import InvalidRequest, StructuredOutput

# "Any JSON object", OpenAI's json_object, compiled as the schema that says so.
_ANY_OBJECT = '{"type": "object"}'
# How each kind of vocabulary writes a control byte: raw; in byte-level BPE as its stand-ins
# U+0100-U+011F (GPT-2's byte alphabet); in sentencepiece also as a byte-fallback token <0x0A>.
_CONTROL = {"RAW": re.compile(r"[\x00-\x1f]"), "BYTE_LEVEL": re.compile(r"[\u0100-\u011f]"),
            "BYTE_FALLBACK": re.compile(r"[\x00-\x1f]|^<0x[01][0-9A-Fa-f]>$")}


def _schema(so: StructuredOutput) -> str:
    return so.schema if so.kind == "json_schema" else _ANY_OBJECT


def check(so: StructuredOutput) -> None:
    """Raises InvalidRequest (field structured_output.json_schema) when xgrammar cannot turn the
    schema into a grammar (an unsupported keyword, a dangling $ref...), or when xgrammar is not
    installed (it is the optional extra `kvmesh[structured]`: it pulls in transformers and triton)."""
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequest("response_format", "structured output needs xgrammar on this router and its workers: "
                             "pip install 'kvmesh[structured]'") from None
    if so.kind != "json_schema":
        return
    try:
        xgrammar.Grammar.from_json_schema(so.schema, any_whitespace=False, strict_mode=True)
    except Exception as e:  # xgrammar raises RuntimeError or its own errors, with the reason
        raise InvalidRequest("structured_output.json_schema", f"cannot be compiled to a grammar: {e}") from None


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, matcher):
        self._matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into `bitmask[row]` (a CPU bitmask from `allocate_bitmask`)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advances by `token_id`; False (state unchanged) when the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    @property
    def finished(self) -> bool:
        """The grammar accepted its stop token (EOS): nothing more is allowed."""
        return self._matcher.is_terminated()


class Grammars:
    """A model's vocabulary for xgrammar, and its compiled grammars (xgrammar caches them by schema)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar

        self._xgr = xgrammar
        spec = json.loads(tokenizer_json)
        # Special (added) tokens are encoded as "" so the grammar never allows them as text.
        vocab = [""] * vocab_size
        for token, i in spec["model"]["vocab"].items():
            if i < vocab_size:
                vocab[i] = token
        for added in spec.get("added_tokens", []):
            if added["id"] < vocab_size:
                vocab[added["id"]] = "" if added.get("special", True) else added["content"]
        meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(tokenizer_json)
        control = _CONTROL[xgrammar.VocabType(meta["vocab_type"]).name]
        vocab = ["" if control.search(token) else token for token in vocab]
        info = xgrammar.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=list(stop_token_ids),
                                      add_prefix_space=meta["add_prefix_space"])
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_limit_bytes=64 << 20)

    @classmethod
    def from_folder(cls, folder: str | Path, vocab_size: int, stop_token_ids: list[int]) -> "Grammars":
        """From the model folder's tokenizer.json; FileNotFoundError without one."""
        return cls((Path(folder) / "tokenizer.json").read_text(), vocab_size, stop_token_ids)

    def start(self, so: StructuredOutput, output_ids: list[int]) -> GrammarState:
        """A fresh state for `so`, advanced over `output_ids`. ValueError when the schema does not
        compile or a token of `output_ids` is not allowed by the grammar."""
        try:
            compiled = self._compiler.compile_json_schema(_schema(so), any_whitespace=False, strict_mode=True)
        except Exception as e:
            raise ValueError(f"structured_output: the schema cannot be compiled to a grammar: {e}") from None
        state = GrammarState(self._xgr.GrammarMatcher(compiled))
        for n, token_id in enumerate(output_ids):
            if not state.accept(token_id):
                raise ValueError(f"structured_output: output token {n} ({token_id}) is not allowed by the grammar")
        return state


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A CPU bitmask for `rows` logits rows (one bit per token), for GrammarState.fill."""
    import xgrammar

    return xgrammar.allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Sets to -inf, in place, the logits of the tokens `bitmask` forbids in each of `rows`."""
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
