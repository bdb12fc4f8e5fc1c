"""vLLM's options that this engine does not take, each with the reason, so that a vLLM command line
or `LLM(...)` call fails saying why instead of "unrecognized arguments" (or being ignored).

Each entry names vLLM's option (its keyword in `LLM(...)`; the flag is `--` + the name with dashes)
and the values that ask for what nanovllm does anyway: `-pp 1`, `--tokenizer-mode auto` or
`--no-enable-lora` are accepted and change nothing; any other value is an error naming the reason.
The options this engine does take are EngineConfig's fields (config.py) and the commands' own flags
(entrypoints/cli.py); tests/test_cli_vllm_flags.py checks every flag of `vllm serve` and `vllm bench
throughput` (vLLM 0.32.0) lands in one or the other.
"""

from __future__ import annotations

from dataclasses import dataclass

# Where an option is refused: the offline API and each command.
LLM_API, SERVE, BENCH, GENERATE = "LLM", "serve", "bench", "generate"
EVERYWHERE = frozenset({LLM_API, SERVE, BENCH, GENERATE})
COMMANDS = frozenset({SERVE, BENCH, GENERATE})


@dataclass(frozen=True)
class Unsupported:
    name: str  # vLLM's option name (LLM keyword; the flag is --name-with-dashes)
    reason: str
    harmless: tuple[str, ...] = ()  # values (lower case, as typed) that ask for what nanovllm does
    switch: bool = False  # an on/off flag: `--name` is "true", `--no-name` is "false"
    short: tuple[str, ...] = ()  # vLLM's short flags for it
    where: frozenset[str] = EVERYWHERE

    @property
    def flags(self) -> tuple[str, ...]:
        long = "--" + self.name.replace("_", "-")
        return (long, *self.short)

    def accepts(self, value: object) -> bool:
        """Whether `value` (a flag's text, True / False for a switch, or LLM()'s keyword value)
        asks for what nanovllm does anyway."""
        text = str(value).lower()
        return text in self.harmless or (value is None and LLM_API in self.where)

    def message(self) -> str:
        ok = f" (accepted: {', '.join(self.harmless)})" if self.harmless and not self.switch else ""
        return f"{self.flags[0]} is not supported by nanovllm{ok}: {self.reason}"


def _group(reason: str, *specs: str, where: frozenset[str] = EVERYWHERE) -> list[Unsupported]:
    """`specs`: "name", "name=v1|v2" (harmless values), "name?" (a switch; "name?=false" when off is
    harmless), and "/-xx" after either for vLLM's short flags."""
    out = []
    for spec in specs:
        spec, _, short = spec.partition("/")
        spec, _, harmless = spec.partition("=")
        switch = spec.endswith("?")
        out.append(Unsupported(spec.rstrip("?"), reason, tuple(harmless.split("|")) if harmless else (), switch,
                               tuple(short.split(",")) if short else (), where))
    return out


_DOWNLOADS = "downloads are not supported: pass a local model directory"
_ONE_MACHINE_BENCH = frozenset({BENCH, GENERATE})

