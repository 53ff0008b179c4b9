"""The dashboard (gateway/dashboard.py, gateway/static/): its login and session cookie over real HTTPS, and the page
itself in headless Chromium during a burst of traffic against examples/chat.py, read back from its own DOM."""
import base64
import hashlib
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from ember.gateway.dashboard import quantile

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
BURST = 12  # concurrent streamed completions per wave; the first wave waits for the first replica in the queue
COMPLETION = {"model": "tiny-qwen3", "prompt": "The sea", "max_tokens": 24, "ignore_eos": True, "stream": True}


def test_quantile_interpolates_inside_the_bucket_like_prometheus():
    buckets = [(0.1, 2.0), (0.5, 6.0), (1.0, 10.0), (float("inf"), 10.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (5 - 2) / 4)
    assert quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * (9.9 - 6) / 4)
    assert quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    assert quantile(0.99, [(0.1, 1.0), (float("inf"), 3.0)]) == 0.1  # past the last bound: that bound


def test_login_gives_a_session_cookie_never_the_key(serve):
    served = serve(ROOT / "examples" / "hello.py")
    admin, plain = served.key("ops", admin=True), served.key("caller")
    with httpx.Client(base_url=served.url, verify=served.tls()) as browser:
        page = browser.get("/dashboard")
        assert page.status_code == 200 and 'name="key"' in page.text and 'type="password"' in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
        for wrong in ("ek_nope_nope", plain, ""):
            refused = browser.post("/dashboard/login", data={"key": wrong})
            assert refused.status_code == 401 and "admin key" in refused.text and "set-cookie" not in refused.headers
        assert browser.get("/dashboard/api/state").json()["error"]["type"] == "unauthorized"

        login = browser.post("/dashboard/login", data={"key": admin})
        assert login.status_code == 303 and login.headers["location"] == "/dashboard"
        cookie = login.headers["set-cookie"]
        attributes = {part.strip().split("=")[0].lower(): part.strip() for part in cookie.split(";")}
        assert {"httponly", "secure", "samesite", "path", "max-age"} <= set(attributes)
        assert attributes["samesite"].lower() == "samesite=strict" and attributes["path"] == "Path=/dashboard"
        token = browser.cookies["ember_dashboard"]
        # the key is ek_<id>_<secret>, and the secret's alphabet has "_" too: its last "_" piece can be one letter
        assert admin not in cookie and admin.split("_", 2)[2] not in cookie and len(token) >= 40

        state = browser.get("/dashboard/api/state")
        assert state.status_code == 200
        assert [f["function"] for f in state.json()["functions"]] == ["square", "Greeter"]
        assert {k["name"] for k in state.json()["keys"]} >= {"ops", "caller"}
        dashboard = browser.get("/dashboard").text
        assert "Log out" in dashboard and 'name="key"' not in dashboard

        served.cli("keys", "revoke", "ops")  # a revoked key's sessions end with it
        assert browser.get("/dashboard/api/state").status_code == 401
        assert 'name="key"' in browser.get("/dashboard").text


def chromium(tmp_path: Path, served):
    """Headless Chromium through chromedriver, trusting only this gateway's certificate (by its public key)."""
    assert shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER), \
        "the browser tests need Debian's chromium and chromium-driver: run scripts/setup.sh"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    cert = x509.load_pem_x509_certificate((served.home / "tls" / "server.pem").read_bytes())
    spki = cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1440,1300",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}",
                 f"--ignore-certificate-errors-spki-list={base64.b64encode(hashlib.sha256(spki).digest()).decode()}"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


CHART_VALUES = """
const found = {};
for (const path of document.querySelectorAll(`figure[data-function="${arguments[0]}"] path[data-series]`)) {
  const name = `${path.closest("figure").dataset.chart}.${path.dataset.series}`;
  found[name] = {last: path.dataset.last, d: path.getAttribute("d")};
}
return found;
"""


PANELS = """
const card = document.querySelector(`section[data-function="${arguments[0]}"]`);
const start = card.querySelector('[data-panel="cold-starts"] .start');
const decision = card.querySelector('[data-panel="decisions"] .decision.start');
return {tier: start ? start.dataset.tier : null, start: start ? start.textContent : "",
        segments: start ? start.querySelectorAll(".bar i").length : 0, decision: decision ? decision.textContent : "",
        keys: [...document.querySelectorAll("#keys tr[data-key]")].map((row) => row.textContent.trim())};
"""


