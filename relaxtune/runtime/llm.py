"""`LLM`: generate text with a compiled language model, the TVM runtime only.

    llm = LLM("build/smollm2.so")
    for piece in llm.generate("The capital of France is", max_tokens=32):
        print(piece, end="", flush=True)
    print(llm.stats)

A prompt is prefilled (in calls of at most the artifact's ``max_prefill`` tokens: a longer prompt is
prefilled in chunks, each attending to the ones before it through the cache), then tokens are
decoded one at a time against the KV cache. Greedy by default; with a temperature, the runtime's
sampler (``vm.builtin.apply_softmax_with_temperature``, ``vm.builtin.sample_top_p_from_prob``) draws
each token. Generation stops at the tokenizer's stop tokens or after ``max_tokens``.

An artifact runs on the device it was compiled for (its manifest's ``device``: ``cpu``, or ``cuda``
for ``--target cuda``, where the weights are copied to the GPU once and the KV cache's pages live there).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import threads
from ..errors import UserError
from . import llm_files, weight_file
from .kv_cache import KVCache

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationStats:
    """Counts and times of the last `generate` / `generate_tokens` call: `new_tokens` given out (a stop
    token is not one), `decode_calls` (each appends one token and gives the next one's logits)."""

    prompt_tokens: int
    new_tokens: int
    decode_calls: int
    prefill_seconds: float
    decode_seconds: float
    sample_seconds: float = 0.0  # choosing the tokens from the logits (on the host)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_calls / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def sample_ms_per_token(self) -> float:
        return self.sample_seconds / self.new_tokens * 1e3 if self.new_tokens else 0.0


def greedy(values: np.ndarray) -> int:
    """The index of the largest of `values` (the first of equals), as np.argmax gives it for values without NaN.
    float16 is compared through int16 keys of the same order (+magnitude, or -magnitude where the sign bit is set:
    -0 and +0 are equal): numpy's argmax over float16 is not vectorised."""
    values = values.reshape(-1)
    if values.dtype != np.float16:
        return int(np.argmax(values))
    bits = values.view(np.int16)
    negative = bits >> 15  # -1 where the sign bit is set, else 0
    return int(np.argmax((bits ^ (negative & 0x7FFF)) - negative))


class LLM:
    """A loaded language-model artifact (see the module docstring). `context`: the most positions one
    generation may hold (prompt + new tokens; default the model's context); `device`: ``cpu`` or
    ``cuda``, which must be the artifact's (None: the artifact's)."""

    def __init__(self, artifact: str | Path, context: int | None = None, device: str | None = None):
        threads.configure()  # before the first parallel kernel starts TVM's pool: its size, workers not pinned
        import tvm
        from tvm.runtime.vm import VirtualMachine

        from .artifact import ensure_runtime_functions

        self.files, self.manifest = llm_files.read_manifest(artifact)
        self.model = self.manifest["model"]
        limit = int(self.model["context_length"])
        self.context = limit if context is None else int(context)
        if not 1 <= self.context <= limit:
            raise UserError(f"--context {self.context} must be in [1, {limit}] (the model's context)")
        self.max_prefill = int(self.manifest["max_prefill"])
        ensure_runtime_functions()  # prefill's bounds check calls relax.run.assert_op
        self.device = open_device(self.manifest, self.files.library, device)
        self.vm = VirtualMachine(tvm.runtime.load_module(str(self.files.library)), self.device)
        weights = weight_file.load(self.files.weights)
        if self.device != tvm.cpu(0):  # one copy of each weight on the device
            used = {n for spec in self.manifest["functions"].values() for n in spec["weights"]}
            weights = {n: weights[n].copyto(self.device) for n in used}
        self._weights = {}
        for f, spec in self.manifest["functions"].items():
            taken = [weights[n] for n in spec["weights"]]
            if spec.get("transform"):  # a GPU build's lifted weight transform, run once here on the device
                taken = list(self.vm[spec["transform"]](taken))
            self._weights[f] = taken
        self._functions = {f: self.vm[f] for f in llm_files.FUNCTIONS}
        self._cache: KVCache | None = None
        # the token ids of a call, on the device: one buffer of max_prefill, viewed per call (an array made per
        # call would be a device allocation, and its release a device synchronisation, every decode step)
        self._tokens = tvm.runtime.empty((1, self.max_prefill), "int32", self.device)
        self._tokenizer = None
        self.stats: GenerationStats | None = None

    # -- text ---------------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The artifact's `tokenizers.Tokenizer` (UserError when it has none)."""
        if self._tokenizer is None:
            info = self.manifest.get("tokenizer")
            if info is None or not self.files.tokenizer.exists():
                raise UserError(
                    f"artifact {self.files.library} has no tokenizer ({self.files.tokenizer.name} is missing): "
                    "give token ids (generate_tokens), or compile a model whose file has a GPT-2 BPE tokenizer"
                )
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(self.files.tokenizer))
        return self._tokenizer

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of `prompt`, wrapped in the model's chat template for one user turn with `chat`."""
        info = self.manifest.get("tokenizer") or {}
        tokenizer = self.tokenizer
        if chat:
            if not info.get("chat"):
                raise UserError(f"artifact {self.files.library} has no chat template: drop --chat")
            before, after = info["chat"]
            prompt = before + prompt + after
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        bos = info.get("bos_id")
        if info.get("add_bos") and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def generate(
        self,
        prompt: str,
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        chat: bool = False,
        seed: int | None = None,
    ) -> Iterator[str]:
        """Text pieces as tokens are generated (see `generate_tokens`)."""
        from tokenizers.decoders import DecodeStream

        ids = self.encode(prompt, chat)
        stream = DecodeStream(skip_special_tokens=True)
        for token in self.generate_tokens(ids, max_tokens, temperature, top_p, seed):
            piece = stream.step(self.tokenizer, token)
            if piece:
                yield piece

    # -- tokens -------------------------------------------------------------------------------------
    def generate_tokens(
        self,
        ids: list[int],
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: bool = True,
    ) -> Iterator[int]:
        """New token ids after `ids`, one at a time; stops at a stop token (with `stop`) or after `max_tokens`."""
        self._check(ids, max_tokens, temperature, top_p)
        stops = set((self.manifest.get("tokenizer") or {}).get("stop_ids", [])) if stop else set()
        rng = np.random.default_rng(seed)
        self.reset(len(ids) + max_tokens)
        start = time.perf_counter()
        logits = self.prefill(ids)
        self.device.sync()  # a GPU runs the calls asynchronously
        prefill_s, decode_s, sample_s, calls = time.perf_counter() - start, 0.0, 0.0, 0
        for new in range(1, max_tokens + 1):
            start = time.perf_counter()
            token = self.sample(logits, temperature, top_p, rng)
            sample_s += time.perf_counter() - start
            self.stats = GenerationStats(len(ids), new - 1, calls, prefill_s, decode_s, sample_s)
            if token in stops:
                return
            self.stats = GenerationStats(len(ids), new, calls, prefill_s, decode_s, sample_s)
            yield token
            if new == max_tokens:
                return
            start = time.perf_counter()
            logits = self.decode(token)
            self.device.sync()
            decode_s, calls = decode_s + time.perf_counter() - start, calls + 1

    def _check(self, ids: list[int], max_tokens: int, temperature: float, top_p: float) -> None:
        if max_tokens < 1:
            raise UserError(f"--max-tokens {max_tokens}: give 1 or more")
        if not ids:
            raise UserError("the prompt is empty: give at least one token")
        if temperature < 0:
            raise UserError(f"--temperature {temperature} is negative: give 0 (greedy) or more")
        if not 0 < top_p <= 1:
            raise UserError(f"--top-p {top_p} must be in (0, 1]")
        vocab = int(self.model["vocab_size"])
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise UserError(f"token id {bad[0]} is outside the vocabulary: ids must be in [0, {vocab - 1}]")
        if len(ids) > self.context:
            raise UserError(f"the prompt is {len(ids)} tokens, longer than the context of {self.context} tokens")
        if len(ids) + max_tokens > self.context:
            raise UserError(
                f"the prompt ({len(ids)} tokens) and --max-tokens {max_tokens} would fill the KV cache of "
                f"{self.context} positions: give --max-tokens <= {self.context - len(ids)}"
                + (
                    f" or a larger --context (at most {self.model['context_length']})"
                    if self.context < int(self.model["context_length"])
                    else ""
                )
            )

    @staticmethod
    def sample(logits, temperature: float, top_p: float, rng: np.random.Generator) -> int:
        """The next token from logits (a (1, 1, vocab) runtime tensor, overwritten when sampling): argmax, or
        the runtime's sampler."""
        import tvm

        if temperature == 0:
            return greedy(logits.numpy())
        if logits.device != tvm.cpu(0) or str(logits.dtype) != "float32":
            logits = tvm.runtime.tensor(logits.numpy().astype(np.float32))  # the sampler runs on the host
        tvm.get_global_func("vm.builtin.apply_softmax_with_temperature")(
            logits, float(temperature)
        )  # in place: now probabilities
        return int(tvm.get_global_func("vm.builtin.sample_top_p_from_prob")(logits, float(top_p), float(rng.random())))

    # -- the model's calls ----------------------------------------------------------------------------
    def reset(self, positions: int) -> None:
        """An empty sequence in a KV cache of at least `positions` positions (reused when large enough)."""
        if self._cache is None or self._cache.capacity < positions:
            self._cache = None  # release the old pages first
            self._cache = KVCache.create(self.vm, positions, self.max_prefill, int(self.manifest["page_size"]))
        else:
            self._cache.clear()

    def prefill(self, ids: list[int]):
        """Append `ids` to the sequence; the logits after the last one ((1, 1, vocab) runtime tensor)."""
        logits = None
        for begin in range(0, len(ids), self.max_prefill):
            logits = self._forward("prefill", ids[begin : begin + self.max_prefill])
        return logits

    def decode(self, token: int):
        """Append one token; the logits after it."""
        return self._forward("decode", [token])

    def pop(self, count: int) -> None:
        """Drop the last `count` positions of the sequence (the next call continues after the rest)."""
        if self._cache is None or not 0 <= count <= self._cache.length:
            raise UserError(
                f"cannot drop {count} positions: the sequence holds {0 if self._cache is None else self._cache.length}"
            )
        self._cache.pop(count)

    def _forward(self, function: str, ids: list[int]):
        cache = self._cache
        if cache is None or cache.length + len(ids) > cache.capacity:
            raise UserError(
                f"the KV cache is full ({0 if cache is None else cache.length} of "
                f"{0 if cache is None else cache.capacity} positions): start a new sequence (reset)"
            )
        tokens = self._tokens._create_view((1, len(ids)))
        tokens.copyfrom(np.asarray([ids], dtype=np.int32))  # after the calls before it on the device's stream
        embeddings = self._functions["embed"](tokens, *self._weights["embed"])
        cache.begin(len(ids))
        logits, _ = self._functions[function](embeddings, cache.handle, *self._weights[function])
        cache.end(len(ids))
        return logits


def open_device(manifest: dict, library: Path, wanted: str | None):
    """The TVM device the artifact was compiled for; UserError when `wanted` is another, or where it is missing."""
    import tvm

    kind = manifest.get("device", "cpu")
    if wanted is not None and wanted != kind:
        built = manifest.get("target", {}).get("arch") or manifest.get("target", {}).get("kind", kind)
        raise UserError(
            f"artifact {library} was compiled for {kind} ({built}), not {wanted}: run it with --device {kind}, "
            f"or compile it again with --target {wanted}"
        )
    if kind == "cpu":
        return tvm.cpu(0)
    from .artifact import ensure_cuda_runtime

    ensure_cuda_runtime()
    device = tvm.cuda(0)
    if not device.exist:
        raise UserError(f"artifact {library} runs on cuda, but no CUDA device is visible here")
    return device
