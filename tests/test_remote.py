"""The remote engine (issue 38): fastgate's methods generating through an OpenAI-compatible ``/v1/completions``.

On loopback, with the tiny model: scaar, flare and dtr through a remote engine pointed at a fastgate server of the
same model give the local engine's answers and gate steps; methods that read hidden states refuse the engine; a
server answering 429 is retried, one that hangs times out and fails only its question, one without logprobs is
refused; the CLI and eval records name the engine, and an eval refuses to resume on another engine.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi import Request  # noqa: E402 - module level: the stub's endpoint annotation is resolved from here

from fastgate.engine.remote import RemoteConfig, RemoteEngine, token_bytes  # noqa: E402
from fastgate.errors import InputError, RemoteError  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Who wrote Hamlet?", "capital of Kyrgyzstan"]
# small settings: every question runs in a fraction of a second on the tiny model. SCAAR with one passage: its
# three-passage prompts overflow the tiny model's 512-token context, where a local engine keeps the passages that fit
# (Method.fit_passages) and a remote one sends them all for its server to cut (no tokenizer here)
PARAMS = {
    "scaar": {"max_sentences": 2, "sentence_tokens": 10, "k": 1},
    "flare": {"max_sentences": 2, "sentence_tokens": 10, "theta": 0.3},
    "dtr": {"tau": 0.5, "pseudo_tokens": 12, "max_answer_tokens": 8},
}


@pytest.fixture(scope="module")
def fastgate_server(small_index):
    """A fastgate server of the tiny model (its own engine: the same weights as ``tiny_engine``) on loopback."""
    from fastgate.engine.local import Engine
    from fastgate.entrypoints.http import create_app
    from fastgate.serving.runtime import Runtime
    from fastgate.serving.service import AnswerService, ServiceConfig
    from fastgate.testing import serve_in_thread, tiny_model

    runtime = Runtime("tiny", index=str(small_index), engine=Engine(tiny_model()))
    svc = AnswerService(ServiceConfig(method="never", index=str(small_index)), runtime).start()
    with serve_in_thread(create_app(svc, timeout_s=60)) as port:
        yield f"http://127.0.0.1:{port}/v1"
    svc.stop()


@pytest.fixture(scope="module")
def remote(fastgate_server):
    engine = RemoteEngine(RemoteConfig(fastgate_server, "tiny", concurrency=4)).connect()
    yield engine
    engine.close()


def _run(engine, small_index, method: str, params: dict):
    from fastgate.serving.runtime import Runtime, check_request

    runtime = Runtime("tiny", index=str(small_index), engine=engine)
    return runtime.build(check_request(method, params)).answer_batch(QUESTIONS)


@pytest.mark.parametrize("method", ["scaar", "flare", "dtr"])
def test_black_box_methods_through_a_fastgate_server_equal_the_local_engine(method, tiny_engine, remote,
                                                                           small_index):
    local = _run(tiny_engine, small_index, method, PARAMS[method])
    through = _run(remote, small_index, method, PARAMS[method])
    for a, b in zip(local, through):
        assert b.answer == a.answer
        assert [s.retrieve for s in b.gate_steps] == [s.retrieve for s in a.gate_steps]
        assert [s.score for s in b.gate_steps] == pytest.approx([s.score for s in a.gate_steps], abs=1e-4)
        assert [getattr(s, "query", None) for s in b.gate_steps] == [getattr(s, "query", None) for s in a.gate_steps]
        assert [h.id for h in b.passages] == [h.id for h in a.passages]
        assert (b.lm_calls, b.generated_tokens, b.retrieval_calls) == (a.lm_calls, a.generated_tokens,
                                                                       a.retrieval_calls)
    assert any(s.retrieve for r in local for s in r.gate_steps)  # the comparison covers retrieving paths
    if method != "dtr":
        assert any(not s.retrieve for r in local for s in r.gate_steps) or method == "scaar"


def test_generations_map_back_token_by_token(tiny_engine, remote):
    from fastgate.config import GenerationConfig
    from fastgate.prompts import SENTENCE_STOP, cot_prompt

    prompts = [cot_prompt(q) for q in QUESTIONS]
    for cfg in (GenerationConfig(max_new_tokens=24, stop=SENTENCE_STOP), GenerationConfig(max_new_tokens=6)):
        local, through = tiny_engine.generate(prompts, cfg), remote.generate(prompts, cfg)
        for a, b in zip(local.sequences, through.sequences):
            assert (b.text, b.finish_reason, b.stop_string, b.answer_tokens) == (a.text, a.finish_reason,
                                                                                 a.stop_string, a.answer_tokens)
            assert remote.token_pieces(b.token_ids) == tiny_engine.token_pieces(a.token_ids)  # bytes, even partial
            assert b.token_logprobs == pytest.approx(a.token_logprobs, abs=1e-4)
            assert b.prompt_tokens == a.prompt_tokens


@pytest.mark.parametrize("method", ["probing", "seakr", "cbdr", "read"])
def test_methods_reading_hidden_states_refuse_the_remote_engine(method, small_index):
    from fastgate.methods import build_method
    from fastgate.serving.runtime import check_request

    engine = RemoteEngine(RemoteConfig("http://127.0.0.1:9/v1", "tiny"))  # never contacted
    with pytest.raises(InputError) as err:
        build_method(method, engine, None)
    message = str(err.value)
    assert "\n" not in message and f"method {method} needs the model's hidden states" in message
    assert message.endswith("use one of: never, always, flare, scaar, dtr")
    with pytest.raises(InputError, match="hidden states"):  # the CLI's early check, before any checkpoint lookup
        check_request(method, {}, None, "tiny", remote=engine.name)


def test_top_logprobs_are_refused_before_anything_is_sent():
    from fastgate.config import GenerationConfig

    engine = RemoteEngine(RemoteConfig("http://127.0.0.1:9/v1", "tiny"))  # never contacted
    (out,) = engine.submit_each(["Hi"], [GenerationConfig(top_logprobs=2)])
    assert isinstance(out, InputError) and "gives no top_logprobs" in str(out)


def test_token_strings_and_bytes():
    assert token_bytes("bytes:\\xe2\\x80") == b"\xe2\x80"
    assert token_bytes(" caf\u00e9") == " café".encode()
    assert token_bytes("x", [226, 156]) == b"\xe2\x9c"


# ---------------------------------------------------------------------------------------------- stub servers
def _stub(handler):
    """A loopback server whose POST /v1/completions answers ``await handler(body) -> (status, json, headers)``."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from fastgate.testing import serve_in_thread

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        status, body, headers = await handler(await request.json())
        return JSONResponse(body, status_code=status, headers=headers or {})

    return serve_in_thread(app)


