"""Embeddings (vLLM's embed task, OpenAI's /v1/embeddings): the final hidden state at a
prompt's last token, L2-normalized, equal to transformers' on the same weights, however
the scheduler slices the prompt; served with the real openai client, beside generation."""

from __future__ import annotations

import base64
import concurrent.futures
import json

import httpx
import numpy as np
import openai
import pytest
import torch

from deployment import llmbus_serve
from llmbus import LLM, SamplingParams, TokensPrompt
from tiny_models import build_tiny_model, random_prompts

pytestmark = pytest.mark.timeout(300)

PROMPTS = random_prompts([1, 5, 17, 40, 70], seed=4)


def hf_embeddings(folder, prompts) -> list[torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return [torch.nn.functional.normalize(model(torch.tensor([p])).last_hidden_state[0, -1], dim=-1)
                for p in prompts]


def assert_equal_embeddings(got, want) -> None:
    assert len(got) == len(want)
    for vector, expected in zip(got, want):
        torch.testing.assert_close(torch.tensor(vector), expected, rtol=1e-5, atol=1e-5)


CASES = {
    "batch": {},
    "chunked_prefill": {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8},
}


@pytest.mark.parametrize("case", CASES)
def test_embed_equals_transformers_last_token_pooling(tiny_llama, case):
    outputs = LLM(str(tiny_llama), **CASES[case]).embed(PROMPTS)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    assert_equal_embeddings([o.outputs.embedding for o in outputs], hf_embeddings(tiny_llama, PROMPTS))


def test_a_prompt_whose_prefix_is_cached_embeds_the_same(tiny_qwen2):
    prefix = random_prompts([48], seed=9)[0]
    prompts = [prefix + [7], prefix + [8, 9]]
    llm = LLM(str(tiny_qwen2), block_size=16)
    first = llm.embed(prompts[:1])
    second = llm.embed(prompts[1:])
    assert llm.stats().prefix_cache_hits >= 48
    assert_equal_embeddings([o.outputs.embedding for o in first + second], hf_embeddings(tiny_qwen2, prompts))


def test_an_embedding_request_samples_one_token_once():
    with pytest.raises(ValueError, match="max_tokens 1 and n 1"):
        SamplingParams(embed=True, max_tokens=2)


@pytest.fixture(scope="module")
def headless(tiny_llama, tmp_path_factory):
    """The tiny Llama's decoder saved alone, as embedding models ship (LlamaModel: no
    `model.` prefix, no LM head)."""
    import shutil

    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("headless")
    AutoModelForCausalLM.from_pretrained(tiny_llama).model.save_pretrained(folder)
    for path in tiny_llama.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")) or path.suffix == ".jinja":
            shutil.copy(path, folder / path.name)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaModel"]
    return folder


def test_a_decoder_without_an_lm_head_embeds_and_refuses_to_generate(headless, tiny_llama):
    llm = LLM(str(headless))
    assert not llm.runner.model.generates
    got = [o.outputs.embedding for o in llm.embed(PROMPTS)]
    assert_equal_embeddings(got, hf_embeddings(headless, PROMPTS))
    assert_equal_embeddings(got, hf_embeddings(tiny_llama, PROMPTS))  # the same decoder's
    with pytest.raises(ValueError, match="no LM head: it serves embeddings"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))
    quantized = LLM(str(headless), dtype="bfloat16", quantization="int8").embed(PROMPTS[:2])
    for vector, expected in zip(quantized, got):
        assert torch.dot(torch.tensor(vector.outputs.embedding), torch.tensor(expected)) > 0.99


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    proc, url = llmbus_serve(["--model", str(tiny_llama), "--served-model-name", "tiny", "--num-kv-blocks", "64"],
                             tmp_path_factory.mktemp("serve") / "serve.log")
    yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    proc.terminate()
    proc.wait(60)


def test_served_embeddings_equal_transformers_in_both_encodings(served, tiny_llama):
    texts = ["hello world", "a second, longer input than the first one", "3"]
    root = str(served.base_url).removesuffix("/").removesuffix("/v1")
    ids = [httpx.post(root + "/tokenize", json={"prompt": t}, timeout=30).json()["tokens"] for t in texts]
    want = hf_embeddings(tiny_llama, ids + [PROMPTS[2]])
    got = served.embeddings.create(model="tiny", input=texts, encoding_format="float")
    assert [d.index for d in got.data] == [0, 1, 2]
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, ids))
    assert_equal_embeddings([d.embedding for d in got.data], want[:3])
    packed = served.embeddings.create(model="tiny", input=PROMPTS[2], encoding_format="base64")
    assert_equal_embeddings([np.frombuffer(base64.b64decode(packed.data[0].embedding), "<f4").tolist()], want[3:])
    # The client's own default (base64, decoded by it) gives the same floats.
    before = prompt_tokens_counted(root)
    assert_equal_embeddings([served.embeddings.create(model="tiny", input=texts[0]).data[0].embedding], want[:1])
    assert prompt_tokens_counted(root) == before + len(ids[0])  # /metrics counts them as other requests'


