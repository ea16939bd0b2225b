"""The inspector router on a bare FastAPI app served by uvicorn in a thread, SmolLM2 real weights;
JSON endpoints over HTTP and the page in headless Chromium (skipped without chromium/selenium)."""

import json
import shutil
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.real_model
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
CONV = [{"role": "user", "content": "What is the capital of France?"}]


def serve(app):
    """Run `app` with uvicorn in a daemon thread; yield its base URL."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(100):
        if srv.started:
            break
        time.sleep(0.1)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(smollm2):
    """A bare app over an engine and its worker, as the server mounts it: /v1/viz/generate streams a request of
    the worker's batch, an attention pass runs on the worker's thread."""
    from fastapi import FastAPI

    from kvtool.engine import Engine
    from kvtool.serving.core import KvtoolCore
    from kvtool.serving.inspect_http import inspect_router
    from kvtool.serving.worker import Worker

    worker = Worker(KvtoolCore(Engine(smollm2)))
    app = FastAPI()
    app.include_router(inspect_router(lambda: smollm2, worker))
    for base in serve(app):
        yield base, worker
    worker.stop()


@pytest.fixture(scope="module")
def chat_server(smollm2):
    """`kvtool serve`'s app, which mounts the inspector; the page streams from /v1/chat/completions."""
    from kvtool.serving.app import create_app

    app = create_app(smollm2)
    for base in serve(app):
        yield base


