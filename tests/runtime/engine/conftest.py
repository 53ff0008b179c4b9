"""Fixtures shared by the engine's API tests."""
import openai
import pytest


@pytest.fixture
def client(served):
    """An OpenAI client of the server the test module starts as its `served` fixture: (app, base URL)."""
    with openai.OpenAI(base_url=served[1], api_key="unused", max_retries=0) as client:
        yield client
