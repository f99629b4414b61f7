"""A stand-in for infinity-emb's reranking server, for the tests of ``bench_serve.py --peer infinity --route rerank``
(CI has no infinity-emb environment).

It takes infinity's command line (``v2 --model-id MODEL --port PORT --engine E --device D --batch-size N --dtype
T``; the options it does not need are accepted and ignored) and answers infinity's routes for a cross-encoder:
``GET /health``, ``GET /models`` and its Cohere-style ``POST /rerank`` (``{"query", "documents", "raw_scores"}`` to
``{"results": [{"index", "relevance_score"}]}``, best first), scoring the pairs with densepass's own cross-encoder
in fp32, as infinity scores the same files. With ``FAKE_PEER_SCORES=sigmoid`` in its environment it answers the
sigmoid of the scores even when asked for raw ones, a server whose scores differ (the agreement check must stop).
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel


class RerankInput(BaseModel):
    """infinity's /rerank body."""

    query: str
    documents: list[str]
    raw_scores: bool = False
    return_documents: bool = False
    model: str = "default/not-specified"
    top_n: int | None = None


def create_app(model_path: str) -> FastAPI:
    """The stand-in's app, scoring with the cross-encoder at ``model_path``."""
    from densepass.models.cross_encoder import CrossEncoder

    reranker = CrossEncoder.from_pretrained(model_path, device=torch.device("cpu"), precision="fp32")
    squash = os.environ.get("FAKE_PEER_SCORES") == "sigmoid"
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        """infinity's health answer."""
        return {"unix": time.time()}

    @app.get("/models")
    def models() -> dict:
        """infinity's model list, with the one model."""
        return {"data": [{"id": model_path, "object": "model", "capabilities": ["rerank"]}], "object": "list"}

    @app.post("/rerank")
    def rerank(body: RerankInput) -> dict:
        """infinity's rerank: the documents' scores against the query, best first."""
        scores = [float(s) for s in reranker.score_pairs([body.query] * len(body.documents), body.documents)]
        if squash or not body.raw_scores:
            scores = [1 / (1 + math.exp(-s)) for s in scores]
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n or None]
        results = [{"index": i, "relevance_score": scores[i]} for i in order]
        return {"object": "rerank", "results": results, "model": model_path}

    return app


def main() -> None:
    """Serve until interrupted."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("command", choices=["v2"])
    parser.add_argument("--model-id", required=True)
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args()
    uvicorn.run(create_app(args.model_id), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
