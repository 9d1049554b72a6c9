"""Fixtures of the load-generator tests: the scripted OpenAI server on 127.0.0.1 and the
tiny test model's tokenizer (module scope: one server per test module)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pdserve.engine.loader import load_tokenizer
from pdserve.engine.testmodel import ensure_test_model
from tests.bench.fake_openai import FakeOpenAI
from tests.support.http import ThreadedServer


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[FakeOpenAI, str]]:
    fake = FakeOpenAI()
    server = ThreadedServer(fake.app)
    try:
        yield fake, server.start()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(ensure_test_model("tiny"))
