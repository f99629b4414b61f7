"""The routes that speak other services' APIs, on the same micro-batcher as ``POST /search`` (one queue, its
limits): the OpenAI embeddings API (``POST /v1/embeddings``, ``GET /v1/models``) as the ``openai`` and
``langchain-openai`` clients call it, and Text Embeddings Inference's ``POST /embed`` and ``POST /rerank``.

Which side a text is embedded as: OpenAI's schema has no field for it, so densepass adds ``input_type``
(``"query"`` or ``"passage"``, default passage); TEI's ``prompt_name`` names the side (``"query"``, or
``"passage"`` / ``"document"``). Either way the side's prompt from the model's config is put before the text, as
``BiEncoder.encode_queries`` / ``encode_passages`` do.

Errors come in each API's own shape (:func:`styled_error`): OpenAI's ``{"error": {"message", "type", "param",
"code"}}`` under ``/v1/``, TEI's ``{"error", "error_type"}`` on ``/embed`` and ``/rerank``, densepass's
``{"error"}`` elsewhere.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from functools import partial
from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from densepass.errors import DensepassError
from densepass.serve.backends import Embedder, PairScorer, TooManyTokens
from densepass.serve.microbatch import MicroBatcher, QueueFull, Unavailable
from densepass.serve.settings import ServeSettings
from densepass.serve.texts import query_problem

TEI_PATHS = ("/embed", "/rerank")

OPENAI_TYPES = {401: "invalid_request_error", 404: "invalid_request_error", 503: "server_error", 500: "server_error"}
TEI_TYPES = {
    401: "Unauthorized",
    429: "Overloaded",
    413: "Validation",
    503: "Unhealthy",
    500: "Backend",
    501: "Backend",
}
# how TEI answers what densepass's own API answers otherwise (its router: an overloaded queue is a 429, a batch or
# an input too large a 413), by the refusal's reason
TEI_STATUS = {"queue_full": 429, "too_large": 413}


class ApiError(Exception):
    """A request a route refuses: HTTP ``status``, a one-line ``message``; ``param`` and ``code`` for OpenAI's
    error shape; ``reason`` (``TEI_STATUS``) where TEI's routes answer it with another status."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, reason: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.reason = status, message, param, code, reason


def styled_error(
    path: str,
    status: int,
    message: str,
    headers: dict[str, str] | None = None,
    param: str | None = None,
    code: str | None = None,
    reason: str | None = None,
) -> JSONResponse:
    """An error answer in the shape the clients of ``path`` read: OpenAI's under ``/v1/`` (where 422 is 400, as
    OpenAI answers invalid parameters), TEI's on its routes (with TEI's status for the ``reason``: a full queue a
    429, too many or too long texts a 413), ``{"error": message}`` elsewhere; always one line."""
    message = " ".join(str(message).split())
    if path.startswith("/v1/"):
        status = 400 if status == 422 else status
        kind = OPENAI_TYPES.get(status, "invalid_request_error")
        code = code or ("invalid_api_key" if status == 401 else None)
        body: dict[str, Any] = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    elif path in TEI_PATHS:
        status = TEI_STATUS.get(reason or "", status)
        body = {"error": message, "error_type": TEI_TYPES.get(status, "Validation")}
    else:
        body = {"error": message}
    return JSONResponse(body, status_code=status, headers=headers)


def check_texts(texts: Any, settings: ServeSettings, field: str, what: str = "input") -> list[str]:
    """``texts`` (a string or a list of strings) as a list, within the service's limits (as many as
    ``--max-queries-per-request``, each at most ``--max-query-chars`` characters, none blank or holding a lone
    surrogate); an :class:`ApiError` 400 naming ``field`` otherwise. A list of token ids is refused: the service
    tokenizes with its own model's tokenizer."""
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not texts:
        raise ApiError(400, f"'{field}' must be a string or a non-empty list of strings", field)
    if any(isinstance(t, int) and not isinstance(t, bool) for t in texts) or any(isinstance(t, list) for t in texts):
        raise ApiError(
            400,
            f"'{field}' holds token ids: densepass takes texts (strings) and tokenizes them with the served model's "
            "own tokenizer",
            field,
        )
    if not all(isinstance(t, str) for t in texts):
        raise ApiError(400, f"'{field}' must be a string or a list of strings", field)
    if len(texts) > settings.max_queries_per_request:
        raise ApiError(
            400,
            f"too many texts in '{field}': {len(texts)} (at most {settings.max_queries_per_request})",
            field,
            reason="too_large",
        )
    for i, text in enumerate(texts):
        where = f"{what} {i}" if len(texts) > 1 else what
        if len(text) > settings.max_query_chars:
            message = f"{where} has {len(text)} characters (at most {settings.max_query_chars})"
            raise ApiError(400, message, field, reason="too_large")
        problem = query_problem(text)
        if problem:
            raise ApiError(400, f"{where} {problem}", field)
    return texts


