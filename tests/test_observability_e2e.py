"""Observability on a live job: JSON metrics, Prometheus text, unit health, and the dashboard
driven by headless Chromium (pause a unit with a click, check it through the API)."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.orchestration.nats_server import free_port
from tests.helpers import AUTH, GATEWAY_TOKEN, REPO, read_status, wait_for

pytestmark = pytest.mark.slow  # real processes and nats-server (run by make test)

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = REPO / "test-artifacts"


#: A ``sitecustomize`` module that shifts a process's wall clock (``time.time``) by
#: ``DILOCO_TEST_CLOCK_OFFSET_S`` seconds and says so on stderr.
SHIFTED_CLOCK = """
import os, sys, time
_offset = float(os.environ["DILOCO_TEST_CLOCK_OFFSET_S"])
_time, _time_ns = time.time, time.time_ns
time.time = lambda: _time() + _offset
time.time_ns = lambda: _time_ns() + int(_offset * 1e9)
print(f"clock shifted by {_offset:+.0f} s", file=sys.stderr, flush=True)
"""


def start_job(
    services,
    nats_url: str,
    job: str,
    *gateway_flags: str,
    clock_offsets_s: dict[int, float] | None = None,
) -> httpx.Client:
    """Outer + 2 tiny learners + a gateway for ``job``; returns a client of the gateway.

    ``clock_offsets_s`` shifts the wall clock of learner processes (by unit) through a
    ``sitecustomize`` module on their ``PYTHONPATH``.
    """
    port = free_port()
    job_flags = ["--nats-url", nats_url, "--job", job, "--model", "tiny"]
    services.start("outer", "outer", *job_flags, "--num-units", "2", "--eval-every-s", "20")
    services.start(
        "gateway",
        "gateway",
        *("--nats-url", nats_url, "--job", job, "--port", str(port)),
        *gateway_flags,
    )
    site = services.workdir / "shifted-clock"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SHIFTED_CLOCK)
    for unit in range(2):
        with pytest.MonkeyPatch.context() as env:
            offset = (clock_offsets_s or {}).get(unit)
            if offset is not None:
                env.setenv("PYTHONPATH", str(site))
                env.setenv("DILOCO_TEST_CLOCK_OFFSET_S", str(offset))
            services.start(
                f"learner-{unit}",
                "learner",
                *job_flags,
                *("--unit", str(unit), "--num-units", "2", "--max-steps", "100000"),
                *("--slowdown", "3"),  # paced: they only need to keep training
                *("--h-steps", "5", "--status-interval-s", "0.5"),
            )
    return httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)


def get_json(client: httpx.Client, path: str) -> dict | None:
    try:
        response = client.get(path)
    except httpx.TransportError:
        return None
    return response.json() if response.status_code == 200 else None


def trained(client: httpx.Client, job: str) -> dict | None:
    """The job's metrics once both units published twice and a merge has been recorded."""
    metrics = get_json(client, f"/jobs/{job}/metrics")
    if (
        metrics
        and len(metrics["units"]) == 2
        and all(u["published"] >= 2 for u in metrics["units"])
        and metrics["train_history"]
        and metrics["eval_history"]
    ):
        return metrics
    return None


