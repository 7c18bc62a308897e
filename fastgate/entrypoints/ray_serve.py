"""Scale-out on Ray Serve (``pip install 'fastgate[ray]'``): ``fastgate serve --ray --replicas N`` runs N engine
replicas behind Ray Serve's HTTP proxy, with the same endpoints as ``fastgate serve`` (``/v1/answer``, the
OpenAI-compatible ones, ``/healthz``, ``/metrics``).

Each replica is a Ray actor that loads the model, opens the read-only indexes and runs its own
:class:`~fastgate.serving.service.AnswerService` (one scheduler batching that replica's requests) behind the FastAPI
app of :func:`fastgate.entrypoints.http.create_app`, mounted with ``@serve.ingress``. Ray Serve's proxy spreads requests
over the replicas, at most ``max_ongoing_requests`` at a time on each (default: the service's ``max_live``, so requests
wait in Ray's router, which sends them to the least loaded replica, rather than in one replica's queue; beyond
``max_queue`` waiting there Ray answers 503). Ray checks every replica's health (``check_health``: its scheduler thread
is alive) and replaces a replica whose actor dies; a request that was on it gets an error from the proxy (5xx) or a
retry, never a hang, and the others are served by the remaining replicas meanwhile. Responses name their replica in
``fastgate.replica`` and ``/healthz``.

On one machine ``fastgate serve --ray`` starts a local Ray; on a cluster, start Ray first (``ray start --head`` on one
machine, ``ray start --address=HEAD:6379`` on the others, fastgate installed on all of them) and pass
``--address auto`` on the head: replicas are then placed on any node with a free CPU (``--num-cpus`` each).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastgate.entrypoints import DEFAULT_HOST, DEFAULT_PORT, LOG_LEVELS
from fastgate.errors import InputError, MissingDependencyError
from fastgate.serving.service import AnswerService, ServiceConfig

__all__ = ["FastgateReplica", "RayServeConfig", "build_app", "serve_ray"]


@dataclass(frozen=True)
class RayServeConfig:
    """How ``fastgate serve --ray`` deploys the replicas."""

    replicas: int = 2  # engine replicas; each holds a model and its own KV cache
    address: str | None = None  # None: start a local Ray; "auto" or HOST:PORT: join a cluster started by `ray start`
    host: str = DEFAULT_HOST  # where Ray Serve's HTTP proxy listens (loopback unless asked)
    port: int = DEFAULT_PORT  # the proxy's port
    num_cpus: float = 1.0  # CPUs Ray reserves per replica (Ray also sets its torch threads to this)
    max_ongoing_requests: int | None = None  # per replica; None: the service's max_live (its batch)
    health_check_period_s: float = 5.0  # a replica whose scheduler died is found within this and replaced
    health_check_timeout_s: float = 30.0  # a check blocked this long (a stuck replica) counts as failed
    app_name: str = "fastgate"  # the Ray Serve application name
    log_level: str = "info"  # the proxy's and replicas' log level (uvicorn's names, as `fastgate serve --log-level`)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise InputError(f"replicas must be >= 1, got {self.replicas}")
        if not self.num_cpus > 0:
            raise InputError(f"num_cpus must be > 0, got {self.num_cpus}")
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise InputError("max_ongoing_requests must be >= 1")
        if not 0 < self.port < 65536:
            raise InputError(f"port must be in 1..65535, got {self.port}")
        if self.log_level not in LOG_LEVELS:
            raise InputError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")

    @property
    def logging_config(self) -> dict[str, str]:
        """Ray Serve's ``LoggingConfig`` for :attr:`log_level` (Python's level names; uvicorn's ``trace`` is below
        ``debug``, which is Python's lowest)."""
        return {"log_level": LOG_LEVELS[self.log_level]}


def _ray():
    try:
        import ray
        from ray import serve
    except ImportError:  # an ImportError too: `except ImportError` around it sees it
        raise MissingDependencyError("ray[serve]", "scale-out on Ray Serve: pip install 'fastgate[ray]'") from None
    return ray, serve


class FastgateReplica:
    """One Ray Serve replica: an :class:`AnswerService` (model, indexes, scheduler) and its FastAPI app.

    Args:
        config: the service settings (model, index, method, limits), the same for every replica.
        runtime_factory: builds the replica's :class:`~fastgate.serving.runtime.Runtime` (tests pass one building the
        tiny
            model); None: built from ``config``. Must be picklable by reference (a module-level function or a
            ``functools.partial`` of one), as Ray ships it to the replica's process.
        timeout_s: the request timeout (default: ``config.timeout_s``).
    """

    def __init__(self, config: ServiceConfig, runtime_factory: Callable[[], Any] | None = None,
                 timeout_s: float | None = None) -> None:
        from ray import serve

        runtime = runtime_factory() if runtime_factory is not None else None
        self.service = AnswerService(config, runtime).start()  # loads the model and the default method now
        self.timeout_s = timeout_s
        context = serve.get_replica_context()
        self.replica = f"{context.replica_id.unique_id}@{os.getpid()}"

    def __serve_build_asgi_app__(self):
        """Called by Ray Serve after ``__init__``: the app is built on the replica's own service."""
        from fastgate.entrypoints.http import create_app

        return create_app(self.service, self.timeout_s, replica=self.replica)

    def check_health(self) -> None:
        """Ray's periodic health check: a replica whose scheduler thread has died is replaced."""
        if not self.service.running:
            raise RuntimeError("the fastgate scheduler thread is not running")

    def __del__(self) -> None:
        service = getattr(self, "service", None)
        if service is not None:
            service.stop(drain=False)