def shorten(vector: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """The first ``dimensions`` components of ``vector`` (all when None), L2-normalised when ``normalize``."""
    out = np.asarray(vector[:dimensions] if dimensions else vector, dtype=np.float32)
    if normalize:
        norm = float(np.linalg.norm(out))
        out = out / norm if norm > 0 else out
    return out


async def batched(batcher: MicroBatcher, operation: str, items: list[Any], function: Callable) -> list[Any]:
    """``function(items)`` through the micro-batcher, its failures as :class:`ApiError` (503 when the queue is
    full or the service is closing, 413 for a text too long without truncation, 400 for input the model refuses)."""
    try:
        return await batcher.run(operation, items, function)
    except Unavailable as err:
        raise ApiError(503, str(err), reason="queue_full" if isinstance(err, QueueFull) else None) from None
    except TooManyTokens as err:
        raise ApiError(413, str(err), reason="too_large") from None
    except DensepassError as err:
        raise ApiError(400, str(err)) from None


# --- OpenAI ---


class EmbeddingsRequest(BaseModel):
    """Body of ``POST /v1/embeddings`` (OpenAI's schema, plus densepass's ``input_type``); strict types, as OpenAI
    checks them (``"dimensions": "8"`` or ``true`` is a 400, not an 8 or a 1); a null ``encoding_format`` is
    unset (float), as OpenAI takes it."""

    model_config = ConfigDict(strict=True, extra="forbid")
    input: Any = Field(..., description="a string or a list of strings (token-id arrays are refused)")
    model: str | None = Field(None, description="the served model's name (GET /v1/models lists the names accepted)")
    encoding_format: Literal["float", "base64"] | None = Field(
        "float", description="float (or null): lists of numbers; base64: little-endian float32 bytes, base64-encoded"
    )
    dimensions: int | None = Field(
        None,
        description="keep the first n components and re-normalise (models trained with Matryoshka only; best at "
        "the prefix dimensions they were trained at)",
    )
    user: str | None = Field(None, description="accepted and ignored")
    input_type: Literal["query", "passage"] = Field(
        "passage", description="densepass: embed as queries or as passages (each with the model's prompt)"
    )


def listed_names(embedder: Embedder) -> tuple[str, ...]:
    """The names of ``embedder`` shown to clients (``GET /v1/models``, the error for an unknown model): its
    ``public_names`` (an :class:`Embedder`'s leave out the model's path on the server), else all its names."""
    return tuple(getattr(embedder, "public_names", embedder.names))


def check_model(embedder: Embedder | None, model: str | None) -> Embedder:
    """The embedder, if the service has one and ``model`` is None or one of its names; else an :class:`ApiError`
    (which lists only the names a client is shown: :func:`listed_names`)."""
    if embedder is None:
        raise ApiError(
            400,
            "this service has no embedding model: serve an index of a bi-encoder (dense, or hybrid) for embeddings",
            "model",
        )
    if model is not None and model not in embedder.names:
        names = ", ".join(repr(n) for n in listed_names(embedder))
        raise ApiError(404, f"the model {model!r} is not served here; use one of {names}", "model", "model_not_found")
    return embedder


def openai_embeddings(
    batcher: MicroBatcher, settings: ServeSettings, embedder: Callable[[], Embedder | None]
) -> Callable:
    """The handler of ``POST /v1/embeddings``; ``embedder()`` gives the current embedder (``backends.Current``)."""

    async def embeddings(body: EmbeddingsRequest, request: Request) -> Any:
        """OpenAI's embeddings API: one embedding per input text, in order, with the tokens the model read."""
        served = check_model(embedder(), body.model)
        texts = check_texts(body.input, settings, "input")
        if body.dimensions is not None and body.dimensions != served.dim:
            if not served.prefix_dims:
                raise ApiError(
                    400,
                    f"dimensions must be {served.dim}: the model was not trained for shorter embeddings (Matryoshka "
                    f"training records its prefix dimensions as matryoshka_dims), got {body.dimensions}",
                    "dimensions",
                )
            if not 1 <= body.dimensions <= served.dim:
                raise ApiError(
                    400, f"dimensions must be from 1 to {served.dim} (the model's), got {body.dimensions}", "dimensions"
                )
        request.state.items = len(texts)
        side = body.input_type
        outputs = await batched(batcher, f"embed:{side}:cut", texts, partial(served.embed, side=side, truncate=True))
        data, tokens = [], 0
        for i, (vector, count) in enumerate(outputs):
            vector = shorten(vector, body.dimensions, body.dimensions is not None and body.dimensions < served.dim)
            if body.encoding_format == "base64":
                value: Any = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
            else:
                value = vector.tolist()
            data.append({"object": "embedding", "index": i, "embedding": value})
            tokens += count
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": served.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    return embeddings


def openai_models(embedder: Callable[[], Embedder | None]) -> Callable:
    """The handler of ``GET /v1/models``."""

    async def models() -> Any:
        """The served model under each name it answers to but its path on the server (:func:`listed_names`;
        none when the index has no bi-encoder)."""
        served = embedder()
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "densepass"}
            for name in (listed_names(served) if served is not None else ())
        ]
        return JSONResponse({"object": "list", "data": data})

    return models


