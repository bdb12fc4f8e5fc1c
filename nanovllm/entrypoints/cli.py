"""`nanovllm` command line: `bench` (the throughput workload), `generate` (one completion), `serve`
(the OpenAI-compatible HTTP server) and `quantize` (a weight-only int8 / int4 checkpoint)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import typing
from collections.abc import Sequence

from nanovllm.config import EngineConfig


def _engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's options as flags, derived from EngineConfig's fields (name, type, default, help)."""
    g = p.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for f in EngineConfig.options():
        if f.name == "model":
            continue
        meta = f.metadata
        flag = "--" + f.name.replace("_", "-")
        kind = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None))
        if kind is bool and f.default:
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=True,
                           help=f"{meta['help']} (default: on)")
            for alias in meta["aliases"]:  # a default-on switch's aliases turn it off
                g.add_argument(alias, dest=f.name, action="store_false", help=f"same as --no-{flag[2:]}")
        elif kind is bool:
            g.add_argument(flag, *meta["aliases"], dest=f.name, action="store_true", help=meta["help"])
        else:
            g.add_argument(flag, *meta["aliases"], dest=f.name, type=kind if kind in (int, float) else str,
                           default=f.default, choices=meta["choices"], metavar=meta["metavar"],
                           help=f"{meta['help']} (default: %(default)s)")
    # How to run, not an engine option.
    g.add_argument("--headless", action="store_true",
                   help="run only this node's tensor-parallel workers (a node other than 0)")


