"""The OpenAI-compatible endpoints, called with the real ``openai`` client against a server on loopback (tiny model):
chat and completions, streaming and not, method parameters in ``extra_body``, the ``fastgate`` extension, ``usage``,
4xx for unsupported fields, and a client disconnecting mid-stream."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import httpx  # noqa: E402

from fastgate.methods import METHODS  # noqa: E402
from fastgate.prompts import closed_book_prompt  # noqa: E402
from fastgate.serving.runtime import Runtime  # noqa: E402
from fastgate.serving.service import AnswerService, ServiceConfig  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Who wrote Hamlet?", "capital of Kyrgyzstan"]
SLOW_SEAKR = {"samples": 8, "step_tokens": 32, "max_steps": 4, "delta": -1e9, "answer_tokens": 64}



@pytest.fixture(scope="module")
def service(tiny_engine, small_index):
    runtime = Runtime("tiny", index=str(small_index), engine=tiny_engine)
    svc = AnswerService(ServiceConfig(method="dtr", params=(("tau", 0.0),), index=str(small_index)), runtime).start()
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def client(service):
    from fastgate.entrypoints.http import create_app
    from fastgate.testing import serve_in_thread

    with serve_in_thread(create_app(service, timeout_s=60, replica="r0")) as port:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)


def _direct(service, method: str, params: dict, question: str):
    """What the service's own method answers for ``question`` (as ``fastgate ask``)."""
    return service._method(service._request(method, params)).answer(question)


def test_models_lists_one_model_per_method_and_the_lm(client):
    models = client.models.list().data
    assert [m.id for m in models] == [f"fastgate-{name}" for name in METHODS] + ["tiny"]
    assert models[-1].model_extra["fastgate"]["method"] is None  # the LM itself: plain completions
    default = [m for m in models if m.model_extra["fastgate"]["default"]]
    assert [m.id for m in default] == ["fastgate-dtr"] and default[0].model_extra["fastgate"]["lm"] == "tiny"


def test_chat_completion_with_extra_body_parameters(client, service):
    q = QUESTIONS[0]
    resp = client.chat.completions.create(
        model="fastgate-dtr", max_tokens=8, temperature=0.7,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}],
        extra_body={"tau": 0.0, "k": 2})
    want = _direct(service, "dtr", {"tau": 0.0, "k": 2, "max_answer_tokens": 8}, q)
    assert resp.object == "chat.completion" and resp.model == "fastgate-dtr" and resp.id.startswith("chatcmpl-")
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == want.answer
    assert resp.choices[0].finish_reason in ("stop", "length")
    ext = resp.model_extra["fastgate"]
    assert ext["retrieved"] is True and ext["method"] == "dtr" and ext["replica"] == "r0"
    assert [p["id"] for p in ext["passages"]] == [h.id for h in want.passages] and len(ext["passages"]) == 2
    assert all(set(p) == {"id", "title", "score"} for p in ext["passages"])
    assert [s["retrieve"] for s in ext["gate_steps"]] == [True] and ext["lm_calls"] == 3
    assert {"total_s", "generation_s", "retrieval_s"} <= set(ext["timings"])
    assert sorted(ext["ignored"]) == ["messages before the last", "temperature"]
    # usage sums every LM call: the closed-book answer, the pseudo-context and the answer from passages
    closed = service.runtime.engine.count_tokens(closed_book_prompt(q))
    assert resp.usage.prompt_tokens == want.prompt_tokens > closed
    assert resp.usage.completion_tokens == want.generated_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completion_usage_is_the_one_lm_call_of_never(client, service):
    q = QUESTIONS[1]
    resp = client.completions.create(model="fastgate-never", prompt=q, max_tokens=6)
    want = _direct(service, "never", {"max_answer_tokens": 6}, q)
    assert resp.object == "text_completion" and resp.choices[0].text == want.answer
    assert resp.model_extra["fastgate"]["retrieved"] is False
    assert resp.usage.prompt_tokens == service.runtime.engine.count_tokens(closed_book_prompt(q))
    assert resp.usage.completion_tokens == want.generated_tokens
    assert resp.choices[0].finish_reason == want.finish_reason


def _collect(stream) -> tuple[str, list[dict], list]:
    """(content, fastgate events, chunks) of a chat or completion stream."""
    content, events, chunks = "", [], list(stream)
    for c in chunks:
        ext = (c.model_extra or {}).get("fastgate")
        if ext is not None:
            events.append(ext)
        for choice in c.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            content += piece or ""
    return content, events, chunks