def _answer(text: str = " Paris", logprobs: bool = True) -> dict:
    tokens = [" Par", "is", "\n"]
    lp = {"tokens": tokens, "token_logprobs": [-0.5, -0.25, -0.125], "top_logprobs": None,
          "text_offset": [0, 4, 6]} if logprobs else None
    return {"choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": lp}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}


def _hanging(at_most_s: float):
    """A stub handler answering at once, except prompts holding "HANG": held until the event is set (at most
    ``at_most_s``); the event and the handler."""
    release = threading.Event()

    async def handler(body):
        if "HANG" in body["prompt"]:
            for _ in range(int(at_most_s / 0.05)):
                if release.is_set():
                    break
                await asyncio.sleep(0.05)
        return 200, _answer(), None

    return release, handler


def test_a_server_answering_429_is_retried_after_its_retry_after():
    from fastgate.config import GenerationConfig

    seen = []

    async def handler(body):
        seen.append(body)
        if len(seen) == 1:
            return 429, {"error": {"message": "slow down"}}, {"Retry-After": "0"}
        return 200, _answer(), None

    with _stub(handler) as port:
        engine = RemoteEngine(RemoteConfig(f"http://127.0.0.1:{port}/v1", "stub", max_retries=2))
        batch = engine.generate(["Q: x\nA:"], GenerationConfig(max_new_tokens=4, stop=("\n",)))
    seq = batch.sequences[0]
    assert len(seen) >= 2 and engine.retries == 1
    assert (seq.text, seq.answer_tokens, seq.finish_reason, seq.stop_string) == (" Paris", 2, "stop", "\n")
    assert seq.token_logprobs == [-0.5, -0.25, -0.125] and seq.prompt_tokens == 7
    last = seen[-1]
    assert last["logprobs"] == 1 and last["temperature"] == 0.0 and last["stop"] == ["\n"] and last["max_tokens"] == 4


