"""The local stack for real, the way a user drives it: `infra/stack.sh up` starts a Prefect server, a process worker
and an MLflow server on free loopback ports with all state in a temp dir and deploys infra/prefect.yaml; the quick
pipeline deployment is triggered through the Prefect REST API with non-default parameters and run by the worker;
MLflow then holds the run and the registered models. A headless Chromium (Debian's chromium + chromium-driver,
driven by Selenium) opens the deployment's run form and the MLflow comparison of two merges; screenshots are saved
under $OPD_TEST_ARTIFACTS (default artifacts/test-screenshots). `infra/stack.sh down` stops everything at the end.
`PORT=<free> bash infra/ui.sh prefect` runs on its own: the browser shows a flow of that server only, and every API
call the page makes goes to that port (not the default 4200).
"""

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from mlflow.tracking import MlflowClient

from tasks.config import pipeline_config
from tasks.common.paths import PROJECT_ROOT

pytestmark = pytest.mark.e2e

SHOTS = Path(os.environ.get("OPD_TEST_ARTIFACTS", PROJECT_ROOT / "artifacts" / "test-screenshots"))
EXPERIMENT = "opd-stack"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("stack-home")
    pp, mp = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "OPD_"))}
    env.update(OPD_HOME=str(home), PREFECT_PORT=str(pp), MLFLOW_PORT=str(mp), OPD_WORK_POOL="opd-test-pool")
    up = subprocess.run(["bash", "infra/stack.sh", "up"], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True,
                        timeout=420)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield {"home": home, "env": env, "api": f"http://127.0.0.1:{pp}/api", "ui": f"http://127.0.0.1:{pp}",
               "mlflow": f"http://127.0.0.1:{mp}", "up": up.stdout}
    finally:
        down = subprocess.run(["bash", "infra/stack.sh", "down"], cwd=PROJECT_ROOT, env=env, capture_output=True,
                              text=True, timeout=120)
        print(down.stdout, down.stderr)


def deployment_id(stack, flow: str, name: str) -> str:
    r = httpx.get(f"{stack['api']}/deployments/name/{flow}/{name}", timeout=30)
    r.raise_for_status()
    return r.json()["id"]


def run_and_wait(stack, flow: str, name: str, parameters: dict, timeout: float = 900) -> tuple[dict, float]:
    """Create a flow run of a deployment through the REST API (what the UI's Run button does) and wait for it."""
    t0 = time.perf_counter()
    for attempt in range(6):  # a 503 (the server's sqlite busy on a loaded machine) says: try again
        r = httpx.post(f"{stack['api']}/deployments/{deployment_id(stack, flow, name)}/create_flow_run",
                       json={"parameters": parameters}, timeout=30)
        if r.status_code != 503:
            break
        print(f"create_flow_run answered 503 ({r.text[:200]}); retrying", flush=True)
        time.sleep(5 * (attempt + 1))
    r.raise_for_status()
    run_id = r.json()["id"]
    while time.perf_counter() - t0 < timeout:
        run = httpx.get(f"{stack['api']}/flow_runs/{run_id}", timeout=30).json()
        if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return run, time.perf_counter() - t0
        time.sleep(3)
    pytest.fail(f"flow run {run_id} of {flow}/{name} did not finish in {timeout}s")


@pytest.fixture(scope="module")
def pipeline_run(stack):
    cfg = pipeline_config("quick", experiment=EXPERIMENT, opd={"steps": 150, "eval_every": 75, "loss": "jsd"},
                          base_train={"steps": 200})
    run, seconds = run_and_wait(stack, "pipeline", "quick", {"cfg": cfg.model_dump(mode="json")})
    print(f"pipeline/quick: 'run' to {run['state']['type']} in {seconds:.0f} s ({run['name']})")
    return cfg, run, seconds


def test_stack_binds_to_loopback_and_deploys_everything(stack):
    assert "Prefect UI  http://127.0.0.1:" in stack["up"] and "MLflow UI   http://127.0.0.1:" in stack["up"]
    r = httpx.post(f"{stack['api']}/deployments/filter", json={}, timeout=30)
    names = {d["name"] for d in r.json()}
    assert {"quick", "default", "nightly"} <= names
    (nightly,) = [d for d in r.json() if d["name"] == "nightly"]
    assert [(s["schedule"]["cron"], s["active"]) for s in nightly["schedules"]] == [("0 6 * * *", False)]


