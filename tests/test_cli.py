"""CLI errors: one clear line on stderr, exit status 2, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fastgate.entrypoints.cli import main


def run_main(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["ask", "   "], "the question is empty"),
        (["ask", "Who?", " "], "question 2 of 2 is empty"),  # of several: which one
        (["ask", "Who?", "--method", "magic"], "unknown method 'magic'"),
        (["ask", "Who?", "--retriever", "elastic"], "unknown retriever 'elastic'"),
        (["ask", "Who?", "--param", "tau"], "--param expects name=value"),
        (["ask", "Who?", "--param", "theta=1"], "unknown parameter(s) for dtr: theta"),
        (["ask", "Who?", "--method", "never", "--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["ask", "Who?", "--method", "probing", "--model", "gemma3-270m"], "none ships for model gemma3-270m"),
        (["ask", "Who?", "--method", "cbdr", "--param", "checkpoint=/no/such/dir"], "no checkpoint directory"),
        (["ask", "Who?", "--method", "seakr", "--param", "samples=1"], "samples must be >= 2"),
        (["ask", "Who?", "--method", "dtr", "--param", "mode=cosine"], "mode must be angle, sum or adaptive"),
        (["ask", "Who?", "--method", "dtr", "--param", "tau=nan"], "parameter tau must be a number, got 'nan'"),
        (["ask", "Who?", "--method", "never", "--device", "tpu"], "unknown device 'tpu'"),
        # a parameter given twice: one value was dropped silently (5 passages for --k 5 --param k=2)
        (["ask", "Who?", "--k", "5", "--param", "k=2"], "--k 5 and --param k=2 both set k: give one"),
        (["ask", "Who?", "--max-tokens", "32", "--param", "max_answer_tokens=8"],
         "--max-tokens 32 and --param max_answer_tokens=8 both set max_answer_tokens: give one"),
        (["ask", "Who?", "--param", "k=2", "--param", "k=3"], "--param k=2 and --param k=3 both set k: give one"),
        # a method that searches nothing answered beside a mistyped --index
        (["ask", "Who?", "--method", "never", "--index", "/nonexistent"], "--index /nonexistent does not exist"),
    ],
)
def test_ask_bad_input(capsys, argv, message):
    code, out, err = run_main(capsys, *argv)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("fastgate: error: ")
    assert "Traceback" not in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_ask_on_cuda_without_it(capsys):
    code, _, err = run_main(capsys, "ask", "Who?", "--method", "never", "--device", "cuda")
    assert code == 2 and "CUDA is not available here" in err and "Traceback" not in err


@pytest.mark.parametrize("argv,message", [
    (["serve", "--replicas", "2"], "--replicas and --address need --ray"),
    (["serve", "--num-cpus", "4"], "--num-cpus needs --ray"),  # it reserved nothing
    (["serve", "--ray", "--replicas", "0"], "replicas must be >= 1"),
])
def test_serve_ray_bad_input(capsys, argv, message):
    if "--ray" in argv:
        pytest.importorskip("ray.serve")
    code, _, err = run_main(capsys, *argv)
    assert code == 2 and message in err and err.startswith("fastgate: error: ")


def test_serve_ray_takes_the_log_level(capsys, monkeypatch, small_index):
    pytest.importorskip("ray.serve")
    import fastgate.entrypoints.ray_serve as rs

    seen = {}
    monkeypatch.setattr(rs, "serve_ray", lambda config, ray_config: seen.update(rc=ray_config))
    code, _, err = run_main(capsys, "serve", "--ray", "--method", "always", "--index", str(small_index),
                            "--log-level", "warning")
    assert code == 0, err
    assert seen["rc"].log_level == "warning" and seen["rc"].logging_config == {"log_level": "WARNING"}
    deployment = rs.build_app(rs.ServiceConfig(method="always", index=str(small_index)), seen["rc"])
    assert deployment._bound_deployment._deployment_config.logging_config["log_level"] == "WARNING"
    with pytest.raises(rs.InputError, match="log_level must be one of"):
        rs.RayServeConfig(log_level="loud")


def test_ask_missing_and_corrupt_index(capsys, tmp_path, small_index):
    code, _, err = run_main(capsys, "ask", "Who?", "--method", "always", "--index", str(tmp_path / "nope"))
    assert code == 2 and f"--index {tmp_path / 'nope'} does not exist" in err
    tmp_path.joinpath("empty").mkdir()
    code, _, err = run_main(capsys, "ask", "Who?", "--method", "always", "--index", str(tmp_path / "empty"))
    assert code == 2 and "no bm25 index" in err
    (tmp_path / "bm25").mkdir()
    code, _, err = run_main(capsys, "ask", "Who?", "--method", "always", "--index", str(tmp_path))
    assert code == 2 and "not a complete bm25 index" in err


def test_index_reports_bad_corpus_line(capsys, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "1", "title": "A", "text": "a"}\n{"id": "2", "title": "B", "text": "b"}\nnot json\n')
    code, _, err = run_main(capsys, "index", "--corpus", str(corpus), "--out", str(tmp_path / "idx"))
    assert code == 2 and "c.jsonl:3: not valid JSON" in err


def test_index_builds_bm25(capsys, tmp_path, small_corpus_file):
    code, out, _ = run_main(capsys, "index", "--corpus", str(small_corpus_file), "--out", str(tmp_path),
                            "--retriever", "bm25")
    assert code == 0 and "bm25:" in out
    assert (tmp_path / "bm25" / "fastgate_index.json").is_file()


def test_methods_lists_parameters(capsys):
    code, out, _ = run_main(capsys, "methods")
    assert code == 0
    assert "dtr:" in out and "tau = 0.001" in out and "smollm2-135m: 0.5" in out


def test_help_for_each_command(capsys):
    proc = subprocess.run([sys.executable, "-m", "fastgate", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage: fastgate" in proc.stdout
    for command in ("ask", "index", "prepare", "methods", "eval", "serve", "calibrate", "train"):
        with pytest.raises(SystemExit) as exit_:  # argparse's --help exits 0 (in this process: no new interpreter)
            main([command, "--help"])
        assert exit_.value.code == 0
        assert f"usage: fastgate {command}" in capsys.readouterr().out


def test_help_and_usage_errors_build_only_the_named_command(capsys):
    """A run builds the arguments of the command it names; the others by name and help line: the same help and
    usage errors as the whole parser, and `fastgate --help` without the imports that take torch (1.6-1.9 s)."""
    import fastgate.entrypoints.cli as cli

    def help_of(parser, argv):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(argv)
        out = capsys.readouterr()
        return exit_.value.code, out.out, out.err

    for argv in (["--help"], ["frob"], ["ask"], ["train"], ["train", "read", "--help"], ["calibrate", "--help"],
                 *([c, "--help"] for c in cli._COMMANDS)):
        lazy = cli.build_parser(cli._command_of(argv))
        assert help_of(lazy, argv) == help_of(cli.build_parser(), argv), argv
    only_ask = cli.build_parser("ask")
    assert only_ask.parse_args(["ask", "Who?"]).func is cli._cmd_ask
    assert not hasattr(only_ask.parse_args(["eval"]), "func")  # not built: this run names ask
    assert cli._command_of(["--version"]) == "" and cli._command_of(["-h", "eval", "--n", "3"]) == "eval"
    # the command is the first word that is not an option only while no option before it takes a value
    assert all(a.nargs == 0 or a.dest == "command" for a in cli.build_parser()._actions)
    code = ("import sys; from fastgate.entrypoints.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("[]"), proc.stdout + proc.stderr


def test_subprocess_error_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "fastgate", "ask", "", "--method", "never"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "fastgate: error: the question is empty"


def test_the_eval_header_names_the_weights_where_not_float():
    from types import SimpleNamespace

    from fastgate.entrypoints.cli import _form

    assert _form(SimpleNamespace(dtype_name="float32", weights_name="int4-dense", engine_name="local")) == \
        "float32, int4-dense weights"
    assert _form(SimpleNamespace(dtype_name="bfloat16", weights_name="float", engine_name="local")) == "bfloat16"
    assert _form(SimpleNamespace(dtype_name=None, weights_name=None, engine_name="openai")) == "openai"


def test_the_command_sets_omp_s_passive_wait_unless_the_user_chose(monkeypatch, capsys):
    """``main`` asks libgomp to sleep its waiting threads (they spun beside the C++ kernels' pool), keeping a policy
    the user set; it can only work if importing the command's module has not loaded torch (libgomp reads it then)."""
    import os
    import subprocess
    import sys

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert main(["methods"]) == 0
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert main(["methods"]) == 0
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    capsys.readouterr()
    probe = "import sys, fastgate.entrypoints.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", "importing fastgate.entrypoints.cli loads torch: OMP_WAIT_POLICY comes too late"


def test_passive_omp_threads_says_whether_it_set_the_policy(monkeypatch):
    """The benches give llama.cpp's own process the environment without the policy fastgate set (bench/_llama_cpp.py:
    one libgomp per process), never without the user's."""
    from fastgate import entrypoints

    monkeypatch.setattr(entrypoints, "OMP_POLICY_SET", False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert entrypoints.passive_omp_threads() is False and not entrypoints.OMP_POLICY_SET
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert entrypoints.passive_omp_threads() is True and entrypoints.OMP_POLICY_SET
    assert entrypoints.passive_omp_threads() is True  # a second call: still the one that set it


@pytest.mark.parametrize(("argv", "message"), [
    (["prepare", "--model", "nosuch"], "unknown embedded model 'nosuch'"),  # it converted nothing and exited 0
    (["train", "prober", "--layers", "abc"], "--layers takes comma-separated layer numbers"),  # after the model loaded
    (["train", "confidence", "--layers", "3,4"], "--layers takes one layer"),
    (["calibrate", "--method", "dtr", "--data", "capitals", "--n", "-190"], "number of questions >= 2"),  # all but 190
    (["train", "confidence", "--n", "-5"], "number of questions >= 0"),
    (["train", "read", "--data", "nq:dev", "--n", "1.5"], "--n takes whole numbers"),  # a traceback
    (["train", "read", "--data", "nq:dev,nq:dev:all"], "--data names one dev set more than once"),  # pooled twice
    (["train", "read", "--data", "nq:dev", "--l2", "-50"], "--l2 must be a finite number >= 0"),  # diverged, saved
    (["train", "read", "--data", "nq:dev", "--price", "nan"], "--price must be a finite number"),  # NaN calibration
    (["train", "read", "--data", "nq:dev", "--adapt", "1.5"], "--adapt must be in [0, 1)"),  # refused after the pass
])
def test_bad_counts_layers_and_names_are_one_error_before_anything_loads(capsys, argv, message):
    from fastgate.entrypoints.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_a_max_tokens_that_fills_the_context_says_so(capsys, monkeypatch, tiny):
    """It said "the question is too long (2 characters) ... leaves room for about -91884 question tokens"."""
    import fastgate.assets.models

    monkeypatch.setattr(fastgate.assets.models, "load", lambda name, *args, **kwargs: tiny)
    code, _, err = run_main(capsys, "ask", "Q?", "--method", "never", "--max-tokens", "100000", "--model", "tiny")
    assert code == 2
    assert err == (f"fastgate: error: max_answer_tokens = 100000 (--max-tokens) leaves no room for a question in "
                   f"this model's context ({tiny.max_context} tokens)\n")


def test_a_reader_that_leaves_early_ends_the_command_quietly():
    """`fastgate methods | head -2` ended with a BrokenPipeError traceback."""
    proc = subprocess.run(f"{sys.executable} -m fastgate methods | head -1", shell=True, capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.startswith("never: ") and proc.stdout.count("\n") == 1 and proc.stderr == ""
    # a reader gone before the first line (head's, after it, is a race the command may win): always a broken pipe
    reader = subprocess.Popen([sys.executable, "-m", "fastgate", "methods"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    reader.stdout.close()
    err = reader.stderr.read()
    assert reader.wait(timeout=120) == 141 and err == b""  # 128 + SIGPIPE, as a shell reports `yes | head -1`'s yes


def test_ctrl_c_while_the_parser_is_built_is_one_line(capsys, monkeypatch):
    """Building the parser imports for seconds, outside the command's error map: Ctrl-C there was a traceback."""
    import fastgate.entrypoints.cli as cli

    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    code, out, err = run_main(capsys, "methods")
    assert code == 130 and out == "" and err == "fastgate: interrupted\n"


@pytest.mark.parametrize(("argv", "message"), [
    (["index", "--corpus", "x.jsonl", "--retriever", "bm25", "--hnsw"], "--hnsw is for the dense index"),
])
def test_flags_that_would_do_nothing_are_refused(capsys, argv, message):
    code, _, err = run_main(capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_prepare_verify_says_what_it_verified(capsys, monkeypatch, tmp_path):
    """--verify of a local model directory checked nothing and said nothing."""
    import fastgate.retrieval

    monkeypatch.setattr(fastgate.retrieval, "build_indexes", lambda *args, **kwargs: {})
    code, _, err = run_main(capsys, "prepare", "--model", str(tmp_path))  # any directory was taken for a model
    assert code == 2 and "is a directory but not a model (no config.json)" in err
    (tmp_path / "config.json").write_text("{}")
    code, out, _ = run_main(capsys, "prepare", "--model", str(tmp_path), "--verify")
    assert code == 0 and f"model {tmp_path}: a local directory, nothing to verify" in out
    code, out, _ = run_main(capsys, "prepare", "--model", str(tmp_path))
    assert code == 0 and "nothing to verify" not in out
    import fastgate.assets.models

    converted = tmp_path / "smollm2-135m-hf-v1"
    converted.mkdir()
    (converted / "fastgate_model.json").write_text(json.dumps({"files": {"a": {"size": 1}, "b": {"size": 2}}}))
    monkeypatch.setattr(fastgate.assets.models, "prepare", lambda name, **kwargs: converted)
    code, out, _ = run_main(capsys, "prepare", "--model", "smollm2-135m", "--verify")
    assert code == 0 and f"model smollm2-135m: {converted} (verified: the SHA-256 of its 2 files match" in out


def test_version_and_help_defaults(capsys):
    from fastgate.version import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"fastgate {__version__}\n"
    with pytest.raises(SystemExit):
        main(["ask", "--help"])
    assert "--max-tokens MAX_TOKENS maximum answer tokens (default: the method's max_answer_tokens, 16)" in \
        " ".join(capsys.readouterr().out.split())


def test_a_threshold_of_minus_zero_prints_as_zero(capsys):
    """Probing-RAG's threshold is -θ: at its default θ = 0 the gate line said "vs threshold -0"."""
    from fastgate.entrypoints.cli import _print_human

    _print_human({"question": "Q?", "answer": "A", "retrieved": False, "retrieval_calls": 0, "method": "probing",
                  "gate_steps": [{"gate": "prober", "score": 0.25, "threshold": -0.0, "retrieve": True}],
                  "passages": [], "timings": {}, "lm_calls": 1, "generated_tokens": 2})
    assert "vs threshold 0 -> retrieve" in capsys.readouterr().out