def test_chat_stream_sends_gate_and_retrieval_then_the_answer_as_decoded(client, service):
    q = QUESTIONS[2]
    kwargs = {"model": "fastgate-dtr", "max_tokens": 12, "messages": [{"role": "user", "content": q}],
              "extra_body": {"tau": 0.0}}
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    content, events, chunks = _collect(stream)
    assert content == whole.choices[0].message.content  # the deltas concatenate to the answer
    kinds = [e["event"] for e in events]
    assert kinds[0] == "gate" and "retrieval" in kinds and kinds[-1] == "done"
    assert events[0]["step"]["retrieve"] is True and events[0]["step"]["gate"] == "answer_nll"
    hits = [e for e in events if e["event"] == "retrieval"][0]["hits"]
    assert hits and all({"id", "title", "score"} <= set(h) for h in hits[0])
    done = events[-1]
    assert done["answer"] == content and done["passages"] == whole.model_extra["fastgate"]["passages"]
    pieces = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1  # sent as decoded, not in one piece
    first_piece = chunks.index(pieces[0])
    assert all(chunks.index(c) < first_piece for c in chunks if (c.model_extra or {}).get("fastgate", {}).get(
        "event") in ("gate", "retrieval"))  # the gate and the retrievals come before the answer
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.parametrize("method,params", [("flare", {"max_sentences": 2, "sentence_tokens": 8, "theta": 0.9}),
                                           ("always", {"k": 1})])
def test_completion_stream_equals_the_non_streamed_answer(client, method, params):
    kwargs = {"model": f"fastgate-{method}", "prompt": QUESTIONS[0], "max_tokens": 8, "extra_body": params}
    whole = client.completions.create(**kwargs)
    content, events, _ = _collect(client.completions.create(stream=True, **kwargs))
    assert content == whole.choices[0].text
    steps = whole.model_extra["fastgate"]["gate_steps"]
    assert [e["step"]["retrieve"] for e in events if e["event"] == "gate"] == [s["retrieve"] for s in steps]
    assert sum(e["event"] == "retrieval" for e in events) == whole.model_extra["fastgate"]["retrieval_calls"]


@pytest.mark.parametrize("extra,param", [
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"stop": ["."]}, "stop"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_unsupported_standard_fields_get_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="fastgate-always", messages=[{"role": "user", "content": "Hamlet?"}],
                                       **extra)
    assert err.value.status_code == 400 and param in err.value.message and err.value.param == param
    assert err.value.body["type"] == "invalid_request_error"


