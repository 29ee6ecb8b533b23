"""Request bodies of the HTTP API (OpenAI's fields plus a few extensions), as pydantic models.

They check shapes and ranges; whatever they let through is still checked by `SamplingParams`
and, for lengths, by the tokenizer. Unknown fields are refused rather than ignored. Types are
strict, as OpenAI's are: a boolean is not an integer, a string is not a number. In the OpenAI
bodies an explicit `null` stands for a field left out.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 16
MAX_TOKEN_ID = 2**31 - 1
# Limits that keep every number representable in msgpack and tensors; the engine's own limits
# (context length, vocabulary) are checked later with messages that name them.
MaxTokens = Annotated[int, Field(ge=1, le=2**31 - 1)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]  # OpenAI's range
# Lower is more urgent (vLLM's convention); only the priority schedule policy takes one but 0.
Priority = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


def one_of(what: str) -> WrapValidator:
    """A union's error in one message that says what the field may be (pydantic reports each
    member's failure at a path of its own, such as `prompt.str`)."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("union_type", "must be {what}", {"what": what}) from None

    return WrapValidator(validate)


Stop = Annotated[str | list[str], one_of("a string or a list of strings")]


def _check_utf8(value: Any, path: str) -> None:
    # JSON can spell lone surrogates ("\ud800"), which no UTF-8 encoder accepts.
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{path or 'body'}: invalid UTF-8 ({e.reason})") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_utf8(k, path)
            _check_utf8(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if not isinstance(v, (int, float)):  # token ids: thousands per prompt
                _check_utf8(v, f"{path}.{i}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _utf8(cls, data: Any) -> Any:
        _check_utf8(data, "")
        return data


def _null_is_absent(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """The JSON schema of a model whose optional fields also take null."""
    for name, field in cls.model_fields.items():
        prop = schema.get("properties", {}).get(name)
        if field.is_required() or prop is None or _nullable(prop):
            continue
        outer = {k: prop.pop(k) for k in ("title", "default", "description") if k in prop}
        schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **outer}


def _nullable(prop: dict[str, Any]) -> bool:
    return any(p.get("type") == "null" for p in prop.get("anyOf", ()))


class _OpenAI(_Strict):
    """An OpenAI body: an explicit null means "left out" for every optional field (OpenAI
    marks nearly all of them nullable; clients send null for what they do not set)."""

    model_config = ConfigDict(json_schema_extra=_null_is_absent)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        optional = {n for n, f in cls.model_fields.items() if not f.is_required()}
        return {k: v for k, v in data.items() if v is not None or k not in optional}


class StreamOptions(_OpenAI):
    include_usage: bool = False


class TextPart(_OpenAI):
    # Clients add keys of their own to parts (say, `cache_control`); they do not change the text.
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class FunctionCall(_OpenAI):
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as the model wrote it


class ToolCallIn(_OpenAI):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageIn(_OpenAI):
    """A message of the conversation. The fields OpenAI's SDK writes into `model_dump()` of an
    answer (`refusal`, `annotations`, `audio`, `function_call`) are accepted as null or empty."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextPart], one_of("a string or a list of text parts")] | None = (
        None
    )
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None
    reasoning_content: str | None = None  # a reasoning model's earlier thinking; not re-sent

    @model_validator(mode="after")
    def _content_by_role(self) -> ChatMessageIn:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required, except for an assistant message with tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: required in a message of role tool")
        if self.annotations:
            raise ValueError("annotations: only null or [] in a request")
        return self


LOGIT_BIAS = "Token id (a numeral) -> a bias in [-100, 100] added to its logit at every step."
REGEX = "The whole output matches this regular expression."
EBNF = "The output follows this grammar (GBNF, starting at `root`; or llguidance's Lark)."
PRIORITY = (
    "Lower is more urgent (any integer); only a server started with --schedule-policy priority "
    "takes one but 0."
)
TOKEN_TIMES = (
    "Add `token_times` to the usage: per choice, when the scheduler had each output token "
    "(seconds since the epoch), and `received_at`, when the API server took the request. A "
    "stream needs stream_options.include_usage for them."
)


class JsonSchemaFormat(_OpenAI):
    """OpenAI's `response_format.json_schema`. The schema is always enforced (`strict` or not);
    a schema the grammar engine cannot enforce in full is refused."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")  # `schema` would shadow pydantic's own
    strict: bool | None = None


class ResponseFormat(_OpenAI):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('`json_schema` goes with "type": "json_schema", and only with it')
        return self


class EngineSampling(_Strict):
    """The sampling fields the OpenAI and the native endpoints share (vLLM / SGLang spelling
    for those OpenAI lacks)."""

    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    top_k: int = Field(default=-1, ge=-1, le=2**31 - 1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    skip_special_tokens: bool = True
    min_tokens: int = Field(default=0, ge=0, le=2**31 - 1)
    include_stop_str_in_output: bool = False
    priority: Priority = Field(default=0, description=PRIORITY)
    logit_bias: dict[str, float] | None = Field(default=None, description=LOGIT_BIAS)
    # SGLang's grammars; at most one of them, `response_format` (other than text) and the
    # native `json_schema`.
    regex: str | None = Field(default=None, description=REGEX)
    ebnf: str | None = Field(default=None, description=EBNF)


class SamplingFields(_OpenAI, EngineSampling):
    """Fields both OpenAI endpoints share."""

    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted for compatibility; not used
    return_token_times: bool = Field(default=False, description=TOKEN_TIMES)
    response_format: ResponseFormat | None = Field(
        default=None, description="The output follows this JSON schema, or is any JSON object."
    )

    def unsupported(self) -> list[str]:
        """The fields set to something this server cannot honour yet."""
        return []


class FunctionDef(_OpenAI):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None  # the arguments always follow the schema when enforced


class Tool(_OpenAI):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_OpenAI):
    name: str


class NamedToolChoice(_OpenAI):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice,
    one_of('"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'),
]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]
STORE = "Only false: this server keeps nothing (true is refused)."
CHAT_TEMPLATE_KWARGS = (
    'Extra variables for the model\'s chat template, such as {"enable_thinking": false}.'
)
REASONING_EFFORT = (
    '"none" or "minimal" turn a reasoning model\'s thinking off (where its chat template '
    "takes `enable_thinking`); the others leave it on."
)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None
    function_call: Any = None
    # Accepted for compatibility: they do not change the answer.
    store: bool | None = Field(default=None, description=STORE)
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    modalities: list[Literal["text"]] | None = None
    reasoning_effort: ReasoningEffort | None = Field(default=None, description=REASONING_EFFORT)
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description=CHAT_TEMPLATE_KWARGS
    )
    documents: list[dict[str, Any]] | None = Field(
        default=None, description="Documents for a chat template that takes them (RAG)."
    )

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        bad += [f for f in ("functions",) if getattr(self, f)]
        bad += [f for f in ("function_call",) if getattr(self, f) not in (None, "none")]
        return bad


