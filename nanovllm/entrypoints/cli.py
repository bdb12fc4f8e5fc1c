"""`nanovllm` command line: `bench` (the throughput workload), `generate` (one completion), `serve`
(the OpenAI-compatible HTTP server) and `quantize` (a weight-only int8 / int4 checkpoint)."""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import re
import socket
import sys
import typing
from collections.abc import Sequence
from pathlib import Path

from nanovllm import unsupported_options
from nanovllm.builtin_code import BUILTIN_CODE, BUILTIN_CODE_DRAFT, resolve_builtin
from nanovllm.builtin_model import BUILTIN_NAME, default_model_dir, ensure_default_model
from nanovllm.chat_inputs import load_chat_template
from nanovllm.config import EngineConfig

# Under each command's --help: vLLM's flags the engine refuses are hidden there (hundreds of them).
UNSUPPORTED_EPILOG = ("vLLM's flags that nanovllm does not support are refused with the reason (e.g. --enable-lora); "
                      "those that ask for what nanovllm does anyway (-pp 1, --no-enable-lora) are accepted.")


_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def human_int(value: str) -> int:
    """vLLM's human-readable integers: 32k = 32,000 and 25.6k = 25,600 (k/m/g/t), 32K = 32,768
    (K/M/G/T, whole numbers only), else a plain integer."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value.strip())
    if match is None:
        return int(value)
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"no decimals with the binary suffix {suffix} (1024s): write "
                                         f"{number}{suffix.lower()} for 1000s")
    return int(number) * _BINARY[suffix]


def human_int_or_auto(value: str) -> int | None:
    """human_int, or -1 / auto: the default (vLLM's --max-model-len: the model's)."""
    return None if value.strip() in ("-1", "auto") else human_int(value)


def positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def tcp_port(value: str) -> int:
    number = int(value)
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535], got {value}")
    return number


# Engine options that take vLLM's human-readable integers.
_HUMAN_INTS = {"max_model_len": human_int_or_auto, "max_num_batched_tokens": human_int,
               "kv_cache_memory_bytes": human_int}
# Log levels as vLLM spells them (in either case); uvicorn's trace logs as debug.
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _engine_args(p: argparse.ArgumentParser, command: str) -> None:
    """The engine's options as flags, derived from EngineConfig's fields (name, type, default, help)."""
    g = p.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for f in EngineConfig.options():
        meta = f.metadata
        if f.name == "model" or (meta["serve_only"] and command != unsupported_options.SERVE):
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None))
        if kind is bool:
            _switch(g, flag, dest=f.name, default=f.default, help=meta["help"])
            for alias in meta["aliases"]:  # a default-on switch's aliases turn it off
                g.add_argument(alias, dest=f.name, action="store_false",
                               help=f"same as --no-{flag[2:]} (default: not given)")
        else:
            kind = _HUMAN_INTS.get(f.name, kind if kind in (int, float) else str)
            shown = "" if "(default" in meta["help"] else " (default: %(default)s)"
            g.add_argument(flag, *meta["aliases"], dest=f.name, type=kind, default=f.default, choices=meta["choices"],
                           metavar=meta["metavar"], help=f"{meta['help']}{shown}")
    if command == unsupported_options.SERVE:  # how to run, not an engine option
        g.add_argument("--headless", action="store_true",
                       help="run only this node's tensor-parallel workers (a node other than 0) (default: off)")
    # vLLM's serve has both spellings (its --uvicorn-log-level is the server's alone). The server
    # logs its startup and requests; bench and generate print their results and only warnings.
    serve = command == unsupported_options.SERVE
    p.add_argument("--log-level", *(["--uvicorn-log-level"] if serve else []), default="info" if serve else "warning",
                   type=str.lower, choices=LOG_LEVELS, help="logging level (default: %(default)s)")
    _refused_args(p, command)


def _switch(p: argparse._ActionsContainer, *flags: str, dest: str, default: bool, help: str) -> None:
    """`--x` / `--no-x`, as vLLM's switches. (BooleanOptionalAction appends its default to the help
    on some Python versions and not on others.)"""
    action = p.add_argument(*flags, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=help)
    if "%(default)" not in action.help:  # type: ignore[operator]
        action.help = f"{action.help} (default: %(default)s)"


class _Refused(argparse.Action):
    """A vLLM flag this engine does not take: an error naming the reason, unless the value given asks
    for what nanovllm does anyway. `value` is the switch's (True for --x, False for --no-x)."""

    def __init__(self, option_strings: list[str], dest: str, entry: unsupported_options.Unsupported,
                 value: bool | None = None, **kwargs: object) -> None:
        takes_value = value is None and not (entry.switch or set(entry.harmless) <= {"true", "false"} and entry.harmless)
        # One value at most: a model directory after `--load-format safetensors` stays the model.
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="?" if takes_value else 0,
                         default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.entry, self.value = entry, value

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        given = self.value if self.value is not None else (values if isinstance(values, str) else True)
        if not self.entry.accepts(given):
            parser.error(self.entry.message())


