"""The OpenAI API's choices and logprobs, driven by the official `openai` client over a real mesh:
`echo` with the prompt's logprobs and `top_logprobs` against transformers, `n` and `best_of`,
prompt lists, `logit_bias`, chat `top_logprobs` with raw token bytes, chat without max_tokens."""

import asyncio

import grpc
import openai
import pytest
import torch

from kvmesh.modelgen import SIZES, make_model
from kvmesh.services.router import output
from kvmesh.tokenizer import Tokenizer
from kvmesh.v1 import generation_pb2 as gen
from kvmesh.v1 import generation_pb2_grpc
from local_mesh import Mesh
from reference import LOGPROB_TOL, _hf_model

CONTEXT = 4096
KV_TOKENS = 2048  # 1 MiB of KV for the tiny model: half its context
PROMPT = "garden river stone north cloud light alpha beta gamma delta over the hills and far away"
CHAT = [{"role": "user", "content": "Name a river."}]


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The tiny llama with a context longer than its worker's KV pool holds."""
    return make_model(tmp_path_factory.mktemp("long-model"), "llama", **{**SIZES["tiny"], "max_position_embeddings": CONTEXT})


@pytest.fixture(scope="module")
def mesh(long_model):
    m = Mesh(long_model, workers=1, extra_worker=["--kv-memory-mib", "1"])
    yield m
    m.close()


