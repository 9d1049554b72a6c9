"""The request bodies in the OpenAPI document the ingress publishes (GET /openapi.json).

The POST routes read their body themselves (to return OpenAI's 400 body, not FastAPI's
422), so FastAPI cannot see their schemas; this module adds them from the pydantic request
models, with the models' shared definitions under ``components/schemas``. Clients and the
property-based fuzz test (tests/deployments/test_openapi_fuzz.py) generate requests from it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from pdserve.deployments.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

REF_TEMPLATE = "#/components/schemas/{model}"
_MODELS = (
    CompletionRequest,
    ChatCompletionRequest,
    TokenizeCompletionRequest,
    TokenizeChatRequest,
    DetokenizeRequest,
)
_REFS, _DEFS = models_json_schema(
    [(model, "validation") for model in _MODELS], ref_template=REF_TEMPLATE
)


def _ref(model: type) -> dict[str, Any]:
    return _REFS[(model, "validation")]


COMPLETION_SCHEMA = _ref(CompletionRequest)
CHAT_SCHEMA = _ref(ChatCompletionRequest)
TOKENIZE_SCHEMA = {"oneOf": [_ref(TokenizeCompletionRequest), _ref(TokenizeChatRequest)]}
DETOKENIZE_SCHEMA = _ref(DetokenizeRequest)


def request_body(schema: dict[str, Any]) -> dict[str, Any]:
    """``openapi_extra`` for a route taking a JSON body of ``schema``."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` include the request models' definitions."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            doc.setdefault("components", {}).setdefault("schemas", {}).update(
                _DEFS.get("$defs", {})
            )
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
