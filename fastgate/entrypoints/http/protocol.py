"""The wire protocol of ``fastgate serve``: every request and response model (pydantic) of the native ``/v1/answer``
endpoint and of the OpenAI-compatible ones, and the OpenAI request fields the server refuses or ignores.

The class names are the schema names of ``/openapi.json``. Three fields depend on the server's settings (the longest
question, the most answer tokens, the default method named in the descriptions): :func:`server_models` gives the
request models narrowed to one server's :class:`~fastgate.serving.service.ServiceConfig`, which the routes declare.

Imports pydantic and nothing of fastgate; :mod:`fastgate.entrypoints.http.answer` and
:mod:`fastgate.entrypoints.http.openai` use it.
"""

# no `from __future__ import annotations`: pydantic and FastAPI read these annotations at runtime
from collections.abc import Callable
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, create_model

__all__ = ["IGNORED_DECLARED", "IGNORED_EXTRA", "REFUSED", "AnswerRequest", "AnswerResponse", "ChatChoice",
           "ChatCompletion", "ChatCompletionRequest", "ChatMessage", "Completion", "CompletionChoice",
           "CompletionRequest", "ErrorBody", "ErrorDetail", "ErrorResponse", "GateStepModel", "Message", "ModelCard",
           "ModelList", "OpenAIRequest", "Passage", "Scalar", "ServerModels", "StreamOptions", "TextPart", "Usage",
           "is_int", "neutral", "server_models"]

Scalar = StrictBool | StrictInt | StrictFloat | StrictStr  # a method parameter's value

_METHODS_HELP = "never | always | flare | probing | dtr | seakr | scaar | cbdr"


# ---------------------------------------------------------------- the fields that depend on the server's settings
def _question(max_chars: int | None = None) -> Any:
    return Field(min_length=1, max_length=max_chars, description="the question (whitespace-only questions are refused)")


def _method_name(default: str = "the server's") -> Any:
    return Field(None, max_length=64, description=f"{_METHODS_HELP} (default: {default})")


def _model_name(default: str = "the server's") -> Any:
    return Field(max_length=128, description=f"fastgate-<method> (GET /v1/models), or fastgate for the default method "
                                             f"({default})")


def _max_tokens(limit: int | None = None, description: str = "maximum answer tokens") -> Any:
    return Field(None, ge=1, le=limit, description=description)


# ---------------------------------------------------------------- native: POST /v1/answer
class AnswerRequest(BaseModel):
    """A question to answer with gated retrieval."""

    model_config = ConfigDict(extra="forbid")
    question: StrictStr = _question()
    method: StrictStr | None = _method_name()
    params: dict[StrictStr, Scalar] | None = Field(
        None, description="method parameters (see `fastgate methods`), e.g. {\"k\": 2}")
    max_tokens: StrictInt | None = _max_tokens()


class Passage(BaseModel):
    id: str
    title: str
    score: float | None


class GateStepModel(BaseModel):
    gate: str
    score: float | None
    threshold: float | None
    retrieve: bool


class AnswerResponse(BaseModel):
    """The same object as ``fastgate ask --json``."""

    method: str
    question: str
    answer: str
    retrieved: bool
    passages: list[Passage]
    retrieval_calls: int
    lm_calls: int
    generated_tokens: int
    gate_steps: list[GateStepModel]
    timings: dict[str, float | None]
    truncated: bool
    prompt_tokens: int
    finish_reason: str
    model: str
    retriever: str | None
    engine: str | None = None  # local, or openai:<base-url>:<model> (the records' field; it was dropped here)
    dtype: str | None = None  # the engine's numeric form, as `ask --json` and every eval record name it
    weights: str | None = None
    # what a method adds of its own (the read gate: its features, base score, answerable-share estimate); absent for
    # the others, as in `ask --json` (the route leaves out what the record does not hold)
    details: dict[str, Any] | None = None


class ErrorResponse(BaseModel):
    error: str


# ---------------------------------------------------------------- OpenAI: requests
class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr = Field(max_length=64)
    text: StrictStr | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr = Field(max_length=64)
    content: StrictStr | list[TextPart] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool | None = None


class OpenAIRequest(BaseModel):
    """The fields chat and completion requests share."""

    # extra fields are the method's parameters (the openai client's extra_body)
    model_config = ConfigDict(extra="allow")
    model: StrictStr = _model_name()
    max_tokens: StrictInt | None = _max_tokens()
    stream: StrictBool | None = Field(None, description="server-sent events: gate steps, retrievals, the answer")
    stream_options: StreamOptions | None = None
    params: dict[StrictStr, Scalar] | None = Field(
        None, description="method parameters (see `fastgate methods`); names that are not standard fields may "
                          "also be given beside the standard fields")
    temperature: StrictFloat | StrictInt | None = Field(None, description="accepted, not applied (greedy answers)")
    top_p: StrictFloat | StrictInt | None = Field(None, description="accepted, not applied (greedy answers)")
    seed: StrictInt | None = Field(None, description="accepted, not applied (answers are deterministic)")
    user: StrictStr | None = Field(None, max_length=256, description="accepted, not applied")