def scrape(client: httpx.Client) -> dict:
    text = client.get("/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


#: Unit 0's wall clock runs ahead of the gateway's, unit 1's behind.
CLOCK_OFFSETS_S = {0: 120.0, 1: -120.0}
HEARTBEAT_TIMEOUT_S = 3


@pytest.mark.timeout(300)
def test_metrics_health_and_liveness_of_units_with_skewed_clocks(nats_server, services):
    """JSON metrics, unit health and Prometheus on a live job whose learners' clocks are two
    minutes ahead and behind: both show running (liveness is judged on the NATS server's
    clock), and a killed one shows lost once its heartbeat is older than the timeout."""
    job = "observe"
    client = start_job(
        services,
        nats_server.url,
        job,
        *("--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S)),
        clock_offsets_s=CLOCK_OFFSETS_S,
    )
    try:
        metrics = wait_for(lambda: trained(client, job), 180, "both units to publish and merge")
        for unit, offset in CLOCK_OFFSETS_S.items():
            assert f"clock shifted by {offset:+.0f} s" in services.log(f"learner-{unit}")
        assert [u["unit"] for u in metrics["units"]] == [0, 1]
        assert metrics["eval_history"][0]["version"] == 0
        assert sum(metrics["staleness"].values()) == metrics["applied"] >= 1
        assert metrics["bytes_sent"] > 0 and metrics["payload_bytes"] > 0
        for unit in metrics["units"]:
            assert unit["state"] == "running" and unit["version_lag"] >= 0
            assert unit["tokens_per_s"] is not None and unit["bytes_sent"] > 0
            assert 0 <= unit["heartbeat_age_s"] < HEARTBEAT_TIMEOUT_S
        view = get_json(client, f"/jobs/{job}")
        assert [(u["unit"], u["state"]) for u in view["units"]] == [(0, "running"), (1, "running")]
        # Goodput: each unit's window is measured on its own (skewed) clock, so it stays sane.
        assert 0 < view["goodput"] <= 1.2 and all(0 <= u["goodput"] <= 1.2 for u in view["units"])

        for unit in CLOCK_OFFSETS_S:
            health = get_json(client, f"/jobs/{job}/units/{unit}")
            assert health["state"] == "running" and health["lost"] is False, health
            # The outer publishes params before its status record, so a unit can already be
            # based on a version the status does not show yet: its lag is then 0.
            expected_lag = max(0, health["outer_version"] - health["base_version"])
            assert health["version_lag"] == expected_lag, health
            assert health["counters"]["published"] >= 2 and health["last_error"] is None
        assert client.get(f"/jobs/{job}/units/7").status_code == 404
        assert client.get("/jobs/nothing/metrics").status_code == 404

        # Prometheus: the scraped values lie between two direct reads of the status records.
        outer_before, units_before = read_status(nats_server.url, job)
        samples = scrape(client)
        outer_after, units_after = read_status(nats_server.url, job)
        labels = (("job", job),)
        version = samples[("diloco_outer_version", labels)]
        assert outer_before.version <= version <= outer_after.version
        applied = samples[("diloco_outer_applied_total", labels)]
        assert outer_before.applied <= applied <= outer_after.applied
        assert samples[("diloco_outer_up", labels)] == 1
        for unit in (0, 1):
            key = (("job", job), ("unit", str(unit)))
            step = samples[("diloco_unit_step", key)]
            assert units_before[unit].step <= step <= units_after[unit].step
            running = (("job", job), ("state", "running"), ("unit", str(unit)))
            assert samples[("diloco_unit_state", running)] == 1
            assert samples[("diloco_unit_bytes_sent_total", key)] > 0
            assert 0 <= samples[("diloco_unit_goodput", key)] <= 1.2
        assert 0 < samples[("diloco_job_goodput", labels)] <= 1.2

        # A unit killed without a word is reported lost once its heartbeat is too old.
        learner1 = next(p for name, p, _ in services.children if name == "learner-1")
        os.kill(learner1.pid, signal.SIGKILL)
        health = wait_for(
            lambda: (found := get_json(client, f"/jobs/{job}/units/1")) and found["lost"] and found,
            30,
            "unit 1 to be reported lost",
        )
        # Lost because its last heartbeat is older than the timeout, on the server's clock.
        assert health["heartbeat_age_s"] > HEARTBEAT_TIMEOUT_S, health
        view = get_json(client, f"/jobs/{job}")
        assert [(u["unit"], u["state"]) for u in view["units"]] == [(0, "running"), (1, "lost")]
        lost = (("job", job), ("state", "lost"), ("unit", "1"))
        assert scrape(client)[("diloco_unit_state", lost)] == 1
        # The dead unit's time counts as lost: its goodput falls while it stays dead.
        dead = next(u for u in view["units"] if u["unit"] == 1)["goodput"]
        wait_for(
            lambda: get_json(client, f"/jobs/{job}")["units"][1]["goodput"] < 0.9 * dead,
            30,
            "the killed unit's goodput to fall",
        )
    except Exception:
        print(services.logs())
        print("metrics:", client.get(f"/jobs/{job}/metrics").text[:3000])
        raise


def chromium_driver():
    """A headless Chromium driven by selenium, or a skip saying what is missing."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[dev]')")
    for binary in (CHROMIUM, CHROMEDRIVER):
        if not (os.path.exists(binary) or shutil.which(os.path.basename(binary))):
            pytest.skip(f"{binary} missing: `make browser` installs chromium + chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    options.add_argument("--window-size=1400,1000")
    driver_path = CHROMEDRIVER if os.path.exists(CHROMEDRIVER) else shutil.which("chromedriver")
    return webdriver.Chrome(service=Service(driver_path), options=options)


def save_screenshot(driver, tmp_path: Path) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / "dashboard.png"
    driver.save_screenshot(str(path))
    shutil.copy(path, tmp_path / "dashboard.png")
    print(f"dashboard screenshot: {path} (and {tmp_path / 'dashboard.png'})")
    return path


@pytest.mark.timeout(300)
def test_dashboard_pauses_a_unit_in_headless_chromium(nats_server, services, tmp_path):
    job = "dash"
    driver = chromium_driver()  # skips the test when selenium or Chromium is missing
    from selenium.webdriver.common.by import By

    try:
        client = start_job(services, nats_server.url, job)
        wait_for(lambda: trained(client, job), 180, "both units to publish and merge")
        driver.get(str(client.base_url))

        def page_ready():
            rows = driver.find_elements(By.CSS_SELECTOR, "#units tbody tr[data-unit]")
            points = driver.find_element(By.ID, "loss-chart").get_attribute("data-points")
            return len(rows) == 2 and int(points or 0) >= 2

        wait_for(page_ready, 30, "the dashboard to list both units and draw the loss chart")
        row = '[data-unit="1"]'
        assert driver.find_element(By.CSS_SELECTOR, f"{row} .state").text == "running"

        def latencies_shown():
            # upload / sync / params medians: the first two once an upload reached the params.
            upload, sync, _ = driver.find_element(By.CSS_SELECTOR, f"{row} .latency").text.split(
                " / "
            )
            return upload != "–" and sync != "–" and float(sync) > 0

        wait_for(latencies_shown, 30, "the dashboard to show unit 1's upload and sync latency")
        assert float(driver.find_element(By.CSS_SELECTOR, f"{row} .network-wait").text) >= 0

        def goodput_shown() -> bool:
            # Shown as 0.00 until the outer has applied an upload of the unit: wait for that.
            unit_goodput = driver.find_element(By.CSS_SELECTOR, f"{row} .goodput").text
            job_goodput = driver.find_element(By.ID, "goodput").text
            return unit_goodput != "–" and float(unit_goodput) > 0 and job_goodput != "–"

        wait_for(goodput_shown, 30, "the dashboard to show unit 1's and the job's goodput")
        assert 0 < float(driver.find_element(By.CSS_SELECTOR, f"{row} .goodput").text) <= 1.2

        driver.find_element(By.ID, "token").send_keys(GATEWAY_TOKEN)
        driver.find_element(By.CSS_SELECTOR, f"{row} button.pause").click()

        def unit1_paused():
            view = get_json(client, f"/jobs/{job}")
            unit = next(u for u in (view or {}).get("units", []) if u["unit"] == 1)
            return unit["desired"] == "paused" and unit["state"] == "paused"

        wait_for(unit1_paused, 30, "unit 1 to be paused (desired and reported)", interval_s=0.5)
        health = get_json(client, f"/jobs/{job}/units/1")
        assert (health["desired"], health["state"]) == ("paused", "paused")
        wait_for(
            lambda: driver.find_element(By.CSS_SELECTOR, f"{row} .state").text == "paused",
            10,
            "the dashboard to show unit 1 paused",
        )
        assert driver.find_element(By.CSS_SELECTOR, '[data-unit="0"] .state').text == "running"
        stored = driver.execute_script("return sessionStorage.getItem('diloco-token')")
        assert stored == GATEWAY_TOKEN
        # A gateway of no job (compose's): its page shows the newest job of the registry.
        port = free_port()
        flags = ("--nats-url", nats_server.url, "--job", "", "--port", str(port))
        services.start("gateway-no-job", "gateway", *flags)
        other = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=10)
        wait_for(lambda: get_json(other, "/readyz"), 60, "the second gateway to be ready")
        driver.get(f"http://127.0.0.1:{port}/")
        wait_for(
            lambda: "no job yet" in driver.find_element(By.ID, "outer-state").text,
            10,
            "the page to say there is no job",
        )
        assert other.post("/jobs", json={"job": "newest", "units": 1}).status_code == 201
        driver.get(f"http://127.0.0.1:{port}/")
        wait_for(lambda: driver.current_url.endswith("/?job=newest"), 10, "the newest job shown")
    except Exception:
        print(services.logs())
        raise
    finally:
        save_screenshot(driver, tmp_path)
        driver.quit()
