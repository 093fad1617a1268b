"""The outage mode: every call fails (or is dropped) for a window, set at start-up or live; the fault dice are
not rolled during it, so the calls after it see what they would have seen without it."""

from __future__ import annotations

import http.client
import time

from sim_http import ANTHROPIC, OPENAI, get_json, post

from simulator import SimulatorConfig
from simulator.testing import running_simulator

CHAT = {"model": "gpt-f", "messages": [{"role": "user", "content": "hello"}]}
MESSAGES = {"model": "claude-f", "max_tokens": 50, "messages": [{"role": "user", "content": "hello"}]}


def test_a_live_outage_fails_every_call_for_its_window():
    with running_simulator() as url:
        assert post(f"{url}/v1/messages", MESSAGES, ANTHROPIC).status == 200
        assert post(f"{url}/_sim/outage", {"seconds": 0.6, "status": 529}).json()["status"] == 529
        during = [post(f"{url}/v1/messages", MESSAGES, ANTHROPIC), post(f"{url}/v1/chat/completions", CHAT, OPENAI)]
        time.sleep(0.7)
        after = post(f"{url}/v1/messages", MESSAGES, ANTHROPIC)
        stats = get_json(f"{url}/_sim/stats")["models"]
    assert [a.status for a in during] == [529, 503]  # OpenAI says overloaded with a 503
    assert during[0].json()["error"]["type"] == "overloaded_error"
    assert after.status == 200
    assert stats["claude-f"]["outage"] == 1 and stats["gpt-f"]["outage"] == 1
    assert stats["claude-f"]["output_tokens"] > 0 and stats["gpt-f"]["output_tokens"] == 0


def test_an_outage_from_the_config_starts_later_and_can_drop_connections():
    with running_simulator(SimulatorConfig(outage_at_s=0.3, outage_s=0.5, outage_status=0)) as url:
        assert post(f"{url}/v1/messages", MESSAGES, ANTHROPIC).status == 200
        time.sleep(0.35)
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=5)
        conn.request("POST", "/v1/messages", body=b'{"model": "claude-f", "max_tokens": 5, "messages": []}',
                     headers={**ANTHROPIC, "Content-Type": "application/json"})
        try:
            dropped = conn.getresponse().status
        except (http.client.RemoteDisconnected, ConnectionError):
            dropped = None
        time.sleep(0.5)
        assert post(f"{url}/v1/messages", MESSAGES, ANTHROPIC).status == 200
    assert dropped is None


def test_the_dice_after_an_outage_are_those_of_a_run_without_it():
    def statuses(outage: bool) -> list[int]:
        with running_simulator(SimulatorConfig(error_rate=0.5, error_statuses=[529], seed=3)) as url:
            out = [post(f"{url}/v1/messages", MESSAGES, ANTHROPIC).status for _ in range(4)]
            if outage:
                post(f"{url}/_sim/outage", {"seconds": 0.3})
                assert post(f"{url}/v1/messages", MESSAGES, ANTHROPIC).status == 503
                time.sleep(0.35)
            return out + [post(f"{url}/v1/messages", MESSAGES, ANTHROPIC).status for _ in range(8)]

    assert statuses(True) == statuses(False)


def test_an_outage_can_start_after_some_calls():
    with running_simulator(SimulatorConfig(outage_after_calls=2, outage_s=0.4, outage_status=529)) as url:
        got = [post(f"{url}/v1/messages", MESSAGES, ANTHROPIC).status for _ in range(4)]
        time.sleep(0.45)
        got.append(post(f"{url}/v1/messages", MESSAGES, ANTHROPIC).status)
    assert got == [200, 200, 529, 529, 200]
