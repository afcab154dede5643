"""The rerank-api backend against real HTTP servers on 127.0.0.1.

The hosted dialects (Cohere, Jina, Voyage) and the self-hosted ones (TEI, Infinity)
answer with the response shapes of their public API references, served by a
scripted local server (tests/support/http_stub.py); rate limits, server errors, slow
and killed servers are real HTTP behaviour.  test_rerank_servers.py runs the backend
against a real llama-server and a real Infinity.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from typing import Any

import pytest

from memory.config import RerankerConfig, load_profile_file
from memory.errors import ConfigError, RerankerError, RerankerUnavailable
from memory.records import Hit
from memory.rerank.base import Ranking
from memory.rerank.rerank_api import DIALECTS, RerankApiBackend, endpoint_url, parse_scores
from memory.rerank.score_parsing import sigmoid
from memory.rerank.service import RerankerService
from tests.support.http_stub import Request, StubServer
from tests.support.rerank import engine_search, falling, rerank_texts

KEY = "sk-test-7f3a9c1e5b2d4f6a8e0c"
QUERY = "when is pizza night"
DOCS = ["pizza night is friday", "my cat sleeps", "bring snacks", "pizza 🍕 at 8pm", ""]


def relevance(query: str, doc: str) -> float:
    """A deterministic score in [0, 1]: the share of query words in the document."""
    words = set(query.split())
    return round(len(words & set(doc.split())) / len(words), 4)


def documented_answer(dialect: str, body: dict[str, Any], logits: bool = False) -> Any:
    """The answer each API reference documents, results sorted best first."""
    docs = body["texts"] if dialect == "tei" else body["documents"]
    scored = [(i, relevance(body["query"], d)) for i, d in enumerate(docs)]
    scored.sort(key=lambda p: -p[1])
    if logits:
        scored = [(i, 8 * s - 4) for i, s in scored]
    if dialect == "tei":
        return [{"index": i, "score": s} for i, s in scored]
    items = [{"index": i, "relevance_score": s} for i, s in scored]
    if dialect == "cohere":
        return {"id": "07734bd2-2473-4f07-94e1-0d9f0e6843cf", "results": items,
                "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1}}}
    if dialect == "voyage":
        return {"object": "list", "data": items, "model": body["model"],
                "usage": {"total_tokens": 26}}
    if dialect == "infinity":
        return {"object": "rerank", "results": items, "model": body["model"],
                "usage": {"prompt_tokens": 26, "total_tokens": 26}, "id": "infinity-1",
                "created": 1700000000}
    return {"model": body["model"], "usage": {"total_tokens": 26}, "results": [
        {**item, "document": {"text": docs[item["index"]]}} for item in items]}


def config(url: str, dialect: str = "jina", **settings: Any) -> RerankerConfig:
    return RerankerConfig.from_table({"backend": "rerank-api", "url": url, "dialect": dialect,
                                      "model": "rerank-test", "timeout": 5.0, **settings})


def backend_for(settings: RerankerConfig) -> RerankApiBackend:
    return RerankApiBackend(settings.rerank_api, settings.timeout)


def answering(dialect: str, **options: Any):
    def respond(request: Request):
        return 200, documented_answer(dialect, request.body, **options), {}
    return respond


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_every_dialect_scores_in_input_order(dialect, monkeypatch):
    monkeypatch.setenv("RERANK_TEST_KEY", KEY)
    with StubServer(answering(dialect)) as server:
        backend = backend_for(config(server.url, dialect, api_key_env="RERANK_TEST_KEY"))
        backend.load()
        assert backend.score(QUERY, DOCS) == [relevance(QUERY, d) for d in DOCS]
    request = server.requests[0]
    assert request.path == DIALECTS[dialect].path
    assert request.headers["authorization"] == f"Bearer {KEY}"
    assert request.body["query"] == QUERY
    if dialect == "tei":
        assert request.body["texts"] == DOCS and request.body["raw_scores"] is False
        assert "model" not in request.body
    else:
        assert request.body["documents"] == DOCS and request.body["model"] == "rerank-test"
    if dialect == "voyage":
        assert request.body["top_k"] == len(DOCS)
    elif dialect != "tei":
        assert request.body["top_n"] == len(DOCS)


@pytest.mark.parametrize("suffix, path", [("", "/v2/rerank"), ("/v2", "/v2/rerank"),
                                          ("/v1", "/v1/rerank"), ("/v1/", "/v1/rerank")])
def test_a_cohere_root_with_its_version_is_asked_at_that_versions_path(suffix, path, monkeypatch):
    """Issue 31, item 8: the README says a trailing /v1 is fine, but a Cohere root ending
    in /v1 was sent to /v1/v2/rerank.  Cohere serves /v1/rerank and /v2/rerank alike."""
    monkeypatch.setenv("RERANK_TEST_KEY", KEY)
    with StubServer(answering("cohere")) as server:
        backend = backend_for(config(server.url + suffix, "cohere",
                                          api_key_env="RERANK_TEST_KEY"))
        backend.load()
        assert backend.score(QUERY, DOCS) == [relevance(QUERY, d) for d in DOCS]
    assert [r.path for r in server.requests] == [path]
    assert server.requests[0].body["model"] == "rerank-test"


@pytest.mark.parametrize("base, dialect, expected", [
    ("https://api.cohere.com", "cohere", "https://api.cohere.com/v2/rerank"),
    ("https://api.cohere.com/v2/", "cohere", "https://api.cohere.com/v2/rerank"),
    ("https://api.cohere.com/v1", "cohere", "https://api.cohere.com/v1/rerank"),
    ("https://api.cohere.com/v1/rerank", "cohere", "https://api.cohere.com/v1/rerank"),
    ("https://api.jina.ai/v1", "jina", "https://api.jina.ai/v1/rerank"),
    ("http://127.0.0.1:8080/v1/rerank", "jina", "http://127.0.0.1:8080/v1/rerank"),
    ("http://tei:80", "tei", "http://tei:80/rerank"),
    ("http://h:7997", "infinity", "http://h:7997/rerank"),
    ("https://api.voyageai.com/v1", "voyage", "https://api.voyageai.com/v1/rerank"),
])
def test_the_endpoint_is_found_from_the_server_root(base, dialect, expected):
    assert endpoint_url(base, DIALECTS[dialect]) == expected


@pytest.mark.parametrize("body, message", [
    ({"results": [{"index": 0, "relevance_score": 0.5}]}, "no result for document index(es) [1]"),
    ({"results": [{"index": 0, "relevance_score": 0.5}] * 2}, "two results"),
    ({"results": [{"index": 2, "relevance_score": 0.5}]}, "not one of the 2 documents"),
    ({"results": [{"index": 0, "relevance_score": "high"}]}, "not a number"),
    ({"results": [{"index": 0, "relevance_score": 3.2}, {"index": 1, "relevance_score": 0.1}]},
     'score_scale = "logit"'),
    ({"data": []}, "missing 'results'"),
    ([1, 2], "missing 'results'"),
])
def test_malformed_answers_are_named(body, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_scores(body, DIALECTS["jina"], 2, "auto")


def test_logit_scale_applies_the_sigmoid_once():
    with StubServer(answering("jina", logits=True)) as server:
        scores = backend_for(config(server.url, score_scale="logit")).score(QUERY, DOCS)
    assert scores == pytest.approx([sigmoid(8 * relevance(QUERY, d) - 4) for d in DOCS])


def test_requests_are_split_at_the_servers_document_limit():
    with StubServer(answering("tei")) as server:
        backend = backend_for(config(server.url, "tei", max_documents=2))
        assert backend.score(QUERY, DOCS) == [relevance(QUERY, d) for d in DOCS]
    assert [r.body["texts"] for r in server.requests] == [DOCS[0:2], DOCS[2:4], DOCS[4:]]
    assert backend.requests_sent == 3


def test_429_with_retry_after_is_retried_within_the_deadline():
    calls = []

    def respond(request: Request):
        calls.append(time.monotonic())
        if len(calls) == 1:
            return 429, {"message": "too many requests"}, {"Retry-After": "0.3"}
        return 200, documented_answer("cohere", request.body), {}

    with StubServer(respond) as server:
        backend = backend_for(config(server.url, "cohere"))
        assert backend.score(QUERY, DOCS) == [relevance(QUERY, d) for d in DOCS]
    assert len(calls) == 2 and calls[1] - calls[0] >= 0.3


def test_a_5xx_is_retried_then_succeeds():
    answers = iter([(503, {"error": "overloaded"}, {}), (500, b"oops", {})])

    def respond(request: Request):
        return next(answers, (200, documented_answer("jina", request.body), {}))

    with StubServer(respond) as server:
        assert backend_for(config(server.url)).score(QUERY, DOCS)[0] == relevance(QUERY, DOCS[0])
    assert len(server.requests) == 3


def search(service: RerankerService) -> tuple[list[Hit], Ranking, float]:
    """DOCS reranked as a search's head (retrieval order: ids 1-5), and how long it took."""
    started = time.monotonic()
    ranked, outcome = rerank_texts(service, QUERY, DOCS, falling(len(DOCS)))
    return ranked, outcome, time.monotonic() - started