def prompt_tokens_counted(root: str) -> float:
    lines = httpx.get(root + "/metrics", timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("llmbus:prompt_tokens_total{"))


def test_embeddings_beside_generation_leave_both_as_they_are_alone(served, tiny_llama):
    prompt = "once upon a time"
    alone = served.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    want = hf_embeddings(tiny_llama, [PROMPTS[4]])
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        texts = [pool.submit(lambda: served.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}))
            for _ in range(3)]
        vectors = [pool.submit(lambda: served.embeddings.create(model="tiny", input=PROMPTS[4])) for _ in range(3)]
        assert [t.result().choices[0].text for t in texts] == [alone] * 3
        for v in vectors:
            assert_equal_embeddings([v.result().data[0].embedding], want)


def test_score_is_the_cosine_of_the_embeddings_offline(tiny_llama):
    """vLLM's LLM.score over an embedding model: one text_1 against each text_2, or pair
    by pair; each pair's score the cosine of its two (normalized) embeddings."""
    llm = LLM(str(tiny_llama))
    query, docs = PROMPTS[1], [PROMPTS[2], PROMPTS[3], PROMPTS[1]]
    vectors = [torch.tensor(o.outputs.embedding) for o in llm.embed([query, *docs])]
    got = llm.score(query, docs)
    want = [float(vectors[0] @ v) for v in vectors[1:]]
    assert [o.outputs.score for o in got] == pytest.approx(want, abs=1e-6)
    assert got[2].outputs.score == pytest.approx(1.0, abs=1e-5) and got[0].prompt_token_ids == query + docs[0]
    pairwise = llm.score(docs[:2], [query, query])
    assert [o.outputs.score for o in pairwise] == pytest.approx(want[:2], abs=1e-6)
    with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
        llm.score(docs[:2], docs)


def test_served_score_and_rerank_rank_by_transformers_embeddings(served, tiny_llama):
    """/score and /rerank (vLLM's paths, Jina's and Cohere's rerank shape): the cosine of
    transformers' embeddings of each text; rerank's documents by it, best first, top_n kept;
    what cannot be scored is a 400 naming its field."""
    root = str(served.base_url).removesuffix("/").removesuffix("/v1")
    query, docs = "a fox jumps", ["the quick brown fox", "paged attention keeps", "a fox jumps", "3"]
    ids = [httpx.post(root + "/tokenize", json={"prompt": t}, timeout=30).json()["tokens"] for t in [query, *docs]]
    vectors = hf_embeddings(tiny_llama, ids)
    want = [float(vectors[0] @ v) for v in vectors[1:]]
    scored = httpx.post(root + "/v1/score", json={"model": "tiny", "text_1": query, "text_2": docs}, timeout=60).json()
    assert [d["index"] for d in scored["data"]] == [0, 1, 2, 3] and scored["object"] == "list"
    assert [d["score"] for d in scored["data"]] == pytest.approx(want, abs=1e-4)
    assert scored["usage"]["prompt_tokens"] == sum(map(len, ids[1:]))  # each distinct text once (the query is docs[2])
    ranked = httpx.post(root + "/rerank", json={"model": "tiny", "query": query, "documents": docs, "top_n": 2},
                        timeout=60).json()
    order = sorted(range(len(docs)), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in ranked["results"]] == order and order[0] == 2
    assert [r["document"]["text"] for r in ranked["results"]] == [docs[i] for i in order]
    assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx([want[i] for i in order], abs=1e-4)
    for path, body, param in (("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
                              ("/score", {"text_1": "a", "text_2": []}, "text_2"),
                              ("/v2/rerank", {"query": "a", "documents": []}, "documents"),
                              ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
                              ("/v1/rerank", {"query": "a", "documents": ["b"], "model": "other"}, "model")):
        refused = httpx.post(root + path, json={"model": "tiny", **body}, timeout=30)
        assert refused.status_code in (400, 404) and refused.json()["error"]["param"] == param, refused.text


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [10**6]}, "input"),
    ({"input": "x", "pooling": "mean"}, "pooling"),
    ({"input": "x", "model": "other"}, "model"),
    ({"input": [[3] * 1024]}, "input"),  # the context is 1024 tokens, one is sampled
])
def test_bad_embedding_requests_are_400s_naming_the_field(served, body, param):
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as info:
        served.post("/embeddings", body={"model": "tiny", **body}, cast_to=object)
    assert info.value.body["param"] == param, info.value.body


