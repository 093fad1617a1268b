"""`python -m simulator` as a real subprocess: port file, flags, pace, and the /_sim endpoints."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai
from sim_http import OPENAI, get_json, post

from simulator import SimulatorConfig
from simulator.testing import running_simulator, simulator_process

CHAT = {"model": "gpt-cli", "messages": [{"role": "user", "content": "hello"}]}


def test_cli_binds_a_free_port_and_writes_the_port_file(tmp_path):
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "simulator", "--port", "0", "--port-file", str(port_file), "--rpm", "7"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline().strip()
        port = int(port_file.read_text())
        assert line == f"simulator listening on http://127.0.0.1:{port}"
        assert get_json(f"http://127.0.0.1:{port}/_sim/health") == {"ok": True}
        r = post(f"http://127.0.0.1:{port}/v1/chat/completions", CHAT, OPENAI)
        assert r.status == 200 and r.headers["x-ratelimit-limit-requests"] == "7"
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


def test_cli_rejects_a_demo_policy_without_dataset():
    r = subprocess.run(
        [sys.executable, "-m", "simulator", "--policy", "demo.json"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "needs --dataset" in r.stderr


def test_pace_stats_and_reset():
    config = SimulatorConfig(ttft_ms=300, tokens_per_s=50, error_rate=0.0, seed=1)
    with simulator_process(config) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        start = time.monotonic()
        r = client.chat.completions.create(**CHAT)
        whole = time.monotonic() - start
        output = r.usage.completion_tokens
        assert 0.3 + output / 50 <= whole < 2.0

        start = time.monotonic()
        stamps = [
            time.monotonic() - start
            for c in client.chat.completions.create(**CHAT, stream=True)
            if c.choices and c.choices[0].delta.content
        ]
        assert 0.3 <= stamps[0] < 0.3 + output / 50  # the first token after the TTFT, the rest later
        assert stamps[-1] >= 0.3 + (output - 1) / 50 - 0.02

        totals = get_json(f"{url}/_sim/stats")["models"]["gpt-cli"]
        assert totals["requests"] == 2 and totals["output_tokens"] == 2 * output
        assert totals["input_tokens"] + totals["cached_tokens"] == 2 * r.usage.prompt_tokens
        assert post(f"{url}/_sim/reset", b"").status == 200
        assert get_json(f"{url}/_sim/stats") == {"models": {}}


def test_paced_requests_are_served_concurrently():
    with running_simulator(SimulatorConfig(ttft_ms=300)) as url:
        start = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda _: post(f"{url}/v1/chat/completions", CHAT, OPENAI), range(16)))
        elapsed = time.monotonic() - start
    assert all(a.status == 200 for a in answers)
    assert 0.3 <= elapsed < 1.2  # sixteen 300 ms waits overlap


def test_report_timing_stamps_answers_with_the_monotonic_clock():
    """report_timing (for bench/bench_shim.py): x-simulator-arrived and x-simulator-sent on every answer (its
    perf_counter when the request reached the handler, and when the answer or a stream's head went out), and
    in a stream a `: sent=T` comment before each paced event and the last one, which the official SDK skips.
    Without the flag, none of them."""
    paced = SimulatorConfig(ttft_ms=30, tokens_per_s=500, report_timing=True)
    with running_simulator(paced) as url, running_simulator(SimulatorConfig(ttft_ms=30)) as plain:
        before = time.perf_counter()
        r = post(f"{url}/v1/chat/completions", CHAT, OPENAI)
        after = time.perf_counter()
        arrived, sent = float(r.headers["x-simulator-arrived"]), float(r.headers["x-simulator-sent"])
        assert before < arrived < sent < after and sent - arrived >= 0.03  # the TTFT lies between them

        s = post(f"{url}/v1/chat/completions", {**CHAT, "stream": True}, OPENAI)
        lines = s.text.strip().splitlines()
        stamps = [float(line.split("=")[1]) for line in lines if line.startswith(": sent=")]
        content = [line for line in lines if '"content"' in line and '"role"' not in line]
        assert len(stamps) == len(content) + 1  # each paced (content) event, and the last one ([DONE])
        assert stamps == sorted(stamps) and float(s.headers["x-simulator-sent"]) < stamps[0]
        assert lines[-3].startswith(": sent=") and lines[-1] == "data: [DONE]"

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**CHAT, stream=True)
                       if c.choices)
        assert text and "sent" not in text

        assert not {"x-simulator-arrived", "x-simulator-sent"} & set(post(f"{plain}/v1/chat/completions", CHAT,
                                                                           OPENAI).headers)
        assert ": sent=" not in post(f"{plain}/v1/chat/completions", {**CHAT, "stream": True}, OPENAI).text