UNSUPPORTED: dict[str, Unsupported] = {u.name: u for u in [
    *_group(_DOWNLOADS, "revision", "code_revision", "tokenizer_revision", "download_dir", "hf_token",
            "hf_config_path", "config_format=auto|hf"),
    *_group("weights load from *.safetensors files only, with their names as written",
            "load_format=auto|safetensors", "safetensors_load_strategy", "safetensors_prefetch_num_threads",
            "safetensors_prefetch_block_size", "model_loader_extra_config", "ignore_patterns",
            "pt_load_map_location=cpu", "max_parallel_loading_workers", "use_tqdm_on_load?=true|false",
            "model_class_overrides", "model_impl=auto"),
    *_group("config.json is read as written (edit a copy of the model directory to change a field)",
            "hf_overrides"),
    *_group("options come from the command line only (no YAML file of them)", "config", where=frozenset({SERVE})),
    *_group("errors are logged with their message (the traceback at DEBUG); responses carry no request-id header "
            "and the server reports no fingerprint", "enable_request_id_headers?=false", "log_error_stack?=false",
            "fingerprint_mode", "fingerprint_value", where=frozenset({SERVE})),
    *_group("the engine keeps its weights and KV cache for its lifetime (no sleep mode) and renders chat "
            "templates in its own text workers", "enable_sleep_mode?=false", "sleep_mode_offload_cudagraph?=false",
            "sleep_preserve_parameter_names", "renderer_num_workers"),
    *_group("tokenizers load through transformers' AutoTokenizer (--tokenizer picks the directory)",
            "tokenizer_mode=auto|hf", "skip_tokenizer_init?=false"),
    *_group("nanovllm runs text generation only (no pooling, embedding or conversion of the model)",
            "runner=auto|generate", "convert=auto|none", "pooler_config", "io_processor_plugin",
            "enable_flash_late_interaction?=true|false", "language_model_only?=true|false"),
    *_group("custom logits processors and other per-request plug-ins are not implemented",
            "logits_processors", "logprobs_mode=raw_logprobs", "return_sampling_mask?=false",
            "use_fp64_gumbel?=false", "enable_return_routed_experts?=false", "aux_output_config",
            "enable_trace_replay?=false"),
    *_group("the models here have no cascade attention or state-space layers (a sliding window runs within "
            "max_model_len <= the window: --disable-sliding-window)",
            "disable_cascade_attn?=true|false", "mamba_backend",
            "mamba_ssu_algorithm", "enable_mamba_cache_stochastic_rounding?=false", "mamba_cache_philox_rounds",
            "mamba_cache_dtype=auto", "mamba_ssm_cache_dtype=auto", "mamba_block_size", "mamba_cache_mode=none",
            "enable_mamba_shared_prefix_checkpoint?=false", "replayssm_buffer_len", "use_replayssm?=false",
            "prefix_match_unit", "swa_bounded_replay?=true|false", "kv_sharing_fast_prefill?=false",
            "gdn_prefill_backend", "kda_prefill_backend", "kda_decode_backend"),
    *_group("prompt embeddings and multimodal inputs are not supported (text models only)",
            "enable_prompt_embeds?=false", "allowed_local_media_path", "allowed_media_domains",
            "limit_mm_per_prompt", "enable_mm_embeds?=false", "media_io_kwargs", "mm_processor_kwargs",
            "mm_processor_cache_gb", "mm_processor_cache_type", "mm_hasher_algorithm",
            "mm_shm_cache_max_object_size_mb", "mm_encoder_only?=false", "mm_encoder_tp_mode",
            "mm_encoder_attn_backend", "mm_encoder_attn_dtype", "mm_encoder_fp8_scale_path",
            "mm_encoder_fp8_scale_save_path", "mm_encoder_fp8_scale_save_margin", "interleave_mm_strings?=false",
            "skip_mm_profiling?=false", "video_pruning_rate", "video_pruning_method", "mm_tensor_ipc",
            "mm_processor_device", "mm_ipc_gpu_memory_gb", "mm_device_do_normalize?", "trust_request_mm_kwargs?=false",
            "enable_multimodal_chat=false", "random_mm_base_items_per_request", "random_mm_num_mm_items_range_ratio",
            "random_mm_limit_mm_per_prompt", "random_mm_bucket_config", "asr_min_audio_len_sec",
            "asr_max_audio_len_sec"),
    *_group("LoRA adapters are not supported", "enable_lora?=false", "max_loras", "max_lora_rank", "lora_dtype",
            "enable_tower_connector_lora?=false", "max_cpu_loras", "fully_sharded_loras?=false", "lora_target_modules",
            "default_mm_loras", "specialize_active_lora?=false", "enable_mixed_moe_lora_format?=false",
            "enable_moe_shared_loras?=false", "max_lora_cls_labels", "lora_modules", "lora_path", "lora_assignment"),
    *_group("only tensor parallelism is implemented (--tensor-parallel-size); worker processes are started "
            "by nanovllm itself (no Ray, no data, pipeline, context or expert parallelism)",
            "distributed_executor_backend=mp|uni", "pipeline_parallel_size=1/-pp", "decode_context_parallel_size=1/-dcp",
            "dcp_comm_backend", "dcp_q_replicate?", "dcp_kv_cache_interleave_size=1", "cp_kv_cache_interleave_size",
            "prefill_context_parallel_size=1/-pcp", "data_parallel_size=1/-dp", "data_parallel_rank/-dpn",
            "data_parallel_start_rank/-dpr", "data_parallel_size_local/-dpl", "data_parallel_address/-dpa",
            "data_parallel_rpc_port/-dpp", "data_parallel_backend/-dpb", "data_parallel_hybrid_lb?=false/-dph",
            "data_parallel_external_lb?=false/-dpe", "data_parallel_multi_port_external_lb=false/-dpm",
            "enable_hc_sp?=false", "enable_expert_parallel?=false/-ep", "enable_batch_sharded_sampling?=false",
            "enable_ep_weight_filter?=false", "all2all_backend", "enable_dbo?=false", "enable_shm_tensor_arena?=false",
            "ubatch_size=0", "enable_elastic_ep?=false", "elastic_ep_max_dp_size", "dbo_decode_token_threshold",
            "dp_sync_interval", "dbo_prefill_token_threshold", "disable_nccl_for_dp_synchronization?",
            "enable_eplb?=false", "eplb_config", "expert_placement_strategy", "ray_workers_use_nsight?=false",
            "disable_custom_all_reduce?=true|false", "worker_cls=auto", "worker_extension_cls",
            "enable_fault_tolerance?=false", "fault_tolerance_config", "distributed_timeout_seconds",
            "cpu_distributed_timeout_seconds", "numa_bind?=false", "numa_bind_nodes", "numa_bind_cpus",
            "api_server_count=1/-asc", "data_parallel_supervisor_port", "dp_supervisor_probe_interval_s",
            "dp_supervisor_probe_timeout_s", "dp_supervisor_probe_failure_threshold", "enable_scale_out?=false"),
    *_group("several machines are for `nanovllm serve` (the other nodes run `serve --headless`); bench and "
            "generate run on this machine", "nnodes=1/-n", "node_rank=0/-r", "master_addr", "master_port",
            "headless=false", where=_ONE_MACHINE_BENCH),
    *_group("pick the GPU with --device cuda:N (or CUDA_VISIBLE_DEVICES)", "device_ids"),
    *_group("the KV cache's size is set by --kv-cache-memory-bytes, --num-gpu-blocks-override or "
            "--gpu-memory-utilization; there is no CPU offloading, KV transfer or hybrid KV cache manager",
            "kv_offloading_size", "kv_offloading_backend", "offload_backend", "cpu_offload_gb=0", "cpu_offload_params",
            "offload_group_size=0", "offload_num_in_group", "offload_prefetch_step", "offload_params",
            "kv_transfer_config", "kv_events_config", "ec_transfer_config", "ec_manager_config",
            "kv_cache_dtype_skip_layers", "disable_hybrid_kv_cache_manager?"),
    *_group("prefix blocks are keyed by a chained XXH64 hash and checked against their token ids; cached "
            "blocks are evicted least recently used", "prefix_caching_hash_algo", "prefix_cache_retention_interval=0"),
    *_group("the scheduler admits first come, first served under --max-num-seqs and --max-num-batched-tokens "
            "(prompts always chunked to fit)", "scheduling_policy=fcfs", "max_num_scheduled_tokens",
            "max_num_active_seqs", "max_num_queued_tokens", "long_prefill_token_threshold=0",
            "long_prefill_token_threshold_adaptive?=false", "disable_chunked_mm_input?=false", "scheduler_cls",
            "scheduler_reserve_full_isl?=true|false", "watermark", "prefill_schedule_interval=1",
            "async_scheduling?=false", "stream_interval=1", "max_num_queued_reqs"),
    *_group("kernels are chosen by device: C++ on CPU, nanovllm's CUDA kernels with flash-attn or Triton "
            "prefill on GPU; decode runs under CUDA graphs unless --enforce-eager", "attention_backend",
            "attention_config/-ac", "compilation_config/-cc", "kernel_config", "ir_op_priority", "moe_backend",
            "linear_backend", "sparse_indexer_topk_backend", "optimization_level", "performance_mode",
            "cudagraph_capture_sizes", "max_cudagraph_capture_size", "enable_flashinfer_autotune?=false",
            "jit_monitor_mode", "jit_monitor_verbose?=false", "enable_cumem_allocator?=false",
            "enable_nccl_comm_suspend?=false", "additional_config",
            "fail_on_environ_validation?=false", "weight_transfer_config", "engram_config", "diffusion_config/-dc",
            "watermark_config"),
    *_group("quantized checkpoints are recognized from their quantization_config (or, with --quantization gptq or "
            "awq, quantize_config.json / quant_config.json); --quantization int8 or int4 quantizes while loading",
            "quantization_config", "allow_deprecated_quantization?=false"),
    *_group("speculative decoding is configured as one JSON object: --speculative-config '{\"method\": \"ngram\", "
            "\"num_speculative_tokens\": 4}'", "spec_method", "spec_model", "spec_tokens"),
    *_group("structured output always uses xgrammar", "structured_outputs_config"),
    *_group("tool calling is not implemented (a request with `tools` gets a 400)",
            "enable_auto_tool_choice?=false", "tool_call_parser", "tool_parser_plugin", "tool_strict_level",
            "tool_server", "exclude_tools_when_tool_choice_none?=false", where=frozenset({SERVE})),
    *_group("reasoning parsers are not implemented (reasoning text stays in the output)", "reasoning_parser",
            "reasoning_parser_plugin", "reasoning_config"),
    *_group("tracing, profiling and the extra metrics are not implemented (GET /metrics has the engine's)",
            "otlp_traces_endpoint", "collect_detailed_traces", "show_hidden_metrics_for_version",
            "per_request_spec_decode_metrics=none", "kv_cache_metrics?=false", "kv_cache_metrics_sample",
            "custom_histogram_buckets", "cudagraph_metrics?=false", "enable_layerwise_nvtx_tracing?=false",
            "enable_mfu_metrics?=false", "enable_logging_iteration_details?=false", "profiler_config",
            "aggregate_engine_logging=false", "logging_config", "log_config_file"),
    *_group("requests are not logged (uvicorn's access log has each HTTP request; GET /metrics the totals); "
            "periodic stats are not logged either", "enable_log_requests?=false", "disable_log_requests=true|false",
            "disable_log_stats=true|false", "max_log_len", "enable_log_outputs?=false", "enable_log_deltas?=true|false"),
    *_group("the server speaks HTTP on a TCP port without TLS; put a reverse proxy in front for TLS, CORS, a root "
            "path or middleware", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "enable_ssl_refresh?=false",
            "ssl_cert_reqs=0", "ssl_ciphers", "root_path", "middleware", "allow_credentials?=false", "allowed_origins",
            "allowed_methods", "allowed_headers", "uds", "grpc=false", "grpc_port", "h11_max_incomplete_event_size",
            "h11_max_header_count", "disable_fastapi_docs?=true|false", "enable_offline_docs?=false",
            "disable_access_log_for_endpoints", where=frozenset({SERVE})),
    *_group("the OpenAI routes answer as documented in the README; this response option is not implemented",
            "chat_template_content_format=auto|string", "default_chat_template_kwargs", "response_role=assistant",
            "return_tokens_as_token_ids?=false", "enable_per_request_metrics?=false",
            "enable_server_load_tracking?=false", "enable_force_include_usage?=false", "sse_keep_alive_interval=0",
            "enable_tokenizer_info_endpoint?=false", "tokens_only?=false", "cohere_is_reasoning_model?", "cohere_format",
            "anthropic_disabled_thinking_effort", where=frozenset({SERVE})),
    *_group("only `serve` has a shutdown to time", "shutdown_timeout", where=frozenset({BENCH, GENERATE, LLM_API})),
    *_group("only `serve` names the model to its clients", "served_model_name",
            where=frozenset({BENCH, GENERATE, LLM_API})),
    *_group("bench runs random token-id prompts through the offline LLM, one sample each, after one short warm-up "
            "request", "backend=vllm", "dataset_name=random", "dataset_path", "no_oversample", "custom_output_len",
            "n=1", "num_warmups", "hf_max_batch_size", "hf_enable_torch_compile=false", "async_engine=false",
            "prequeue_requests", "disable_detokenize=false", "prefix_len=0", "random_prefix_len=0", "hf_subset",
            "hf_split", "hf_name", "profile=false", "prefix_repetition_prefix_len", "prefix_repetition_suffix_len",
            "prefix_repetition_num_prefixes", "prefix_repetition_output_len", "random_batch_size=1", "no_reranker",
            where=frozenset({BENCH})),
]}


def refused_here(where: str) -> list[Unsupported]:
    """The entries that apply to `where` (LLM_API or a command)."""
    return [u for u in UNSUPPORTED.values() if where in u.where]
