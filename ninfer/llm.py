"""The offline Python API, shaped like vLLM's ``LLM``."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

from ninfer.engine.builder import LoadedEngine, build_engine
from ninfer.engine.request import GenerationEvent
from ninfer.outputs import CompletionOutput, RequestOutput
from ninfer.plugins import load_registry
from ninfer.sampling_params import SamplingParams

PromptType = Union[str, list[int], dict]
#: the most sequences an offline engine may decode together (``LLM(max_num_seqs=...)``)
MAX_NUM_SEQS = 256


def _is_profile(path: str) -> bool:
    return path.endswith((".yaml", ".yml")) and Path(path).is_file()


class LLM:
    """Load a checkpoint (a directory, ``tiny:FAMILY``, or a profile YAML) and generate.

    ``overrides`` use profile option names: ``LLM("tiny:qwen3", max_concurrency=4,
    prefill_chunk=64, dtype="fp32")``. ``max_num_seqs`` (as in vLLM) lets offline runs
    decode more sequences together than the server's 1..8 admission range allows.
    ``lora_modules`` maps adapter names to PEFT adapter paths to load right away (see
    :meth:`load_lora`). ``weights``: the checkpoint's (name, tensor) pairs, used instead of
    the directory's weight files (its config and tokenizer are still read from it).
    ``decode_ahead_on_cpu`` runs decode steps launched ahead on CPU too, where they are
    merely synchronous (tests check that CUDA path there; see ``build_engine``).
    """

    def __init__(
        self,
        model_path_or_profile: Optional[str] = None,
        *,
        lora_modules: Optional[dict[str, str]] = None,
        max_num_seqs: Optional[int] = None,
        weights: Optional[Iterable[tuple[str, Any]]] = None,
        decode_ahead_on_cpu: bool = False,
        **overrides: Any,
    ):
        import attrs

        from ninfer.profile import load_profile, resolve

        if model_path_or_profile is not None and _is_profile(model_path_or_profile):
            profile = load_profile(model_path_or_profile, overrides=overrides)
        else:
            profile = load_profile(None, model=model_path_or_profile, overrides=overrides)
        if max_num_seqs is not None:
            # offline use may batch beyond the server's admission range (engine.max_concurrency);
            # set before resolving, so the defaults derived from it (state snapshot rows) follow
            if not 1 <= max_num_seqs <= MAX_NUM_SEQS:
                raise ValueError(f"max_num_seqs must be in 1..{MAX_NUM_SEQS}, got {max_num_seqs}")
            profile = attrs.evolve(profile, engine=attrs.evolve(profile.engine, max_concurrency=max_num_seqs))
        self.profile = resolve(profile)
        self.registry = load_registry(self.profile.plugins.allow)
        self.loaded: LoadedEngine = build_engine(self.profile, self.registry, weights,
                                                 decode_ahead_on_cpu=decode_ahead_on_cpu)
        self.engine = self.loaded.engine
        self._pipeline = None
        for name, path in (lora_modules or {}).items():
            self.load_lora(name, path)

    def get_tokenizer(self):
        return self.loaded.tokenizer

    # what the pipeline reads of its owner (ninfer.frontend.host.ModelHost)
    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def family(self):
        return self.loaded.family

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_context

    @property
    def kv_capacity_tokens(self) -> int:
        return self.engine.kv_capacity_tokens

    @property
    def pipeline(self):
        """The generation pipeline every front door shares, here without a server around it."""
        if self._pipeline is None:
            from ninfer.frontend.pipeline import Pipeline

            self._pipeline = Pipeline(self)
        return self._pipeline

    def load_lora(self, name: str, path: Union[str, Path]) -> None:
        """Serve the PEFT LoRA adapter at ``path`` (a directory or its ``.safetensors``) as ``name``."""
        self.engine.loras.load(name, path)

    # -- generation ------------------------------------------------------------
    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        thinking: Optional[bool] = None,
        lora_name: Union[str, None, Sequence[Optional[str]]] = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids) together; results keep input order.

        ``lora_name`` names a loaded adapter for every prompt, or gives one name (or
        None for the base model) per prompt; prompts with different adapters share batches.
        """
        from ninfer.frontend.pipeline_request import TextPrompt

        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([_text_prompt(p, thinking, TextPrompt) for p in prompts], sampling_params, lora_name)

    def chat(
        self,
        messages: Union[list[dict], list[list[dict]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        tools: Optional[list[dict]] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Optional[dict] = None,
        lora_name: Union[str, None, Sequence[Optional[str]]] = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the checkpoint's chat template, then generate.

        ``chat_template_kwargs`` takes the template options the server accepts:
        ``enable_thinking``, ``preserve_thinking`` and ``reasoning_effort``.
        """
        from ninfer.frontend.chat_messages import parse_messages
        from ninfer.frontend.pipeline_request import ChatPrompt, TemplateOptions

        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        kwargs = dict(chat_template_kwargs or {})
        unknown = sorted(set(kwargs) - _TEMPLATE_OPTIONS)
        if unknown:
            raise ValueError(f"chat_template_kwargs: unknown option {unknown[0]!r} "
                             f"(supported: {', '.join(sorted(_TEMPLATE_OPTIONS))})")
        options = TemplateOptions(effort=kwargs.get("reasoning_effort"), enable=kwargs.get("enable_thinking"),
                                  preserve=kwargs.get("preserve_thinking"))
        prompts = [ChatPrompt(parse_messages(conv), tools=tuple(tools or ()), options=options,
                              continue_final=continue_final_message, add_generation_prompt=add_generation_prompt)
                   for conv in conversations]
        return self._run(prompts, sampling_params, lora_name)

    # -- internals -------------------------------------------------------------
    @staticmethod
    def _params_per_prompt(sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(count)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if len(sampling_params) != count:
            raise ValueError("give one SamplingParams, or one per prompt")
        return list(sampling_params)

    def _loras_per_prompt(self, lora_name, count: int) -> list[Optional[str]]:
        names = [lora_name] * count if lora_name is None or isinstance(lora_name, str) else list(lora_name)
        if len(names) != count:
            raise ValueError("give one lora_name, or one per prompt")
        for name in names:  # unknown names fail before any request is queued
            self.engine.lora_slot(name)
        return names

    def _run(self, prompts: Sequence[Any], sampling_params, lora_name) -> list[RequestOutput]:
        """One pipeline request per prompt, every engine request fed to the engine together."""
        from ninfer.frontend.pipeline_request import GenerateRequest

        params_list = self._params_per_prompt(sampling_params, len(prompts))
        lora_names = self._loras_per_prompt(lora_name, len(prompts))
        outputs: list[RequestOutput] = []
        by_id: dict[str, tuple[RequestOutput, CompletionOutput]] = {}
        try:
            # A request the engine refuses (e.g. a guide that does not compile) withdraws
            # the ones queued before it: nothing of this call is left in the engine.
            for prompt, params, lora in zip(prompts, params_list, lora_names):
                rid = uuid.uuid4().hex
                plan = self.pipeline.plan(GenerateRequest([prompt], params, n=params.n, lora=lora,
                                                          prompt_param="prompt"), rid)
                rendered = plan.prompts[0]
                # token-id prompts report no text, as in vLLM
                token_only = getattr(prompt, "token_ids", None) is not None and prompt.text is None
                text = None if token_only else rendered.text
                result = RequestOutput(rid, text, rendered.token_ids, [], finished=False)
                outputs.append(result)
                for index, engine_request in enumerate(plan.requests):  # one per sample (seed: sample_index)
                    completion = CompletionOutput(index, "", [], logprobs=[] if params.logprobs is not None else None)
                    result.outputs.append(completion)
                    by_id[engine_request.request_id] = (result, completion)
                    self.engine.add_request(engine_request)
            while self.engine.has_unfinished():
                for event in self.engine.step():
                    _apply(event, *by_id[event.request_id])
                if self.engine.dead:
                    raise RuntimeError(f"engine failed: {self.engine.dead}")
        except BaseException:
            for rid in by_id:
                self.engine.abort_request(rid)
            raise
        for result in outputs:
            result.finished = True
        return outputs


#: the chat-template options ``LLM.chat`` passes on (the ones the server's requests may set)
_TEMPLATE_OPTIONS = frozenset({"enable_thinking", "preserve_thinking", "reasoning_effort"})


def _text_prompt(prompt: PromptType, thinking: Optional[bool], make: Any) -> Any:
    """A raw prompt for the pipeline: text, token ids, or vLLM's ``{"prompt_token_ids": ...}``."""
    if isinstance(prompt, str):
        return make(text=prompt, thinking=thinking)
    if isinstance(prompt, dict):
        return make(text=prompt.get("prompt"), token_ids=list(prompt["prompt_token_ids"]), thinking=thinking)
    return make(token_ids=list(prompt), thinking=thinking)


def _apply(event: GenerationEvent, result: RequestOutput, completion: CompletionOutput) -> None:
    if event.error is not None:
        raise event.error
    completion.text += event.text
    completion.token_ids += event.token_ids
    if event.logprobs and completion.logprobs is not None:
        completion.logprobs += event.logprobs
    result.num_cached_tokens = event.num_cached_tokens
    if event.prompt_logprobs is not None:  # every sample of a prompt scores it alike; keep one
        result.prompt_logprobs = event.prompt_logprobs
    if event.finished:
        completion.finish_reason = event.finish_reason
        completion.stop_reason = event.stop_reason