def test_invalid_requests_get_openai_style_errors(client):
    user = [{"role": "user", "content": "Who wrote Hamlet?"}]
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=user)
    assert err.value.code == "model_not_found" and "fastgate-dtr" in err.value.message
    for kwargs, message in [
        ({"messages": user, "extra_body": {"bogus": 1}}, "unknown parameter"),
        ({"messages": user, "extra_body": {"k": 2.5}}, "expects int"),
        ({"messages": user, "extra_body": {"params": {"k": 2}, "k": 3}}, "both"),
        ({"messages": [*user, {"role": "assistant", "content": "Shakespeare"}]}, "last message"),
        ({"messages": [{"role": "user", "content": "  "}]}, "empty"),
        ({"messages": user, "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "text"),
        ({"messages": user, "temperature": 5}, "temperature must be between 0 and 2"),  # accepted with 200 before
        ({"messages": user, "temperature": -1}, "temperature must be between 0 and 2"),
        ({"messages": user, "top_p": 2}, "top_p must be in (0, 1]"),
        ({"messages": user, "max_tokens": 64, "extra_body": {"max_answer_tokens": 2}}, "differ"),  # 64 won silently
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="fastgate-never", **kwargs)
        assert message in err.value.message, (kwargs, err.value.message)
    with pytest.raises(openai.BadRequestError, match="one prompt"):
        client.completions.create(model="fastgate-never", prompt=["a?", "b?"])
    # the service's refusals name the field (param was null): the question's, a method parameter, max_tokens
    for create, kwargs, param in [
            (client.chat.completions.create, {"messages": [{"role": "user", "content": "  "}]}, "messages"),
            (client.completions.create, {"prompt": "x" * 5000}, "prompt"),
            (client.chat.completions.create, {"messages": user, "extra_body": {"bogus": 1}}, "bogus"),
            (client.chat.completions.create, {"messages": user, "extra_body": {"k": 2.5}}, "k")]:
        with pytest.raises(openai.BadRequestError) as err:
            create(model="fastgate-never", **kwargs)
        assert err.value.param == param, (kwargs, err.value.message)
    for path in ("chat/completions", "completions"):  # a body that is not UTF-8: OpenAI's error format, not FastAPI's
        r = httpx.post(f"{client.base_url}{path}", content=b'{"model": "fastgate-never", "prompt": "\xc9\xff"}',
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert "not JSON in UTF-8" in r.json()["error"]["message"]
        # nested 100,000 deep (the JSON parser's RecursionError): the same, not FastAPI's bare {"detail": ...}
        r = httpx.post(f"{client.base_url}{path}", content=b"[" * 100_000 + b"]" * 100_000,
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text[:200]
    r = httpx.post(f"{str(client.base_url)[:-len('v1/')]}v1/answer", content=b"[" * 100_000 + b"]" * 100_000,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 422 and "not JSON" in r.json()["error"], r.text[:200]
    lm = next(m.id for m in client.models.list().data if m.id not in ("fastgate-never", "fastgate-dtr")
              and not m.id.startswith("fastgate-"))
    for path, body in [  # a lone surrogate (valid JSON): 400 in OpenAI's format, not a plain-text 500
        ("chat/completions", {"model": "fastgate-never", "messages": [{"role": "user", "content": "Capital \ud800?"}]}),
        ("chat/completions", {"model": "fastgate-never", "stream": True, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Capital \ud800?"}]}]}),
        ("completions", {"model": "fastgate-dtr", "prompt": "Capital \ud800?"}),
        ("completions", {"model": lm, "prompt": "Capital \ud800?", "max_tokens": 4}),
    ]:
        content = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as the escape \ud800
        r = httpx.post(f"{client.base_url}{path}", content=content, headers={"content-type": "application/json"},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", (path, r.text)
        assert "lone surrogate U+D800" in r.json()["error"]["message"]
    for method, path, status, code in [("get", "no/such/path", 404, "not_found"),
                                       ("post", "embeddings", 404, "not_found"),
                                       ("get", "chat/completions", 405, "method_not_allowed")]:
        r = getattr(httpx, method)(f"{client.base_url}{path}", timeout=30)  # OpenAI's paths: OpenAI's format
        assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    assert "allow" in r.headers  # the 405 says what is
    root = str(client.base_url).removesuffix("v1/")
    assert httpx.get(f"{root}no/such/path", timeout=30).json() == {"detail": "Not Found"}  # elsewhere: FastAPI's
    r = httpx.post(f"{client.base_url}completions", content=b'{"model":', headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] is None  # not the offset as a field name
    assert "not valid JSON at character 9" in r.json()["error"]["message"]
    assert client.models.retrieve("fastgate-dtr").id == "fastgate-dtr"  # the OpenAI client's models.retrieve
    card = client.models.retrieve("fastgate")  # the name the completions take for the default method: 404 before
    assert card.id == "fastgate" and card.model_extra["fastgate"]["method"] == "dtr"
    r = httpx.get(f"{root}v1/answer", timeout=30)  # the native endpoint's format: FastAPI's {"detail"} before
    assert r.status_code == 405 and "POST /v1/answer" in r.json()["error"] and "allow" in r.headers
    with pytest.raises(openai.BadRequestError) as err:  # every error names its code (some had none)
        client.chat.completions.create(model="fastgate-never", messages=[*user, {"role": "assistant", "content": "x"}])
    assert err.value.code == "invalid_value" and err.value.param == "messages"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o")
    assert err.value.code == "model_not_found"


def test_a_client_that_disconnects_mid_stream_cancels_its_program(client, service):
    cancelled, answered = service.metrics.cancelled, service.metrics.answered
    stream = client.chat.completions.create(model="fastgate-seakr", stream=True, extra_body=SLOW_SEAKR,
                                            messages=[{"role": "user", "content": "capital of Kyrgyzstan"}])
    first = next(iter(stream))  # the stream has started: the program runs
    assert first.choices[0].delta.role == "assistant"
    deadline = time.time() + 30
    while not service.live_programs and time.time() < deadline:
        time.sleep(0.02)
    assert service.live_programs == 1
    stream.close()  # the client goes away
    deadline = time.time() + 60
    while service.live_programs and time.time() < deadline:
        time.sleep(0.05)
    assert service.live_programs == 0 and service.scheduler.idle
    assert service.metrics.cancelled == cancelled + 1 and service.metrics.answered == answered  # stopped, not run out
    whole = client.chat.completions.create(model="fastgate-never", messages=[{"role": "user", "content": "Hi?"}])
    assert whole.choices[0].message.content is not None  # still serving
    metrics = httpx.get(str(client.base_url).removesuffix("v1/") + "metrics", timeout=30).text
    assert 'fastgate_requests_total{status="499"}' in metrics  # counted as a non-streamed one is


def test_plain_completions_of_the_lm_return_logprobs_to_the_openai_client(client, service):
    """The LM's own name: the prompt as is, stop strings, greedy at temperature 0, and OpenAI's logprobs."""
    from fastgate.config import GenerationConfig
    from fastgate.prompts import SENTENCE_STOP, cot_prompt

    engine = service.runtime.engine
    prompt = cot_prompt(QUESTIONS[0])
    resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                     stop=list(SENTENCE_STOP), logprobs=3)
    want = engine.generate([prompt], GenerationConfig(max_new_tokens=12, stop=SENTENCE_STOP)).sequences[0]
    choice = resp.choices[0]
    assert choice.text == want.text and choice.finish_reason == ("length" if want.finish_reason == "length"
                                                                 else "stop")
    assert choice.model_extra["stop_reason"] == want.stop_string
    lp = choice.logprobs
    pieces = engine.token_pieces(want.token_ids)
    assert len(lp.tokens) == len(want.token_ids) and lp.token_logprobs == pytest.approx(want.token_logprobs, abs=1e-4)
    for token, piece in zip(lp.tokens, pieces):  # whole UTF-8 as text, partial characters as bytes:\xNN
        assert token == piece.decode() if not token.startswith("bytes:") else token == "bytes:" + "".join(
            f"\\x{b:02x}" for b in piece)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    for top, token, logprob in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs):
        best = max(top, key=top.get)  # greedy: the chosen token is the most likely one
        assert best == token and top[best] == logprob  # the decode loop's own value, from the same logits
    assert resp.usage.completion_tokens == len(want.token_ids) and resp.usage.prompt_tokens == want.prompt_tokens
    one = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                    stop=list(SENTENCE_STOP), logprobs=1).choices[0].logprobs
    assert [list(t) for t in one.top_logprobs] == [[t] for t in one.tokens]  # greedy, one: the chosen token
    sampled = [client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.9, seed=7,
                                         logprobs=0).choices[0] for _ in range(2)]
    assert sampled[0].text == sampled[1].text and sampled[0].logprobs.top_logprobs is None  # seeded: reproducible
    # without a seed each request draws afresh (every unseeded request sampled the same text: seed 0)
    fresh = {client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0).choices[0].text
             for _ in range(4)}
    assert len(fresh) > 1, fresh


def test_fastgate_never_returns_its_answer_logprobs_in_chat_and_completion_format(client, service):
    from fastgate.config import GenerationConfig
    from fastgate.prompts import ANSWER_STOP

    q = QUESTIONS[1]
    engine = service.runtime.engine
    want = engine.generate([closed_book_prompt(q)], GenerationConfig(max_new_tokens=6, stop=ANSWER_STOP)).sequences[0]
    pieces = engine.token_pieces(want.token_ids[:want.answer_tokens])
    chat = client.chat.completions.create(model="fastgate-never", messages=[{"role": "user", "content": q}],
                                          max_tokens=6, logprobs=True, top_logprobs=1)
    content = chat.choices[0].logprobs.content
    assert [bytes(c.bytes) for c in content] == pieces
    assert [c.logprob for c in content] == pytest.approx(want.token_logprobs[:want.answer_tokens], abs=1e-4)
    assert all([t.token for t in c.top_logprobs] == [c.token] for c in content)
    assert b"".join(pieces).decode("utf-8", "replace").strip() == chat.choices[0].message.content
    comp = client.completions.create(model="fastgate-never", prompt=q, max_tokens=6, logprobs=0)
    assert comp.choices[0].logprobs.token_logprobs == pytest.approx([c.logprob for c in content], abs=1e-6)
    text, lp = comp.choices[0].text, comp.choices[0].logprobs  # the offsets index the answer as returned: stripped
    assert lp.text_offset == sorted(lp.text_offset) and 0 <= lp.text_offset[-1] <= len(text)
    for i, (token, offset) in enumerate(zip(lp.tokens, lp.text_offset)):
        clean = b"".join(pieces[:i]).decode("utf-8", "ignore").encode() == b"".join(pieces[:i])
        assert token.startswith("bytes:") or not clean or text[offset:].startswith(token.lstrip()), (text, lp)
    for bad in ({"model": "fastgate-never", "logprobs": 3}, {"model": "fastgate-dtr", "logprobs": 1},
                {"model": "tiny", "logprobs": 6}):
        with pytest.raises(openai.BadRequestError, match="logprobs") as err:
            client.completions.create(prompt=q, max_tokens=4, **bad)
        assert err.value.param == "logprobs"
    with pytest.raises(openai.BadRequestError, match="plain completions"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": q}])


def test_a_stream_whose_program_fails_ends_with_the_errors_own_code(tiny_engine, small_index):
    """The service's own timeout cancels a streamed program: its last event carries code ``timeout`` as the same
    error does outside a stream (it carried none)."""
    from fastgate.entrypoints.http import create_app
    from fastgate.testing import serve_in_thread

    runtime = Runtime("tiny", index=str(small_index), engine=tiny_engine)
    svc = AnswerService(ServiceConfig(method="dtr", index=str(small_index), timeout_s=0.5, no_warmup=True),
                        runtime).start()
    slow = {**SLOW_SEAKR, "samples": 16, "step_tokens": 64, "max_steps": 8, "answer_tokens": 128}
    try:
        with serve_in_thread(create_app(svc, timeout_s=60)) as port:
            body = {"model": "fastgate-seakr", "stream": True, "messages": [{"role": "user", "content": "Kyrgyzstan?"}],
                    **slow}
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60) as r:
                events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "timeout" and error["type"] == "timeout_error", error
    finally:
        svc.stop()


def test_an_error_building_a_response_is_a_counted_500_in_openai_format(client, service, monkeypatch):
    """An error no route maps, raised once the answer is there (here: its usage cannot be built): streamed, the
    stream stopped without an error event or [DONE] (the client read a broken chunked body); not streamed, the client
    got Starlette's plain-text 500 and the connection was dropped; neither was counted in /metrics. Now: the error as
    the stream's last event, then [DONE]; a JSON 500 in OpenAI's format; both counted, the server serving on."""
    import fastgate.entrypoints.http.openai as routes

    def broken(record):
        raise ValueError("no usage")

    base = str(client.base_url).removesuffix("/v1/").removesuffix("/v1")
    body = {"model": "fastgate-never", "messages": [{"role": "user", "content": QUESTIONS[1]}], "max_tokens": 4}

    def errors_500(http) -> float:
        rows = [ln for ln in http.get(f"{base}/metrics").text.splitlines()
                if ln.startswith('fastgate_requests_total{status="500"}')]
        return float(rows[0].split()[-1]) if rows else 0.0

    with httpx.Client(timeout=60) as http:
        before = errors_500(http)
        monkeypatch.setattr(routes, "usage", broken)
        r = http.post(f"{base}/v1/chat/completions", json=body)
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text
        assert "ValueError: no usage" in r.json()["error"]["message"]
        with http.stream("POST", f"{base}/v1/chat/completions",
                         json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
            events = [ln.removeprefix("data: ") for ln in s.iter_lines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "internal_error", events
        monkeypatch.undo()
        assert errors_500(http) == before + 2
        assert http.post(f"{base}/v1/chat/completions", json=body).status_code == 200  # the same connection


def test_completion_logprobs_offsets_count_from_the_stripped_answer():
    from fastgate.entrypoints.http.logprobs import completion_logprobs

    pieces, lps = [b" ", b" Par", b"is", b"\xe2\x82", b"\xac!", b"\xad", b"x"], [-0.1] * 7
    # "  Paris€!\ufffdx": the euro sign split across two tokens counts where it is whole; an invalid byte as one U+FFFD
    assert completion_logprobs(pieces, lps, None)["text_offset"] == [0, 1, 5, 7, 7, 9, 10]
    # as returned stripped ("Paris€!\ufffdx"), the two leading spaces are not in the text
    assert completion_logprobs(pieces, lps, None, stripped=True)["text_offset"] == [0, 0, 3, 5, 5, 7, 8]
