"""Scale-out on Ray Serve: a local Ray with 2 replicas of the tiny model behind Ray Serve's HTTP proxy on loopback.
Concurrent requests are spread over both replicas and answered as in one process; a replica killed mid-load is
replaced, no request hangs, and the service recovers. Bounded: every request has a client timeout and every wait a
deadline."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from fastgate.testing import free_port

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytest.importorskip("ray.serve")

pytestmark = pytest.mark.ray

QUESTIONS = ["What is the capital of France?", "Who wrote Hamlet?", "capital of Kyrgyzstan", "largest planet",
             "When was the Eiffel Tower completed?", "capital of Germany"]
PARAMS = (("tau", 0.0),)  # DTR always retrieves: every request runs three generations and a dense search


_SERVE = """
import functools, sys
from fastgate.entrypoints.ray_serve import RayServeConfig, serve_ray
from fastgate.serving.service import ServiceConfig
from fastgate.testing import tiny_runtime

index, port = sys.argv[1], int(sys.argv[2])
serve_ray(ServiceConfig(method="never", index=index), RayServeConfig(replicas=1, num_cpus=1, port=port),
          runtime_factory=functools.partial(tiny_runtime, index))
print("serve_ray returned", flush=True)
"""


def test_sigterm_to_the_process_group_exits_promptly(small_index, tmp_path):
    """``timeout``, ``systemctl stop`` and ``kill -- -PGID`` signal the local Ray's GCS and raylet with the server:
    the clean-up must see the cluster is gone rather than wait 60 s for the GCS and die with rc 1. First in this
    module: its own local Ray, before the module's fixture starts one in this process."""
    import httpx

    port = free_port()
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", _SERVE, str(small_index), str(port)], stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.time() + 180
        while "is ready at" not in log.read_text():  # serve.run has returned: the SIGTERM handler is set
            assert proc.poll() is None and time.time() < deadline, log.read_text()
            time.sleep(0.5)
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=30).status_code == 200
        time.sleep(1.0)
        started = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=60)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert rc == 0 and "serve_ray returned" in text, text
    assert took < 15, (took, text)
    assert "Failed to connect to GCS" not in text and "already gone" in text


@pytest.fixture(scope="module")
def ray_url(small_index):
    import ray
    from ray import serve

    from fastgate.entrypoints.ray_serve import RayServeConfig, build_app
    from fastgate.serving.service import ServiceConfig
    from fastgate.testing import tiny_runtime

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = ServiceConfig(method="dtr", params=PARAMS, index=str(small_index))
        app = build_app(config, RayServeConfig(replicas=2, num_cpus=1, health_check_period_s=1.0),
                        runtime_factory=functools.partial(tiny_runtime, str(small_index)), timeout_s=60)
        serve.run(app, name="fastgate", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def single_process_answers(tiny_engine, small_index):
    from fastgate.serving.runtime import Runtime
    from fastgate.serving.service import AnswerService, ServiceConfig

    svc = AnswerService(ServiceConfig(method="dtr", params=PARAMS, index=str(small_index)),
                        Runtime("tiny", index=str(small_index), engine=tiny_engine))
    return {r.question: r.answer for r in svc._method(svc._request(None, None)).answer_batch(QUESTIONS)}


def _ask(client, question: str) -> tuple[str, str]:
    resp = client.chat.completions.create(model="fastgate-dtr", messages=[{"role": "user", "content": question}])
    return resp.choices[0].message.content, resp.model_extra["fastgate"]["replica"]


def _client(url: str, timeout: float = 120):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)


def test_concurrent_requests_are_spread_over_both_replicas_and_answered_as_in_one_process(ray_url,
                                                                                         single_process_answers):
    client = _client(ray_url)
    replicas: set[str] = set()
    with ThreadPoolExecutor(6) as pool:
        for _ in range(4):  # rounds of 6 concurrent requests until both replicas have answered (bounded)
            results = list(pool.map(lambda q: (q, *_ask(client, q)), QUESTIONS))
            for question, answer, replica in results:
                assert answer == single_process_answers[question], (question, replica)
                replicas.add(replica)
            if len(replicas) == 2:
                break
    assert len(replicas) == 2, replicas


def test_a_killed_replica_is_replaced_and_no_request_hangs(ray_url, single_process_answers):
    import httpx

    client = _client(ray_url, timeout=90)  # a request that hung would fail the test with APITimeoutError
    seen: dict[str, int] = {}
    deadline = time.time() + 60
    while len(seen) < 2 and time.time() < deadline:
        health = httpx.get(f"{ray_url}/healthz", timeout=30).json()
        seen[health["replica"]] = health["pid"]
    assert len(seen) == 2
    victim, pid = sorted(seen.items())[0]

    def ask(q: str):
        try:
            return _ask(client, q)
        except openai.APIStatusError as exc:  # the requests that were on the killed replica: an error, not a hang
            return exc.status_code
        except openai.APIConnectionError as exc:
            if isinstance(exc, openai.APITimeoutError):
                raise
            return "connection"

    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(ask, q) for q in QUESTIONS * 2]
        time.sleep(0.5)  # mid-load: the requests are in flight on both replicas
        os.kill(pid, signal.SIGKILL)
        outcomes = [f.result(timeout=120) for f in futures]
    answered = [(q, o) for q, o in zip(QUESTIONS * 2, outcomes) if isinstance(o, tuple)]
    assert answered, outcomes  # the surviving replica went on answering
    assert all(answer == single_process_answers[q] for q, (answer, _) in answered)
    # recovery: Ray starts a new replica; both replicas answer again, and nothing from the killed one
    replicas: set[str] = set()
    deadline = time.time() + 120
    while len(replicas) < 2 and time.time() < deadline:
        try:
            answer, replica = _ask(client, QUESTIONS[0])
        except (openai.APIStatusError, openai.APIConnectionError):
            time.sleep(0.5)
            continue
        assert answer == single_process_answers[QUESTIONS[0]]
        replicas.add(replica)
    assert len(replicas) == 2 and victim not in replicas, (replicas, victim)
