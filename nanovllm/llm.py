"""`LLM`: the offline entry point, with vLLM's names so users can switch."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from tqdm.auto import tqdm

from nanovllm import unsupported_options
from nanovllm.builtin_model import ensure_default_model
from nanovllm.chat_inputs import joined_text, load_chat_template, template_conversation
from nanovllm.config import EngineConfig
from nanovllm.engine.llm_engine import LLMEngine, PromptType, valid_text
from nanovllm.engine.beam_search import run_beam_search
from nanovllm.outputs import BeamSearchOutput, RequestOutput
from nanovllm.sampling_params import BeamSearchParams, SamplingParams

Conversation = list[dict[str, Any]]
logger = logging.getLogger("nanovllm")


_POOLING = "pooling models (embeddings, classification, scores) are not supported: nanovllm runs generative models"


def _unsupported(name: str, reason: str) -> Callable[..., Any]:
    def method(self: LLM, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"LLM.{name}() is not supported: {reason}")

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"vLLM's LLM.{name}: not supported ({reason})."
    return method


class LLM:
    def __init__(self, model: str | None = None, **options: Any) -> None:
        """`model`: a Hugging Face model directory, or "builtin-code": the small code model shipped
        with the package (trained on Python's standard library by scripts/train_tiny_model.py;
        "builtin-code-draft" is its 1-layer draft); none: the built-in model (random weights,
        created once in ~/.cache/nanovllm: for trying the engine out, its text is noise).
        `options`: the engine's (nanovllm.config.EngineConfig's fields, each with its default and
        meaning there; vLLM's names): dtype, tokenizer, max_model_len, max_num_seqs,
        max_num_batched_tokens, block_size, enable_prefix_caching, gpu_memory_utilization,
        kv_cache_memory_bytes, num_kvcache_blocks, max_logprobs, enforce_eager, seed, device,
        quantization, and tensor parallelism: tensor_parallel_size (> 1 splits the model over that
        many GPUs, or processes on CPU), distributed_backend, and across machines nnodes, node_rank,
        master_addr, master_port (this process is node 0; the others run `nanovllm serve ...
        --node-rank N --headless`); chat_template (vLLM's: chat()'s template where a call gives
        none, a file's path or the template itself). vLLM's other names of these are taken too
        (num_gpu_blocks_override), and None for max_num_seqs / enable_prefix_caching /
        enable_chunked_prefill is the default, as vLLM reads it. vLLM's options this engine does not
        implement are a ValueError naming the reason, unless the value asks for what it does anyway
        (pipeline_parallel_size=1)."""
        chat_template = load_chat_template(options.pop("chat_template", None), "chat_template")
        for alias, name in EngineConfig.python_aliases().items():
            if alias in options:
                if name in options:
                    raise TypeError(f"LLM() got both {name} and its other name {alias}")
                options[name] = options.pop(alias)
        known = {f.name for f in EngineConfig.options()}
        refused = {u.name: u for u in unsupported_options.refused_here(unsupported_options.LLM_API)}
        for name in sorted(set(options) - known):
            entry = refused.get(name)
            if entry is None:
                raise TypeError(f"LLM() got unknown engine option {name!r}; the options are "
                                f"{', '.join(sorted(known - {'model'}))}")
            if not entry.accepts(options.pop(name)):
                raise ValueError(f"LLM({name}=...) is not supported: {entry.reason}")
        if model is None:
            model = str(ensure_default_model())
            logger.warning("no model given: using nanovllm's built-in model (%s), a small Qwen3 with RANDOM weights "
                           "and a trained tokenizer, for trying the engine out: its text is meaningless", model)
        self.engine = LLMEngine(EngineConfig(model=str(model), **options))
        if chat_template is not None:
            self.engine.tokenizer.chat_template = chat_template

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use without sampling_params: vLLM's defaults, with those the
        generation config sets (the engine's generation_config option; "vllm": none)."""
        return SamplingParams(**self.engine.sampling_defaults)

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's name for it)."""
        return self.engine

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        lora_request: object = None,
        priority: int | Sequence[int] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.generate. `tokenization_kwargs` may set truncate_prompt_tokens, truncation_side
        (vLLM 0.32's place for them) and add_special_tokens; LoRA, priorities other than 0 and
        multimodal options are a ValueError naming them."""
        _check_unsupported(lora_request, priority, mm_processor_kwargs)
        prompt_list = _as_prompt_list(prompts)
        if priority is not None and not isinstance(priority, int) and len(priority) != len(prompt_list):
            raise ValueError(f"got {len(priority)} priorities for {len(prompt_list)} prompts; pass one or one per "
                             "prompt")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = _as_params_list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompt_list)} prompts; pass one or one per prompt"
                )
        if tokenization_kwargs:
            prompt_list, params_list = self._with_tokenization(prompt_list, params_list, tokenization_kwargs)
        return self._run(prompt_list, params_list, use_tqdm)

    def _with_tokenization(self, prompts: list[PromptType], params: list[SamplingParams],
                           kwargs: dict[str, Any]) -> tuple[list[PromptType], list[SamplingParams]]:
        """vLLM 0.32's tokenization_kwargs: truncate_prompt_tokens and truncation_side (as the sampling
        params'), add_special_tokens (text prompts encoded here with it); other keys ignored with a
        warning, as vLLM does."""
        taken = {k: kwargs[k] for k in ("truncate_prompt_tokens", "truncation_side") if k in kwargs}
        ignored = sorted(set(kwargs) - set(taken) - {"add_special_tokens"})
        if ignored:
            logger.warning("tokenization_kwargs %s ignored (taken: truncate_prompt_tokens, truncation_side, "
                           "add_special_tokens)", ", ".join(repr(k) for k in ignored))
        if taken:
            params = [replace(p, **taken) for p in params]
        if "add_special_tokens" in kwargs:
            special = bool(kwargs["add_special_tokens"])
            encode = self.engine.tokenizer.encode
            prompts = [{"prompt_token_ids": encode(valid_text(text), add_special_tokens=special), "prompt": text}
                       if (text := _text_of(p)) is not None else p for p in prompts]
        return prompts, params

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: object = None,
        priority: int | Sequence[int] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Applies the chat template (the tokenizer's, or `chat_template`) to each conversation, then
        generates, as vLLM's LLM.chat (the same parameters, in its order): `continue_final_message`
        extends the last (assistant) message instead of opening a new turn; `tools` and
        `chat_template_kwargs` (e.g. Qwen3's {"enable_thinking": False}) reach the template. A
        message's list of OpenAI content parts reaches it as their texts joined by newlines
        (`chat_template_content_format` "auto" or "string"), or as the list ("openai")."""
        _check_unsupported(lora_request, priority, mm_processor_kwargs)
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError("chat_template_content_format must be 'auto', 'string' or 'openai', got "
                             f"{chat_template_content_format!r}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template; pass chat_template")
        options: dict[str, Any] = dict(chat_template_kwargs or {})
        options.update(add_generation_prompt=add_generation_prompt, chat_template=chat_template, tools=tools)
        if continue_final_message:
            options["continue_final_message"] = True
        prompts: list[PromptType] = []
        for conv in conversations:
            if chat_template_content_format != "openai":
                conv = [{**m, "content": joined_text(m["content"])}
                        if isinstance(m, dict) and isinstance(m.get("content"), list) else m for m in conv]
            conv = template_conversation(conv, chat_template or tokenizer.chat_template)
            text = tokenizer.apply_chat_template(conv, tokenize=False, **options)
            # The template writes the special tokens: encoding its text without adding them is
            # what apply_chat_template(tokenize=True) does.
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm, tokenization_kwargs=tokenization_kwargs)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: object = None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """The best `params.beam_width` sequences per prompt, best first (vLLM's LLM.beam_search:
        `concurrency_limit` prompts at a time, all of them if None)."""
        _check_unsupported(lora_request, None, None)
        prompt_list = _as_prompt_list(prompts)
        if concurrency_limit is not None and (not isinstance(concurrency_limit, int)
                                              or isinstance(concurrency_limit, bool) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be None or an integer >= 1, got {concurrency_limit!r}")
        chunk = concurrency_limit or max(1, len(prompt_list))
        out: list[BeamSearchOutput] = []
        for start in tqdm(range(0, len(prompt_list), chunk), desc="Beam search", disable=not use_tqdm,
                          dynamic_ncols=True):
            out += run_beam_search(self.engine, prompt_list[start:start + chunk], params)
        return out

    def _run(self, prompts: list[PromptType], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                rid = engine.next_request_id()
                # Compiled here, in the caller's thread (a cache hit for a spec seen before).
                grammar = engine.grammars.compile(p.structured_outputs) if p.structured_outputs else None
                engine.add_request(rid, prompt, p, grammar=grammar)
                ids.append(rid)
        except BaseException:
            # A bad prompt rejects the whole call and leaves nothing behind in the engine.
            for rid in ids:
                engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while len(results) < len(ids):
                for out in engine.step():
                    results[out.request_id] = out
                    bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in results:
                    engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in ids]

    def stats(self) -> dict[str, int]:
        return self.engine.stats()

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prompt prefix; only while no request runs (offline, between calls:
        always). Returns whether it did. vLLM's two options ask for nothing here: no request runs
        between calls, and there is no KV connector."""
        return self.engine.reset_prefix_cache()

    # vLLM's LLM methods for what this engine does not do: a NotImplementedError saying so, not an
    # AttributeError.
    encode = _unsupported("encode", _POOLING)
    embed = _unsupported("embed", _POOLING)
    classify = _unsupported("classify", _POOLING)
    score = _unsupported("score", _POOLING)
    sleep = _unsupported("sleep", "sleep mode (offloading weights and freeing the KV cache) is not implemented")
    wake_up = _unsupported("wake_up", "sleep mode (offloading weights and freeing the KV cache) is not implemented")
    start_profile = _unsupported("start_profile", "profile a step with benchmarks/profile_cpu_step.py")
    stop_profile = _unsupported("stop_profile", "profile a step with benchmarks/profile_cpu_step.py")
    collective_rpc = _unsupported("collective_rpc", "workers take no calls from user code")
    apply_model = _unsupported("apply_model", "workers take no calls from user code")
    get_metrics = _unsupported("get_metrics", "LLM.stats() gives the engine's counters; `nanovllm serve` has "
                                              "/metrics")


def _check_unsupported(lora_request: object, priority: int | Sequence[int] | None,
                       mm_processor_kwargs: dict[str, Any] | None) -> None:
    """vLLM's request options this engine has no use for: refused unless they ask for nothing."""
    if isinstance(lora_request, bool):  # chat(messages, params, use_tqdm, add_generation_prompt) of old
        raise TypeError("the 4th argument of generate() and chat() is lora_request, as in vLLM: pass "
                        "add_generation_prompt=... by name")
    if lora_request is not None:
        raise ValueError("lora_request is not supported: this engine serves the model's own weights (no LoRA)")
    priorities = [priority] if isinstance(priority, int) else list(priority or [])
    if any(p != 0 for p in priorities):
        raise ValueError("priority must be 0: requests run first come, first served (no priority scheduling)")
    if mm_processor_kwargs:
        raise ValueError("mm_processor_kwargs is not supported: prompts are text or token ids")


def _text_of(prompt: PromptType) -> str | None:
    """A text prompt's text (a str, or a dict with a string `prompt` and no token ids), else None."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    return None


def _as_params_list(params: object) -> list[SamplingParams]:
    """As vLLM: SamplingParams objects only. A dict (the server's JSON habit) would otherwise be
    read as a sequence of its keys."""
    if isinstance(params, (dict, str, bytes)) or not isinstance(params, Sequence):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {type(params).__name__}"
                        + (": write SamplingParams(**params)" if isinstance(params, dict) else ""))
    for p in params:
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got a list holding "
                            f"{type(p).__name__}" + (": write SamplingParams(**params)" if isinstance(p, dict) else ""))
    return list(params)


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    # bytes would pass as a sequence of ints (token ids), None fail deep inside with a TypeError.
    if prompts is None or isinstance(prompts, (bytes, bytearray)):
        raise ValueError("prompts must be a string, a list of token ids, a dict or a list of those, got "
                         f"{type(prompts).__name__}" + (" (decode bytes to str first)" if prompts is not None else ""))
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # a single prompt of token ids
    return prompts
