"""Fixtures shared by the engine's tests."""
import openai
import pytest

from .hf_models import FAMILIES, build


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model_family(request, tmp_path_factory):
    """(directory, transformers model) of each family's random-weight model, built once per test module."""
    directory = tmp_path_factory.mktemp(request.param)
    model = build(request.param, directory)
    return str(directory), model


@pytest.fixture
def client(served):
    """An OpenAI client of the server the test module starts as its `served` fixture: (app, base URL)."""
    with openai.OpenAI(base_url=served[1], api_key="unused", max_retries=0) as client:
        yield client
