"""`/tokenize` and `/detokenize`, as vLLM serves them: a prompt or a conversation counted with
the gateway's own tokenizer and chat template, and token ids turned back into text.

    POST /tokenize   {model?, prompt, add_special_tokens?, return_token_strs?}
                     {model?, messages, tools?, tool_choice?, chat_template_kwargs?, reasoning_effort?, ...}
                  -> {count, max_model_len, tokens, token_strs}
    POST /detokenize {model?, tokens} -> {prompt}

A request is translated into the text or chat completion request it counts and goes through the
same checks and tokenizing (gateway/planner.py `check`, `prompts`, on a preparation thread) as
that request would, so `count` is the `usage.prompt_tokens` a completion of the same prompt or
messages reports; a prompt that cannot fit the context from its byte length alone is refused as
a completion's is.  Neither endpoint needs a worker: they answer while none is ready, and then
`max_model_len` is the model's own (the workers' --max-model-len is known once one answers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from gateway.admission import InvalidField, Rejected
from gateway.chat import ChatMessage, Tool
from gateway.errors import shown
from gateway.fields import IGNORED_HEADER, neutral
from gateway.protocol import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from gateway.app import Gateway

# vLLM's fields of /tokenize that Tandem cannot honour: refused unless neutral (as gateway/fields.py)
UNHONOURED: dict[str, tuple[tuple[Any, ...], str]] = {
    "add_generation_prompt": ((None, True), "add_generation_prompt=false is not supported: chat completions always "
                              "add the generation prompt, and /tokenize counts what they send"),
    "continue_final_message": ((None, False), "continue_final_message is not supported"),
    "chat_template": ((None,), "chat_template is not supported: the checkpoint's template is used"),
    "mm_processor_kwargs": ((None, {}), "mm_processor_kwargs is not supported: this server takes text only"),
    "media_io_kwargs": ((None, {}), "media_io_kwargs is not supported: this server takes text only"),
}
CHAT_ONLY = ("tools", "tool_choice", "chat_template_kwargs", "reasoning_effort")


class TokenizeRequest(BaseModel):
    """vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`), one model:
    exactly one of the two is sent."""
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)     # as chat's
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    tokens: list[int]


class Tokenization:
    """Serves both endpoints for one gateway (its tokenizer, context, checks and threads)."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        backend = gw.tokenizer.backend
        # whether add_special_tokens=true changes anything: the tokenizer adds tokens around every text
        self.adds_special = backend.encode("", add_special_tokens=True).ids != []

    async def tokenize(self, body: TokenizeRequest, request: Request) -> JSONResponse:
        """The ids the equivalent completion request is served with; raises Rejected (400/404)
        naming the field at fault, before anything is tokenized."""
        gw = self.gw
        inner = self.translate(body)
        request.state.ignored_fields = self.ignored(body, inner.ignored_fields())
        self.check(body)
        gw.completions.check(inner)        # messages and tools bounded, fields checked, as for chat
        context = gw.context_len()
        ids = (await gw.prepare(gw.completions.prompts, inner, context))[0]
        strs = [gw.tokenizer.backend.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
        return self._answer({"count": len(ids), "max_model_len": context, "tokens": ids, "token_strs": strs},
                            request)

    def translate(self, body: TokenizeRequest) -> ChatCompletionRequest | CompletionRequest:
        """The completion request whose prompt `body` counts: a chat completion's when it sends
        messages, else a text completion's (`check` refuses what does not go together)."""
        model = self.gw.config.served_model_name
        if body.messages is None:
            return CompletionRequest(model=model, prompt=body.prompt or "")
        return ChatCompletionRequest(model=model, messages=body.messages, tools=body.tools,
                                     tool_choice=body.tool_choice, chat_template_kwargs=body.chat_template_kwargs,
                                     reasoning_effort=body.reasoning_effort)

    def check(self, body: TokenizeRequest) -> None:
        """Raises Rejected for another model, a field that cannot be honoured, or fields that
        do not go together."""
        self._check_model(body.model)
        for name, value in (body.model_extra or {}).items():
            if name in UNHONOURED and not neutral(value, UNHONOURED[name][0]):
                raise InvalidField(name, UNHONOURED[name][1], "unsupported")
        if body.add_special_tokens and self.adds_special:
            raise InvalidField("add_special_tokens", "add_special_tokens=true is not supported: this tokenizer would "
                               "add tokens that no completion of this server sends (send false or leave it out)",
                               "unsupported")
        if (body.prompt is None) == (body.messages is None):
            raise InvalidField("prompt", "send either prompt (a text) or messages (a conversation), not "
                               f"{'both' if body.prompt is not None else 'neither'}", "invalid_request")
        if body.prompt is not None and (sent := [f for f in CHAT_ONLY if getattr(body, f) is not None]):
            raise InvalidField(sent[0], f"{sent[0]} goes with messages, not with a prompt", "invalid_request")

    async def detokenize(self, body: DetokenizeRequest, request: Request) -> JSONResponse:
        """The text of `tokens`, special tokens included (a chat prompt's ids give back the
        rendered template); at most the context length of tokens, every one in the vocabulary."""
        gw = self.gw
        request.state.ignored_fields = self.ignored(body)
        self._check_model(body.model)
        context, vocab = gw.context_len(), gw.tokenizer.vocab_size
        if len(body.tokens) > context:
            raise InvalidField("tokens", f"the request has {len(body.tokens)} tokens; at most {context} (this "
                               f"model's context length) are allowed")
        bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidField("tokens", f"tokens[{bad}]={str(body.tokens[bad])[:24]} is not a token of this "
                               f"model's vocabulary (0..{vocab - 1})")
        return self._answer({"prompt": await gw.prepare(gw.tokenizer.decode, body.tokens, False)}, request)

    def ignored(self, body: BaseModel, nested: Sequence[str] = ()) -> str:
        """The fields of `body` nobody defines (and `nested`, those inside its messages and
        tools), logged and counted as a completion's are; the header's value."""
        names = [k for k in body.model_extra or {} if k not in UNHONOURED] + list(nested)
        if names:
            self.gw.metrics.ignored_fields.inc()
        return self.gw.completions.ignored_log.report(names)

    def _answer(self, content: dict[str, Any], request: Request) -> JSONResponse:
        response = JSONResponse(content)
        if ignored := request.state.ignored_fields:
            response.headers[IGNORED_HEADER] = ignored
        return response

    def _check_model(self, model: str | None) -> None:
        served = self.gw.config.served_model_name
        if model is not None and model != served:
            raise Rejected("model_not_found", f"the model {shown(model)} does not exist; this server serves "
                           f"{served!r}")


def add_routes(app: FastAPI, gw: Gateway, tenant: Callable[[Request], str]) -> None:
    """POST /tokenize and /detokenize, behind the API keys (`tenant`) like every endpoint."""
    tokenization = Tokenization(gw)

    @app.post("/tokenize", dependencies=[Depends(tenant)])
    async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
        return await tokenization.tokenize(body, request)

    @app.post("/detokenize", dependencies=[Depends(tenant)])
    async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
        return await tokenization.detokenize(body, request)