class ChatCompletionRequest(OpenAIRequest):
    """An OpenAI chat completion request: the last message (the user's) is the question."""

    messages: list[Message] = Field(min_length=1, max_length=1024)
    max_completion_tokens: StrictInt | None = _max_tokens(description="as max_tokens")


class CompletionRequest(OpenAIRequest):
    """An OpenAI completion request: the prompt is the question."""

    prompt: StrictStr | list[StrictStr]


# ---------------------------------------------------------------- OpenAI: responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    finish_reason: str
    logprobs: dict[str, Any] | None = None


class ChatCompletion(BaseModel):
    """An OpenAI chat completion, with the gated answer's signals under ``fastgate``."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    fastgate: dict[str, Any]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str
    logprobs: dict[str, Any] | None = None
    stop_reason: str | None = None


class Completion(BaseModel):
    """An OpenAI completion, with the gated answer's signals under ``fastgate``."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    fastgate: dict[str, Any]


class ModelCard(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str
    fastgate: dict[str, Any]


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


# ---------------------------------------------------------------- one server's request models
class ServerModels(NamedTuple):
    """The request models of one server (same names as the module's: the schema names them)."""

    answer: type[AnswerRequest]
    chat: type[ChatCompletionRequest]
    completion: type[CompletionRequest]


def server_models(config: Any) -> ServerModels:
    """The request models narrowed to ``config`` (a :class:`~fastgate.serving.service.ServiceConfig`): questions of at
    most
    ``max_question_chars``, at most ``max_tokens_limit`` answer tokens, ``method`` named as the default."""
    limit, method = config.max_tokens_limit, config.method
    openai = {"model": (StrictStr, _model_name(method)), "max_tokens": (StrictInt | None, _max_tokens(limit))}
    return ServerModels(
        answer=_narrowed(AnswerRequest, question=(StrictStr, _question(config.max_question_chars)),
                         method=(StrictStr | None, _method_name(method)),
                         max_tokens=(StrictInt | None, _max_tokens(limit))),
        chat=_narrowed(ChatCompletionRequest, **openai,
                       max_completion_tokens=(StrictInt | None, _max_tokens(limit, "as max_tokens"))),
        completion=_narrowed(CompletionRequest, **openai))


def _narrowed(cls: type[BaseModel], **fields: tuple[Any, Any]) -> Any:
    """A subclass of ``cls`` of the same name, docstring and module, with ``fields`` redeclared (their places in the
    schema are kept)."""
    return create_model(cls.__name__, __base__=cls, __doc__=cls.__doc__, __module__=cls.__module__, **fields)


# ---------------------------------------------------------------- OpenAI fields the methods cannot honour
def is_int(v: Any, n: int) -> bool:
    """Whether ``v`` is the integer ``n`` (not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool) and v == n


def neutral(check: Callable[[Any], bool], value: Any) -> bool:
    """Whether ``value`` passes ``check`` (a value the check cannot compare is not the neutral one)."""
    try:
        return bool(check(value))
    except Exception:  # noqa: BLE001 - a value the check cannot compare is not the neutral one
        return False


# standard fields that would change the result and cannot be honoured: refused unless null or neutral
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (lambda v: is_int(v, 1), "one answer per question: n must be 1"),
    "best_of": (lambda v: is_int(v, 1), "one answer per question: best_of must be 1"),
    "logprobs": (lambda v: v is False or is_int(v, 0), "token log-probabilities are returned by fastgate-never "
                 "and by plain completions of the LM (its own model name) only"),
    "top_logprobs": (lambda v: is_int(v, 0), "token log-probabilities are returned by fastgate-never and by plain "
                     "completions of the LM (its own model name) only"),
    "echo": (lambda v: v is False, "the prompt is not echoed"),
    "suffix": (lambda v: v == "", "suffixes are not supported"),
    "stop": (lambda v: v == "" or v == [], "each method stops its generations itself"),
    "presence_penalty": (lambda v: v == 0 and not isinstance(v, bool), "penalties are not supported"),
    "frequency_penalty": (lambda v: v == 0 and not isinstance(v, bool), "penalties are not supported"),
    "logit_bias": (lambda v: v == {}, "logit_bias is not supported"),
    "tools": (lambda v: v == [], "tool calls are not supported"),
    "tool_choice": (lambda v: v == "none", "tool calls are not supported"),
    "functions": (lambda v: v == [], "function calls are not supported"),
    "function_call": (lambda v: v == "none", "function calls are not supported"),
    "response_format": (lambda v: isinstance(v, dict) and v.get("type") == "text" and len(v) == 1,
                        "the answer is text; structured output is not supported"),
    "modalities": (lambda v: v == ["text"], "the answer is text"),
    "audio": (lambda v: False, "audio output is not supported"),
    "prediction": (lambda v: False, "predicted outputs are not supported"),
    "web_search_options": (lambda v: False, "web search is not supported; the server retrieves from its index"),
    "reasoning_effort": (lambda v: False, "reasoning effort is not supported"),
}
# standard fields with no effect on the answer here: accepted, not applied, named in fastgate.ignored
IGNORED_DECLARED = ("temperature", "top_p", "seed", "user")
IGNORED_EXTRA = ("store", "metadata", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier",
                 "verbosity")