def test_a_server_that_cannot_do_a_request_is_not_retried_and_bad_prompts_never_reach_it():
    """A 501 was retried as a passing failure (four requests, "answered 501 4 times"); a string as the prompts ran one
    request per character and a float k raised TypeError (the local engine refuses both with InputError)."""
    from fastgate.config import GenerationConfig

    seen = []

    async def handler(body):
        seen.append(body)
        return 501, {"error": {"message": "completions are not implemented"}}, None

    with _stub(handler) as port:
        engine = RemoteEngine(RemoteConfig(f"http://127.0.0.1:{port}/v1", "stub", max_retries=3))
        with pytest.raises(RemoteError, match=r"failed the request \(501\): completions are not implemented"):
            engine.generate(["Q: x\nA:"], GenerationConfig(max_new_tokens=4))
        assert len(seen) == 1 and engine.retries == 0
        for bad, message in [("Q: x\nA:", "a list of prompts, not a string"), ([1], "prompts must be strings")]:
            with pytest.raises(InputError, match=message):
                engine.generate(bad)
        with pytest.raises(InputError, match="k must be an int"):
            engine.generate(["Q: x\nA:"], k=1.0)
        with pytest.raises(InputError, match="config must be a GenerationConfig"):
            engine.generate(["Q: x\nA:"], config="x")
    assert len(seen) == 1  # none of them was sent


def test_a_hanging_server_times_out_and_only_that_question_fails():
    from fastgate.methods import NeverRetrieve
    from fastgate.scheduler import Scheduler

    release, handler = _hanging(5.0)
    with _stub(handler) as port:
        engine = RemoteEngine(RemoteConfig(f"http://127.0.0.1:{port}/v1", "stub", timeout_s=0.5, max_retries=0))
        method = NeverRetrieve(engine, None)
        sched = Scheduler(engine)
        tasks = sched.run([sched.submit(method, q) for q in ("Who wrote Hamlet?", "HANG forever?")])
        release.set()
    ok, hung = tasks
    assert ok.error is None and ok.result.answer == "Paris"
    assert isinstance(hung.error, RemoteError) and "no answer within 0.5 s" in str(hung.error)
    assert "\n" not in str(hung.error)


def test_a_server_without_logprobs_is_refused_with_a_message_saying_so():
    from fastgate.serving.runtime import Runtime

    async def handler(body):
        return 200, _answer(logprobs=False), None

    async def refuses(body):
        return 400, {"error": {"message": "logprobs is not supported"}}, None

    for h in (handler, refuses):
        with _stub(h) as port:
            runtime = Runtime(remote=RemoteConfig(f"http://127.0.0.1:{port}/v1", "stub"))
            with pytest.raises(RemoteError, match="returns no token log-probabilities") as err:
                runtime.engine  # noqa: B018 - connecting checks the server once
        assert "\n" not in str(err.value)


