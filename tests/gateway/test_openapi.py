"""/openapi.json and /docs of a real gateway: one path per deployed function with its arguments' JSON types from the
signature, calls checked against the same types (422 naming the field), and the docs page rendered in Chromium."""
from pathlib import Path

import pytest

from tests.gateway.test_dashboard import chromium

APPS = Path(__file__).resolve().parent / "apps"


@pytest.fixture(scope="module")
def served(serve_module):
    served = serve_module(APPS / "quick.py", "--no-watch")
    served.cli("deploy", str(APPS / "typed.py"))
    return served


@pytest.fixture(scope="module")
def spec(served) -> dict:
    return served.client(served.key("reader")).get("/openapi.json").json()


def body_schema(spec: dict, path: str) -> dict:
    return spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def result_schema(spec: dict, path: str) -> dict:
    ok = spec["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    return ok["properties"]["result"]


def test_each_function_is_its_own_path_with_its_arguments_json_types(spec):
    assert {"/quick/add", "/quick/sleepy", "/typed/quote", "/typed/count", "/typed/Shouter.shout",
            "/typed/{path}"} <= set(spec["paths"])
    add = body_schema(spec, "/quick/add")
    assert add["properties"] == {"a": {"title": "A", "type": "integer"}, "b": {"title": "B", "type": "integer"}}
    assert add["required"] == ["a", "b"] and add["additionalProperties"] is False

    quote = body_schema(spec, "/typed/quote")
    assert quote["required"] == ["items"]
    assert quote["properties"]["items"] == {"items": {"$ref": "#/components/schemas/typed.quote.Item"},
                                            "title": "Items", "type": "array"}
    assert quote["properties"]["discount"] == {"default": 0.0, "title": "Discount", "type": "number"}
    assert quote["properties"]["note"] == {"default": None, "title": "Note"}  # unannotated: any value
    item = spec["components"]["schemas"]["typed.quote.Item"]
    assert item["properties"]["price"]["type"] == "number" and item["required"] == ["name"]
    assert result_schema(spec, "/typed/quote") == {"additionalProperties": {"type": "number"}, "type": "object"}

    shout = body_schema(spec, "/typed/Shouter.shout")
    assert shout["properties"]["word"]["type"] == "string" and shout["properties"]["times"]["default"] == 1
    assert result_schema(spec, "/typed/Shouter.shout") == {"type": "string"}
    assert "text/event-stream" in spec["paths"]["/typed/count"]["post"]["responses"]["200"]["content"]
    assert set(spec["paths"]["/typed/{path}"]) == {"get", "post", "put", "patch", "delete", "head", "options"}
    assert "OpenAI" in spec["paths"]["/typed/v1/chat/completions"]["post"]["summary"]
    assert set(spec["paths"]["/typed/v1/models"]) == {"get"}
    assert spec["paths"]["/typed/quote"]["post"]["responses"]["422"]["content"]


def test_a_call_is_checked_against_the_same_types_and_the_error_names_the_field(served):
    with served.client(served.key()) as http:
        good = http.post("/typed/quote", json={"items": [{"name": "tea", "price": 2.0}], "discount": 0.5})
        assert good.json() == {"result": {"total": 1.0}}
        bad = http.post("/typed/quote", json={"items": [{"price": 2.0}]})
        assert bad.status_code == 422 and bad.json()["error"]["type"] == "invalid_arguments"
        assert "items.0.name: Field required" in bad.json()["error"]["message"]
        typo = http.post("/typed/Shouter.shout", json={"word": "hi", "timez": 2})
        assert typo.status_code == 422 and "unknown argument 'timez'" in typo.json()["error"]["message"]


def test_a_redeploy_changes_the_document(served, spec, tmp_path):
    changed = tmp_path / "typed.py"
    changed.write_text((APPS / "typed.py").read_text().replace("discount: float = 0.0", "discount: int = 0"))
    served.cli("deploy", str(changed))
    now = served.client(served.key("reader")).get("/openapi.json").json()
    assert body_schema(now, "/typed/quote")["properties"]["discount"] == {"default": 0, "title": "Discount",
                                                                          "type": "integer"}
    served.cli("deploy", str(APPS / "typed.py"))  # back, for the other tests


DOCS = """
const found = {};
for (const row of document.querySelectorAll('.operation[data-path="' + arguments[0] + '"] tr[data-argument]')) {
  found[row.dataset.argument] = [...row.querySelectorAll("td")].map((cell) => cell.textContent);
}
return found;
"""


def test_the_docs_page_renders_every_function_with_its_argument_types(served, tmp_path):
    page = served.client(None).get("/docs")
    assert page.status_code == 200 and "/docs/static/docs.js" in page.text and "http" not in page.text.split(
        "<body>")[0].replace("http-equiv", "")  # no CDN: the page loads only from the gateway
    browser = chromium(tmp_path, served)
    try:
        browser.get(f"{served.url}/docs#key={served.key('docs-reader')}")
        from selenium.webdriver.support.ui import WebDriverWait

        WebDriverWait(browser, 20).until(lambda b: b.execute_script(DOCS, "/typed/quote"))
        assert browser.execute_script(DOCS, "/typed/quote") == {
            "items": ["items", "array of Item", "yes", ""], "discount": ["discount", "number", "no", "0"],
            "note": ["note", "any", "no", "null"]}
        assert browser.execute_script(DOCS, "/quick/add") == {"a": ["a", "integer", "yes", ""],
                                                               "b": ["b", "integer", "yes", ""]}
        sections = browser.execute_script("return [...document.querySelectorAll('section')].map(s => s.dataset.group)")
        assert sections == ["gateway", "quick", "typed"]
    finally:
        browser.quit()


def test_the_document_names_only_the_functions_the_callers_key_may_call(served):
    from ember.gateway.keys import KeyStore

    anonymous = served.client(None).get("/openapi.json")
    assert anonymous.status_code == 200 and "/healthz" in anonymous.json()["paths"]
    assert not [p for p in anonymous.json()["paths"] if p.startswith(("/quick/", "/typed/"))]  # no app named
    scoped = KeyStore(served.home / "ember.db").create("typed-only", scopes=["app:typed"])[1]
    paths = served.client(scoped).get("/openapi.json").json()["paths"]
    assert "/typed/quote" in paths and not [p for p in paths if p.startswith("/quick/")]
    refused = served.client("ek_not_a_key").get("/openapi.json")
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "unauthorized"