def test_llmbus_serve_of_a_decoder_alone_embeds_and_answers_generation_with_a_400(headless, tmp_path):
    proc, url = llmbus_serve(["--model", str(headless), "--served-model-name", "tiny", "--num-kv-blocks", "64"],
                             tmp_path / "serve.log")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        got = client.embeddings.create(model="tiny", input=[PROMPTS[1], PROMPTS[3]])
        assert_equal_embeddings([d.embedding for d in got.data], hf_embeddings(headless, [PROMPTS[1], PROMPTS[3]]))
        with pytest.raises(openai.BadRequestError, match="no LM head"):
            client.completions.create(model="tiny", prompt="hello", max_tokens=4)
    finally:
        proc.terminate()
        proc.wait(60)


def write_pooling(folder, **modes):
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))


def test_the_pooling_a_model_asks_for_is_read_from_its_sentence_transformers_files(tmp_path):
    from shared.hf.pooling_config import pooling_mode

    assert pooling_mode(tmp_path) == "last"  # none: a decoder's default
    write_pooling(tmp_path, pooling_mode_lasttoken=True, pooling_mode_mean_tokens=False)
    assert pooling_mode(tmp_path) == "last"
    write_pooling(tmp_path, pooling_mode_mean_tokens=True)
    assert pooling_mode(tmp_path) == "mean"
    (tmp_path / "modules.json").write_text("{not json")
    assert pooling_mode(tmp_path) == "last"


def test_a_model_that_pools_otherwise_is_refused_embeddings_by_name(headless, tmp_path):
    import shutil

    from fastapi.testclient import TestClient

    from services.gateway.app import create_app
    from shared.config import GatewayConfig
    from test_gateway import FakeEngine
    from services.tokenizer.tokenizer import Tokenizer

    folder = tmp_path / "mean"
    shutil.copytree(headless, folder)
    write_pooling(folder, pooling_mode_mean_tokens=True)
    with pytest.raises(ValueError, match="pools its embeddings by mean; llmbus pools by the last token only"):
        LLM(str(folder)).embed(PROMPTS[:1])
    tokenizer = Tokenizer(folder)

    async def factory(on_stats):
        return FakeEngine(tokenizer, None)

    config = GatewayConfig("tiny", unsupported_pooling="this model's sentence-transformers config pools by mean")
    with TestClient(create_app(factory, tokenizer, config)) as client:
        resp = client.post("/v1/embeddings", json={"model": "tiny", "input": "hi"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "model"


# ---- sequence classifiers: vLLM's classify task ------------------------------------------


def hf_class_logits(folder, prompts) -> list[list[float]]:
    """transformers' own: the score head at each prompt's last token."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].tolist() for p in prompts]


@pytest.mark.parametrize("arch", ["llama_classifier", "qwen3_classifier"])
def test_classify_equals_transformers_sequence_classification(tmp_path, arch):
    """A *ForSequenceClassification checkpoint: its decoder, its score head at the prompt's
    last token (through chunked prefill too), softmax over its labels; it neither generates
    nor embeds, and a regression head's score comes as it is."""
    folder = build_tiny_model(tmp_path / arch, arch, seed=3)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[4]]
    want = torch.tensor(hf_class_logits(folder, prompts)).softmax(-1)
    llm = LLM(str(folder), max_num_batched_tokens=16)
    out = llm.classify([TokensPrompt(prompt_token_ids=p) for p in prompts])
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in out]), want, rtol=1e-4, atol=1e-5)
    assert [o.outputs.num_classes for o in out] == [3, 3, 3] and [o.prompt_token_ids for o in out] == prompts
    assert llm.classifier.labels == ("negative", "neutral", "positive")
    with pytest.raises(ValueError, match="no LM head"):
        llm.generate([prompts[0]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="classify"):
        llm.embed([prompts[0]])
    reward = build_tiny_model(tmp_path / "reward", arch, seed=3, num_labels=1, id2label={0: "LABEL_0"},
                              label2id={"LABEL_0": 0}, problem_type="regression")
    got = LLM(str(reward)).classify([TokensPrompt(prompt_token_ids=p) for p in prompts])
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in got]),
                               torch.tensor(hf_class_logits(reward, prompts)), rtol=1e-4, atol=1e-5)


