"""The dashboard's controls in headless Chromium: a dashboard started without a token is read-only (no button works,
and a request made anyway is refused); one started with a token acts only on requests that bear it: pause and
resume from the page change the run's control state in PostgreSQL (a pause that holds calls sets the shims' hold
in Valkey, and the resume lifts it)."""

from __future__ import annotations

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from contract import keys
from dispatcher import store
from dispatcher.dashboard.app import serve_in_thread
from dispatcher.dashboard.live import LiveRun
from dispatcher.driver import loop as runmod
from tests.dashboard.test_live_view import Loop, plan_for

TOKEN = "a-control-token-of-this-test"
POST_JS = """
const done = arguments[arguments.length - 1];
fetch("api/runs/" + arguments[0] + "/control", {method: "POST", headers: {"Content-Type": "application/json",
      "Authorization": "Bearer " + arguments[1]}, body: JSON.stringify({action: "pause"})})
  .then((r) => done(r.status), () => done(-1));
"""


@pytest.fixture
def live_run(tmp_path, pg, valkey, unique):
    """A running run with a live view for the page to follow."""
    plan = plan_for(tmp_path, unique)
    runmod.open_run(pg, plan)
    LiveRun(valkey, plan, Loop(target=1, running={}), every_s=0, pool_every_s=0, ledger_every_s=0).update({}, {})
    return unique


def paused(pg, run: str) -> bool:
    got = store.control(pg, run).paused
    pg.commit()
    return got


def calls_held(pg, run: str) -> bool:
    got = store.control(pg, run).hold_calls
    pg.commit()
    return got


def open_page(browser, url: str, run: str) -> None:
    browser.get(f"{url}?run={run}")
    WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "state").text == "running")
    WebDriverWait(browser, 20).until(lambda b: b.execute_script("return controlEnabled !== undefined"))


def button(browser, name: str):
    return browser.find_element(By.ID, name)


def test_without_a_token_the_dashboard_is_read_only(browser, valkey_url, live_run, pg):
    url = serve_in_thread(valkey_url, port=0)
    open_page(browser, url, live_run)
    WebDriverWait(browser, 20).until(lambda b: "read-only" in b.find_element(By.ID, "control-msg").text)
    assert browser.find_element(By.ID, "token").get_attribute("disabled") is not None
    assert all(not button(browser, b).is_enabled() for b in ("pause", "hold-calls", "resume", "resize", "cancel"))
    assert browser.execute_async_script(POST_JS, live_run, "anything") == 403  # asked anyway: refused
    assert not paused(pg, live_run)


def test_with_its_token_pause_and_resume_act_and_without_it_nothing_does(browser, valkey_url, valkey, live_run, pg):
    url = serve_in_thread(valkey_url, port=0, token=TOKEN)
    open_page(browser, url, live_run)
    WebDriverWait(browser, 20).until(lambda b: b.execute_script("return controlEnabled"))
    assert not button(browser, "pause").is_enabled()  # no token typed: no button works
    assert browser.execute_async_script(POST_JS, live_run, "") == 401
    assert not paused(pg, live_run)

    token = browser.find_element(By.ID, "token")
    token.send_keys("not-the-token")
    button(browser, "pause").click()
    WebDriverWait(browser, 20).until(lambda b: "refused" in b.find_element(By.ID, "control-msg").text)
    assert not paused(pg, live_run)

    token.clear()
    token.send_keys(TOKEN)
    button(browser, "pause").click()
    WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "control-msg").text == "pause: done")
    assert paused(pg, live_run) and not valkey.exists(keys.run_hold(live_run))  # launches paused, calls not held
    button(browser, "hold-calls").click()  # pause again, holding the shims' new calls too (`pause --hold-calls`)
    button(browser, "pause").click()
    WebDriverWait(browser, 20).until(lambda b: calls_held(pg, live_run))
    assert paused(pg, live_run) and valkey.exists(keys.run_hold(live_run))  # the shims' key, set with the row
    button(browser, "resume").click()
    WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "control-msg").text == "resume: done")
    assert not paused(pg, live_run)
    assert not valkey.exists(keys.run_hold(live_run))  # the shims' hold lifted with it

    resize = browser.find_element(By.ID, "resize-n")
    resize.clear()
    resize.send_keys("3")
    button(browser, "resize").click()
    WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "control-msg").text == "resize: done")
    assert store.control(pg, live_run).concurrency == 3
    pg.commit()
