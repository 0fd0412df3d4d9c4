"""`--generation-config`: requests that omit sampling fields get the model's defaults (auto) or OpenAI's (vllm)."""
from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from ecoserve.config import EngineArgs
from ecoserve.engine.async_engine import AsyncEngine
from ecoserve.engine.llm_engine import LLMEngine
from ecoserve.server.app import create_app
from tests.server.conftest import ENGINE_KWARGS
from tests.utils import make_tiny_checkpoint


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("gencfg") / "m", "llama",
                                generation_config={"temperature": 0.2, "top_p": 0.9, "do_sample": True})
    return LLMEngine(EngineArgs(str(path), **ENGINE_KWARGS).create_engine_config())


def sent_params(engine: LLMEngine, mode: str, body: dict, caplog) -> list:
    """The SamplingParams the server queued for `body`, under `--generation-config mode`."""
    async def main() -> list:
        ae = AsyncEngine(engine)
        seen = []
        real = ae.generate

        def record(request_id, ids, params, *args, **kwargs):
            seen.append(params)
            return real(request_id, ids, params, *args, **kwargs)

        ae.generate = record
        with caplog.at_level(logging.INFO, logger="ecoserve.server.app"):
            app = create_app(ae, "tiny", generation_config=mode)
        ae.start()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, **body})
            assert r.status_code == 200, r.text
        await ae.stop()
        return seen

    return asyncio.run(main())


def test_auto_applies_the_models_defaults_and_says_so(engine, caplog):
    (params,) = sent_params(engine, "auto", {}, caplog)
    assert (params.temperature, params.top_p) == (0.2, 0.9)
    assert "temperature=0.2, top_p=0.9" in caplog.text and "--generation-config vllm" in caplog.text
    (params,) = sent_params(engine, "auto", {"temperature": 0.7}, caplog)  # what a request sets wins
    assert (params.temperature, params.top_p) == (0.7, 0.9)


def test_vllm_mode_uses_openai_defaults(engine, caplog):
    (params,) = sent_params(engine, "vllm", {}, caplog)
    assert (params.temperature, params.top_p) == (1.0, 1.0)
    assert "ignoring the model's sampling defaults" in caplog.text
    with pytest.raises(ValueError, match="generation_config must be one of"):
        create_app(AsyncEngine(engine), generation_config="model")
