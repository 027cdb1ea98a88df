"""A fake OpenAI-compatible engine for the gateway's openai-logprobs tests: ``/v1/models`` and
``/v1/completions`` with echo + logprobs, scored by a real (tiny) model, in the two dialects
the gateway meets — vLLM (token-id prompts, ``token_id:N`` strings with
``return_tokens_as_token_ids``) and llama-cpp-python (text prompts only, token strings with
special tokens as "", every BOS left out of the listing, the actual token merged into the top)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import orjson
import torch

from core.runners import ModelRunner

Listing = dict[str, list[Any]]


class FakeEngine:
    def __init__(self, runner: ModelRunner, dialect: str, refuse_echo: bool = False) -> None:
        assert dialect in ("vllm", "llama-cpp")
        self.runner, self.dialect, self.refuse_echo = runner, dialect, refuse_echo
        self.tokenizer = runner.tokenizer
        self.special = set(self.tokenizer.all_special_ids)
        self.bos = self.tokenizer.bos_token_id
        self.prompts: list[Any] = []  # every completion prompt, as sent
        self.mangle: Callable[[Listing], Listing] | None = None  # breaks the answers

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            entry: dict[str, Any] = {"id": "tiny", "object": "model"}
            if self.dialect == "vllm":
                entry["max_model_len"] = 1024
            return httpx.Response(200, json={"object": "list", "data": [entry]})
        if request.url.path != "/v1/completions":
            return httpx.Response(404, json={"detail": "Not Found"})
        body = orjson.loads(request.content)
        self.prompts.append(body["prompt"])
        if self.refuse_echo:  # llama.cpp's llama-server
            return httpx.Response(
                400, json={"error": {"message": "'echo' is not supported", "type": "invalid_request_error"}}
            )
        if isinstance(body["prompt"], list):
            if self.dialect == "llama-cpp":
                return httpx.Response(
                    500,
                    json={
                        "error": {
                            "message": "Input should be a valid string",
                            "type": "internal_server_error",
                        }
                    },
                )
            ids = list(body["prompt"])
        else:
            ids = list(self.tokenizer.encode(body["prompt"], add_special_tokens=False))
        listing, generated = self._listing(
            ids, int(body["logprobs"]), bool(body.get("return_tokens_as_token_ids"))
        )
        if self.mangle is not None:
            listing = self.mangle(listing)
        echoed = body["prompt"] if isinstance(body["prompt"], str) else self.tokenizer.decode(ids)
        text = echoed + (
            ""
            if generated in self.special and self.dialect == "llama-cpp"
            else self.tokenizer.decode([generated])
        )
        choice = {"index": 0, "text": text, "logprobs": listing, "finish_reason": "length"}
        return httpx.Response(
            200, json={"id": "cmpl-1", "object": "text_completion", "model": "tiny", "choices": [choice]}
        )

    def _listing(self, ids: list[int], k: int, as_ids: bool) -> tuple[Listing, int]:
        # row i: after ids[: i + 1]
        logprobs = torch.log_softmax(self.runner.forward_full(ids, len(ids)).double(), dim=-1)
        generated = int(torch.argmax(logprobs[-1]))
        if self.dialect == "llama-cpp":
            # as llama_cpp.Llama._create_completion (0.3.x): a leading BOS leaves the tokens but
            # not the scores, so without one each token gets the scores *after* it and the
            # generated token falls off the end
            stripped = ids[0] == self.bos
            pairs = list(zip([*(ids[1:] if stripped else ids), generated], logprobs))
        else:  # OpenAI's meaning: each token with the distribution it was drawn from
            pairs = list(zip([*ids, generated], [None, *logprobs]))
        listing: Listing = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        for token, row in pairs:
            if self.dialect == "llama-cpp" and token == self.bos:
                continue  # llama-cpp-python skips every BOS
            name = self._name(token, as_ids)
            if row is None or not listing["tokens"]:  # the first entry has none
                value, top = None, None
            else:
                best = torch.topk(row, k).indices.tolist()
                top = {self._name(t, as_ids): float(row[t]) for t in best}
                value = float(row[token])
                top[name] = value  # the actual token is merged in (overwriting a namesake)
            listing["tokens"].append(name)
            listing["token_logprobs"].append(value)
            listing["top_logprobs"].append(top)
        return listing, generated

    def _name(self, token: int, as_ids: bool) -> str:
        if self.dialect == "vllm" and as_ids:
            return f"token_id:{token}"
        if self.dialect == "llama-cpp" and token in self.special:
            return ""
        return str(self.tokenizer.decode([token])).replace("\ufffd", "")


class Router(httpx.AsyncBaseTransport):
    """Requests by host: each to its own transport (fake engines, in-process worker apps)."""

    def __init__(self, routes: dict[str, httpx.AsyncBaseTransport]) -> None:
        self.routes = routes

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.routes[request.url.host].handle_async_request(request)
