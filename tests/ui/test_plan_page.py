"""The plan page and signing in, in a real browser against the real API (no job runs here)."""

import json

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from tests.api.conftest import Server
from tests.ui.conftest import PHONE, TOKEN_KEY, token_of

H100_POOL = {"name": "h100", "gpu": "H100", "gpusPerNode": 8, "maxNodes": 2, "intraNode": "nvlink4",
             "interNode": "ib-8x400g", "pricePerGPUHour": 4.0}


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with Server(tmp_path_factory.mktemp("ui-plan") / "data", local_ray=False) as server:
        yield server


def set_value(browser, element_id: str, value) -> None:
    element = browser.driver.find_element(By.ID, element_id)
    element.clear()
    element.send_keys(str(value))


def plan_on_the_page(browser) -> tuple[dict, dict]:
    """Submits the form; the request it sent (as the page shows it) and the answer it drew."""
    browser.js("document.getElementById('plan-result').replaceChildren()")
    browser.driver.find_element(By.ID, "plan-submit").click()
    browser.wait(lambda: browser.text("#plan-result-strategy") or browser.text("#plan-error"), what="a plan or an error")
    sent = browser.js("const e = document.querySelector('#plan-result details pre'); return e ? e.textContent : '{}'")
    request = json.loads(sent)
    return request, {"strategy": browser.text("#plan-result-strategy"), "cost": browser.text("#plan-result-cost"),
                     "band": browser.text("#plan-result-band"), "band_basis": browser.text("#plan-result-band-basis"),
                     "rejected": browser.js("return [...document.querySelectorAll('#plan-rejected tbody tr')]"
                                            ".map(r => [...r.cells].map(c => c.innerText))"),
                     "title": browser.text("#plan-result-title")}


def test_a_wrong_token_is_refused_and_a_right_one_signs_in(api, browser):
    alice = api.tenant("alice")
    browser.driver.get(f"{api.url}/ui/")
    browser.js(f"sessionStorage.removeItem('{TOKEN_KEY}'); location.reload()")
    browser.wait(lambda: browser.driver.find_elements(By.ID, "token-input"), what="the sign-in box")
    assert browser.attribute("label[for=token-input]", "for") == "token-input"  # the field has its label
    browser.driver.find_element(By.ID, "token-input").send_keys("tw-not-a-token")
    browser.driver.find_element(By.CSS_SELECTOR, "#signin-form button[type=submit]").click()
    browser.wait(lambda: "refused this token (401)" in browser.text("#signin-error"), what="the 401 said")
    assert browser.js(f"return sessionStorage.getItem('{TOKEN_KEY}')") is None
    set_value(browser, "token-input", token_of(alice))
    browser.driver.find_element(By.CSS_SELECTOR, "#signin-form button[type=submit]").click()
    browser.wait(lambda: browser.text("#jobs-empty").startswith("No jobs yet"), what="alice's (empty) job list")
    assert browser.console_errors() == []


def test_the_plan_page_plans_a_described_pool_and_names_the_field_it_refuses(api, browser):
    alice = api.tenant("alice")
    browser.open(api.url, token_of(alice), "/plan")
    browser.wait(lambda: browser.driver.find_elements(By.ID, "plan-submit"), what="the plan form")
    # the choices come from the API's own schema
    gpus = [o.get_attribute("value") for o in Select(browser.driver.find_element(By.ID, "plan-gpu")).options]
    assert {"H100", "H200", "A100-40GB"} <= set(gpus)
    Select(browser.driver.find_element(By.ID, "plan-method")).select_by_value("full")
    request, shown = plan_on_the_page(browser)
    answer = alice.post("/v1/plans", json=request)  # what the page sent, asked again
    assert answer.status_code == 200, answer.text
    plan = answer.json()["plan"]
    assert request["poolSpec"]["gpu"] == "H100" and request["spec"]["method"] == {"type": "full"}
    assert shown["strategy"] == f"{plan['strategy']} · {plan['gpus']} GPUs" + (
        f" on {plan['nodes']} nodes" if plan["nodes"] > 1 else "")
    assert shown["cost"] == f"${plan['predicted']['costUSD']:,.2f}"
    band = plan["predicted"]["band"]  # how far to trust it, and what that comes from
    assert f"${band['costUSDLow']:,.2f}" in shown["band"] and f"${band['costUSDHigh']:,.2f}" in shown["band"]
    assert shown["band_basis"] == band["basis"] and "P10-P90" in band["basis"]
    assert len(plan["rejected"]) >= 2 and shown["rejected"] == [
        [r["strategy"], str(r["gpus"]) if r["gpus"] is not None else "—", r["reason"]] for r in plan["rejected"]]
    assert "on the pool described" in shown["title"]

    # a field the API refuses: its message beside that field, the field marked invalid
    set_value(browser, "plan-gpus-per-node", 0)
    plan_on_the_page(browser)
    error = browser.text("#plan-gpus-per-node-error")
    assert "poolSpec.gpusPerNode" in error and "greater than 0" in error
    assert browser.attribute("#plan-gpus-per-node", "aria-invalid") == "true"
    assert "poolSpec.gpusPerNode" in browser.text("#plan-error")
    set_value(browser, "plan-gpus-per-node", 8)
    set_value(browser, "plan-model", "hf://nobody/nothing")
    plan_on_the_page(browser)
    assert "unknown model" in browser.text("#plan-model-error")
    assert browser.attribute("#plan-gpus-per-node", "aria-invalid") is None  # the earlier error is gone

    # a registered pool is offered, and planned on by name
    assert api.client().post("/v1/pools", json=H100_POOL).status_code == 201
    browser.open(api.url, token_of(alice), "/plan")
    browser.wait(lambda: browser.driver.find_elements(By.CSS_SELECTOR, "#plan-pool option[value=h100]"),
                 what="the registered pool offered")
    Select(browser.driver.find_element(By.ID, "plan-pool")).select_by_value("h100")
    assert browser.attribute("#pool-spec", "disabled") is not None  # the description is not what is planned
    request, shown = plan_on_the_page(browser)
    assert request["pool"] == "h100" and "poolSpec" not in request and "on pool h100" in shown["title"]
    browser.viewport(PHONE, mobile=True)
    browser.wait(lambda: browser.js("return innerWidth") == PHONE[0], what="the phone's width")
    assert browser.js("return document.documentElement.scrollWidth") <= PHONE[0]  # nothing runs off the screen
    browser.screenshot("plan-page-phone.png", full_page=True)
    assert browser.console_errors() == []