class Burst:
    """Waves of concurrent streamed completions until stopped; the status codes they got."""

    def __init__(self, served, key: str):
        self.served, self.key = served, key
        self.codes: list[int] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def one(self) -> None:
        with self.served.client(self.key, timeout=120) as http:
            self.codes.append(http.post("/chat/v1/completions", json=COMPLETION).status_code)

    def run(self) -> None:
        while not self.stopping.is_set():
            wave = [threading.Thread(target=self.one) for _ in range(BURST)]
            for thread in wave:
                thread.start()
            for thread in wave:
                thread.join()
            time.sleep(0.3)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(120)


@pytest.mark.slow
def test_dashboard_in_chromium_shows_the_replicas_and_queue_admin_status_reports(serve, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    served = serve(ROOT / "examples" / "chat.py", timeout=120)
    admin = served.key("ops", admin=True)
    browser = chromium(tmp_path, served)
    burst = Burst(served, served.key("traffic"))
    try:
        browser.get(f"{served.url}/dashboard")
        browser.find_element(By.NAME, "key").send_keys(admin)
        browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        wait = WebDriverWait(browser, 30)
        card = (By.CSS_SELECTOR, 'section[data-function="chat/Chat"]')
        wait.until(expected_conditions.presence_of_element_located(card))
        assert browser.execute_script("return document.cookie") == ""  # HttpOnly: the page's script cannot read it

        burst.thread.start()
        seen = {"queued": False, "hot": False}
        deadline = time.monotonic() + 90
        with served.client(admin) as http:
            while not all(seen.values()):
                assert time.monotonic() < deadline, f"the charts never agreed with /admin/status: {seen}"
                charts = browser.execute_script(CHART_VALUES, "chat/Chat")
                status = http.get("/admin/status").json()["apps"]["chat"]["functions"]["Chat"]
                shown = {state: charts[f"replicas.{state}"]["last"] for state in ("starting", "hot", "parked")}
                reported = {state: str(status["replicas_by_state"][state]) for state in ("starting", "hot", "parked")}
                # the LLM charts (slots among them) appear once the engine's metrics were read, after the first start
                slots = "slots.slots" not in charts or (charts["slots.slots"]["last"], charts["slots.queue_slots"][
                    "last"]) == (str(status["load"]), str(status["queue_slots"]))
                if shown == reported and charts["queue.queue"]["last"] == str(status["queue_depth"]) and slots:
                    seen["queued"] |= status["queue_depth"] > 0  # the first wave, waiting for the first start
                    seen["hot"] |= status["replicas_by_state"]["hot"] > 0
                time.sleep(0.2)

        # Once a wave has finished, the request, latency and LLM charts have something to draw.
        WebDriverWait(browser, 60).until(lambda b: all(
            b.execute_script(CHART_VALUES, "chat/Chat")[series]["last"] not in ("", None)
            for series in ("requests.rps", "latency.p99", "ttft.ttft_p99", "itl.itl_p50", "kv.kv", "slots.slots")))
        time.sleep(4)  # a few more seconds of traffic on the charts
        charts = browser.execute_script(CHART_VALUES, "chat/Chat")
        assert float(charts["requests.rps"]["last"]) > 0 and charts["replicas.hot"]["d"].count("L") > 3
        # The page redraws from /admin/status every second, so what it shows can be a second older than a read made
        # now: a replica woken in that second has turned its start from full-boot to parked (a clean-clone CI run
        # saw it). Read until the panel and a status read made around it agree, or give up after 15 s.
        deadline = time.monotonic() + 15
        with served.client(admin) as http:
            def tiers() -> set[str]:
                replicas = http.get("/admin/status").json()["apps"]["chat"]["functions"]["Chat"]["replicas"]
                return {r["start"]["tier"] for r in replicas}

            while True:
                before = tiers()
                panels = browser.execute_script(PANELS, "chat/Chat")  # one read of every panel
                around = before | tiers()
                if panels["tier"] in around or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        assert panels["tier"] in around and "ms" in panels["start"]
        assert panels["segments"] >= 2  # the start's breakdown, one segment per phase
        assert "replicas" in panels["decision"]  # the policy's reason for its start
        assert any(row.startswith("traffic") for row in panels["keys"])

        screenshot = tmp_path / "dashboard.png"
        browser.save_screenshot(str(screenshot))
        assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and screenshot.stat().st_size > 50_000
    finally:
        burst.stop()
        browser.quit()
    assert burst.codes and set(burst.codes) == {200}
