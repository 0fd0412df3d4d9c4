"""Fixtures for the serving benchmark: a tiny word-level tokenizer and a fake OpenAI streaming server."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

CHAT_TEMPLATE_TOKENS = 3  # what the fake server adds to a chat prompt's usage count


@pytest.fixture(scope="session")
def word_tokenizer_dir(tmp_path_factory) -> str:
    """A HF tokenizer dir whose tokens are the words w0..w199 (decode/encode round-trips exactly)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(200)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("word_tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return str(path)


class FakeState:
    def __init__(self, fail_every: int = 0, token_delay: float = 0.002):
        self.fail_every, self.token_delay = fail_every, token_delay
        self.requests = self.in_flight = self.max_in_flight = 0
        self.bodies: list[dict] = []


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models_():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def serve(request: Request, chat: bool):
        body = await request.json()
        state.requests += 1
        state.bodies.append(body)
        if state.fail_every and state.requests % state.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error",
                                           "param": None, "code": 500}}, status_code=500)
        n = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        if chat:
            prompt_tokens = len(body["messages"][0]["content"].split()) + CHAT_TEMPLATE_TOKENS
        else:
            p = body["prompt"]
            prompt_tokens = len(p) if isinstance(p, list) else len(p.split())
        usage = body.get("stream_options", {}).get("include_usage")

        def chunk(text: str | None, finish: str | None = None) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
            return f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n"

        async def events():
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                if chat:  # the role-only first delta carries no text and must not count as the first token
                    role = {"index": 0, "delta": {"role": "assistant"}}
                    yield f"data: {json.dumps({'id': 'x', 'choices': [role]})}\n\n"
                for i in range(n):
                    await asyncio.sleep(state.token_delay)
                    yield chunk(f" w{i % 200}")
                yield chunk(None, "length")
                if usage:
                    u = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
                    yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': u})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    return app


@pytest.fixture
def fake_server():
    """Start a fake server on a free 127.0.0.1 port; yields a factory(fail_every=0) -> (base_url, state)."""
    started: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(fail_every: int = 0) -> tuple[str, FakeState]:
        state = FakeState(fail_every)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(make_app(state), log_level="warning", lifespan="off"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.01)
        started.append((server, thread))
        return f"http://127.0.0.1:{port}", state

    yield start
    for server, thread in started:
        server.should_exit = True
        thread.join(timeout=5)


@pytest.fixture
def stand_in_package(tmp_path, monkeypatch):
    """Install a stand-in package for peer subprocesses: (name, source) -> the interpreter to run them."""
    import sys

    def install(name: str, source: str) -> str:
        (tmp_path / "fakepkgs" / name).mkdir(parents=True)
        (tmp_path / "fakepkgs" / name / "__init__.py").write_text(source)
        monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fakepkgs"))
        return sys.executable

    return install