def _refused_args(p: argparse.ArgumentParser, command: str) -> None:
    taken = set(p._option_string_actions)
    for entry in unsupported_options.refused_here(command):
        flags = [f for f in entry.flags if f not in taken]
        if flags:
            p.add_argument(*flags, action=_Refused, entry=entry, value=True if entry.switch else None)
        off = "--no-" + entry.flags[0][2:]
        if entry.switch and off not in taken:
            p.add_argument(off, action=_Refused, entry=entry, value=False)
    p.epilog = UNSUPPORTED_EPILOG


def _engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The engine options of the command line: LLM's keyword arguments, EngineConfig's fields (a
    command without the several-machines flags leaves them at their defaults)."""
    return {f.name: getattr(args, f.name) for f in EngineConfig.options() if f.name != "model" and hasattr(args, f.name)}


def _make_llm(args: argparse.Namespace, model: str | None):  # noqa: ANN202 - LLM imported lazily
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


def _setup_logging(args: argparse.Namespace) -> None:
    level = "DEBUG" if args.log_level == "trace" else args.log_level.upper()
    logging.basicConfig(level=level, format="%(levelname)s %(asctime)s %(name)s: %(message)s")


def _length_range(length: int | None, ratio: float, most: int | None, default_most: int, flag: str) -> tuple[int, int]:
    """A bench length range: vLLM's fixed `length` widened by `ratio`, or nano-vllm's [100, most]."""
    if length is not None and most is not None:
        raise ValueError(f"--{flag}-len and --max-{flag}-len both set the {flag} lengths: give one")
    if length is None:
        hi = most or default_most
        return min(100, hi), hi
    if length < 1 or not 0.0 <= ratio < 1.0:
        raise ValueError(f"--{flag}-len must be >= 1 and --random-range-ratio in [0, 1)")
    return max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))


def _cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from nanovllm.entrypoints.bench import make_workload, run_engine

    _setup_logging(args)
    llm = _make_llm(args, args.model)
    on_gpu = llm.engine.device.type == "cuda"
    num_seqs = args.num_seqs if args.num_seqs is not None else (256 if on_gpu else 64)
    input_lo, input_hi = _length_range(args.input_len, args.random_range_ratio, args.max_input_len,
                                       1024 if on_gpu else 256, "input")
    output_lo, output_hi = _length_range(args.output_len, args.random_range_ratio, args.max_output_len,
                                         1024 if on_gpu else 128, "output")
    workload = make_workload(num_seqs, input_hi, output_hi, llm.engine.vocab_size, seed=args.seed,
                             min_len=input_lo, min_output_len=output_lo)
    print(f"model: {llm.engine.config.model}\ndevice: {llm.engine.device} ({torch.get_num_threads()} threads), "
          f"{num_seqs} sequences, input [{input_lo}, {input_hi}], output [{output_lo}, {output_hi}]")
    try:
        result = run_engine(llm, workload)
    finally:
        llm.engine.shutdown()
    print(f"Total: {result.output_tokens} output tokens in {result.seconds:.2f}s, "
          f"Throughput: {result.output_tok_s:.2f} tok/s (prompt+output {result.total_tok_s:.2f} tok/s)")
    if args.output_json:
        # vLLM's `bench throughput --output-json` keys.
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump({"elapsed_time": result.seconds, "num_requests": num_seqs,
                       "total_num_tokens": result.prompt_tokens + result.output_tokens,
                       "total_output_tokens": result.output_tokens,
                       "requests_per_second": num_seqs / result.seconds, "tokens_per_second": result.total_tok_s,
                       "output_tokens_per_second": result.output_tok_s}, f, indent=2)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from nanovllm.sampling_params import SamplingParams

    _setup_logging(args)
    llm = _make_llm(args, args.model)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed)
    try:
        out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    finally:
        llm.engine.shutdown()
    print(out.outputs[0].text)
    return 0


def _check_port_free(host: str, port: int) -> None:
    """Fails now, naming the address, rather than after the model has loaded (uvicorn binds the
    same way: SO_REUSEADDR, so a port left in TIME_WAIT is not "in use")."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"cannot serve on --host {host!r}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            raise ValueError(f"cannot serve on {host}:{port}: {e.strerror} (another server there? pick another "
                             "--port)") from None


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        from nanovllm.entrypoints.openai.api_server import ServerConfig, run_server
    except ImportError as e:
        print(f"nanovllm: error: `serve` needs the serve extra (pip install 'nanovllm[serve]'): {e}", file=sys.stderr)
        return 2
    _setup_logging(args)
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    model = args.model_tag or args.model
    if args.headless:
        return _run_headless(args, model or str(ensure_default_model()))
    chat_template = load_chat_template(args.chat_template, "--chat-template")
    _check_port_free(args.host, args.port)
    llm = _make_llm(args, model)  # without a model: LLM() says the built-in model's weights are random
    names = args.served_model_name or [BUILTIN_NAME if model is None else model]
    path = resolve_builtin(model) if model is not None else str(default_model_dir())  # what the engine loaded
    # vLLM's deployments give the key as VLLM_API_KEY: read too, so that one never leaves the server open.
    env_key = os.environ.get("NANOVLLM_API_KEY") or os.environ.get("VLLM_API_KEY")
    api_key = args.api_key or ([env_key] if env_key else None)
    config = ServerConfig(model_path=path, served_model_names=names, host=args.host, port=args.port,
                          api_key=api_key,
                          max_queued_requests=args.max_queued_requests, log_level=args.log_level,
                          access_log=not args.disable_access_log, max_request_bytes=args.max_request_bytes,
                          trust_request_chat_template=args.trust_request_chat_template,
                          enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                          chat_template_timeout=args.chat_template_timeout, limit_concurrency=args.limit_concurrency,
                          timeout_keep_alive=args.timeout_keep_alive, header_timeout=args.header_timeout,
                          shutdown_timeout=args.shutdown_timeout, stream_stall_timeout=args.stream_stall_timeout,
                          grammar_compile_timeout=args.grammar_compile_timeout, step_timeout=args.step_timeout)
    engine = llm.engine
    if chat_template is not None:
        engine.tokenizer.chat_template = chat_template
    try:
        code = run_server(engine, config)
    finally:
        engine.shutdown()  # tensor-parallel workers: stopped now, not at interpreter exit
    return 0 if code is None else code