def _engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The engine options of the command line: LLM's keyword arguments, EngineConfig's fields."""
    return {f.name: getattr(args, f.name) for f in EngineConfig.options() if f.name != "model"}


def _make_llm(args: argparse.Namespace, model: str):  # noqa: ANN202 - LLM imported lazily
    from nanovllm.llm import LLM

    return LLM(model, **_engine_kwargs(args))  # type: ignore[arg-type]


def _run_headless(args: argparse.Namespace, model: str) -> int:
    """A node other than 0: start this node's workers and wait for them (they end when the engine
    on node 0 stops, or fail when it dies)."""
    from nanovllm.executor.launcher import WorkerProcesses

    config = EngineConfig(model=model, **_engine_kwargs(args))
    parallel = config.parallel
    if parallel.node_rank == 0:
        raise ValueError("--headless is for nodes other than 0 (--node-rank >= 1): node 0 runs the engine")
    workers = WorkerProcesses(config, parallel, parallel.local_ranks)
    workers.expect_exit()  # they leave (0) when node 0's engine stops
    try:
        return workers.wait()
    finally:
        workers.stop(timeout=0.5)


def _cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from nanovllm.builtin_model import ensure_default_model
    from nanovllm.entrypoints.bench import make_workload, run_engine

    model = args.model or str(ensure_default_model())
    if args.headless:
        return _run_headless(args, model)
    llm = _make_llm(args, model)
    on_gpu = llm.engine.device.type == "cuda"
    num_seqs = args.num_seqs or (256 if on_gpu else 64)
    max_input = args.max_input_len or (1024 if on_gpu else 256)
    max_output = args.max_output_len or (1024 if on_gpu else 128)
    workload = make_workload(num_seqs, max_input, max_output, llm.engine.vocab_size, seed=args.seed)
    print(f"model: {model}\ndevice: {llm.engine.device} ({torch.get_num_threads()} threads), "
          f"{num_seqs} sequences, input [100, {max_input}], output [100, {max_output}]")
    try:
        result = run_engine(llm, workload)
    finally:
        llm.engine.shutdown()
    print(f"Total: {result.output_tokens} output tokens in {result.seconds:.2f}s, "
          f"Throughput: {result.output_tok_s:.2f} tok/s (prompt+output {result.total_tok_s:.2f} tok/s)")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from nanovllm.sampling_params import SamplingParams

    if args.headless:
        return _run_headless(args, args.model)
    llm = _make_llm(args, args.model)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed)
    try:
        out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    finally:
        llm.engine.shutdown()
    print(out.outputs[0].text)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        from nanovllm.entrypoints.openai.api_server import ServerConfig, run_server
    except ImportError as e:
        print(f"nanovllm: error: `serve` needs the serve extra (pip install 'nanovllm[serve]'): {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    if args.model is None:
        from nanovllm.builtin_model import BUILTIN_NAME, ensure_default_model

        model = str(ensure_default_model())
        names = args.served_model_name or [BUILTIN_NAME]
    else:
        model = args.model
        names = args.served_model_name or [model]
    if args.headless:
        return _run_headless(args, model)
    config = ServerConfig(model_path=model, served_model_names=names, host=args.host, port=args.port,
                          api_key=args.api_key or os.environ.get("NANOVLLM_API_KEY") or None,
                          max_queued_requests=args.max_queued_requests, log_level=args.log_level,
                          access_log=not args.disable_access_log, max_request_bytes=args.max_request_bytes,
                          trust_request_chat_template=args.trust_request_chat_template,
                          chat_template_timeout=args.chat_template_timeout, limit_concurrency=args.limit_concurrency,
                          timeout_keep_alive=args.timeout_keep_alive, header_timeout=args.header_timeout,
                          shutdown_timeout=args.shutdown_timeout, stream_stall_timeout=args.stream_stall_timeout,
                          grammar_compile_timeout=args.grammar_compile_timeout, step_timeout=args.step_timeout)
    engine = _make_llm(args, model).engine
    try:
        code = run_server(engine, config)
    finally:
        engine.shutdown()  # tensor-parallel workers: stopped now, not at interpreter exit
    return 0 if code is None else code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm", description="LLM inference with a C++ scheduling core")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="throughput on random prompts (built-in model unless --model)")
    bench.add_argument("--model", default=None, help="a Hugging Face model directory")
    bench.add_argument("--num-seqs", type=int, default=None)
    bench.add_argument("--max-input-len", type=int, default=None)
    bench.add_argument("--max-output-len", type=int, default=None)
    _engine_args(bench)
    bench.set_defaults(func=_cmd_bench)

    gen = sub.add_parser("generate", help="print one completion")
    gen.add_argument("--model", required=True)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sampling-seed", type=int, default=None)
    _engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (built-in model unless MODEL_DIR)")
    serve.add_argument("model", nargs="?", default=None, metavar="MODEL_DIR", help="a Hugging Face model directory")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on /v1 routes (default: $NANOVLLM_API_KEY)")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="the name(s) clients pass as `model` (default: MODEL_DIR); the first is reported")
    serve.add_argument("--max-queued-requests", type=int, default=1024,
                       help="answer 503 when this many sequences already wait for the scheduler")
    serve.add_argument("--max-request-bytes", type=int, default=None,
                       help="answer 413 to a larger request body, before reading it (default: 64 bytes per token "
                            "of max_model_len, at least 1 MiB)")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="run chat templates sent with a request (`chat_template`); refused with 400 otherwise")
    serve.add_argument("--chat-template-timeout", type=float, default=5.0,
                       help="seconds a chat template may take to render before the request gets a 400")
    serve.add_argument("--limit-concurrency", type=int, default=None,
                       help="answer 503 beyond this many open connections or requests at once "
                            "(default: the open-file limit less 128, at most 8192)")
    serve.add_argument("--timeout-keep-alive", type=float, default=5.0,
                       help="close an idle keep-alive connection after this many seconds")
    serve.add_argument("--header-timeout", type=float, default=10.0,
                       help="close a connection that has not sent a request's complete headers within this many "
                            "seconds (of connecting or of its previous response); a body part late by as much is a 408")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM/SIGINT, seconds the requests in flight get to finish before they are ended "
                            "(streams with an error event, others with a 503)")
    serve.add_argument("--stream-stall-timeout", type=float, default=60.0,
                       help="abort a request whose client has read none of its output for this many seconds")
    serve.add_argument("--grammar-compile-timeout", type=float, default=30.0,
                       help="a structured-output grammar (JSON schema, regex, grammar) that takes longer to compile "
                            "gets a 400; compiles run in their own worker processes, and end when their client leaves")
    serve.add_argument("--step-timeout", type=float, default=300.0,
                       help="a step that makes no progress for this many seconds (a hung tensor-parallel worker) "
                            "fails the requests in flight with 503, marks /health unhealthy and exits non-zero")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--disable-access-log", action="store_true")
    _engine_args(serve)
    serve.set_defaults(func=_cmd_serve)

    from nanovllm.entrypoints import quantize

    quant = sub.add_parser("quantize", help="write an int8 / int4 weight-only (compressed-tensors) copy of a checkpoint")
    quantize.add_arguments(quant)
    quant.set_defaults(func=quantize.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"nanovllm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