def test_cli_ask_through_the_remote_engine_names_it(fastgate_server, tiny_engine, capsys):
    from fastgate.entrypoints.cli import main
    from fastgate.methods import NeverRetrieve

    argv = ["ask", "--engine", "openai", "--base-url", fastgate_server, "--api-model", "tiny", "--method", "never",
            "--json", "--max-tokens", "6", QUESTIONS[1]]
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["engine"] == f"openai:{fastgate_server}:tiny" and record["model"] == "tiny"
    from fastgate.methods.base import MethodConfig

    local = NeverRetrieve(tiny_engine, None, MethodConfig(max_answer_tokens=6)).answer(QUESTIONS[1])
    assert record["answer"] == local.answer and "dtype" not in record
    # a method that reads hidden states: one line, exit 2, nothing contacted
    assert main(["ask", "--engine", "openai", "--base-url", "http://127.0.0.1:9/v1", "--api-model", "x",
                 "--method", "cbdr", "Hi?"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fastgate: error: method cbdr needs the model's hidden states") and "\n" not in err
    assert main(["ask", "--engine", "openai", "--method", "never", "Hi?"]) == 2
    assert "--base-url" in capsys.readouterr().err


def test_eval_records_name_the_engine_and_refuse_a_resume_on_another(tiny_engine, remote, small_index, tmp_path):
    from fastgate.eval.datasets import QAExample
    from fastgate.eval.runner import ResultsStore, RunSpec, evaluate
    from fastgate.serving.runtime import Runtime

    examples = [QAExample("q1", QUESTIONS[0], ("Paris",)), QAExample("q2", QUESTIONS[1], ("Shakespeare",))]
    run = RunSpec("never", None)
    store = ResultsStore(tmp_path / "results.jsonl")
    # a remote engine's records name no dtype: the local --device (here one this machine may lack) is not read
    through = Runtime("tiny", index=str(small_index), engine=remote, device="cuda:7")
    local = Runtime("tiny", index=str(small_index), engine=tiny_engine)
    evaluate(through, [run], examples[:1], store, progress=False)
    rec = next(iter(store.records.values()))
    assert rec["engine"] == remote.name and "dtype" not in rec
    with pytest.raises(InputError, match="made on the engine openai:"):
        evaluate(local, [run], examples, ResultsStore(store.path), progress=False)
    evaluate(through, [run], examples, ResultsStore(store.path), progress=False)
    assert len(ResultsStore(store.path).records) == 2


def test_calibrate_through_a_server_writes_a_threshold_that_ask_through_it_uses(fastgate_server, small_index,
                                                                                 tmp_path, monkeypatch, capsys,
                                                                                 caplog):
    """Issue 43's acceptance: `fastgate calibrate --method dtr --engine openai ...` against a running `fastgate serve`
    writes a threshold for the served model, and `fastgate ask --engine openai` with that model uses it."""
    import fastgate.assets.models
    import fastgate.methods.calibration as calibration
    from fastgate.entrypoints.cli import main

    def never(*args, **kwargs):
        raise AssertionError("a remote engine loads no local model")

    monkeypatch.setattr(fastgate.assets.models, "load", never)
    monkeypatch.setenv("FASTGATE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(calibration, "_WARNED", set())
    remote = ["--engine", "openai", "--base-url", fastgate_server, "--api-model", "tiny", "--index", str(small_index)]
    ask = ["ask", *remote, "--method", "dtr", "--json", "--param", "max_answer_tokens=6", "--param",
           "pseudo_tokens=8", QUESTIONS[1]]
    with caplog.at_level("WARNING", logger="fastgate.calibration"):  # no entry yet: it says so, once
        assert main(ask) == 0 and main(ask) == 0
    assert [r.getMessage() for r in caplog.records if "no calibration of dtr on model tiny" in r.getMessage()] \
        and len(caplog.records) == 1
    capsys.readouterr()
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answers": [a]}) + "\n" for q, a in (
        ("What is the capital of France?", "Paris"), ("Who wrote Hamlet?", "Shakespeare"),
        ("What is the largest planet?", "Jupiter"), ("capital of Kyrgyzstan", "Bishkek"))))
    assert main(["calibrate", "--method", "dtr", *remote, "--data", str(data), "--n", "4", "--rate", "0.5",
                 "--quiet", "--batch-size", "4", "--param", "max_answer_tokens=6", "--param", "pseudo_tokens=8",
                 "--out", str(tmp_path / "runs")]) == 0
    assert f"for tiny behind {fastgate_server}" in capsys.readouterr().out
    doc = json.loads((tmp_path / "home" / "calibration" / "tiny.json").read_text())
    (entry,) = doc["entries"]
    assert entry["method"] == "dtr" and entry["engine"] == f"openai:{fastgate_server}:tiny" and entry["n"] == 4
    recs = [json.loads(line) for line in (tmp_path / "runs" / "results.jsonl").read_text().splitlines()]
    assert all(r["engine"] == f"openai:{fastgate_server}:tiny" for r in recs)
    tau = entry["params"]["tau"]
    assert main(ask) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["gate_steps"][0]["threshold"] == pytest.approx(tau)
    assert "tau" not in entry.get("when", {})


