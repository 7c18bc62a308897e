"""One source for every setting: the service's and the scheduler's configs own their defaults and validation, the
CLI's flags are made from their fields, and a request's method config is built once."""

from __future__ import annotations

import dataclasses

import pytest

from fastgate.errors import InputError
from fastgate.scheduler import WHOLE_PROMPTS, Scheduler, SchedulerConfig
from fastgate.serving.service import AnswerService, ServiceConfig


def test_the_service_keeps_its_serving_defaults_and_the_library_scheduler_its_own():
    lib, served = SchedulerConfig(), ServiceConfig().scheduler_config()
    assert (lib.admit_every, lib.prefill_budget, lib.kv_budget) == (8, WHOLE_PROMPTS, None)  # batch throughput
    assert (served.admit_every, served.prefill_budget, served.kv_budget) == (1, 512, 2048 * 2**20)
    for name in ("max_rows", "continuous", "layout", "prefill_order"):  # the rest: one default, the scheduler's
        assert getattr(served, name) == getattr(lib, name), name


@pytest.mark.parametrize(("fields", "message"), [
    ({"layout": "sideways"}, "layout must be auto, packed or padded"),
    ({"prefill_order": "sideways"}, "prefill_order must be program or arrival"),
    ({"max_rows": 0}, "max_rows must be >= 1"),
    ({"admit_every": 0}, "admit_every must be >= 1"),
    ({"prefill_budget": -1}, "prefill_budget must be >= 0"),
])
def test_the_scheduler_settings_are_checked_once_for_both_configs(fields, message):
    with pytest.raises(InputError, match=message):
        SchedulerConfig(**fields)
    with pytest.raises(InputError, match=message):
        ServiceConfig(**fields)


def test_a_scheduler_takes_its_config_or_keyword_settings(tiny_engine):
    config = SchedulerConfig(max_rows=4, prefill_budget=8, layout="padded")
    sched = Scheduler(tiny_engine, config)
    assert sched.config is config and sched.max_rows == 4 and sched.layout == "padded"
    assert Scheduler(tiny_engine, config, max_rows=2).config == dataclasses.replace(config, max_rows=2)
    assert Scheduler(tiny_engine, prefill_budget=None).prefill_budget == WHOLE_PROMPTS  # earlier versions' None
    with pytest.raises(TypeError):
        Scheduler(tiny_engine, no_such_setting=1)


def test_serve_flags_are_the_service_fields_with_their_defaults():
    from fastgate.entrypoints.cli import SERVE_SETTINGS, build_parser

    args = build_parser().parse_args(["serve"])
    assert ServiceConfig(**{name: getattr(args, name) for name in SERVE_SETTINGS}) == ServiceConfig()
    args = build_parser().parse_args(["serve", "--timeout", "5", "--prefill-budget", "0", "--layout", "padded"])
    assert (args.timeout_s, args.prefill_budget, args.layout) == (5.0, 0, "padded")


def test_help_lines_name_every_method_and_model():
    from fastgate.assets.models import MODELS
    from fastgate.entrypoints.cli import build_parser
    from fastgate.methods import METHODS

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    ask = sub["ask"].format_help()
    assert " | ".join(METHODS) in " ".join(ask.split())
    assert all(name in ask for name in MODELS)


@pytest.mark.parametrize(("method", "params"), [("never", {"max_answer_tokens": 5}), ("dtr", {"tau": 0.5})])
def test_one_request_builds_its_method_config_once(tiny_engine, small_index, monkeypatch, method, params):
    """Validation, the question check, the integer-parameter limit and the method's construction share one config."""
    import fastgate.methods
    from fastgate.serving.runtime import Runtime

    runtime = Runtime("tiny", index=str(small_index), engine=tiny_engine)
    svc = AnswerService(ServiceConfig(method="dtr", params=(("tau", 0.0),), index=str(small_index)), runtime).start()
    try:
        calls = []
        make_config = fastgate.methods.make_config

        def counted(*args, **kwargs):
            calls.append(args[0])
            return make_config(*args, **kwargs)

        monkeypatch.setattr(fastgate.methods, "make_config", counted)
        record = svc.submit("Who wrote Hamlet?", method=method, params=params).result(timeout=120)
        assert record["method"] == method
        assert calls == [method]
        svc.submit("Who wrote Hamlet?", method=method, params=params).result(timeout=120)
        assert calls == [method]  # the same parameters again: the validated request is reused
    finally:
        svc.stop()