def test_quick_pipeline_deployment_runs_with_non_default_parameters(stack, pipeline_run):
    cfg, run, _ = pipeline_run
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert run["name"].startswith("pipeline-quick-3routes-jsd-")
    client = MlflowClient(stack["mlflow"])
    exp = client.get_experiment_by_name(EXPERIMENT)
    (merge_run,) = client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'")
    assert merge_run.data.params["opd.steps"] == "150" and merge_run.data.params["opd.loss"] == "jsd"
    assert merge_run.data.params["opd.eval_every"] == "75"
    for route in cfg.world.routes:
        assert f"retention/{route}" in merge_run.data.metrics
        active = client.get_model_version_by_alias(f"teacher-{route}", "active")
        assert active.tags["route"] == route
    student = client.get_model_version_by_alias("opd-student", "champion")
    assert student.run_id == merge_run.info.run_id
    # The artifacts went through the server's artifact proxy into the stack's own state directory.
    assert any(p.name == "retention.json" for p in (stack["home"] / "mlartifacts").rglob("retention.json"))


@pytest.fixture(scope="module")
def second_merge(stack, pipeline_run):
    cfg, _, _ = pipeline_run
    mcfg = cfg.merge("", []).model_copy(update={"opd": cfg.opd.model_copy(update={"loss": "forward_kl", "steps": 40,
                                                                                   "eval_every": 40})})
    run, seconds = run_and_wait(stack, "merge", "quick", {"cfg": mcfg.model_dump(mode="json")})
    print(f"merge/quick: 'run' to {run['state']['type']} in {seconds:.0f} s ({run['name']})")
    assert run["state"]["type"] == "COMPLETED", run["state"]
    return run


def chromium():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for exe in ("/usr/bin/chromium", "/usr/bin/chromedriver"):
        assert shutil.which(exe), (f"{exe} missing: `make browser-deps` (part of `make test`) installs Debian's "
                                   "chromium and chromium-driver")
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-quic", "--window-size=1600,1300", f"--user-data-dir={tempfile.mkdtemp(prefix='chromium-')}"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)


def wait_for_text(driver, texts: list[str], timeout: float = 60) -> str:
    from selenium.webdriver.common.by import By

    t0 = time.time()
    body = ""
    while time.time() - t0 < timeout:
        body = driver.find_element(By.TAG_NAME, "body").text
        if all(t in body for t in texts):
            return body
        time.sleep(1)
    missing = [t for t in texts if t not in body]
    pytest.fail(f"{driver.current_url}: {missing} not shown after {timeout}s; page text starts: {body[:500]!r}")


def test_stack_ui_calls_its_api_on_the_stack_port(stack):
    r = httpx.get(f"{stack['ui']}/ui-settings", timeout=30)
    r.raise_for_status()
    assert r.json()["api_url"] == stack["api"]


