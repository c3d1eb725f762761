"""transformers as the reference the runtime must match (a test dependency only)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

TIE_GAP = 1e-4  # reference top-two logits closer than this: either token is a correct greedy choice
LOGPROB_TOL = 1e-4


def save_hf_checkpoint(arch: str, out: Path, **overrides) -> Path:
    """A random checkpoint written by transformers' own save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 bos_token_id=1, eos_token_id=2)
    shape.update(overrides)
    torch.manual_seed(1234)
    model = model_cls(config_cls(**shape))
    with torch.no_grad():  # biases start at zero in transformers; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(out)
    return out


@lru_cache(maxsize=8)
def _hf_model(model_dir: str, dtype: torch.dtype, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


@dataclass
class Reference:
    token_ids: list[int]
    logits: list[torch.Tensor]  # raw float32 logits at each generated position


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int, dtype=torch.float32, device: str = "cpu") -> Reference:
    """transformers' generate, greedy, EOS ignored (the runtime is compared with ignore_eos)."""
    model = _hf_model(str(model_dir), dtype, str(device))
    out = model.generate(
        torch.tensor([prompt], device=device), max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False,
        eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt):].tolist()
    return Reference(tokens, [l[0].float().cpu() for l in out.logits])


def assert_matches_reference(got_tokens: list[int], got_logprobs: list[float], ref: Reference,
                             tie_gap: float = TIE_GAP, logprob_tol: float = LOGPROB_TOL) -> int:
    """Token-exact up to a reference near-tie (top-two logits within `tie_gap`), where the comparison
    stops; returns how many tokens were compared. Logprobs within `logprob_tol` of the reference."""
    assert len(got_tokens) == len(ref.token_ids), (len(got_tokens), len(ref.token_ids))
    for i, (got, want) in enumerate(zip(got_tokens, ref.token_ids)):
        logits = ref.logits[i]
        top2 = torch.topk(logits, 2).values
        if got != want:
            gap = float(top2[0] - top2[1])
            assert gap < tie_gap, f"token {i}: got {got}, transformers {want}, top-two gap {gap:.2e} is no tie"
            print(f"comparison stops at token {i}: reference top-two logits within {gap:.1e} (a tie)")
            return i
        want_lp = float(torch.log_softmax(logits, -1)[want])
        assert abs(got_logprobs[i] - want_lp) < logprob_tol, (i, got_logprobs[i], want_lp)
        if float(top2[0] - top2[1]) < tie_gap:
            print(f"comparison stops after token {i}: reference near-tie, later tokens may diverge")
            return i + 1
    return len(got_tokens)
