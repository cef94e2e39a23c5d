"""`kvcompile serve`: an OpenAI-compatible server (`/v1/completions`, `/v1/chat/completions`, streamed or
not) with continuous batching, on a model compiled with a kvcompile policy.

kvcompile's own thin OpenAI layer (FastAPI + pydantic models, this module) over transformers'
continuous-batching engine (`kvcompile.integrations.batching`: every request in its own compressed cache). Not
transformers' `serve` handlers: they let one request kill the engine for every later one (an empty or
oversize prompt), run every request with the first request's sampling settings and reseed torch's
global generator per request, ignore `stop`/`n`/`logprobs` silently, answer errors in FastAPI's
`{"detail"}` shape and scan a Hugging Face cache folder for `/v1/models` (docs/INTERNALS.md, "Serving").

What a request gets (docs/GENERATE.md, "Serving"):
- validated before it reaches the engine: types and ranges (pydantic, strict), unknown fields refused as
  OpenAI refuses them, OpenAI fields kvcompile does not honour refused by name, an empty prompt, a prompt
  (+ max_tokens) past the model's context, a prompt the KV pool can never hold. A 4xx in OpenAI's error
  shape `{"error": {"message", "type", "param", "code"}}`; an unknown model is 404 `model_not_found`.
- its own sampling: temperature, top_p and seed as `generate()` takes them, its own random generator
  (`kvcompile.integrations.batching.RequestSampling`); `stop` strings, `logprobs`, `stream_options.include_usage`.
- a failure inside the engine fails the requests of that step with a 500 in the same shape; the engine
  goes on (`KVCompileBatchingManager._generation_loop_body`); a request whose own work raises in the engine (its
  cache's compression or append, its copy of a kept cache, its sampling) fails alone
  (`KVCompileBatchProcessor._fail_alone`), and so does one whose decoding or stop check raises here (`Job`).

The model name requests carry is `--served-model-name`, by default the checkpoint folder's name (`smollm2-135m` for
`--model models/smollm2-135m`: `default_model_name`); `GET /v1/models` lists it. Without `--served-model-name`
the `--model` argument as given is accepted too.
"""

import asyncio
import logging
import math
import sys
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

log = logging.getLogger("kvcompile.serve")

DEFAULT_MAX_TOKENS = 1024  # a request without max_tokens: transformers serve's default (capped at the context)
MIN_TEMPERATURE = 0.01  # below it (and above 0) the logits divided by the temperature overflow float32 for
#   ordinary logits (1e-300 gives inf and nan probabilities) long before they differ from greedy: refused, as
#   vLLM refuses to go below it (it raises such a temperature to 0.01)
SEED_RANGE = (-2**63, 2**63 - 1)  # int64, as OpenAI's and vLLM's `seed`


@dataclass(frozen=True)
class ServeOptions:
    """What `kvcompile serve` runs: the policy, the model, the engine's KV budget and where it listens."""

    spec: object  # a spec name, a YAML file or a Policy
    model: str  # a local checkpoint folder
    overrides: dict = field(default_factory=dict)  # spec overrides (per_head=...)
    host: str = "127.0.0.1"
    port: int = 8000
    kv_tokens: int = 16384  # the engine's pool: room for this many tokens of full cache
    page_size: int = 16  # tokens per block
    max_batch_tokens: int = 2048  # tokens one forward packs
    log_level: str = "warning"  # uvicorn's and transformers' loggers
    served_model_name: str | None = None  # the `model` requests carry (default: the folder's name)
    log_requests: bool = True  # one line per request and one at shutdown, on stderr
    reuse_context: bool = False  # a request that starts with a finished request's prompt and answer continues
    #   that request's compressed cache (query-agnostic policies only; docs/GENERATE.md "Serving")
    reuse_context_bytes: int | None = None  # the kept caches' bound (least recently used dropped first);
    #   None: a quarter of the pool

    @property
    def model_name(self) -> str:
        return self.served_model_name or default_model_name(self.model)

    @property
    def accepted_names(self) -> set[str]:
        """The `model` a request may carry: the served name; without --served-model-name also `model` as given."""
        return {self.served_model_name} if self.served_model_name else {self.model_name, self.model}


def default_model_name(model: str) -> str:
    """The name a checkpoint folder is served under by default: the folder's own name (`models/smollm2-135m` ->
    `smollm2-135m`), not the path it was given as."""
    from pathlib import Path

    return Path(model).name or Path(model).resolve().name or model


def _require_serving() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ImportError("kvcompile serve needs fastapi and uvicorn: pip install 'kvcompile[serve]' "
                          "(or `pip install fastapi uvicorn openai`)") from exc


def cb_config(options: ServeOptions):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    if options.kv_tokens < options.page_size:
        raise ValueError(f"kvcompile serve: --kv-tokens {options.kv_tokens} is less than one block "
                         f"({options.page_size} tokens)")
    return ContinuousBatchingConfig(num_blocks=options.kv_tokens // options.page_size, page_size=options.page_size,
                                    max_batch_tokens=options.max_batch_tokens, use_async_batching=False,
                                    allow_block_sharing=False)


# --- errors in OpenAI's shape ------------------------------------------------------------------