def test_the_remote_flags_are_generated_from_the_remote_config():
    """One source: every command that takes --engine openai gets RemoteConfig's fields as flags, defaults included."""
    import argparse

    from fastgate.engine.remote import RemoteConfig
    from fastgate.entrypoints.cli import build_parser
    from fastgate.methods.calibration import user_calibration_file

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for command in ("ask", "eval", "serve", "calibrate"):
        flags = {s for a in subs[command]._actions for s in a.option_strings}
        assert {"--engine", "--base-url", "--api-model", "--api-timeout", "--api-concurrency", "--api-retries",
                "--api-key-env", "--api-context"} <= flags, command
    args = parser.parse_args(["calibrate", "--method", "dtr", "--engine", "openai", "--base-url", "http://h:1/v1",
                              "--api-model", "m/x", "--api-retries", "5", "--api-context", "8192"])
    from fastgate.serving.engine_args import remote_config

    config = remote_config(args)
    assert config == RemoteConfig("http://h:1/v1", "m/x", max_retries=5, context_tokens=8192)  # 4096 was fixed
    assert (args.api_timeout_s, args.api_concurrency) == (RemoteConfig.timeout_s, RemoteConfig.concurrency)
    assert user_calibration_file("m/x").name == "m--x.json"


def test_an_html_error_page_becomes_one_line_of_its_text():
    """A server that is not an OpenAI one (an HTML error page) is reported in one line, tags dropped."""
    import httpx

    from fastgate.engine.remote import _message

    page = ("<!DOCTYPE HTML>\n<html lang=\"en\">\n  <head><title>Error response</title></head>\n  <body>\n"
            "    <h1>Error response</h1>\n    <p>Error code: 501</p>\n  </body>\n</html>\n")
    message = _message(httpx.Response(501, text=page))
    assert message == "Error response Error response Error code: 501"
    assert _message(httpx.Response(502, text="")) == "(an empty body)"
    assert _message(httpx.Response(400, json={"error": {"message": "bad model"}})) == "bad model"


def test_a_refused_connection_is_retried_as_a_restart_and_malformed_answers_are_one_error():
    """A server restarting refuses connections (not a 5xx): retried within --api-retries; an answer whose fields
    have other types (tokens that are numbers) is a RemoteError, not an AttributeError's traceback."""
    import socket

    from fastgate.config import GenerationConfig

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = RemoteEngine(RemoteConfig(f"http://127.0.0.1:{port}/v1", "stub", max_retries=2, max_retry_wait_s=0.01))
    with pytest.raises(RemoteError, match="cannot reach the server .ConnectError.*3 attempts"):
        engine.connect()
    assert engine.retries == 2

    async def handler(body):
        bad = _answer()
        bad["choices"][0]["logprobs"]["tokens"] = [1, 2, 3]
        return 200, bad, None

    with _stub(handler) as port:
        engine = RemoteEngine(RemoteConfig(f"http://127.0.0.1:{port}/v1", "stub", max_retries=0))
        with pytest.raises(RemoteError, match="the server's answer is malformed .AttributeError"):
            engine.generate(["Q: x\nA:"], GenerationConfig(max_new_tokens=4))