MODEL_HELP = (f"a Hugging Face model directory, or {BUILTIN_CODE}: the small code model shipped with nanovllm "
              f"({BUILTIN_CODE_DRAFT}: its draft)")


def _model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=f"{MODEL_HELP} (default: the built-in model, random weights, created "
                   f"in {default_model_dir()})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm", description="LLM inference with a C++ scheduling core",
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, allow_abbrev=False,
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    bench = command("bench", "throughput on random prompts (built-in model unless --model)")
    _model_arg(bench)
    bench.add_argument("--num-prompts", "--num-seqs", dest="num_seqs", type=positive_int, default=None,
                       help="sequences in the workload (default: 256 on GPU, 64 on CPU)")
    bench.add_argument("--input-len", "--random-input-len", dest="input_len", type=positive_int, default=None,
                       help="every prompt this many tokens (vLLM's random dataset; default: --max-input-len's range)")
    bench.add_argument("--output-len", "--random-output-len", dest="output_len", type=positive_int, default=None,
                       help="every output this many tokens, EOS ignored (default: --max-output-len's range)")
    bench.add_argument("--random-range-ratio", type=float, default=0.0,
                       help="with --input-len / --output-len: lengths uniform in [len * (1 - r), len * (1 + r)] "
                            "(default: %(default)s)")
    bench.add_argument("--max-input-len", type=positive_int, default=None,
                       help="nano-vllm's workload: prompt lengths uniform in [min(100, N), N] (default: 1024 on GPU, "
                            "256 on CPU)")
    bench.add_argument("--max-output-len", type=positive_int, default=None,
                       help="output lengths uniform in [min(100, N), N] (default: 1024 on GPU, 128 on CPU)")
    bench.add_argument("--output-json", default=None, metavar="PATH",
                       help="also write the results as JSON, with vLLM's keys (default: none)")
    _engine_args(bench, unsupported_options.BENCH)
    bench.set_defaults(func=_cmd_bench)

    gen = command("generate", "print one completion (built-in model unless --model)")
    _model_arg(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text (required)")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's mass (default: %(default)s)")
    gen.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest, -1: all (default: %(default)s)")
    gen.add_argument("--sampling-seed", type=int, default=None,
                     help="the request's own seed (default: none, the engine's generator from --seed)")
    _engine_args(gen, unsupported_options.GENERATE)
    gen.set_defaults(func=_cmd_generate)

    serve = command("serve", "OpenAI-compatible HTTP server (built-in model unless MODEL_DIR or --model)")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL_DIR",
                       help=f"{MODEL_HELP} (default: the built-in model, random weights)")
    serve.add_argument("--model", default=None, help="the same as MODEL_DIR, vLLM's spelling (default: none)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only, %(default)s)")
    serve.add_argument("--port", type=tcp_port, default=8000,
                       help="checked before the model loads (default: %(default)s)")
    serve.add_argument("--api-key", nargs="+", default=None,
                       help="require `Authorization: Bearer KEY` on /v1 routes, any of the keys given (default: "
                            "$NANOVLLM_API_KEY, else $VLLM_API_KEY)")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="the name(s) clients pass as `model` (default: MODEL_DIR); the first is reported")
    serve.add_argument("--chat-template", default=None,
                       help="a chat template (a .jinja file, or the template itself) instead of the tokenizer's "
                            "(default: the tokenizer's)")
    serve.add_argument("--max-queued-requests", type=int, default=1024,
                       help="answer 503 when this many sequences already wait for the scheduler (default: %(default)s)")
    serve.add_argument("--max-request-bytes", type=int, default=None,
                       help="answer 413 to a larger request body, before reading it (default: 64 bytes per token "
                            "of max_model_len, at least 1 MiB)")
    _switch(serve, "--trust-request-chat-template", dest="trust_request_chat_template", default=False,
            help="run chat templates sent with a request (`chat_template`); refused with 400 otherwise")
    _switch(serve, "--enable-prompt-tokens-details", dest="enable_prompt_tokens_details", default=False,
            help="report in each response's usage.prompt_tokens_details.cached_tokens the prompt tokens the "
                 "prefix cache held")
    serve.add_argument("--chat-template-timeout", type=float, default=5.0,
                       help="seconds a chat template may take to render before the request gets a 400 "
                            "(default: %(default)s)")
    serve.add_argument("--limit-concurrency", type=int, default=None,
                       help="answer 503 beyond this many open connections or requests at once "
                            "(default: the open-file limit less 128, at most 8192)")
    serve.add_argument("--timeout-keep-alive", type=float, default=5.0,
                       help="close an idle keep-alive connection after this many seconds (default: %(default)s)")
    serve.add_argument("--header-timeout", type=float, default=10.0,
                       help="close a connection that has not sent a request's complete headers within this many "
                            "seconds (of connecting or of its previous response); a body part late by as much is a "
                            "408 (default: %(default)s)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM/SIGINT, seconds the requests in flight get to finish before they are ended "
                            "(streams with an error event, others with a 503) (default: %(default)s)")
    serve.add_argument("--stream-stall-timeout", type=float, default=60.0,
                       help="abort a request whose client has read none of its output for this many seconds "
                            "(default: %(default)s)")
    serve.add_argument("--grammar-compile-timeout", type=float, default=30.0,
                       help="a structured-output grammar (JSON schema, regex, grammar) that takes longer to compile "
                            "gets a 400; compiles run in their own worker processes, and end when their client leaves "
                            "(default: %(default)s)")
    serve.add_argument("--step-timeout", type=float, default=300.0,
                       help="a step that makes no progress for this many seconds (a hung tensor-parallel worker) "
                            "fails the requests in flight with 503, marks /health unhealthy and exits non-zero "
                            "(default: %(default)s)")
    _switch(serve, "--disable-access-log", "--disable-uvicorn-access-log", dest="disable_access_log", default=False,
            help="no line per HTTP request")
    _engine_args(serve, unsupported_options.SERVE)
    serve.set_defaults(func=_cmd_serve)

    from nanovllm.entrypoints import quantize

    quant = command("quantize", "write an int8 / int4 weight-only (compressed-tensors) copy of a checkpoint")
    quantize.add_arguments(quant)
    quant.set_defaults(func=quantize.run)
    return parser


