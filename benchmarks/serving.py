"""Serving benchmark: open-loop load against a running `nanovllm serve`, streaming.

Requests arrive as a Poisson process at `--request-rate` per second (`inf`: all at once). Open
loop, as vLLM's benchmark_serving: an arrival never waits for earlier responses, so a server
that falls behind builds a queue and its latencies show it. Each request is a streamed
`/v1/completions` whose prompt is `--input-len` random token ids (drawn from ids the server's
own tokenizer produces, so they decode to text) and which generates exactly `--output-len`
tokens (`ignore_eos`), at `--temperature`.

Measured on the client, per request: TTFT (send -> first chunk with text), ITL (gaps between
consecutive chunks with text; one chunk per engine step), E2E latency; over the run: requests/s
and output tokens/s (from the server's `usage`) over the wall time from the first send to the
last [DONE]. Prints p50/p90/p99 (and the mean); `--json PATH` writes everything.

Usage:
    nanovllm serve --port 8000 &                   # the built-in model, or MODEL_DIR
    python benchmarks/serving.py --num-prompts 200 --request-rate 8 --json serving.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from bench_report import cpu_busy_seconds, machine, write_json

SEED_TEXT = ("The quick brown fox jumps over the lazy dog while a server streams tokens to many clients "
             "at once; continuous batching lets each step carry every running request. ") * 8


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="the `model` to send (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("NANOVLLM_API_KEY"))
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests per second (inf: all at once)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH")
    return p.parse_args(argv)


async def token_pool(client: httpx.AsyncClient, base_url: str) -> list[int]:
    r = await client.post(f"{base_url}/tokenize", json={"prompt": SEED_TEXT, "add_special_tokens": False})
    r.raise_for_status()
    return sorted(set(r.json()["tokens"]))


async def send(client: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> RequestResult:
    start = time.perf_counter()
    res = RequestResult(ok=False)
    last: float | None = None
    try:
        async with client.stream("POST", url, json=payload) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    res.ok = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - start
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run(args: argparse.Namespace) -> tuple[list[RequestResult], float, str]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, headers=headers, limits=limits) as client:
        model = args.model
        if model is None:
            r = await client.get(f"{args.base_url}/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        pool = await token_pool(client, args.base_url)
        rng = random.Random(args.seed)
        payloads = [{
            "model": model, "prompt": [rng.choice(pool) for _ in range(args.input_len)],
            "max_tokens": args.output_len, "ignore_eos": True, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True},
        } for _ in range(args.num_prompts)]
        url = f"{args.base_url}/v1/completions"
        # A short warm-up request, so that connection setup and first-call costs stay out.
        await send(client, url, {**payloads[0], "max_tokens": 2})
        tasks = []
        start = time.perf_counter()
        arrival = 0.0
        for payload in payloads:
            if math.isfinite(args.request_rate):
                arrival += rng.expovariate(args.request_rate)
                delay = start + arrival - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(client, url, payload)))
        results = list(await asyncio.gather(*tasks))
        return results, time.perf_counter() - start, model


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def pct(q: float) -> float:
        # Nearest-rank on the sorted samples, interpolated (as numpy's default "linear").
        pos = (len(ordered) - 1) * q
        lo, hi = math.floor(pos), math.ceil(pos)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {"mean": statistics.fmean(ordered), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    busy0 = cpu_busy_seconds()
    results, seconds, model = asyncio.run(run(args))
    busy1 = cpu_busy_seconds()
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "model": model, "base_url": args.base_url, "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "input_len": args.input_len, "output_len": args.output_len, "temperature": args.temperature,
        "completed": len(ok), "failed": len(failed), "duration_s": seconds,
        "request_throughput": len(ok) / seconds, "output_throughput": out_tokens / seconds,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / seconds,
        "output_tokens": out_tokens,
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": percentiles([x for r in ok for x in r.itl]),
        "e2e_s": percentiles([r.e2e for r in ok if r.e2e is not None]),
        "machine": machine(),
        "machine_cpu_busy_s": None if busy0 is None or busy1 is None else busy1 - busy0,
    }
    rate = summary["request_rate"]
    print(f"model {model} at {args.base_url}: {args.num_prompts} requests at rate {rate}/s, "
          f"input {args.input_len}, output {args.output_len} tokens, temperature {args.temperature}")
    print(f"completed {len(ok)}, failed {len(failed)} in {seconds:.2f} s")
    print(f"request throughput {summary['request_throughput']:.2f} req/s, output {summary['output_throughput']:.1f} "
          f"tok/s, total (prompt + output) {summary['total_token_throughput']:.1f} tok/s")
    print("| metric (ms) | mean | p50 | p90 | p99 |")
    print("|---|---:|---:|---:|---:|")
    for name, key in (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("E2E latency", "e2e_s")):
        row = summary[key]
        cells = " | ".join("-" if row[q] is None else f"{1000 * row[q]:.1f}" for q in ("mean", "p50", "p90", "p99"))
        print(f"| {name} | {cells} |")
    if summary["machine_cpu_busy_s"] is not None:
        print(f"machine CPU busy: {summary['machine_cpu_busy_s']:.1f} CPU-s over {seconds:.1f} s "
              f"(server + this client + anything else)")
    for r in failed[:5]:
        print(f"failed: {r.error}", file=sys.stderr)
    if args.json:
        write_json(args.json, {"summary": summary, "requests": [asdict(r) for r in results]})
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
