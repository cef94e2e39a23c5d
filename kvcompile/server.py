"""`kvcompile serve`: transformers' OpenAI-compatible server (`transformers serve`: FastAPI + uvicorn,
`/v1/chat/completions`, `/v1/completions`, streaming) with continuous batching, on a model compiled
with a kvcompile policy.

transformers' `Serve` command builds its `ModelManager` itself and takes no hook to compile the model
it loads; this module assembles the same parts (`cli/serving`: ModelManager, GenerationState, the
handlers, `build_server`, uvicorn) with a `ModelManager` whose `_load_model` compiles the model and
checks, before the server listens, that continuous batching can run the policy
(`kvcompile.serving.check_batching`). Requests then go through the engine of kvcompile.serving.
Needs the serving extra: `pip install fastapi uvicorn openai` (transformers[serving]).

New tokens: a request's `max_tokens` (chat: `max_completion_tokens` first; responses:
`max_output_tokens`) is honored; a request without one gets transformers serve's default, 1024 (the
model's generation_config.max_new_tokens where larger; `BaseHandler._build_generation_config`). That
default costs no memory up front: a request reserves its compressed prompt and at most
`plan.SPARE_RUN` spare pages per head whatever its max_new_tokens, then grows as it decodes (and is
soft-reset and replayed exactly when the pool runs out; kvcompile.serving). Sampling: the request's
`seed` field is transformers' (it seeds torch's generator, which the engine's sampling shares); the
server has no seed option of its own.
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field


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
    log_level: str = "warning"


def _require_serving() -> None:
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise ImportError("kvcompile serve needs transformers' serving extra: pip install fastapi uvicorn openai "
                          "(or `pip install transformers[serving]`)")


def _accepts(function, name: str) -> bool:
    import inspect

    return name in inspect.signature(function).parameters


def cb_config(options: ServeOptions):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    if options.kv_tokens < options.page_size:
        raise ValueError(f"kvcompile serve: --kv-tokens {options.kv_tokens} is less than one block "
                         f"({options.page_size} tokens)")
    return ContinuousBatchingConfig(num_blocks=options.kv_tokens // options.page_size, page_size=options.page_size,
                                    max_batch_tokens=options.max_batch_tokens, use_async_batching=False,
                                    allow_block_sharing=False)


def model_manager_class():
    """transformers' ModelManager whose loaded models are compiled (defined lazily: FastAPI is optional)."""
    from transformers.cli.serving.model_manager import ModelManager

    class KVCompileModelManager(ModelManager):
        """Loads as transformers serve does, then compiles the model with the policy and refuses, before any
        request, a policy or configuration that continuous batching cannot run."""

        def __init__(self, *, policy, cb, **kwargs):
            self.kvcompile_policy, self.kvcompile_cb = policy, cb
            super().__init__(**kwargs)

        def _load_model(self, model_id_and_revision, tqdm_class=None, progress_callback=None, gguf_file=None):
            import kvcompile
            from kvcompile.serving import check_batching

            model = super()._load_model(model_id_and_revision, tqdm_class=tqdm_class,
                                        progress_callback=progress_callback, gguf_file=gguf_file)
            kvcompile.compile(model.eval(), self.kvcompile_policy)
            check_batching(model, model.kvcompile_plan, model.generation_config, self.kvcompile_cb)
            return model

    return KVCompileModelManager


class KVCompileServer:
    """transformers' serving app over a compiled model; `start()` runs uvicorn in a thread, `run()` in this
    one, `stop()` stops the engine and the server."""

    def __init__(self, options: ServeOptions):
        _require_serving()
        import uvicorn
        from transformers.cli.serving.chat_completion import ChatCompletionHandler
        from transformers.cli.serving.completion import CompletionHandler
        from transformers.cli.serving.model_manager import ModelManager
        from transformers.cli.serving.response import ResponseHandler
        from transformers.cli.serving.server import build_server
        from transformers.cli.serving.systemone import SystemOneHandler
        from transformers.cli.serving.transcription import TranscriptionHandler
        from transformers.cli.serving.utils import GenerationState
        from transformers.utils import logging

        from kvcompile.spec import load_spec

        self.options = options
        policy = load_spec(options.spec, **options.overrides)  # a bad spec fails here, naming file and field
        cb = cb_config(options)
        logging.get_logger("transformers").setLevel(logging.log_levels[options.log_level.lower()])
        # preloads (force_model) and compiles the model now: an unsupported model or policy fails at start
        # `continuous_batching` (transformers >= 5.23: it picks a Metal flash kernel on MPS) is unknown to 5.20-5.22
        extra = {"continuous_batching": True} if _accepts(ModelManager.__init__, "continuous_batching") else {}
        self.model_manager = model_manager_class()(policy=policy, cb=cb, device="cpu", dtype="auto",
                                                   attn_implementation="sdpa", force_model=options.model, **extra)
        self.generation_state = GenerationState(continuous_batching=True, cb_config=cb)
        state, manager = self.generation_state, self.model_manager
        app = build_server(manager, ChatCompletionHandler(model_manager=manager, generation_state=state),
                           completion_handler=CompletionHandler(model_manager=manager, generation_state=state),
                           response_handler=ResponseHandler(model_manager=manager, generation_state=state),
                           transcription_handler=TranscriptionHandler(manager, state),
                           systemone_handler=SystemOneHandler(model_manager=manager, generation_state=state),
                           generation_state=state)
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host=options.host, port=options.port,
                                                    log_level=options.log_level.lower()))
        self._thread: threading.Thread | None = None

    @property
    def model(self):
        """The compiled model the server runs."""
        key = self.model_manager.process_model_name(self.options.model)
        return self.model_manager.loaded_models[key].model

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
        import time

        end = time.monotonic() + timeout
        while not self.server.started:
            if self._thread is not None and not self._thread.is_alive():
                raise RuntimeError("kvcompile serve: the server thread ended before it started listening")
            if time.monotonic() > end:
                raise TimeoutError(f"kvcompile serve: not listening after {timeout} s")
            time.sleep(0.05)

    def shutdown(self) -> None:
        self.generation_state.shutdown()
        self.model_manager.shutdown()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        self.shutdown()
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=timeout)


def serve(options: ServeOptions) -> None:
    """`kvcompile serve`: build and run the server until interrupted."""
    server = KVCompileServer(options)
    print(f"kvcompile serve: {options.model} with {server.model.kvcompile_policy.name} on "
          f"http://{options.host}:{options.port}/v1 (chat/completions, completions); KV pool "
          f"{options.kv_tokens} tokens of full cache", flush=True)
    server.run()