def build_app(config: ServiceConfig, ray_config: RayServeConfig | None = None,
              runtime_factory: Callable[[], Any] | None = None, timeout_s: float | None = None):
    """The Ray Serve application: ``ray_config.replicas`` replicas of :class:`FastgateReplica`."""
    _, serve = _ray()
    rc = ray_config or RayServeConfig()
    ingress = serve.ingress()(FastgateReplica)  # the app is late-bound: __serve_build_asgi_app__
    deployment = serve.deployment(
        ingress, name="fastgate", num_replicas=rc.replicas,
        max_ongoing_requests=rc.max_ongoing_requests or config.max_live,
        max_queued_requests=config.max_queue,  # beyond it Ray answers 503, like one server's full queue
        ray_actor_options={"num_cpus": rc.num_cpus},
        health_check_period_s=rc.health_check_period_s, health_check_timeout_s=rc.health_check_timeout_s,
        logging_config=rc.logging_config)
    return deployment.bind(config, runtime_factory, timeout_s)


def serve_ray(config: ServiceConfig, ray_config: RayServeConfig | None = None, timeout_s: float | None = None,
              runtime_factory: Callable[[], Any] | None = None, block: bool = True) -> None:
    """Deploy the replicas on Ray Serve and, with ``block``, serve until interrupted (Ctrl-C or SIGTERM), then shut
    Serve down (and the local Ray, if this call started it)."""
    ray, serve = _ray()
    rc = ray_config or RayServeConfig()
    started = not ray.is_initialized()
    if started:
        ray.init(address=rc.address, include_dashboard=False, log_to_driver=False)
    # cluster-wide: ignored if Serve already runs
    serve.start(http_options={"host": rc.host, "port": rc.port}, logging_config=rc.logging_config)
    serve.run(build_app(config, rc, runtime_factory, timeout_s), name=rc.app_name, route_prefix="/",
              logging_config=rc.logging_config)
    if not block:
        return
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):  # a timed wait: Ctrl-C is handled between waits
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        # SIGTERM may have gone to the whole process group, the local Ray's GCS included: give it time to go. Ctrl-C
        # does not reach Ray's processes (they block SIGINT)
        _shut_down(ray, serve, rc.app_name, started, settle_s=SIGTERM_SETTLE_S if stop.is_set() else 0.0)


SHUTDOWN_TIMEOUT_S = 30.0  # the most the Serve clean-up may take before the process goes on exiting without it
SIGTERM_SETTLE_S = 2.0  # after SIGTERM: how long a GCS that still accepts connections is watched for going away


def _gcs_reachable(ray, settle_s: float = 0.0) -> bool:
    """Whether the Ray cluster's GCS still accepts TCP connections (a plain socket, not Ray's own client), tried
    every 0.1 s for ``settle_s``: False as soon as one is refused.

    ``SIGTERM`` to the server's process group (``timeout``, ``systemctl stop``, ``kill -- -PGID``) reaches the local
    Ray's GCS and raylet too: they are in that group. Any Ray call after that (``serve.delete``: the controller's
    handle is looked up in the GCS) waits 60 s for the GCS to come back, then Ray kills the process (rc 1,
    "Failed to connect to GCS within 60 seconds"). A socket connect tells the GCS is gone at once; but this process
    may handle the signal before the GCS has exited (it took 7-35 ms here), hence the settling time."""
    try:
        host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
        address = (host.strip("[]"), int(port))
    except (ValueError, RuntimeError):  # a malformed address, Ray not connected
        return False
    deadline = time.monotonic() + settle_s
    while True:
        try:
            with socket.create_connection(address, timeout=1.0):
                pass
        except OSError:  # refused or unreachable
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.1)


def _shut_down(ray, serve, app_name: str, started: bool, settle_s: float = 0.0) -> None:
    """Delete the app (and Serve and the local Ray, if this process started Ray), within bounded time.

    With the cluster gone (see :func:`_gcs_reachable`, given ``settle_s``) there is nothing left to delete: only
    the driver is disconnected. Otherwise Serve's clean-up runs in a daemon thread given :data:`SHUTDOWN_TIMEOUT_S`:
    a cluster that dies midway must not hold the exit for Ray's 60 s reconnection wait."""
    if _gcs_reachable(ray, settle_s):
        def clean_up() -> None:
            try:
                serve.delete(app_name)
                if started:
                    serve.shutdown()
            except Exception as exc:  # noqa: BLE001 - a cluster dying under the clean-up: nothing left to delete
                print(f"fastgate: Ray Serve clean-up failed ({type(exc).__name__}: {exc})", file=sys.stderr)

        worker = threading.Thread(target=clean_up, name="fastgate-ray-shutdown", daemon=True)
        worker.start()
        worker.join(SHUTDOWN_TIMEOUT_S)
        if worker.is_alive():
            print(f"fastgate: Ray Serve did not shut down within {SHUTDOWN_TIMEOUT_S:.0f} s; exiting without it",
                  file=sys.stderr)
    else:
        print("fastgate: the Ray cluster is already gone (its processes were stopped too); exiting",
              file=sys.stderr, flush=True)
    if started:
        ray.shutdown()