def test_the_timeout_bounds_the_whole_answer_of_a_server_that_trickles():
    """httpx's timeout bounds each read: a server sending a byte every 0.1 s never reached a 0.5 s limit."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from fastgate.config import GenerationConfig
    from fastgate.testing import serve_in_thread

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions():
        async def trickle():
            for _ in range(60):
                yield b" "
                await asyncio.sleep(0.1)
        return StreamingResponse(trickle(), media_type="application/json")

    with serve_in_thread(app) as port:
        engine = RemoteEngine(RemoteConfig(f"http://127.0.0.1:{port}/v1", "stub", timeout_s=0.5, max_retries=0))
        t0 = __import__("time").perf_counter()
        with pytest.raises(RemoteError, match="no answer within 0.5 s"):
            engine.generate(["Q: x\nA:"], GenerationConfig(max_new_tokens=4))
        assert __import__("time").perf_counter() - t0 < 3


def test_an_eval_goes_on_past_a_question_the_server_fails_and_a_rerun_retries_it(small_index, tmp_path):
    from fastgate.eval.datasets import QAExample
    from fastgate.eval.runner import ResultsStore, RunSpec, evaluate
    from fastgate.serving.runtime import Runtime

    fail, seen = {"on": True, "down": False}, []

    async def handler(body):
        seen.append(body)
        if fail["down"] or fail["on"] and "Kyrgyzstan" in body["prompt"]:
            return 500, {"error": {"message": "boom"}}, None
        return 200, _answer(), None

    examples = [QAExample(f"q{i}", q, ("Paris",)) for i, q in
                enumerate(["capital of France?", "capital of Kyrgyzstan?", "Who wrote Hamlet?"])]
    with _stub(handler) as port:
        config = RemoteConfig(f"http://127.0.0.1:{port}/v1", "stub", max_retries=0)
        runtime = Runtime("stub", index=str(small_index), remote=config)
        store = ResultsStore(tmp_path / "results.jsonl")
        runs = [RunSpec("never", None), RunSpec("always", "bm25")]
        with pytest.raises(RemoteError, match=r"2 runs \(never, always\) have questions .* q1: .*rerun"):
            evaluate(runtime, runs, examples, store, batch_size=2, progress=False)
        # the others recorded, the failed one not; the later run went on (it never started before; its prompts hold
        # passages, which may name Kyrgyzstan too)
        assert sorted(qid for key, qid in store.records if key == "never") == ["q0", "q2"]
        assert ("always", "q2") in store.records and ("always", "q1") not in store.records
        fail["on"] = False
        evaluate(runtime, runs, examples, ResultsStore(store.path), batch_size=2, progress=False)
        assert len(ResultsStore(store.path).records) == 6
        fail["down"], seen[:] = True, []  # the server fails everything: a run none of whose questions got an
        with pytest.raises(RemoteError, match="3 of 3 questions of never"):  # answer ends the evaluation there
            evaluate(runtime, runs, examples, ResultsStore(tmp_path / "down.jsonl"), batch_size=2, progress=False)
        assert seen and not any("passages" in body["prompt"].lower() for body in seen)  # always not tried


def test_a_server_on_a_remote_engine_lists_the_methods_it_runs_and_names_its_engine(fastgate_server, small_index):
    from fastapi.testclient import TestClient

    from fastgate.entrypoints.http import create_app
    from fastgate.methods import METHODS
    from fastgate.serving.runtime import Runtime
    from fastgate.serving.service import AnswerService, ServiceConfig

    config = RemoteConfig(fastgate_server, "tiny")
    front = AnswerService(ServiceConfig(method="never", index=str(small_index), remote=config),
                          Runtime("tiny", index=str(small_index), remote=config)).start()
    try:
        with TestClient(create_app(front)) as client:
            ids = {m["id"] for m in client.get("/v1/models").json()["data"]}
            assert ids == {f"fastgate-{name}" for name, cls in METHODS.items() if cls.black_box}  # no probing...
            body = client.post("/v1/answer", json={"question": "Who wrote Hamlet?"}).json()
            assert body["engine"] == f"openai:{fastgate_server}:tiny", body  # FastAPI's response model dropped it
    finally:
        front.stop()


def test_a_failing_upstream_is_a_502_and_a_string_is_not_a_list_of_prompts(tiny_engine):
    from fastgate.entrypoints.http.errors import ErrorMap

    err = ErrorMap(60, lambda status: None).error(RemoteError("stub: the server answered 500 4 times"), openai=True)
    assert (err.status, err.code) == (502, "upstream_error")  # not 500 "internal error": this server is fine
    with pytest.raises(InputError, match="a list of prompts, not a string"):
        tiny_engine.generate("Q: hi\nA:")  # ran as 8 one-character prompts


def test_eval_all_on_a_remote_engine_runs_the_methods_it_can(capsys, tmp_path):
    """--all named every method and the run was refused for the ones reading hidden states."""
    import socket

    from fastgate.entrypoints.cli import main

    with socket.socket() as s:  # nothing listens: the run stops at its first question, after the runs were chosen
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = main(["eval", "--all", "--engine", "openai", "--base-url", f"http://127.0.0.1:{port}/v1", "--api-model",
                 "x", "--api-retries", "0", "--n", "1", "--data", "capitals", "--out", str(tmp_path / "e"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot reach the server" in err, err
    assert "--all on a remote engine: never, always, flare, dtr, scaar" in err and "evaluating 5 run(s)" in err


def test_a_request_the_server_is_slow_to_answer_holds_no_other_question():
    """The scheduler keeps a remote request in flight across ticks: a question asked after a hanging one is answered
    while the hanging one still waits (the tick waited for every request of its call, and the later ticks with it)."""
    from fastgate.methods import NeverRetrieve
    from fastgate.scheduler import Scheduler

    release, handler = _hanging(10.0)
    with _stub(handler) as port:
        engine = RemoteEngine(RemoteConfig(f"http://127.0.0.1:{port}/v1", "stub", timeout_s=30, max_retries=0))
        method = NeverRetrieve(engine, None)
        sched = Scheduler(engine)
        hung = sched.submit(method, "HANG for a while?")
        sched.step()  # its request is in flight
        ok = sched.submit(method, "Who wrote Hamlet?")
        for _ in range(2000):  # ticks of at most 10 ms each while nothing is answered
            if ok.done:
                break
            sched.step()
        assert ok.done and ok.error is None and ok.result.answer == "Paris"
        assert not hung.done  # still in flight: it held nothing
        release.set()
        while not hung.done:
            sched.step()
    assert hung.error is None and hung.result.answer == "Paris" and not sched._live
    assert not sched.batching._inflight  # nothing left behind


def test_the_request_pool_runs_calls_on_daemon_threads_and_cancels_the_queued_ones():
    """Daemon threads: an interrupted `fastgate eval` exits without waiting for requests in flight (Python joined
    ThreadPoolExecutor's threads at exit, up to --api-timeout: 21 s against 2.6 s by hand)."""
    from fastgate.engine.remote import _DaemonPool

    pool = _DaemonPool(1, "test-pool")
    gate = threading.Event()
    first = pool.submit(gate.wait, 10)
    queued = [pool.submit(lambda x: x * 2, i) for i in range(3)]
    failing = pool.submit(int, "not a number")
    assert all(t.daemon for t in pool._threads) and queued[0].cancel()  # still queued behind the first
    gate.set()
    assert first.result(5) is True and [f.result(5) for f in queued[1:]] == [2, 4]
    with pytest.raises(ValueError):
        failing.result(5)
    gate.clear()
    pool.submit(gate.wait, 10)
    left = pool.submit(lambda: 1)
    pool.shutdown(wait=False, cancel_futures=True)
    assert left.cancelled()
    gate.set()
    for t in pool._threads:
        t.join(5)
    assert not any(t.is_alive() for t in pool._threads)


@pytest.mark.parametrize("change,message", [
    ({"text": " Paris is nice"}, "log-probs for 7 of the answer's 14 bytes"),  # tokens for part of the text
    ({"tokens": [], "token_logprobs": []}, "log-probs for 0 of the answer's 6 bytes"),
    ({"token_logprobs": [float("nan"), -0.25, -0.125]}, "token log-prob of nan"),
    ({"token_logprobs": [-float("inf"), -0.25, -0.125]}, "token log-prob of -inf"),
    ({"token_logprobs": [0.7, -0.25, -0.125]}, "token log-prob of 0.7"),
])
def test_log_probs_that_cannot_be_the_answers_are_refused(change, message):
    """Log-probs of part of the text, or values no probability has, went into the gates: DTR's score inf (always
    retrieving) or NaN (never). (Parsed directly: a JSON server cannot send NaN.)"""
    engine = RemoteEngine(RemoteConfig("http://127.0.0.1:9/v1", "stub", max_retries=0))
    out = _answer(change.get("text", " Paris"))
    out["choices"][0]["logprobs"].update({k: v for k, v in change.items() if k != "text"})
    with pytest.raises(RemoteError, match=message):
        engine._parse(out, "Q: x\nA:", None)
    engine._parse(_answer(), "Q: x\nA:", None)  # the unchanged answer parses


def test_a_server_that_drops_the_stop_token_with_text_before_it_is_taken():
    """llama-server drops the log-probs of the token that held the stop string: Qwen's ".\\n" is one token, so
    " Paris." comes with log-probs for " Paris" only. Taken when the server stopped on a stop string asked for."""
    from fastgate.config import GenerationConfig

    engine = RemoteEngine(RemoteConfig("http://127.0.0.1:9/v1", "stub", max_retries=0))
    out = _answer(" Paris.")
    out["choices"][0]["logprobs"].update({"tokens": [" Paris"], "token_logprobs": [-0.5]})
    gen = engine._parse(out, "Q: x\\nA:", GenerationConfig(max_new_tokens=4, stop=("\\n",)))
    assert gen.text == " Paris."
    with pytest.raises(RemoteError, match="log-probs for 6 of the answer's 7 bytes"):
        engine._parse(out, "Q: x\\nA:", GenerationConfig(max_new_tokens=4))  # no stop string asked: refused


@pytest.mark.parametrize(("command", "local"), [
    ("ask", ["--model", "qwen2.5-0.5b", "--dtype", "float32", "--weights", "int8", "--step", "compiled", "--device",
             "cuda"]),
    ("ask", ["--device", "cuda"]),  # accepted without CUDA: nothing reads it on a remote engine
    ("eval", ["--step", "compiled"]),
    ("serve", ["--model", "qwen2.5-0.5b"]),
    ("calibrate", ["--weights", "int4"]),
])
def test_a_local_model_flag_with_the_remote_engine_is_refused_before_anything_is_contacted(command, local, capsys,
                                                                                           monkeypatch):
    """``--engine openai`` loads no model: ``--model / --device / --dtype / --step / --weights`` were dropped without a
    word (rc 0). Refused in one line naming them, before the server (here: nothing listening) is contacted."""
    import fastgate.engine.remote
    from fastgate.entrypoints.cli import main

    def never(*args, **kwargs):
        raise AssertionError("the server was contacted")

    monkeypatch.setattr(fastgate.engine.remote.RemoteEngine, "connect", never)
    remote = ["--engine", "openai", "--base-url", "http://127.0.0.1:9/v1", "--api-model", "m"]
    extra = {"ask": ["--method", "never", "Hi?"], "eval": ["--method", "never", "--data", "capitals", "--n", "1"],
             "serve": ["--method", "never"], "calibrate": ["--method", "dtr"]}[command]
    assert main([command, *remote, *local, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fastgate: error: --engine openai loads no local model") and "\n" not in err, err
    named = [f"{flag} {value}" for flag, value in zip(local[::2], local[1::2])]
    assert all(n in err for n in named), err


def test_the_local_model_flags_default_to_the_runtime_config_in_every_command():
    """The remote engine's check reads RuntimeConfig's defaults: every command declaring a local model's flag must
    default it alike (else an untouched flag would be refused)."""
    import argparse
    import dataclasses

    from fastgate.entrypoints.cli import build_parser
    from fastgate.serving.engine_args import LOCAL_SETTINGS, remote_config
    from fastgate.serving.runtime import RuntimeConfig

    defaults = {f.name: f.default for f in dataclasses.fields(RuntimeConfig)}
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for command in ("ask", "eval", "serve", "calibrate"):
        for action in subs[command]._actions:
            if action.dest in LOCAL_SETTINGS:
                assert action.default == defaults[action.dest], (command, action.dest)
    args = parser.parse_args(["ask", "--engine", "openai", "--base-url", "http://h:1/v1", "--api-model", "m", "Hi?"])
    assert remote_config(args) is not None  # untouched local flags: accepted