def test_llmbus_serve_of_a_classifier_answers_classify_and_refuses_the_rest(tmp_path, served):
    """`llmbus serve` of a *ForSequenceClassification checkpoint: vLLM's /classify (and
    /v1/classify) gives each input's probabilities and label, equal to transformers'; its
    embeddings and completions are 400s, as /classify is for a model that does not classify."""
    folder = build_tiny_model(tmp_path / "clf", "llama_classifier", seed=3)
    proc, url = llmbus_serve(["--model", str(folder), "--served-model-name", "tiny", "--num-kv-blocks", "64"],
                             tmp_path / "serve.log")
    try:
        inputs = [PROMPTS[1], PROMPTS[3]]
        want = torch.tensor(hf_class_logits(folder, inputs)).softmax(-1)
        body = httpx.post(url + "/classify", json={"model": "tiny", "input": inputs}, timeout=60).json()
        got = torch.tensor([d["probs"] for d in body["data"]])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        labels = ["negative", "neutral", "positive"]
        assert [d["label"] for d in body["data"]] == [labels[i] for i in want.argmax(-1).tolist()]
        assert [(d["index"], d["num_classes"]) for d in body["data"]] == [(0, 3), (1, 3)]
        assert body["usage"]["prompt_tokens"] == sum(map(len, inputs)) and body["object"] == "list"
        one = httpx.post(url + "/v1/classify", json={"model": "tiny", "input": inputs[0]}, timeout=60).json()
        assert one["data"][0]["probs"] == pytest.approx(body["data"][0]["probs"], abs=1e-6)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="sequence classifier"):
            client.embeddings.create(model="tiny", input="hello")
        with pytest.raises(openai.BadRequestError, match="no LM head"):
            client.completions.create(model="tiny", prompt="hello", max_tokens=2)
        scored = httpx.post(url + "/score", json={"model": "tiny", "text_1": "a", "text_2": "b"}, timeout=30)
        assert scored.status_code == 400 and "not a cross-encoder" in scored.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(60)
    root = str(served.base_url).removesuffix("/").removesuffix("/v1")
    refused = httpx.post(root + "/classify", json={"model": "tiny", "input": "hello"}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"


def cross_encoder(tmp_path):
    return build_tiny_model(tmp_path / "ce", "qwen3_classifier", seed=3, num_labels=1, id2label={0: "LABEL_0"},
                            label2id={"LABEL_0": 0})


QUERY, DOCUMENTS = "what keeps the cache in blocks", ["Paged attention keeps the KV cache in blocks.", "a fox", "café"]


def hf_cross_scores(folder, query, documents) -> list[float]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(**tokenizer(query, d, return_tensors="pt")).logits[0, 0].sigmoid().item() for d in documents]


def test_a_cross_encoder_scores_each_pair_encoded_together_as_transformers(tmp_path):
    """A classifier of one label (a reranker) scores a pair as vLLM's score task does: the
    pair through it as its tokenizer encodes a text pair, sigmoid; one of more labels does
    not score pairs."""
    folder = cross_encoder(tmp_path)
    got = LLM(str(folder)).score(QUERY, DOCUMENTS)
    assert [o.outputs.score for o in got] == pytest.approx(hf_cross_scores(folder, QUERY, DOCUMENTS), abs=1e-5)
    three = build_tiny_model(tmp_path / "three", "qwen3_classifier", seed=3)
    with pytest.raises(ValueError, match="3 labels does not score pairs"):
        LLM(str(three)).score(QUERY, DOCUMENTS)


def test_llmbus_serve_of_a_cross_encoder_scores_and_reranks(tmp_path):
    folder = cross_encoder(tmp_path)
    want = hf_cross_scores(folder, QUERY, DOCUMENTS)
    proc, url = llmbus_serve(["--model", str(folder), "--served-model-name", "tiny", "--num-kv-blocks", "64"],
                             tmp_path / "serve.log")
    try:
        scores = httpx.post(url + "/score", json={"model": "tiny", "text_1": QUERY, "text_2": DOCUMENTS},
                            timeout=60).json()["data"]
        assert [d["score"] for d in scores] == pytest.approx(want, abs=1e-5)
        ranked = httpx.post(url + "/v1/rerank", json={"model": "tiny", "query": QUERY, "documents": DOCUMENTS,
                                                      "top_n": 2}, timeout=60).json()["results"]
        order = sorted(range(3), key=lambda i: -want[i])[:2]
        assert [r["index"] for r in ranked] == order
        assert [r["relevance_score"] for r in ranked] == pytest.approx([want[i] for i in order], abs=1e-5)
    finally:
        proc.terminate()
        proc.wait(60)
