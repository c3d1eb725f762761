"""Offline batch inference: a JSONL file of requests in, a JSONL file of completions out, in order.

Input line: `prompt` (text) or `prompt_token_ids`, and optionally `max_new_tokens`,
`temperature`, `top_p`, `top_k`, `seed`, `stop_token_ids`, `ignore_eos`, `repetition_penalty`,
`presence_penalty`, `frequency_penalty`. Output line: `token_ids`, `text`, `logprobs`,
`finish_reason` (`length`, `stop`, `eos`), `usage` {`prompt_tokens`, `completion_tokens`,
`cached_prompt_tokens`}. A bad line gets `{"error": "..."}` naming the field and the limit;
the other lines still run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from kvmesh.engine import LLMEngine
from kvmesh.params import InvalidRequest, SamplingParams, StoppingParams
from kvmesh.tokenizer import Tokenizer

_NUMBER_FIELDS = {"temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"}
_INT_FIELDS = {"max_new_tokens", "top_k", "seed"}
_KNOWN_FIELDS = _NUMBER_FIELDS | _INT_FIELDS | {"prompt", "prompt_token_ids", "stop_token_ids", "ignore_eos"}


def _typed(line: dict, name: str, kind: type, default):
    if name not in line:
        return default
    value = line[name]
    accepted = (int, float) if kind is float else int
    if isinstance(value, bool) or not isinstance(value, accepted):
        raise InvalidRequest(name, f"must be {'a number' if kind is float else 'an integer'}, got {value!r}")
    return value


def _int_list(line: dict, name: str) -> list[int]:
    value = line.get(name, [])
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise InvalidRequest(name, "must be a list of integers")
    return value


def parse_line(raw: str, tokenizer: Tokenizer | None) -> tuple[list[int], SamplingParams, StoppingParams]:
    """One input line to (prompt ids, sampling, stopping); InvalidRequest names the bad field."""
    try:
        line = json.loads(raw)
    except json.JSONDecodeError as e:
        raise InvalidRequest("line", f"is not valid JSON ({e.msg})") from None
    if not isinstance(line, dict):
        raise InvalidRequest("line", "must be a JSON object")
    unknown = sorted(set(line) - _KNOWN_FIELDS)
    if unknown:
        raise InvalidRequest(unknown[0], f"is not a known field (known: {', '.join(sorted(_KNOWN_FIELDS))})")
    if ("prompt" in line) == ("prompt_token_ids" in line):
        raise InvalidRequest("prompt", "give exactly one of prompt (text) and prompt_token_ids")
    if "prompt" in line:
        if not isinstance(line["prompt"], str):
            raise InvalidRequest("prompt", "must be a string")
        if tokenizer is None:
            raise InvalidRequest("prompt", "this model has no tokenizer.json; send prompt_token_ids")
        ids = tokenizer.encode(line["prompt"]) if line["prompt"] else []
    else:
        ids = _int_list(line, "prompt_token_ids")
    defaults = SamplingParams()
    sampling = SamplingParams(
        temperature=float(_typed(line, "temperature", float, defaults.temperature)),
        top_p=float(_typed(line, "top_p", float, defaults.top_p)),
        top_k=_typed(line, "top_k", int, defaults.top_k),
        repetition_penalty=float(_typed(line, "repetition_penalty", float, defaults.repetition_penalty)),
        presence_penalty=float(_typed(line, "presence_penalty", float, defaults.presence_penalty)),
        frequency_penalty=float(_typed(line, "frequency_penalty", float, defaults.frequency_penalty)),
        seed=_typed(line, "seed", int, None),
    )
    ignore_eos = line.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise InvalidRequest("ignore_eos", f"must be true or false, got {ignore_eos!r}")
    stopping = StoppingParams(
        max_new_tokens=_typed(line, "max_new_tokens", int, StoppingParams().max_new_tokens),
        stop_token_ids=tuple(_int_list(line, "stop_token_ids")),
        ignore_eos=ignore_eos,
    )
    return ids, sampling, stopping


def run_offline(engine: LLMEngine, tokenizer: Tokenizer | None, lines: list[str], out: TextIO, progress: bool = True) -> dict[str, int]:
    """Runs every line through the engine and writes one result line per input line, in order."""
    results: list[dict[str, Any] | None] = [None] * len(lines)
    index_of = {}
    for i, raw in enumerate(lines):
        try:
            ids, sampling, stopping = parse_line(raw, tokenizer)
            index_of[engine.add_request(ids, sampling, stopping).request_id] = i
        except InvalidRequest as e:
            results[i] = {"error": str(e)}
    bar = tqdm(total=len(index_of), desc="requests", unit="req", file=sys.stderr, disable=not progress)
    while engine.has_unfinished():
        for event in engine.step():
            if event.finish_reason is not None:
                results[index_of[event.request.request_id]] = _result(event.request, tokenizer)
                bar.update(1)
    bar.close()
    for result in results:
        out.write(json.dumps(result, ensure_ascii=False) + "\n")
    return {"completed": len(index_of), "errors": len(lines) - len(index_of)}


def _result(req, tokenizer: Tokenizer | None) -> dict[str, Any]:
    return {
        "token_ids": req.output_token_ids,
        "text": tokenizer.decode(req.output_token_ids) if tokenizer else None,
        "logprobs": req.output_logprobs,
        "finish_reason": req.finish_reason.value,
        "usage": {
            "prompt_tokens": len(req.prompt_token_ids),
            "completion_tokens": len(req.output_token_ids),
            "cached_prompt_tokens": req.num_cached_prompt_tokens,
        },
    }


def load_tokenizer(model_dir: Path) -> Tokenizer | None:
    return Tokenizer.from_dir(model_dir) if (Path(model_dir) / "tokenizer.json").is_file() else None
