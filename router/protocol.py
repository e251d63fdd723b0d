"""OpenAI-compatible request and response models (chat, completions, models, errors).

A request field this server does not implement is a 400 naming it, never silently ignored: a
client that asked for JSON output, tools or beam search must hear that it will not get them.
Only fields that change nothing about the output are accepted and ignored (``user``, ``store``,
``metadata``). vLLM's sampling extensions (sent by the ``openai`` SDK through ``extra_body``) are
accepted. Range checks that need no model
live here or in ``SamplingParams``; checks that need the model (vocabulary, context) happen in
the serving layer and the engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from baton_serve.workers.errors import InvalidRequestError
from baton_serve.workers.sampling.params import SamplingParams
from baton_serve.workers.sampling.structured.spec import StructuredSpec
from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Tokenizers hold ids as u32 and fail on anything else before the engine's vocabulary check runs.
TokenId = Annotated[int, Field(ge=0, lt=2**32)]


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """OpenAI's ``response_format.json_schema``: the schema is always enforced (``strict`` or not)."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(True, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Request):
    """vLLM's ``structured_outputs`` (``extra_body``): exactly one of the constraints."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class CalledFunction(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"  # JSON text, as OpenAI sends it; an object is accepted too


class ToolCallParam(_Request):
    """A call in an earlier assistant turn, as the client sends the history back."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Request):
    """One turn; ``content`` is a string or a list of text parts (images are not supported)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _calls_from_assistant(self) -> ChatMessage:
        # As in OpenAI's API; the tool-call fallback and chat templates render calls of assistant turns only.
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role} messages")
        return self


class SamplingRequest(_Request):
    """Fields shared by chat and completions, including vLLM's ``extra_body`` extensions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=128)  # OpenAI's limit; each sample is an engine request
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # Accepted and ignored: they label or store the request, and change nothing in the answer.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    priority: int = 0
    # structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def structured_spec(self) -> StructuredSpec | None:
        """The grammar the output must follow, from whichever field gave it; 400 if more than one did."""
        found: list[tuple[str, StructuredSpec]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredSpec.json_object()))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise InvalidRequestError("response_format of type json_schema needs a json_schema object",
                                          param="response_format.json_schema")
            found.append(("response_format", StructuredSpec.json_schema(rf.json_schema.schema_,
                                                                        param="response_format.json_schema")))
        so = self.structured_outputs
        if so is not None:
            given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                          ("grammar", so.grammar)) if v is not None]
            if so.json_object:
                given.append(("json_object", True))
            if len(given) != 1:
                raise InvalidRequestError("structured_outputs takes exactly one of json, regex, choice, grammar, "
                                          f"json_object; got {', '.join(k for k, _ in given) or 'none'}",
                                          param="structured_outputs")
            found.append(("structured_outputs", _spec(*given[0], param=f"structured_outputs.{given[0][0]}")))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                found.append((name, _spec(kind, value, param=name)))
        if len(found) > 1:
            raise InvalidRequestError(f"give one output constraint, not {len(found)} ({', '.join(n for n, _ in found)})",
                                      param=found[1][0])
        return found[0][1] if found else None

    def to_sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Engine parameters; raises InvalidRequestError (with the OpenAI param name) on bad values."""
        spec = self.structured_spec()
        return SamplingParams(
            structured_outputs=spec.to_dict() if spec is not None else None,
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            logit_bias=_parse_logit_bias(self.logit_bias),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )


def _spec(kind: str, value: Any, param: str) -> StructuredSpec:
    if kind == "json":
        return StructuredSpec.json_schema(value, param=param)
    if kind == "json_object":
        return StructuredSpec.json_object()
    if kind == "regex":
        return StructuredSpec.regex(value, param=param)
    if kind == "choice":
        return StructuredSpec.choice(value, param=param)
    return StructuredSpec.grammar(value, param=param)


def _parse_logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    # JSON object keys are strings; OpenAI documents them as token ids.
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            out[int(key)] = float(value)
        except ValueError:
            raise InvalidRequestError(f"logit_bias keys must be token ids (integers), got {key!r}",
                                      param="logit_bias") from None
    return out


class FunctionDefinition(_Request):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True  # vLLM extension

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` supersedes the deprecated ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def engine_logprobs(self) -> int | None:
        """The engine's ``logprobs`` (number of alternatives) or None when not requested."""
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingRequest):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = None


# ---------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_empty_calls(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class _Sparse(BaseModel):
    """A streamed delta: only the keys that are set appear."""

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_Sparse):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Sparse):
    """One streamed piece of a call: the first carries id, type and name; later ones argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM extension: the stop string or token id that matched


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(_Sparse):
    """A streamed message delta: only the keys that are set appear (``{}`` on the final chunk)."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """Also the streamed chunk shape (OpenAI uses ``text_completion`` for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "baton"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
