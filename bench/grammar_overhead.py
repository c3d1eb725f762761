"""Per-token cost of grammar-constrained sampling for the candidate libraries, on the default
model's vocabulary (4096 byte-level BPE tokens): xgrammar, llguidance and outlines-core.

For each library: building its tokenizer info from tokenizer.json, compiling a JSON schema, and
then, token by token over sampled documents, computing the allowed-token bitmask, applying it to a
`[1, vocab]` logits row and advancing the grammar with the chosen token. The per-token figure is
what the worker's sampler adds per constrained sequence per step.

    PYTHONPATH=$PWD python bench/grammar_overhead.py [--documents 20] [--libraries xgrammar,llguidance,outlines-core]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from kvmesh.modelgen import default_model_dir

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "active", "tags"],
    "additionalProperties": False,
}
MAX_TOKENS = 300


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE writes -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class XGrammar:
    def __init__(self, tokenizer_json: str, vocab: list[str], eos: int):
        import xgrammar as xgr

        self.xgr = xgr
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer_json)
        info = xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=len(vocab), stop_token_ids=[eos],
                                 add_prefix_space=meta["add_prefix_space"])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.bitmask = xgr.allocate_token_bitmask(1, len(vocab))

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, m, logits: torch.Tensor) -> None:
        m.fill_next_token_bitmask(self.bitmask)
        self.xgr.apply_token_bitmask_inplace(logits, self.bitmask)

    def accept(self, m, token: int) -> bool:
        m.accept_token(token)
        return m.is_terminated()


class LLGuidance:
    def __init__(self, tokenizer_json: str, vocab: list[str], eos: int):
        import llguidance
        import llguidance.torch as lt

        self.llg, self.lt = llguidance, lt
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=len(vocab), eos_token=eos)
        self.bitmask = lt.allocate_token_bitmask(1, len(vocab))

    def compile(self, schema: dict):
        return self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                           defaults={"whitespace_flexible": False})

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tokenizer, compiled)

    def mask(self, m, logits: torch.Tensor) -> None:
        self.lt.fill_next_token_bitmask(m, self.bitmask, 0)
        self.lt.apply_token_bitmask_inplace(logits, self.bitmask)

    def accept(self, m, token: int) -> bool:
        m.consume_token(token)
        return m.is_stopped()


class OutlinesCore:
    def __init__(self, tokenizer_json: str, vocab: list[str], eos: int):
        import outlines_core
        from outlines_core.kernels import torch as kernels

        self.oc, self.kernels = outlines_core, kernels
        decoder = _byte_decoder()
        special = {t["content"] for t in json.loads(tokenizer_json).get("added_tokens", [])}
        words: dict[bytes, list[int]] = {}
        for i, tok in enumerate(vocab):
            if i != eos and tok not in special:
                words.setdefault(bytes(decoder[c] for c in tok), []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, words)
        self.bitmask = kernels.allocate_token_bitmask(len(vocab))

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def mask(self, m, logits: torch.Tensor) -> None:
        self.kernels.fill_next_token_bitmask(m, self.bitmask)
        self.kernels.apply_token_bitmask_inplace(logits, self.bitmask)

    def accept(self, m, token: int) -> bool:
        m.advance(token)
        return m.is_finished()


LIBRARIES = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines-core": OutlinesCore}


def measure(name: str, documents: int, tokenizer_json: str, vocab: list[str], eos: int) -> dict:
    started = time.perf_counter()
    lib = LIBRARIES[name](tokenizer_json, vocab, eos)
    setup_s = time.perf_counter() - started
    started = time.perf_counter()
    compiled = lib.compile(SCHEMA)
    compile_s = time.perf_counter() - started
    per_token, finished = [], 0
    rng = torch.Generator().manual_seed(0)
    for _ in range(documents):
        m = lib.matcher(compiled)
        for _ in range(MAX_TOKENS):
            logits = torch.randn(1, len(vocab), generator=rng)
            t0 = time.perf_counter()
            lib.mask(m, logits)
            t1 = time.perf_counter()
            token = int(torch.multinomial(logits.softmax(-1), 1, generator=rng))  # the draw is not counted
            t2 = time.perf_counter()
            done = lib.accept(m, token)
            per_token.append(t1 - t0 + time.perf_counter() - t2)
            if done or token == eos:
                finished += 1
                break
    return {"library": name, "setup_s": round(setup_s, 3), "compile_s": round(compile_s, 4),
            "tokens": len(per_token), "documents_finished": f"{finished}/{documents}",
            "per_token_us_median": round(statistics.median(per_token) * 1e6, 1),
            "per_token_us_p99": round(sorted(per_token)[int(0.99 * (len(per_token) - 1))] * 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=20)
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    args = parser.parse_args()
    folder = default_model_dir()
    tokenizer_json = (folder / "tokenizer.json").read_text()
    spec = json.loads(tokenizer_json)
    ids = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec.get("added_tokens", [])}}
    vocab = [""] * (max(ids.values()) + 1)
    for token, i in ids.items():
        vocab[i] = token
    eos = ids["</s>"]
    torch.set_num_threads(1)
    random.seed(0)
    for name in args.libraries.split(","):
        print(json.dumps(measure(name, args.documents, tokenizer_json, vocab, eos)), flush=True)


if __name__ == "__main__":
    main()