@pytest.mark.parametrize("scenario", ["slow", "always_429", "retry_after_too_long", "always_500"])
def test_a_struggling_server_falls_back_within_the_deadline(scenario):
    def respond(request: Request):
        if scenario == "slow":
            time.sleep(1.5)
            return 200, documented_answer("jina", request.body), {}
        if scenario == "always_429":
            return 429, {"message": "slow down"}, {"Retry-After": "0.2"}
        if scenario == "retry_after_too_long":
            return 429, {"message": "slow down"}, {"Retry-After": "30"}
        return 500, {"error": {"message": "boom"}}, {}

    with StubServer(respond) as server:
        service = RerankerService(config(server.url, timeout=0.8, oversample=1))
        ranked, outcome, took = search(service)
        service.close()
    assert [h.id for h in ranked] == [1, 2, 3, 4, 5]  # the retrieval order
    assert outcome.fallback and not outcome.ranked
    assert took < 1.2
    if scenario == "retry_after_too_long":
        assert len(server.requests) == 1  # a wait past the deadline is not attempted


def test_a_killed_server_falls_back_and_says_it_is_unreachable():
    with StubServer(answering("jina")) as server:
        service = RerankerService(config(server.url, oversample=1))
        ranked, outcome, _ = search(service)
        assert outcome.fallback is None and ranked[0].id == 1
        server.stop()
        ranked, outcome, took = search(service)
    assert [h.id for h in ranked] == [1, 2, 3, 4, 5]
    assert "cannot reach the rerank API" in outcome.fallback and took < 2.0
    service.close()