@pytest.fixture
def prefect_ui_on_another_port(tmp_path):
    """`PORT=<free> bash infra/ui.sh prefect` from a shell that still points PREFECT_API_URL at a server on the default
    port (as `eval "$(bash infra/stack.sh env)"` for a default stack leaves it): yields its UI URL."""
    port = free_port()
    while port == 4200:
        port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "OPD_"))}
    env.update(OPD_HOME=str(tmp_path / "state"), PORT=str(port), PREFECT_API_URL="http://127.0.0.1:4200/api")
    log = open(tmp_path / "prefect-ui.log", "w")
    proc = subprocess.Popen(["bash", "infra/ui.sh", "prefect"], cwd=PROJECT_ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    ui = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            try:
                if httpx.get(f"{ui}/api/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (tmp_path / "prefect-ui.log").read_text()[-3000:]
            assert time.time() - t0 < 180, "prefect server not healthy after 180 s"
            time.sleep(1)
        yield ui
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
        log.close()


def post_api(url: str, body: dict) -> httpx.Response:
    """POST to a Prefect server's API the way Prefect's own client does: a 503 (the server's answer while its SQLite
    database is busy, as on a loaded 2-core machine right after it starts) is retried, a few times, then raised."""
    for _ in range(6):
        r = httpx.post(url, json=body, timeout=30)
        if r.status_code != 503:
            break
        time.sleep(2)
    return r.raise_for_status()


def test_prefect_ui_on_another_port_calls_its_api_on_that_port(prefect_ui_on_another_port):
    ui = prefect_ui_on_another_port
    settings = httpx.get(f"{ui}/ui-settings", timeout=30).json()
    assert settings["api_url"] == f"{ui}/api", settings
    flow_name = f"ui-port-check-{ui.rsplit(':', 1)[1]}"  # exists only on this server: rendering it proves the calls
    r = post_api(f"{ui}/api/flows/", {"name": flow_name})
    post_api(f"{ui}/api/flow_runs/", {"flow_id": r.json()["id"], "name": "ui-port-check-run"})

    SHOTS.mkdir(parents=True, exist_ok=True)
    driver = chromium()
    try:
        driver.get(f"{ui}/flows")
        wait_for_text(driver, [flow_name])
        driver.save_screenshot(str(SHOTS / "prefect-ui-other-port.png"))
        api_calls = driver.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name).filter(n => n.includes('/api/'))")
    finally:
        driver.quit()
    assert api_calls, "the page made no API calls"
    assert all(u.startswith(f"{ui}/api/") for u in api_calls), [u for u in api_calls if not u.startswith(ui)]


def test_browser_shows_the_run_form_and_the_mlflow_comparison(stack, pipeline_run, second_merge):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.actions.wheel_input import ScrollOrigin

    SHOTS.mkdir(parents=True, exist_ok=True)
    driver = chromium()
    try:
        # The merge deployment's run form: every config field with its description, choices as dropdowns.
        dep = deployment_id(stack, "merge", "quick")
        driver.get(f"{stack['ui']}/deployments/deployment/{dep}/run")
        wait_for_text(driver, ["Parameters", "World (Optional)", "Opd (Optional)", "Student Uri (Optional)",
                               "Optimizer steps of the on-policy stage.", "sampled_token", "skew_reverse_kl"])
        driver.save_screenshot(str(SHOTS / "prefect-merge-run-form.png"))
        loss = driver.find_element(By.XPATH, "//*[normalize-space(text())='Loss (Optional)']")
        driver.execute_script("arguments[0].scrollIntoView({block: 'start'});", loss)
        time.sleep(1)
        driver.save_screenshot(str(SHOTS / "prefect-merge-run-form-objective.png"))

        # The real profile's run form: its spec (a path relative to the project root, where the worker runs flows)
        # and its base, as a user starts it from the UI.
        dep = deployment_id(stack, "pipeline", "real")
        driver.get(f"{stack['ui']}/deployments/deployment/{dep}/run")
        wait_for_text(driver, ["Parameters", "Spec (Optional)", "Base Model (Optional)", "Specialist Train (Optional)"])
        shown = driver.execute_script("""return [...document.querySelectorAll('input, textarea')].map(e => e.value)
            .concat([document.body.innerText]).join('\\n');""")
        assert "tasks/gym/routes.yaml" in shown and "smollm2-135m-instruct" in shown, shown[:2000]
        driver.save_screenshot(str(SHOTS / "prefect-real-run-form.png"))

        # MLflow's comparison of the two merges: the compare page lists retention/<route> among the metrics ...
        client = MlflowClient(stack["mlflow"])
        exp = client.get_experiment_by_name(EXPERIMENT)
        runs = client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'")
        assert len(runs) == 2
        ids = json.dumps([r.info.run_id for r in runs], separators=(",", ":"))
        driver.get(f"{stack['mlflow']}/#/compare-runs?runs={ids}&experiments=[\"{exp.experiment_id}\"]")
        wait_for_text(driver, ["Comparing 2 Runs", "Metrics", *(r.info.run_name for r in runs)])
        driver.save_screenshot(str(SHOTS / "mlflow-compare-runs.png"))
        grid = driver.execute_script("""
            const g = [...document.querySelectorAll('.ReactVirtualized__Grid')]
                .filter(g => g.scrollHeight > g.clientHeight + 5 && getComputedStyle(g).overflowY === 'auto');
            if (g.length) g[g.length - 1].scrollIntoView({block: 'center'});
            return g[g.length - 1];""")
        assert grid is not None, "no metrics table on the compare page"
        for _ in range(60):  # the metrics table is virtualised: scroll it as a person would
            if "retention/rev-low" in driver.find_element(By.TAG_NAME, "body").text:
                break
            ActionChains(driver).scroll_from_origin(ScrollOrigin.from_element(grid), 0, 120).perform()
            time.sleep(0.3)
        assert "retention/rev-low" in driver.find_element(By.TAG_NAME, "body").text

        # ... and its metric view plots retention per route for both runs side by side.
        keys = ["retention/mean", *(f"retention/{r}" for r in pipeline_run[0].world.routes)]
        driver.get(f"{stack['mlflow']}/#/metric?runs={ids}&metric={quote(json.dumps(keys[0]))}"
                   f"&experiments=[\"{exp.experiment_id}\"]&plot_metric_keys={quote(json.dumps(keys))}"
                   "&x_axis=step&y_axis_scale=linear&line_smoothness=1&show_point=true")
        body = wait_for_text(driver, ["Comparing 2 Runs", *keys, *(f"{r.info.run_name} ({keys[-1]})" for r in runs)])
        driver.save_screenshot(str(SHOTS / "mlflow-compare-retention.png"))
        for r in runs:  # the table under the chart shows each run's final retention/mean
            assert f"{r.info.run_name} {r.data.metrics['retention/mean']}" in body.replace("\n", " ")
    finally:
        driver.quit()
    for shot in ("prefect-merge-run-form.png", "prefect-merge-run-form-objective.png", "prefect-real-run-form.png",
                 "mlflow-compare-runs.png",
                 "mlflow-compare-retention.png"):
        assert (SHOTS / shot).stat().st_size > 10_000, shot