def vllm_spellings(argv: Sequence[str]) -> list[str]:
    """The command line as vLLM's parser rewrites it: `--max_model_len` as `--max-model-len`,
    `-O3` / `-O 3` as `--optimization-level 3`, and a JSON option's keys given one by one
    (`--speculative-config.method ngram`, values JSON or else strings) as one JSON object."""
    out: list[str] = []
    objects: dict[str, dict[str, object]] = {}
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg.startswith("--"):
            key, eq, value = arg.partition("=")
            head, dot, path = key.partition(".")
            head = "--" + head[2:].replace("_", "-")
            if dot:
                if not eq:
                    if i >= len(args):
                        raise ValueError(f"{arg} needs a value")
                    value = args[i]
                    i += 1
                try:
                    parsed: object = json.loads(value)
                except json.JSONDecodeError:
                    parsed = value
                node = objects.setdefault(head, {})
                *parents, leaf = path.split(".")
                for part in parents:
                    node = node.setdefault(part, {})  # type: ignore[assignment]
                node[leaf] = parsed
                continue
            out.append(head + eq + value)
        elif arg.startswith("-O") and arg != "-O":
            out += ["--optimization-level", arg[3:] if arg[2:3] == "=" else arg[2:]]
        elif arg == "-O" and i < len(args) and args[i] in {"0", "1", "2", "3"}:
            out.append("--optimization-level")
        else:
            out.append(arg)
    for head, obj in objects.items():
        # The whole object given too (`--x JSON` or `--x=JSON`): its keys given one by one go over it.
        at = next((k for k, a in enumerate(out) if a == head or a.startswith(head + "=")), None)
        whole = None
        if at is not None:
            whole = out[at].partition("=")[2] if "=" in out[at] else (out[at + 1] if at + 1 < len(out) else None)
        try:
            merged = {**json.loads(whole), **obj} if whole is not None else obj
        except (json.JSONDecodeError, TypeError):
            raise ValueError(f"{head} is not a JSON object: {whole}") from None
        if at is not None:
            del out[at:at + (1 if "=" in out[at] or whole is None else 2)]
        out += [head, json.dumps(merged)]
    return out


# serve's options that take several values: a model directory after them would be one more.
_MANY_VALUES = ("--served-model-name", "--api-key")


def _check_model_first(argv: Sequence[str]) -> None:
    """vLLM's rule: the model comes first. `serve --served-model-name NAME MODEL` (or `--api-key KEY
    MODEL`) takes MODEL as one more value and would serve the built-in model: refused where such a
    value is a model directory."""
    if len(argv) < 2 or argv[0] != "serve" or not argv[1].startswith("-"):
        return
    for k, arg in enumerate(argv):
        if arg in _MANY_VALUES:
            values = itertools.takewhile(lambda a: not a.startswith("-"), argv[k + 1:])
            model = next((v for v in values if Path(v).is_dir()), None)
            if model is not None:
                raise ValueError(f"give the model first: `nanovllm serve {model} {arg} ...` (after {arg}, "
                                 f"{model} was taken as one more of its values)")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        argv = vllm_spellings(sys.argv[1:] if argv is None else argv)
        _check_model_first(argv)
    except ValueError as e:
        print(f"nanovllm: error: {e}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # OSError: also a path that is not a directory, no permission, a full disk
        print(f"nanovllm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