Prompt = Annotated[
    str | list[str] | list[TokenId] | list[list[TokenId]],
    one_of(
        f"a string, a list of strings, a list of token ids (integers in [0, {MAX_TOKEN_ID}]) "
        "or a list of such lists"
    ),
]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.echo:
            bad.append("echo")
        if self.best_of is not None and self.best_of != self.n:
            bad.append("best_of")
        if self.suffix:
            bad.append("suffix")
        return bad

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list (a batch), each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class NativeSamplingParams(EngineSampling):
    max_new_tokens: MaxTokens | None = 128
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=20)
    # A JSON schema as JSON text (SGLang's spelling) or as an object.
    json_schema: (
        Annotated[str | dict[str, Any], one_of("a JSON schema: JSON text or an object")] | None
    ) = Field(default=None, description="The output is JSON that this JSON schema accepts.")


class GenerateRequest(_Strict):
    """The native endpoint: one prompt as text or token ids."""

    text: str | None = None
    input_ids: list[TokenId] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    return_token_times: bool = Field(
        default=False,
        description="The finished answer's meta_info gains `token_times`: when the scheduler "
        "had each output token (seconds since the epoch).",
    )

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of `text` and `input_ids`")
        return self


# ---- the Responses API (stateless) ---------------------------------------------------------


class _Item(_OpenAI):
    # Items the SDK returns carry more fields (ids, statuses, annotations) than a request needs;
    # a client sends them back as they came.
    model_config = ConfigDict(extra="ignore")


class InputText(_Item):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str | list[InputText], one_of("a string or a list of text parts")]

    @property
    def text(self) -> str:
        c = self.content
        return c if isinstance(c, str) else "".join(p.text for p in c)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(_Item):
    """A reasoning item of an earlier answer: accepted, not shown to the model again."""

    type: Literal["reasoning"]


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
    one_of("a message, function_call, function_call_output or reasoning item"),
]


class ResponseTool(FunctionDef):
    type: Literal["function"]


class ResponseNamedTool(NamedFunction):
    type: Literal["function"]


class TextFormat(_OpenAI):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_OpenAI):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(_OpenAI):
    effort: ReasoningEffort | None = None
    summary: str | None = None


class ResponsesRequest(_OpenAI):
    model: str | None = None
    input: Annotated[str | list[InputItem], one_of("a string or a list of input items")]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[ResponseTool] | None = None
    tool_choice: (
        Annotated[
            Literal["none", "auto", "required"] | ResponseNamedTool,
            one_of('"none", "auto", "required" or {"type": "function", "name": ...}'),
        ]
        | None
    ) = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool | None = Field(default=None, description=STORE)
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    user: str | None = None
    previous_response_id: str | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)  # an extension
