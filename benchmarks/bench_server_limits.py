"""What oversized uploads cost `magicdec serve`: a 40 MB prompt's refusal, a small request's latency while three are in
flight, and the server's resident memory before and after.

    PYTHONPATH=. python benchmarks/bench_server_limits.py [--mb 40] [--rounds 3]

Servers of the default model (4 slots x 1024 tokens, no drafting), one after another: with the default body limit
(the prompt gets 413 before it is read); with --max-request-mb 64, so that it is read, parsed and refused (400) by its
length in characters before any tokenizing; and the same with MAGICDEC_MALLOPT=0 (glibc's own malloc settings), to
see what magicdec's keep-freed-memory settings do to the memory a refusal took. For each: one prompt timed alone;
three sent at once with a 4-token completion 0.2 s later (its latency and the refusals' slowest); the server's VmRSS
after a warm-up request and after --rounds rounds of three. Writes benchmarks/results/server_limits.json with the
machine info; prints a table.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_serving import RESULTS, free_port, serving  # noqa: E402

from magicdec.calibrate.machine import machine_info  # noqa: E402
from magicdec.loading import model_identity  # noqa: E402
from magicdec.planner.report import format_table  # noqa: E402

MAX_LEN = 1024
SMALL = json.dumps({"prompt": "The sea was", "max_tokens": 4, "temperature": 0}).encode()
#: name -> (extra serve flags, extra environment)
CONFIGS = {"default limit": ([], {}), "64 MB limit": (["--max-request-mb", "64"], {}),
           "64 MB limit, MAGICDEC_MALLOPT=0": (["--max-request-mb", "64"], {"MAGICDEC_MALLOPT": "0"})}


def post(port: int, body: bytes) -> tuple[int, float]:
    """(status, seconds) of a completion request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status, time.perf_counter() - start
    finally:
        conn.close()


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")) / 1024


def server_pid() -> int:
    """The server's process id: this process's only child."""
    [pid] = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
    return int(pid)


def measure(port: int, huge: bytes, rounds: int) -> dict:
    """One huge prompt alone; three with a small request 0.2 s into them; memory around `rounds` rounds of three."""
    pid = server_pid()
    assert post(port, SMALL)[0] == 200
    rss_before = rss_mb(pid)
    status, alone_s = post(port, huge)
    with ThreadPoolExecutor(3) as pool:
        refusals = [pool.submit(post, port, huge) for _ in range(3)]
        time.sleep(0.2)
        small_status, small_s = post(port, SMALL)
        three = [r.result() for r in refusals]
        for _ in range(rounds - 1):
            three += pool.map(lambda body: post(port, body), [huge] * 3)
    assert small_status == 200 and {s for s, _ in three} == {status}
    return {"status": status, "refusal_s": alone_s, "small_with_three_s": small_s,
            "slowest_of_three_s": max(s for _, s in three[:3]), "rss_before_mb": rss_before,
            "rss_after_mb": rss_mb(pid)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=40, help="prompt size in MB (default 40)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of three huge prompts before memory is read")
    p.add_argument("--out", default=str(RESULTS / "server_limits.json"))
    args = p.parse_args(argv)
    huge = json.dumps({"prompt": "x" * int(args.mb * 1_000_000), "max_tokens": 4}).encode()
    rows = []
    for name, (flags, env) in CONFIGS.items():
        port = free_port()
        cmd = [sys.executable, "-m", "magicdec", "serve", "--port", str(port), "--max-running", "4",
               "--max-model-len", str(MAX_LEN), "--draft", "none", "--log-level", "warning", *flags]
        with serving(cmd, f"http://127.0.0.1:{port}", {"PYTHONPATH": str(ROOT), **env}):
            rows.append({"config": name, "command": " ".join(["magicdec", *cmd[3:]]), "env": env,
                         **measure(port, huge, args.rounds)})
    doc = {"machine": machine_info(), "model": model_identity(None), "prompt_mb": args.mb, "rounds": args.rounds,
           "max_model_len": MAX_LEN, "rows": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(format_table([{"config": r["config"], "status": r["status"], "refusal s": f"{r['refusal_s']:.2f}",
                         "small with 3 in flight s": f"{r['small_with_three_s']:.2f}",
                         "slowest of 3 s": f"{r['slowest_of_three_s']:.2f}",
                         "RSS before MB": f"{r['rss_before_mb']:.0f}", "RSS after MB": f"{r['rss_after_mb']:.0f}"}
                        for r in rows]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