def openai_model(embedder: Callable[[], Embedder | None]) -> Callable:
    """The handler of ``GET /v1/models/{model}``."""

    async def model(model: str) -> Any:
        """One served model, or 404."""
        check_model(embedder(), model)
        return JSONResponse({"id": model, "object": "model", "created": 0, "owned_by": "densepass"})

    return model


# --- Text Embeddings Inference ---

PROMPT_SIDES = {None: "passage", "query": "query", "passage": "passage", "document": "passage"}


class EmbedRequest(BaseModel):
    """Body of ``POST /embed`` (TEI's schema; strict types as TEI's own parser: ``"truncate": "yes"`` is a 422,
    not a true)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    inputs: Any = Field(..., description="a string or a list of strings")
    normalize: bool = Field(True, description="L2-normalise (false: the model's own output)")
    truncate: bool = Field(False, description="cut texts longer than the model reads (false: refuse them, 413)")
    truncation_direction: Literal["right", "Right"] | None = Field(None, description="only right is supported")
    prompt_name: str | None = Field(None, description="'query', or 'passage' / 'document' (the default)")


def tei_embed(batcher: MicroBatcher, settings: ServeSettings, embedder: Callable[[], Embedder | None]) -> Callable:
    """The handler of ``POST /embed``."""

    async def embed(body: EmbedRequest, request: Request) -> Any:
        """TEI's embed: one vector per input, in order."""
        served = check_model(embedder(), None)
        if body.prompt_name not in PROMPT_SIDES:
            raise ApiError(422, f"prompt_name must be 'query', 'passage' or 'document', got {body.prompt_name!r}")
        texts = check_texts(body.inputs, settings, "inputs")
        request.state.items = len(texts)
        side = PROMPT_SIDES[body.prompt_name]
        operation = f"embed:{side}:{'cut' if body.truncate else 'refuse'}"
        outputs = await batched(batcher, operation, texts, partial(served.embed, side=side, truncate=body.truncate))
        return JSONResponse([shorten(vector, None, body.normalize).tolist() for vector, _ in outputs])

    return embed


class RerankRequest(BaseModel):
    """Body of ``POST /rerank`` (TEI's schema; strict types, as ``EmbedRequest``)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    query: str = Field(..., description="the query")
    texts: list[str] = Field(..., description="the texts to score against it")
    raw_scores: bool = Field(False, description="the reranker's raw scores (false: a sigmoid of them)")
    return_text: bool = Field(False, description="give each text back beside its score")
    truncate: bool = Field(False, description="cut pairs longer than the cross-encoder reads (false: refuse, 413)")
    truncation_direction: Literal["right", "Right"] | None = Field(None, description="only right is supported")


def pair_scores(reranker: PairScorer, pairs: list[tuple[str, str]], truncate: bool) -> list[float]:
    """The reranker's score of each (query, text) pair; ``truncate`` False: a pair longer than a cross-encoder
    reads is a :class:`TooManyTokens` error (ColBERT reads each side up to its own limit and cuts)."""
    queries, texts = [q for q, _ in pairs], [t for _, t in pairs]
    limit, tokenizer = getattr(reranker, "max_length", None), getattr(reranker, "tokenizer", None)
    if not truncate and isinstance(limit, int) and tokenizer is not None:
        lengths = [len(ids) for ids in tokenizer(queries, texts, verbose=False)["input_ids"]]
        for i, length in enumerate(lengths):
            if length > limit:
                raise TooManyTokens(
                    f"text {i} with the query has {length} tokens, more than the {limit} the reranker reads "
                    "(send truncate: true to cut it)"
                )
    return [float(s) for s in np.asarray(reranker.score_pairs(queries, texts), dtype=np.float64)]


def tei_rerank(
    batcher: MicroBatcher, settings: ServeSettings, current_reranker: Callable[[], PairScorer | None]
) -> Callable:
    """The handler of ``POST /rerank``."""

    async def rerank(body: RerankRequest, request: Request) -> Any:
        """TEI's rerank: each text's score against the query, best first."""
        reranker = current_reranker()
        if reranker is None:
            message = "this service has no reranker: start it with --rerank MODEL (a cross-encoder or ColBERT)"
            raise ApiError(400, message)
        (query,) = check_texts(body.query, settings, "query", "the query")
        texts = check_texts(body.texts, settings, "texts", "text")
        request.state.items = len(texts)
        operation = f"rerank:{'cut' if body.truncate else 'refuse'}"
        pairs = [(query, text) for text in texts]
        scores = await batched(batcher, operation, pairs, partial(pair_scores, reranker, truncate=body.truncate))
        # ordered by the raw scores: the sigmoid saturates (1.0 above ~36.7), which would tie large scores
        order = sorted(range(len(texts)), key=lambda i: (-scores[i], i))
        if not body.raw_scores:
            scores = [1 / (1 + math.exp(-s)) if s > -700 else 0.0 for s in scores]
        return JSONResponse(
            [{"index": i, "score": scores[i], **({"text": texts[i]} if body.return_text else {})} for i in order]
        )

    return rerank