class APIError(Exception):
    """A refusal or failure answered as OpenAI answers it: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _refuse(name: str, why: str = "") -> APIError:
    return APIError(400, f"kvcompile serve does not support `{name}`{why}", param=name, code="unsupported_parameter")


# --- the request models --------------------------------------------------------------------------

def _unicode(text: str) -> str:
    """`text` if it is valid Unicode text (encodable as UTF-8): JSON's `\\ud800` escapes give Python a lone UTF-16
    surrogate, which no tokenizer and no UTF-8 stream can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains a lone UTF-16 surrogate ({text[exc.start]!r} at character {exc.start}): not "
                         "valid Unicode text") from None
    return text


def _temperature(value: float) -> float:
    if 0 < value < MIN_TEMPERATURE:
        raise ValueError(f"temperature must be 0 (greedy) or from {MIN_TEMPERATURE} to 2, got {value!r} (a smaller "
                         "temperature gives non-finite probabilities; use 0 for greedy)")
    return value


def _models():
    """The pydantic request models (defined lazily: pydantic comes with the serving extra)."""
    from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

    Float = StrictFloat | StrictInt
    Text = Annotated[StrictStr, AfterValidator(_unicode)]  # every string that reaches the tokenizer or the log

    class Strict(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)

    class StreamOptions(Strict):
        include_usage: StrictBool | None = None
        continuous_usage_stats: StrictBool | None = None  # vLLM's; refused below when true

    class Common(Strict):
        """Fields both endpoints share. Fields OpenAI knows but kvcompile does not honour are declared (so
        they are not "unrecognized") and refused by name when set to anything but their no-op value."""

        model: Text
        max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
        temperature: Annotated[Float, Field(ge=0, le=2), AfterValidator(_temperature)] | None = None
        top_p: Annotated[Float, Field(gt=0, le=1)] | None = None
        seed: Annotated[StrictInt, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
        stop: Annotated[Text, Field(min_length=1)] | Annotated[
            list[Annotated[Text, Field(min_length=1)]], Field(max_length=4)] | None = None
        n: Annotated[StrictInt, Field(ge=1, le=128)] | None = None
        stream: StrictBool | None = None
        stream_options: StreamOptions | None = None
        user: Text | None = None  # an end-user id: logged
        frequency_penalty: Annotated[Float, Field(ge=-2, le=2)] | None = None
        presence_penalty: Annotated[Float, Field(ge=-2, le=2)] | None = None
        logit_bias: dict[str, Float] | None = None

        def refuse_unsupported(self) -> None:
            if self.n not in (None, 1):
                raise _refuse("n", " above 1 (one choice per request; send n requests)")
            for name in ("frequency_penalty", "presence_penalty"):
                if getattr(self, name) not in (None, 0):
                    raise _refuse(name)
            if self.logit_bias:
                raise _refuse("logit_bias")
            if self.stream_options is not None:
                if not self.stream:
                    raise APIError(400, "`stream_options` is only allowed when `stream` is true",
                                   param="stream_options", code="invalid_value")
                if self.stream_options.continuous_usage_stats:
                    raise _refuse("stream_options.continuous_usage_stats")

    class CompletionRequest(Common):
        prompt: Text | list[Any]
        logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = None
        echo: StrictBool | None = None
        best_of: Annotated[StrictInt, Field(ge=1)] | None = None
        suffix: Text | None = None

        def refuse_unsupported(self) -> None:
            super().refuse_unsupported()
            if not isinstance(self.prompt, str):
                raise APIError(400, "`prompt` must be one string (batched prompts and token-id prompts are not "
                                    "supported by kvcompile serve)", param="prompt", code="invalid_type")
            if self.echo:
                raise _refuse("echo")
            if self.best_of not in (None, 1):
                raise _refuse("best_of", " above 1")
            if self.suffix:
                raise _refuse("suffix")
            if self.logprobs is not None and self.stream:
                raise _refuse("logprobs", " with `stream` (ask without streaming)")

        @property
        def top_logprobs_asked(self) -> int | None:
            return self.logprobs

    class TextPart(Strict):
        type: Literal["text"]
        text: Text

    class Message(Strict):
        role: Literal["system", "developer", "user", "assistant"]
        content: Text | list[TextPart]
        name: Text | None = None

        def text(self) -> str:
            return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    class ChatRequest(Common):
        messages: Annotated[list[Message], Field(min_length=1)]
        max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
        logprobs: StrictBool | None = None
        top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
        tools: list[Any] | None = None
        tool_choice: Any = None
        parallel_tool_calls: StrictBool | None = None
        functions: list[Any] | None = None
        function_call: Any = None
        response_format: dict | None = None
        modalities: list[Any] | None = None
        audio: Any = None
        prediction: Any = None
        reasoning_effort: Any = None
        service_tier: Any = None
        store: StrictBool | None = None
        metadata: dict | None = None
        web_search_options: Any = None

        def refuse_unsupported(self) -> None:
            super().refuse_unsupported()
            for name in ("tools", "tool_choice", "functions", "function_call", "audio", "prediction",
                         "reasoning_effort", "web_search_options"):
                if getattr(self, name) is not None:
                    raise _refuse(name)
            if self.parallel_tool_calls:
                raise _refuse("parallel_tool_calls")
            if self.response_format is not None and self.response_format.get("type") != "text":
                raise _refuse("response_format", " other than {\"type\": \"text\"}")
            if self.modalities not in (None, ["text"]):
                raise _refuse("modalities", " other than [\"text\"]")
            if self.store:
                raise _refuse("store")
            if self.service_tier not in (None, "auto", "default"):
                raise _refuse("service_tier")
            if self.top_logprobs is not None and not self.logprobs:
                raise APIError(400, "`top_logprobs` needs `logprobs: true`", param="top_logprobs", code="invalid_value")
            if self.logprobs and self.stream:
                raise _refuse("logprobs", " with `stream` (ask without streaming)")
            if self.max_tokens is not None and self.max_completion_tokens is not None:
                raise APIError(400, "give `max_completion_tokens` or `max_tokens`, not both",
                               param="max_completion_tokens", code="invalid_value")

        @property
        def top_logprobs_asked(self) -> int | None:
            return (self.top_logprobs or 0) if self.logprobs else None

    return CompletionRequest, ChatRequest


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _validation_error(exc) -> APIError:
    """A pydantic validation error as OpenAI's 400, naming the first field at fault."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": str(exc), "type": ""}
    # a field with a union type (a string or text parts) has one error per member: name the member the value had
    # the type of (its value is what is wrong), not the first member's type mismatch
    same_field = [e for e in errors if e.get("loc", ())[:1] == first.get("loc", ())[:1]]
    first = next((e for e in same_field if not e.get("type", "").endswith("_type")), first)
    loc = []
    for part in first.get("loc", ()):
        if isinstance(part, int):
            loc.append(str(part))
        elif part != "body" and part not in _UNION_TAGS and part.isidentifier():  # `list[str]`: a union member
            loc.append(part)
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param,
                        code="unrecognized_argument")
    if first.get("type") == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    return APIError(400, f"Invalid value for '{param}': {first.get('msg')}", param=param, code="invalid_value")


# --- one request in the engine -------------------------------------------------------------------

class EngineFailure(Exception):
    """The engine failed a request (its error message)."""


@dataclass
class Outcome:
    """What a finished request gave: its text, tokens, why it ended, its log-probabilities."""

    text: str
    tokens: list[int]
    finish_reason: str
    logprobs: list


class Job:
    """One request in the engine: its outputs arrive on the event loop (`register_result_handler`), are decoded
    and cut at the first stop string (the engine request is then cancelled)."""

    def __init__(self, server: "KVCompileServer", request_id: str, prompt_ids: list[int], max_new_tokens: int,
                 sampling, stop: list[str], continues=None):
        self.server, self.request_id, self.prompt_ids = server, request_id, prompt_ids
        self.max_new_tokens, self.sampling, self.stop = max_new_tokens, sampling, stop
        self.continues = continues  # the kept sequence it continues (--reuse-context), or None
        self.queue: asyncio.Queue = asyncio.Queue()
        self.start = time.perf_counter()
        self.first_token: float | None = None
        self.tokens: list[int] = []
        self.finished = False
        self.status = "running"
        self.cut = False  # ended at a stop string (its cache holds tokens past the answer)
        self.keep = False  # hand its cache over when it ends, to be kept for a continuation (--reuse-context)
        self.give_back = None  # returns the kept sequence it continues, once (weakref.finalize; --reuse-context)
        self.reused = 0 if continues is None else len(continues.ids) - 1  # tokens of the kept sequence not fed again

    def submit(self) -> None:
        manager = self.server.manager
        manager.register_result_handler(self.request_id, self.queue.put_nowait)
        if self.keep:
            with self.server.cache.kvcompile.keep_lock:
                self.server.cache.kvcompile.keep.add(self.request_id)
        try:
            manager.submit(self.prompt_ids, self.request_id, self.max_new_tokens, self.sampling, streaming=True,
                           eos_token_id=self.server.eos_token_id,
                           continues=None if self.continues is None else self.continues.cache)
        except Exception:
            self.forget()
            with self.server.cache.kvcompile.keep_lock:
                self.server.cache.kvcompile.keep.discard(self.request_id)
            raise

    def forget(self) -> None:
        with self.server.manager.output_router._lock:
            self.server.manager.output_router.result_handlers.pop(self.request_id, None)

    def cancel(self) -> None:
        """Stop the engine's request (client gone, or a stop string found): its blocks go back to the pool."""
        if not self.finished:
            self.finished = True
            self.forget()
            self.server.manager.cancel_request(self.request_id)

    def decode(self, tokens: list[int]) -> str:
        return self.server.tokenizer.decode(tokens, skip_special_tokens=True)

    def _held_back(self, text: str) -> int:
        """Characters at the end of `text` not to stream yet: an incomplete character, or the start of a stop
        string."""
        if text.endswith("\ufffd"):
            return len(text) - len(text.rstrip("\ufffd"))
        hold = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        return hold

    def _cut(self, tokens: list[int], seen: int) -> tuple[int, str] | None:
        """The first stop string in the text of `tokens`: (tokens up to the one completing it, text before it)."""
        text = self.decode(tokens)
        hits = [text.find(s) for s in self.stop if s in text]
        if not hits:
            return None
        at = min(hits)
        for k in range(max(seen, 1), len(tokens) + 1):  # the first token whose text completes a stop string
            if any(s in self.decode(tokens[:k]) for s in self.stop):
                return k, text[:at]
        return len(tokens), text[:at]

    async def deltas(self):
        """Text as it becomes final, then an Outcome."""
        sent, seen = 0, 0
        while True:
            output = await self.queue.get()
            if self.sampling.error is not None:  # its token could not be picked: what the output holds is a stand-in
                self.cancel()
                raise EngineFailure(f"{type(self.sampling.error).__name__}: {self.sampling.error}")
            if output.error is not None:
                self.finished = True
                self.forget()
                raise EngineFailure(output.error)
            tokens = list(output.generated_tokens)
            if tokens and self.first_token is None:
                self.first_token = time.perf_counter()
            done = output.is_finished()
            cut = self._cut(tokens, seen) if self.stop else None
            if cut is not None:
                count, text = cut
                self.cut = True
                self.tokens = tokens[:count]
                self.cancel()
                text = text if len(text) >= sent else self.decode(self.tokens)[:sent]
                if len(text) > sent:
                    yield text[sent:]
                yield Outcome(text, self.tokens, "stop", self._logprobs())
                return
            text = self.decode(tokens)
            self.tokens, seen = tokens, len(tokens)
            if done:
                self.finished = True
                if len(text) > sent:
                    yield text[sent:]
                reason = "length" if len(tokens) >= self.max_new_tokens else "stop"
                yield Outcome(text, tokens, reason, self._logprobs())
                return
            ready = len(text) - self._held_back(text)
            if ready > sent:
                yield text[sent:ready]
                sent = ready

    def _logprobs(self) -> list:
        return list(self.sampling.logprobs[:len(self.tokens)]) if self.sampling.top_logprobs is not None else []

    def kv_held(self) -> int | None:
        """Bytes the request's cache held when it ended (None if it never had one)."""
        for _ in range(5):  # the engine thread appends to it: retry a read that raced with it
            try:
                finished = list(self.server.cache.kvcompile.finished)
                break
            except RuntimeError:
                continue
        else:
            return None
        return next((u.bytes for u in reversed(finished) if u.request_id == self.request_id), None)


# --- the server ------------------------------------------------------------------------------------

def prompt_chars_bound(tokenizer, context: int | None) -> int | None:
    """The most characters a prompt of `context` tokens can have: `context` times the longest token of the
    vocabulary (added and special tokens included) in characters. A token's string in the vocabulary has at least
    as many characters as the text it stands for (byte-level: one per byte; SentencePiece: `▁` for a space;
    WordPiece: `##` more), so a longer prompt is past the context whatever its tokens, unless the tokenizer's
    normalizer deletes characters (accents, control characters), which the tokenizers of causal LMs do not.
    None: no context known."""
    if context is None:
        return None
    return context * max(1, max((len(token) for token in tokenizer.get_vocab()), default=1))


def check_reuse(policy, options: ServeOptions) -> None:
    """Refuse, before anything loads, `--reuse-context` where a kept cache would not be what the policy keeps of the
    longer prompt for any question: a scorer that ranks the prompt by the question at its end."""
    if options.reuse_context_bytes is not None and not options.reuse_context:
        raise ValueError("kvcompile serve: --reuse-context-bytes bounds the kept caches of --reuse-context; give both")
    if options.reuse_context_bytes is not None and options.reuse_context_bytes < 1:
        raise ValueError("kvcompile serve: --reuse-context-bytes must be at least 1, got "
                         f"{options.reuse_context_bytes}")
    if options.reuse_context and not getattr(policy.scoring, "query_agnostic", False):
        raise ValueError(f"kvcompile serve: --reuse-context needs a query-agnostic policy (its scores of a context do "
                         f"not depend on the question after it: expected_attention, knorm, streamingllm); "
                         f"{policy.name}'s scorer {type(policy.scoring).__name__} ranks the prompt by the question at "
                         "its end, so a cache compressed before the question would not be what it keeps")


class KVCompileServer:
    """The OpenAI layer and the engine over one compiled model; `start()` runs uvicorn in a thread, `run()` in
    this one, `stop()` stops the server and the engine."""

    def __init__(self, options: ServeOptions):
        _require_serving()
        import uvicorn
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
        from transformers.utils import logging as hf_logging

        import kvcompile
        from kvcompile.integrations.batching import KVCompilePagedCache
        from kvcompile.spec import load_spec

        self.options = options
        policy = load_spec(options.spec, **options.overrides)  # a bad spec fails here, naming file and field
        check_reuse(policy, options)
        cb = cb_config(options)
        hf_logging.get_logger("transformers").setLevel(hf_logging.log_levels[options.log_level.lower()])
        log.setLevel(logging.INFO)
        self._handler = None
        if options.log_requests:
            self._handler = logging.StreamHandler(sys.stderr)
            self._handler.setFormatter(logging.Formatter("%(asctime)s kvcompile serve: %(message)s"))
            log.addHandler(self._handler)
            log.propagate = False
        self.tokenizer = AutoTokenizer.from_pretrained(options.model)
        model = AutoModelForCausalLM.from_pretrained(options.model, dtype="auto", attn_implementation="sdpa")
        kvcompile.compile(model.eval(), policy)
        self.model = model
        eos = model.generation_config.eos_token_id
        eos = model.config.eos_token_id if eos is None else eos
        self.eos_token_id = -1 if eos is None else eos
        self.context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self.max_prompt_chars = prompt_chars_bound(self.tokenizer, self.context)
        # prompts are tokenized on this thread, off the event loop, one at a time
        from concurrent.futures import ThreadPoolExecutor

        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcompile-tokenize")
        # the engine's own config is greedy and processes no logits: every request brings its own (RequestSampling)
        engine_config = GenerationConfig(do_sample=False, max_new_tokens=DEFAULT_MAX_TOKENS,
                                         eos_token_id=self.eos_token_id,
                                         pad_token_id=model.generation_config.pad_token_id)
        # refuses here, before listening, a policy or configuration the engine cannot run (check_batching)
        self.manager = model.init_continuous_batching(generation_config=engine_config, continuous_batching_config=cb)
        self.manager.start()
        end = time.monotonic() + 60
        while not isinstance(getattr(self.manager.batch_processor, "cache", None), KVCompilePagedCache):
            if not self.manager.is_running() or time.monotonic() > end:
                error = self.manager.background_thread_status.fatal_error
                self.manager.stop(block=True, timeout=10)
                raise RuntimeError(f"kvcompile serve: the engine did not start ({error})")
            time.sleep(0.01)
        self.cache = self.manager.batch_processor.cache
        self.kept = None
        self.reused_requests = 0
        if options.reuse_context:
            from kvcompile.integrations.context import KeptSequences

            state = self.cache.kvcompile
            pool = self.cache.num_blocks * state.bytes_per_block
            bound = pool // 4 if options.reuse_context_bytes is None else options.reuse_context_bytes
            if bound >= pool:
                self.manager.stop(block=True, timeout=10)
                raise ValueError(f"kvcompile serve: --reuse-context-bytes {bound} is not less than the KV pool "
                                 f"({pool} bytes: --kv-tokens {options.kv_tokens}); the kept caches must leave room "
                                 "for the requests")
            self.kept = KeptSequences(bound)
            # a request is admitted only if it fits beside kept caches filling their bound (it never waits on them)
            state.outside_bound_blocks = math.ceil(bound / state.bytes_per_block)
        self.counts = {"ok": 0, "refused": 0, "failed": 0, "cancelled": 0}
        self.started_at = time.time()
        self.app = self._build_app()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=options.host, port=options.port,
                                                    log_level=options.log_level.lower(), lifespan="off"))
        self._thread: threading.Thread | None = None
        self._stopped = False

    # --- requests -------------------------------------------------------------------------------
    def _check_model(self, name: str) -> None:
        if name not in self.options.accepted_names:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.options.model_name}`",
                           param="model", code="model_not_found")

    def _check_prompt_size(self, request, chat: bool) -> None:
        """Refuse, before tokenizing it, a prompt whose characters are more than the context could hold
        (`prompt_chars_bound`): a multi-megabyte prompt costs no tokenizer time."""
        if self.max_prompt_chars is None:
            return
        chars = sum(len(m.text()) for m in request.messages) if chat else len(request.prompt)
        if chars > self.max_prompt_chars:
            raise APIError(400, f"This model's maximum context length is {self.context} tokens; the prompt has "
                                f"{chars} characters, more than {self.context} tokens of this tokenizer can hold (at "
                                f"most {self.max_prompt_chars // self.context} characters a token)",
                           param="messages" if chat else "prompt", code="context_length_exceeded")

    def _prompt_ids(self, request, chat: bool) -> list[int]:
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise APIError(400, "the served model has no chat template; use /v1/completions", param="messages",
                               code="invalid_value")
            messages = [{"role": m.role, "content": m.text()} for m in request.messages]
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"]
        else:
            if not request.prompt:
                raise APIError(400, "`prompt` is empty", param="prompt", code="invalid_value")
            ids = self.tokenizer(request.prompt)["input_ids"]
        ids = list(ids)
        if not ids:
            raise APIError(400, "the prompt has no tokens", param="messages" if chat else "prompt",
                           code="invalid_value")
        return ids

    def _max_new_tokens(self, request, prompt: int, chat: bool) -> int:
        param = "messages" if chat else "prompt"
        asked = (request.max_completion_tokens or request.max_tokens) if chat else request.max_tokens
        if self.context is not None and prompt >= self.context:
            raise APIError(400, f"This model's maximum context length is {self.context} tokens; the prompt has "
                                f"{prompt}", param=param, code="context_length_exceeded")
        if asked is None:
            default = max(DEFAULT_MAX_TOKENS, self.model.generation_config.max_new_tokens or 0)
            return default if self.context is None else min(default, self.context - prompt)
        if self.context is not None and prompt + asked > self.context:
            name = "max_completion_tokens" if chat and request.max_completion_tokens else "max_tokens"
            raise APIError(400, f"This model's maximum context length is {self.context} tokens; the prompt has "
                                f"{prompt} and `{name}` asks {asked} more", param=name,
                           code="context_length_exceeded")
        return asked

    def _sampling(self, request):
        """The request's sampling as generate() would run it with the same arguments: the checkpoint's
        generation_config completed as generate() completes it (`_prepare_generation_config`: top_k 50 where it
        samples...), then the request's temperature (0: greedy) and top_p."""
        from kvcompile.integrations.batching import RequestSampling

        settings = {}
        if request.temperature is not None:
            settings = {"do_sample": False} if request.temperature == 0 else {"do_sample": True,
                                                                               "temperature": float(request.temperature)}
        if request.top_p is not None and settings.get("do_sample", self.model.generation_config.do_sample):
            settings["top_p"] = float(request.top_p)
        config, _ = self.model._prepare_generation_config(None, **settings)
        return RequestSampling.for_config(self.model, config, seed=request.seed,
                                          top_logprobs=request.top_logprobs_asked)

    async def prepare(self, request, chat: bool, request_id: str) -> Job:
        """Validate `request` against the model, its context and the pool; the Job to submit. The prompt is
        tokenized on the tokenizer's thread: the event loop (other requests' streams, /health) never waits on it."""
        request.refuse_unsupported()
        self._check_model(request.model)
        self._check_prompt_size(request, chat)
        ids = await asyncio.get_running_loop().run_in_executor(self._tokenizing, self._prompt_ids, request, chat)
        new = self._max_new_tokens(request, len(ids), chat)
        error = self.cache.admission_error(request_id, len(ids), new)
        if error is not None:
            raise APIError(400, str(error), param="messages" if chat else "prompt", code="kv_pool_exceeded")
        stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        entry = None if self.kept is None else self.kept.match(ids, lend=True)
        if entry is not None and self.cache.admission_error(request_id, len(ids), new, entry.cache) is not None:
            self._give_back(entry)
            entry = None  # its copy and new tokens cannot fit beside the kept caches: prefilled as a new prompt
        if entry is not None:
            self.reused_requests += 1
        job = Job(self, request_id, ids, new, self._sampling(request), stop, continues=entry)
        job.keep = self.kept is not None
        if entry is not None:  # given back when the request is settled, or else when the job is dropped
            job.give_back = weakref.finalize(job, self._give_back, entry)
        return job

    # --- reuse of kept compressed sequences (--reuse-context) ------------------------------------
    def _settle(self, job: Job, outcome) -> None:
        """After a request ends: keep its compressed cache (prompt + answer) for a continuation when it ended by
        itself (eos or max_tokens: not cut at a stop string, cancelled or failed), else give its blocks back."""
        from kvcompile.integrations.batching import outside_id, request_bytes, RequestKV
        from kvcompile.integrations.context import KeptSequence

        if job.give_back is not None:
            job.give_back()  # the kept sequence it continued: its memory is no longer this request's to hold
        if not job.keep:
            return
        state, key = self.cache.kvcompile, outside_id(job.request_id)
        with state.keep_lock:  # the engine hands a finished request's cache over before its last output
            cache = state.handed.pop(job.request_id, None)
            state.keep.discard(job.request_id)
        ids = list(job.prompt_ids) + list(job.tokens)
        if cache is None or outcome is None or job.cut or cache.seq_length != len(ids) - 1:
            self.cache.release_outside(key)
            return
        try:
            dropped = self.kept.put(KeptSequence(tuple(ids), cache, request_bytes(RequestKV(cache, 0)), key))
        except Exception:  # noqa: BLE001 - keeping it failed: the answer stands, its blocks go back
            log.exception(f"{job.request_id}: its compressed cache could not be kept for a continuation; its blocks "
                          "go back to the pool")
            self.cache.release_outside(key)
            return
        for entry in dropped:
            self.cache.release_outside(entry.key)

    def _give_back(self, entry) -> None:
        """A continuation is done with the kept sequence `entry`: release its blocks if it was dropped meanwhile."""
        for dropped in self.kept.give_back(entry):
            self.cache.release_outside(dropped.key)

    async def settle(self, job: Job | None, outcome) -> None:
        if job is None or self.kept is None:
            return
        await asyncio.get_running_loop().run_in_executor(None, self._settle, job, outcome)

    def _log(self, job: Job | None, status: int, outcome: str, path: str, note: str = "",
             request_id: str = "-") -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        if job is None:
            log.info(f"{request_id} {path} {status} {outcome}{': ' + note if note else ''}")
            return
        ttft = "-" if job.first_token is None else f"{job.first_token - job.start:.3f}s"
        held = job.kv_held()
        log.info(f"{job.request_id} {path} {status} {outcome} prompt_tokens={len(job.prompt_ids)} "
                 f"completion_tokens={len(job.tokens)} ttft={ttft} total={time.perf_counter() - job.start:.3f}s "
                 f"kv_held={'-' if held is None else held}{f' reused={job.reused}' if job.reused else ''}"
                 f"{' ' + note if note else ''}")

    # --- responses ------------------------------------------------------------------------------
    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _logprobs_body(self, job: Job, outcome: Outcome, chat: bool):
        if job.sampling.top_logprobs is None:
            return None
        if chat:
            content = []
            for token, (logprob, top) in zip(outcome.tokens, outcome.logprobs):
                text = self._token_text(token)
                content.append({"token": text, "logprob": logprob, "bytes": list(text.encode()),
                                "top_logprobs": [{"token": self._token_text(t), "logprob": lp,
                                                  "bytes": list(self._token_text(t).encode())} for t, lp in top]})
            return {"content": content}
        tokens, offsets, offset = [], [], len(self.tokenizer.decode(job.prompt_ids, skip_special_tokens=True))
        for token in outcome.tokens:
            tokens.append(self._token_text(token))
            offsets.append(offset)
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in outcome.logprobs],
                "top_logprobs": [{self._token_text(t): v for t, v in top} for _, top in outcome.logprobs],
                "text_offset": offsets}

    def _usage(self, job: Job, outcome_tokens: int) -> dict:
        prompt = len(job.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": outcome_tokens, "total_tokens": prompt + outcome_tokens}

    async def complete(self, job: Job, chat: bool) -> dict:
        job.submit()
        outcome = None
        try:
            async for item in job.deltas():
                if isinstance(item, Outcome):
                    outcome = item
        finally:
            if outcome is None:
                job.cancel()
            await self.settle(job, outcome)
        choice = {"index": 0, "logprobs": self._logprobs_body(job, outcome, chat), "finish_reason": outcome.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": outcome.text}
        else:
            choice["text"] = outcome.text
        return {"id": job.request_id, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.options.model_name, "choices": [choice],
                "usage": self._usage(job, len(outcome.tokens))}

    def _chunk(self, job: Job, chat: bool, text: str | None = None, finish: str | None = None, role: bool = False,
               usage: dict | None = None, choices: bool = True) -> str:
        import json

        body = {"id": job.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.options.model_name}
        if choices:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                body["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
            else:
                body["choices"] = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
        else:
            body["choices"] = []
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    async def stream(self, job: Job, chat: bool, include_usage: bool, path: str):
        import json

        status, outcome, note, ended = 200, "cancelled", "", None
        try:
            if chat:
                yield self._chunk(job, chat, role=True)
            async for item in job.deltas():
                if isinstance(item, Outcome):
                    ended = item
                    yield self._chunk(job, chat, finish=item.finish_reason)
                    if include_usage:
                        yield self._chunk(job, chat, usage=self._usage(job, len(item.tokens)), choices=False)
                    yield "data: [DONE]\n\n"
                    outcome = "ok"
                    return
                yield self._chunk(job, chat, text=item)
        except EngineFailure as exc:
            status, outcome, note = 500, "failed", str(exc)
            error = APIError(500, f"the engine failed this request: {exc}", code="engine_error")
            yield f"data: {json.dumps(error.body())}\n\n"
            yield "data: [DONE]\n\n"
        except Exception as exc:  # noqa: BLE001 - this layer's failure for this request (its decoding, its stop
            #   check): its stream ends with the error, as a failure of the engine's would (the engine request is
            #   cancelled below)
            log.exception(f"{path}: unexpected error in {job.request_id}'s stream")
            status, outcome, note = 500, "failed", f"{type(exc).__name__}: {exc}"
            error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
            yield f"data: {json.dumps(error.body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()
            if self.kept is not None:  # in the background: the client may be gone
                asyncio.get_running_loop().run_in_executor(None, self._settle, job, ended)
            self._log(job, status, outcome, path, note)

    # --- the app --------------------------------------------------------------------------------
    def _build_app(self):
        from fastapi import FastAPI, Request
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
        from pydantic import ValidationError
        from starlette.exceptions import HTTPException as StarletteHTTPException

        CompletionRequest, ChatRequest = _models()
        app = FastAPI(title="kvcompile serve")
        server = self

        def answer(error: APIError) -> JSONResponse:
            return JSONResponse(error.body(), status_code=error.status)

        @app.exception_handler(APIError)
        async def _api_error(_request, exc: APIError):
            return answer(exc)

        @app.exception_handler(RequestValidationError)
        async def _invalid(_request, exc):
            return answer(_validation_error(exc))

        @app.exception_handler(StarletteHTTPException)
        async def _http(_request, exc):
            return answer(APIError(exc.status_code, str(exc.detail), code=None))

        async def body_of(request: Request, model, path: str):
            try:
                data = await request.json()
            except Exception:  # noqa: BLE001 - any unreadable body
                raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
            if not isinstance(data, dict):
                raise APIError(400, "the request body must be a JSON object", code="invalid_json")
            try:
                return model.model_validate(data)
            except ValidationError as exc:
                raise _validation_error(exc) from None

        async def handle(request: Request, model, chat: bool, path: str):
            job = None
            request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            try:
                body = await body_of(request, model, path)
                job = await server.prepare(body, chat, request_id)
                if body.stream:
                    job.submit()
                    include = bool(body.stream_options and body.stream_options.include_usage)
                    return StreamingResponse(server.stream(job, chat, include, path), media_type="text/event-stream")
                reply = await server.complete(job, chat)
            except APIError as exc:
                server._log(job, exc.status, "refused", path, exc.message, request_id)
                return answer(exc)
            except EngineFailure as exc:
                server._log(job, 500, "failed", path, str(exc), request_id)
                return answer(APIError(500, f"the engine failed this request: {exc}", code="engine_error"))
            except Exception as exc:  # noqa: BLE001 - a bug of this layer fails this request only
                log.exception(f"{path}: unexpected error")
                server._log(job, 500, "failed", path, f"{type(exc).__name__}: {exc}", request_id)
                return answer(APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error"))
            server._log(job, 200, "ok", path)
            return JSONResponse(reply)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await handle(request, CompletionRequest, False, "/v1/completions")

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await handle(request, ChatRequest, True, "/v1/chat/completions")

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [server.model_card()]}

        @app.get("/v1/models/{name:path}")
        async def model(name: str):
            server._check_model(name)
            return server.model_card()

        @app.get("/health")
        async def health():
            if not server.engine_alive():
                return answer(APIError(503, "the engine is not running", code="engine_stopped"))
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(server.metrics_text(), media_type="text/plain; version=0.0.4")

        return app

    def model_card(self) -> dict:
        return {"id": self.options.model_name, "object": "model", "created": int(self.started_at),
                "owned_by": "kvcompile", "policy": self.model.kvcompile_policy.name,
                "max_model_len": self.context}

    def engine_alive(self) -> bool:
        return self.manager.is_running() and self.manager.background_thread_status.fatal_error is None

    # --- metrics --------------------------------------------------------------------------------
    def metrics(self) -> dict:
        """What the operator watches: requests running and waiting, KV bytes held against the full cache of the
        same tokens, pool blocks free, soft resets, failed engine steps, requests by outcome."""
        from kvcompile.integrations.batching import request_bytes

        cache, state = self.cache, self.cache.kvcompile
        plan = state.plan
        per_token = plan.num_layers * len(plan.kv_heads) * 2 * plan.head_dim * cache.dtype.itemsize
        for _ in range(5):  # the engine thread changes these dicts: retry a read that raced with it
            try:
                live = list(state.requests.values())
                held = sum(request_bytes(kv) for kv in live)
                full = sum(kv.cache.seq_length * per_token for kv in live)
                scheduler = self.manager.batch_processor.scheduler
                running, waiting = len(scheduler.active_requests), len(scheduler.waiting_requests)
                free = cache.pool.count_free_blocks(cache.allocator.index) + \
                    cache.pool.num_free_sectors * cache.allocator.blocks_per_sector
                break
            except (RuntimeError, AttributeError):
                continue
        else:
            held = full = running = waiting = free = -1
        waiting += self.manager.input_queue.qsize()
        kept = 0 if self.kept is None else self.kept.nbytes
        return {"requests_running": running, "requests_waiting": waiting, "kv_bytes_held": held,
                "kv_bytes_kept": kept, "kv_bytes_outside": self.cache.outside_bytes(),
                "kept_sequences": 0 if self.kept is None else len(self.kept), "requests_reused": self.reused_requests,
                "kv_bytes_full": full, "blocks_free": free, "blocks_total": cache.num_blocks,
                "soft_resets": state.soft_resets, "failed_engine_steps": state.failed_forwards,
                "requests": dict(self.counts)}

    def metrics_text(self) -> str:
        m = self.metrics()
        lines = []
        for name, help_text, kind in (
                ("requests_running", "requests in the engine now", "gauge"),
                ("requests_waiting", "requests queued for the engine", "gauge"),
                ("kv_bytes_held", "KV bytes the live requests' compressed caches hold", "gauge"),
                ("kv_bytes_full", "KV bytes a full cache of the same tokens would hold", "gauge"),
                ("kv_bytes_kept", "KV bytes of the compressed sequences kept for continuations", "gauge"),
                ("kv_bytes_outside", "KV bytes the pool accounts for outside the engine (kept caches)", "gauge"),
                ("kept_sequences", "compressed sequences kept for continuations", "gauge"),
                ("requests_reused", "requests that continued a kept sequence since start", "counter"),
                ("blocks_free", "free blocks of the KV pool", "gauge"),
                ("blocks_total", "blocks of the KV pool", "gauge"),
                ("soft_resets", "requests preempted and replayed since start", "counter"),
                ("failed_engine_steps", "engine steps that raised (their requests failed) since start", "counter")):
            metric = f"kvcompile_{name}" + ("_total" if kind == "counter" else "")
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}", f"{metric} {m[name]}"]
        lines += ["# HELP kvcompile_requests_total HTTP completion requests by outcome",
                  "# TYPE kvcompile_requests_total counter"]
        lines += [f'kvcompile_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(m["requests"].items())]
        return "\n".join(lines) + "\n"

    # --- running --------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self.server.run()
        finally:
            self.shutdown()

    def start(self) -> None:
        def serve():
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            loop.run_until_complete(self.server.serve())

        self._thread = threading.Thread(target=serve, name="kvcompile-serve", daemon=True)
        self._thread.start()

    def wait_started(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while not self.server.started:
            if self._thread is not None and not self._thread.is_alive():
                raise RuntimeError("kvcompile serve: the server thread ended before it started listening")
            if time.monotonic() > end:
                raise TimeoutError(f"kvcompile serve: not listening after {timeout} s")
            time.sleep(0.05)

    def shutdown(self) -> None:
        """Stop the engine (once) and log the run's totals."""
        if self._stopped:
            return
        self._stopped = True
        report = self.cache.memory_report()
        if self.kept is not None:
            self.kept.clear()
        self.manager.stop(block=True, timeout=10)
        self._tokenizing.shutdown(wait=False, cancel_futures=True)
        counts = ", ".join(f"{k} {v}" for k, v in self.counts.items())
        log.info(f"shut down after {sum(self.counts.values())} requests ({counts}); at most "
                 f"{report['peak_requests']} at once; {report['soft_resets']} soft resets; "
                 f"{report['free_blocks']}/{report['num_blocks']} blocks free; up {time.time() - self.started_at:.0f}s")
        if self._handler is not None:
            log.removeHandler(self._handler)
            log.propagate = True
            self._handler = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        self.shutdown()


def serve(options: ServeOptions) -> None:
    """`kvcompile serve`: build and run the server until interrupted."""
    server = KVCompileServer(options)
    print(f"kvcompile serve: {options.model} with {server.model.kvcompile_policy.name} on "
          f"http://{options.host}:{options.port}/v1 (chat/completions, completions, models; /health, /metrics); "
          f"requests name the model {options.model_name!r}; KV pool {options.kv_tokens} tokens of full cache",
          flush=True)
    server.run()