def sse(base, body, timeout=300):
    events = []
    with httpx.stream("POST", f"{base}/v1/viz/generate", json=body, timeout=timeout) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_page_and_assets(server):
    base, _ = server
    page = httpx.get(f"{base}/inspect")
    assert page.status_code == 200 and "kvtool inspector" in page.text and "inspect.js" in page.text
    assert httpx.get(f"{base}/inspect/static/inspect.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(f"{base}/inspect/static/../inspect.py").status_code == 404
    missing = httpx.get(f"{base}/inspect/static/nothing.js")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    cfg = httpx.get(f"{base}/v1/viz/config").json()
    assert cfg["num_layers"] == 30 and cfg["num_heads"] == 9 and cfg["generate_url"] == "/v1/viz/generate"


def test_render_and_attention(server, smollm2):
    from kvtool.viz.probs import attention_row

    base, _ = server
    data = httpx.post(f"{base}/v1/viz/render", json={"messages": CONV}).json()
    toks = data["tokens"]
    assert toks[0]["piece"] == "<|im_start|>" and toks[0]["channel"] == "special"
    assert {"system", "user", "assistant"} <= {t["role"] for t in toks}
    q = data["n_tokens"] - 1
    att = httpx.post(f"{base}/v1/viz/attention", json={"ids": data["ids"], "query": q, "layer": 20, "head": "mean"},
                     timeout=120).json()
    assert len(att["row"]) == q + 1 and abs(sum(att["row"]) - 1) < 1e-4
    ref = attention_row(smollm2, data["ids"], q, 20, "mean")
    assert max(abs(a - b) for a, b in zip(att["row"], ref)) < 1e-6
    assert att["top"][0][0] == 0  # the sink


@pytest.mark.parametrize("body, status, words", [
    ({"ids": [1, 2, 3], "query": 1, "layer": 30, "head": 0}, 400, "layer 30 is out of range"),
    ({"ids": [1, 2, 3], "query": 1, "layer": 0, "head": 9}, 400, "head 9 is out of range"),
    ({"ids": [1, 2, 3], "query": 3, "layer": 0, "head": 0}, 400, "query 3 is out of range"),
    ({"ids": [], "query": 0, "layer": 0, "head": 0}, 400, "empty"),
    ({"ids": [1] * 8193, "query": 0, "layer": 0, "head": 0}, 400, "context window is 8192"),
])
def test_attention_bad_input(server, body, status, words):
    base, _ = server
    resp = httpx.post(f"{base}/v1/viz/attention", json=body, timeout=60)
    assert resp.status_code == status and words in resp.json()["error"]["message"]
    assert resp.json()["error"]["type"] == "invalid_request_error"  # the chat routes' shape
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_render_and_generate_bad_input(server):
    base, _ = server
    resp = httpx.post(f"{base}/v1/viz/render", json={"prompt": "  "})
    assert resp.status_code == 400 and "empty" in resp.json()["error"]["message"]
    resp = httpx.post(f"{base}/v1/viz/generate", json={"messages": CONV, "max_tokens": 9000})
    assert resp.status_code == 400 and "context window" in resp.json()["error"]["message"]


def test_generate_streams_tokens_and_timings_through_the_worker(server, smollm2):
    base, worker = server
    got, gate = [], threading.Event()
    busy = threading.Thread(target=worker.run_exclusive, args=(gate.wait,))
    busy.start()  # the worker's thread is taken: the stream must wait for it
    t = threading.Thread(target=lambda: got.extend(sse(base, {"messages": CONV, "max_tokens": 12})))
    t.start()
    time.sleep(1.5)
    assert not got and t.is_alive()
    gate.set()
    t.join(timeout=300)
    tokens = [e for e in got if e["type"] == "token"]
    done = got[-1]
    assert got[0]["type"] == "start" and tokens and done["type"] == "done"
    assert all({"id", "piece", "channel", "t_ms"} <= set(e) for e in tokens)
    assert "Paris" in "".join(e["piece"] for e in tokens)
    assert done["timings"]["ttft_ms"] > 0 and done["timings"]["cached_tokens"] == 0
    assert [e["t_ms"] for e in tokens] == sorted(e["t_ms"] for e in tokens)


def test_a_router_without_a_worker_makes_its_own(smollm2):
    from fastapi import FastAPI

    from kvtool.serving.inspect_http import inspect_router

    app = FastAPI()
    app.include_router(inspect_router(lambda: smollm2))
    for base in serve(app):
        events = sse(base, {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0})
        ids = httpx.post(f"{base}/v1/viz/render", json={"prompt": "Paris is"}).json()["ids"]
        att = httpx.post(f"{base}/v1/viz/attention", json={"ids": ids, "query": len(ids) - 1}, timeout=120).json()
    assert [e["type"] for e in events] == ["start", "token", "token", "token", "done"], events
    assert len(att["row"]) == len(ids) and abs(sum(att["row"]) - 1) < 1e-4


def browser(profile):
    """Headless Chromium via selenium + /usr/bin/chromedriver, or None when any piece is missing.

    Its profile lives in ``profile`` (the test's tmp_path), so no run leaves one behind."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        return None
    chrome = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chrome or not driver:
        return None
    opts = webdriver.ChromeOptions()
    opts.binary_location = chrome
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1500,1000",
                 f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=opts)


@pytest.mark.parametrize("which", ["server", "chat_server"])
def test_inspector_page_in_headless_chromium(which, request, tmp_path):
    driver = browser(tmp_path / "chromium")
    if driver is None:
        pytest.skip("needs chromium, chromedriver and selenium (apt-get install chromium chromium-driver; "
                    "pip install selenium)")
    base = request.getfixturevalue(which)
    base = base[0] if isinstance(base, tuple) else base
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        wait = WebDriverWait(driver, 240)
        driver.get(f"{base}/inspect")
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
        box = driver.find_element(By.ID, "conversation")
        box.clear()
        box.send_keys(json.dumps(CONV))
        driver.find_element(By.ID, "max-tokens").clear()
        driver.find_element(By.ID, "max-tokens").send_keys("16")
        runs = 2 if which == "chat_server" else 1  # the server's prefix cache serves the second run
        for run in range(runs):
            driver.execute_script("document.body.dataset.generation = ''")
            driver.find_element(By.ID, "generate").click()
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#tokens .tok.gen"))  # tokens stream in
            wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-generation") == "done")
        assert "Paris" in driver.find_element(By.ID, "raw").text
        assert driver.find_element(By.ID, "stat-ttft").text.endswith("ms")
        cached = int(driver.find_element(By.ID, "stat-cached").text)
        assert cached == 0 if which == "server" else cached > 0
        generated = driver.find_elements(By.CSS_SELECTOR, "#tokens .tok.gen")
        target = generated[len(generated) // 2]
        query = int(target.get_attribute("data-i"))
        target.click()
        strip = driver.find_element(By.ID, "strip")
        wait.until(lambda d: strip.get_attribute("data-query") == str(query))
        assert int(strip.get_attribute("data-len")) == query + 1
        painted = driver.execute_script(
            "const c = document.getElementById('strip');"
            "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let n = 0;"
            "for (let i = 3; i < d.length; i += 4) n += d[i] > 0; return n;")
        assert painted > 1000
        assert "token #" in driver.find_element(By.ID, "attention-info").text
        assert not driver.find_element(By.ID, "error").is_displayed()
        ARTIFACTS.mkdir(exist_ok=True)
        driver.save_screenshot(str(ARTIFACTS / f"inspector-{which}.png"))
    finally:
        driver.quit()