def test_a_missing_key_is_one_line_at_load_and_on_search(monkeypatch):
    monkeypatch.delenv("COHERE_TEST_KEY", raising=False)
    with StubServer(answering("cohere")) as server:
        backend = backend_for(config(server.url, "cohere", api_key_env="COHERE_TEST_KEY"))
        with pytest.raises(RerankerUnavailable, match="COHERE_TEST_KEY, which is not set"):
            backend.load()
        with pytest.raises(RerankerUnavailable, match="not set"):
            backend.score(QUERY, DOCS)
    assert server.requests == []  # nothing was sent without a key


@pytest.mark.parametrize("status", [401, 403])
def test_a_refused_key_is_one_line_naming_the_variable(status, monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("VOYAGE_TEST_KEY", KEY)

    def respond(request: Request):  # a server that echoes the key it was given
        return status, {"detail": f"Provided API key {KEY} is invalid"}, {}

    caplog.set_level(logging.DEBUG)
    with StubServer(respond) as server:
        settings = config(server.url, "voyage", api_key_env="VOYAGE_TEST_KEY", oversample=1)
        result = engine_search(tmp_path, settings, DOCS, QUERY)
    reason = result.trace.rerank_fallback
    assert reason.startswith("the rerank API at 127.0.0.1 refused the API key")
    assert "check VOYAGE_TEST_KEY" in reason and "\n" not in reason
    assert server.requests, "the search asked the server"
    assert KEY not in json.dumps(dataclasses.asdict(result.trace)) and KEY not in caplog.text


def test_the_key_never_reaches_logs_or_traces(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("JINA_TEST_KEY", KEY)
    answers = iter([(429, {"message": "later"}, {"Retry-After": "0"}),
                    (500, {"error": "x"}, {})])

    def respond(request: Request):
        return next(answers, (200, documented_answer("jina", request.body), {}))

    caplog.set_level(logging.DEBUG)
    with StubServer(respond) as server:
        settings = config(server.url, api_key_env="JINA_TEST_KEY", oversample=1)
        result = engine_search(tmp_path, settings, DOCS, QUERY)
        backend = backend_for(settings)
    assert result.trace.reranked and len(server.requests) == 3
    assert all(r.headers["authorization"] == f"Bearer {KEY}" for r in server.requests)
    assert KEY not in caplog.text and KEY not in json.dumps(dataclasses.asdict(result.trace))
    assert KEY not in repr(backend.config) and KEY not in repr(settings)


def test_errors_are_typed_and_never_raise_through_a_search():
    with StubServer(lambda r: (400, {"message": "documents too long"}, {})) as server:
        backend = backend_for(config(server.url))
        with pytest.raises(RerankerError, match="HTTP 400 \\(documents too long\\)") as info:
            backend.score(QUERY, DOCS)
    assert info.value.kind == "http_4xx"


@pytest.mark.parametrize("backend", ["rerank-api", "llama-server"])
@pytest.mark.parametrize("url", ["https://user:sk-secret@rerank.example/v1",
                                 "https://rerank.example/v1?api_key=sk-secret",
                                 "https://rerank.example/v1#sk-secret"])
def test_a_url_with_credentials_is_refused_at_profile_validation(backend, url, tmp_path):
    """A key in the URL would be written into log lines and fallback reasons; the
    profile is refused in one line that shows the URL without it."""
    profile = tmp_path / "p.toml"
    profile.write_text(f'[reranker]\nbackend = "{backend}"\nurl = "{url}"\n'
                       'dialect = "jina"\n', "utf-8")
    with pytest.raises(ConfigError, match="reranker.api_key_env") as info:
        load_profile_file(profile)
    message = str(info.value)
    assert "sk-secret" not in message and "\n" not in message
    assert "https://rerank.example/v1" in message


def test_a_backend_built_in_code_refuses_a_url_with_credentials(caplog):
    """Without a profile file (benchmarks, code): refused before anything is sent or
    logged, since httpx itself logs every request's URL."""
    caplog.set_level(logging.DEBUG)
    with StubServer(answering("jina")) as server:
        secret_url = server.url.replace("http://", "http://user:sk-secret@")
        with pytest.raises(ConfigError, match="api_key_env") as info:
            backend_for(config(secret_url))
    assert server.requests == []
    assert "sk-secret" not in str(info.value) and "sk-secret" not in caplog.text
    assert server.url in str(info.value)
