"""OpenAI request schemas (msgspec) and the OpenAI error object.

Unknown fields are ignored, as OpenAI does; a wrong type or value is a 400 that
names the parameter.
"""

import msgspec


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False):
    role: str
    content: str


class _SamplingFields(msgspec.Struct, forbid_unknown_fields=False):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    user: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] = ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = []
    max_completion_tokens: int | None = None


class APIError(Exception):
    """An error the client caused or must handle, rendered as OpenAI's error object."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param=None
    ):
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": type_, "param": param, "code": None}}


def decode(body: bytes, kind: type[msgspec.Struct]) -> msgspec.Struct:
    """Parse a JSON body into `kind`, or raise a 400 APIError naming what is wrong."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        param = str(e).rsplit("$.", 1)[-1].rstrip("`").split("[")[0] if "$." in str(e) else None
        raise APIError(400, str(e), param=param) from None
    except msgspec.DecodeError as e:
        raise APIError(400, f"invalid JSON body: {e}") from None