@pytest.fixture(scope="module")
def client(mesh):
    return openai.OpenAI(base_url=f"http://{mesh.child('router').http}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(long_model):
    return Tokenizer.from_dir(long_model)


def reference_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of `ids`: `[len(ids), vocab]`."""
    with torch.no_grad():
        logits = _hf_model(str(model_dir), torch.float32)(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_echo_with_logprobs_gives_the_prompts_logprobs_and_top_k_as_transformers(client, long_model, tokenizer):
    ids = tokenizer.encode(PROMPT)
    answer = client.completions.create(model="default", prompt=ids, max_tokens=1, logprobs=5, echo=True, temperature=0)
    [choice] = answer.choices
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference_logprobs(long_model, ids)
    want = [float(ref[p, ids[p + 1]]) for p in range(len(ids) - 1)]
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(want, abs=LOGPROB_TOL)
    for p in range(len(ids) - 1):  # position p's alternatives score the token at p + 1
        values, top_ids = torch.topk(ref[p], 5)
        want_top = {output.token_text(tokenizer, int(t)): float(v) for t, v in zip(top_ids, values)}
        assert lp.top_logprobs[p + 1] == pytest.approx(want_top, abs=LOGPROB_TOL)
    generated = int(ref[-1].argmax())  # greedy: the generated token is the reference's top one
    assert lp.token_logprobs[-1] == pytest.approx(float(ref[-1, generated]), abs=LOGPROB_TOL)
    assert max(lp.top_logprobs[-1].values()) == lp.token_logprobs[-1]
    assert choice.text == tokenizer.decode(ids) + tokenizer.decode([generated])
    assert "".join(lp.tokens) == choice.text and lp.text_offset[0] == 0


def test_echo_streamed_equals_echo_not_streamed(client):
    kwargs = dict(model="default", prompt=PROMPT, max_tokens=6, logprobs=2, echo=True, temperature=0)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs)]
    assert "".join(c.text for c in chunks) == whole.text and whole.text.startswith(PROMPT)
    assert [x for c in chunks if c.logprobs for x in c.logprobs.token_logprobs] == whole.logprobs.token_logprobs
    assert [x for c in chunks if c.logprobs for x in c.logprobs.text_offset] == whole.logprobs.text_offset


def test_echo_without_logprobs_puts_the_prompt_before_the_completion(client):
    answer = client.completions.create(model="default", prompt=PROMPT, max_tokens=4, echo=True, temperature=0)
    plain = client.completions.create(model="default", prompt=PROMPT, max_tokens=4, temperature=0)
    assert answer.choices[0].text == PROMPT + plain.choices[0].text


def test_n_choices_with_a_seed_are_distinct_and_reproducible(client):
    kwargs = dict(model="default", prompt=PROMPT, max_tokens=12, n=3, seed=7, temperature=1.0,
                  extra_body={"ignore_eos": True})
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert len(set(texts)) == 3
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts
    assert first.usage.completion_tokens == 36
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == texts
    one = client.completions.create(**{**kwargs, "n": 1})
    assert one.choices[0].text == texts[0]  # choice 0 draws with the request's own seed


def test_the_choices_after_the_first_reuse_the_prompts_pages(mesh, tokenizer):
    ids = tokenizer.encode(PROMPT * 3)
    request = gen.GenerateRequest(prompt_token_ids=gen.TokenIds(ids=ids), n=3, sampling=gen.SamplingParams(seed=3),
                                  stopping=gen.StoppingParams(max_new_tokens=4, ignore_eos=True))

    async def run():
        async with grpc.aio.insecure_channel(mesh.addr) as ch:
            return [r async for r in generation_pb2_grpc.GenerationStub(ch).Generate(request, timeout=60)]

    finishes = {r.index: r.finish for r in asyncio.run(run()) if r.HasField("finish")}
    assert sorted(finishes) == [0, 1, 2]
    full_pages = len(ids) // 16 * 16
    assert finishes[1].cached_prompt_tokens == finishes[2].cached_prompt_tokens == full_pages
    assert all(f.completion_tokens == 4 for f in finishes.values())


def test_best_of_returns_the_likeliest_of_its_samples(client):
    kwargs = dict(model="default", prompt=PROMPT, max_tokens=8, seed=11, temperature=1.0, logprobs=0,
                  extra_body={"ignore_eos": True})
    samples = client.completions.create(n=4, **kwargs).choices
    best = client.completions.create(n=1, best_of=4, **kwargs).choices
    likeliest = max(samples, key=lambda c: sum(c.logprobs.token_logprobs))
    assert [c.text for c in best] == [likeliest.text] and best[0].index == 0


def test_a_prompt_list_is_one_request_of_several_sequences(client, tokenizer):
    prompts = [tokenizer.encode("north garden"), tokenizer.encode("river stone light over"), tokenizer.encode("cloud")]
    batch = client.completions.create(model="default", prompt=prompts, max_tokens=5, n=2, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert sorted(c.index for c in batch.choices) == list(range(6))
    by_index = {c.index: c.text for c in batch.choices}
    for i, ids in enumerate(prompts):
        alone = client.completions.create(model="default", prompt=ids, max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text
        assert by_index[2 * i] == by_index[2 * i + 1] == alone
    assert batch.usage.prompt_tokens == sum(map(len, prompts)) and batch.usage.completion_tokens == 30
    by_text = client.completions.create(model="default", prompt=["north garden", "cloud"], max_tokens=5, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(by_text.choices, key=lambda c: c.index)] == [by_index[0], by_index[4]]


def greedy_ids(mesh, text: str, max_tokens: int) -> list[int]:
    request = gen.GenerateRequest(prompt=text, sampling=gen.SamplingParams(temperature=0),
                                  stopping=gen.StoppingParams(max_new_tokens=max_tokens, ignore_eos=True))

    async def run():
        async with grpc.aio.insecure_channel(mesh.addr) as ch:
            return [t.id async for r in generation_pb2_grpc.GenerationStub(ch).Generate(request, timeout=60) for t in r.tokens]

    return asyncio.run(run())


def test_logit_bias_steers_the_draw_but_not_the_reported_logprobs(client, mesh, tokenizer):
    plain = client.completions.create(model="default", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                                      extra_body={"ignore_eos": True})
    forced = tokenizer.encode(" river", add_special_tokens=False)[-1]
    biased = client.completions.create(model="default", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                                       logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert biased.choices[0].text == tokenizer.decode([forced] * 6)
    first = greedy_ids(mesh, PROMPT, 1)[0]
    banned = client.completions.create(model="default", prompt=PROMPT, max_tokens=6, temperature=0,
                                       logit_bias={str(first): -100}, extra_body={"ignore_eos": True})
    assert banned.choices[0].text != plain.choices[0].text
    assert all(lp < 0 for lp in biased.choices[0].logprobs.token_logprobs)  # raw, not biased, logprobs


def test_chat_top_logprobs_carry_each_tokens_raw_bytes(client, long_model, tokenizer):
    answer = client.chat.completions.create(model="default", messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                            top_logprobs=4, extra_body={"ignore_eos": True})
    content = answer.choices[0].logprobs.content
    ids = tokenizer.encode_chat(CHAT)
    generated = []
    for entry in content:
        assert len(entry.top_logprobs) == 4
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the token is the likeliest
        assert [a.logprob for a in entry.top_logprobs] == sorted((a.logprob for a in entry.top_logprobs), reverse=True)
        generated.append(bytes(entry.bytes))
    assert b"".join(generated).decode("utf-8", errors="replace") == answer.choices[0].message.content
    ref = reference_logprobs(long_model, ids)
    values, _ = torch.topk(ref[-1], 4)
    assert [a.logprob for a in content[0].top_logprobs] == pytest.approx(values.tolist(), abs=LOGPROB_TOL)
    streamed = [e for c in client.chat.completions.create(model="default", messages=CHAT, max_tokens=8, temperature=0,
                                                          logprobs=True, top_logprobs=4, stream=True,
                                                          extra_body={"ignore_eos": True})
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes, e.logprob) for e in streamed] == [(e.token, e.bytes, e.logprob) for e in content]


def test_chat_logprobs_give_a_split_characters_bytes_to_each_of_its_tokens(tokenizer):
    ids = tokenizer.encode("wörld 日本", add_special_tokens=False)
    tokens = [gen.Token(id=i, logprob=-1.0) for i in ids]
    entries = output.chat_logprobs(tokenizer, tokens)["content"]
    assert b"".join(bytes(e["bytes"]) for e in entries) == "wörld 日本".encode()
    assert all(e["bytes"] and "\ufffd" not in e["token"] for e in entries)
    split = [e for e in entries if len(e["bytes"]) == 1 and e["bytes"][0] >= 0x80]
    assert split, "the text should hold a character split over tokens"


def test_chat_n_choices_are_distinct_and_reproducible(client):
    kwargs = dict(model="default", messages=CHAT, max_tokens=10, n=2, seed=5, temperature=1.0,
                  extra_body={"ignore_eos": True})
    first = sorted(client.chat.completions.create(**kwargs).choices, key=lambda c: c.index)
    again = sorted(client.chat.completions.create(**kwargs).choices, key=lambda c: c.index)
    assert [c.index for c in first] == [0, 1]
    assert first[0].message.content != first[1].message.content
    assert [c.message.content for c in again] == [c.message.content for c in first]
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[0], streamed[1]] == [c.message.content for c in first]


def test_chat_without_max_tokens_runs_as_far_as_the_kv_pool_holds(client, tokenizer):
    ids = tokenizer.encode_chat(CHAT)
    answer = client.chat.completions.create(model="default", messages=CHAT, temperature=0, timeout=600,
                                            extra_body={"ignore_eos": True})
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == KV_TOKENS - len(ids)  # not the context's CONTEXT - len(ids)
