"""The systems `benchmarks/gpu_llm.py` times: relaxtune's artifact (relaxtune.LLM, the KV cache in the runtime)
and transformers' model of the same checkpoint, eager or under torch.compile, each with the same three calls:
`prefill(ids) -> seconds`, `decode(ids, tokens) -> seconds` (the context `ids` prefilled untimed, then one
call per token of `tokens`, fed as given: no sampling, no copy of the logits to the host), and
`logits(ids, prompt) -> (len(ids) - prompt + 1, vocab) float32` (the next-token logits at each position from
the prompt's last on, the tokens after the prompt fed one at a time by relaxtune), each waiting for the device.
"""

from __future__ import annotations

import inspect
import time

import numpy as np

MODES = ("eager", "default", "reduce-overhead")  # transformers: eager, torch.compile default, and reduce-overhead


class Relaxtune:
    def __init__(self, artifact, device: str, capacity: int):
        from relaxtune import LLM

        self.llm = LLM(artifact, device=device)
        self.llm.reset(capacity)  # one cache for every call (reset reuses it)
        self.sync = self.llm.device.sync

    def prefill(self, ids) -> float:
        self.llm.reset(len(ids) + 1)
        self.sync()
        start = time.perf_counter()
        self.llm.prefill(ids)
        self.sync()
        return time.perf_counter() - start

    def decode(self, ids, tokens) -> float:
        self.llm.reset(len(ids) + len(tokens) + 1)
        self.llm.prefill(ids)
        self.sync()
        start = time.perf_counter()
        for token in tokens:
            self.llm.decode(token)
        self.sync()
        return time.perf_counter() - start

    def logits(self, ids, prompt: int) -> np.ndarray:
        self.llm.reset(len(ids) + 1)
        out = [self.llm.prefill(ids[:prompt]).numpy()]
        out += [self.llm.decode(t).numpy() for t in ids[prompt:]]
        return np.stack([o.reshape(-1) for o in out]).astype(np.float32)

    def greedy(self, ids, steps: int) -> list[int]:
        return list(self.llm.generate_tokens(ids, steps, stop=False))


def static_cache(model, length: int):
    """transformers' StaticCache for one sequence of `length` positions, whatever its constructor takes
    (4.x: config, max_batch_size, max_cache_len, device, dtype; 5.x: config, max_cache_len)."""
    from transformers import StaticCache

    offered = {
        "config": model.config,
        "max_batch_size": 1,
        "batch_size": 1,
        "max_cache_len": length,
        "device": model.device,
        "dtype": next(model.parameters()).dtype,
    }
    taken = inspect.signature(StaticCache.__init__).parameters
    return StaticCache(**{k: v for k, v in offered.items() if k in taken})


class Transformers:
    """transformers' LlamaForCausalLM from the checkpoint folder: `mode` eager (a DynamicCache), default
    (torch.compile of the model, a DynamicCache, shapes dynamic) or reduce-overhead (torch.compile of its
    forward with CUDA graphs over a StaticCache, as transformers documents it)."""

    def __init__(self, folder, device: str, dtype: str, mode: str, capacity: int):
        import torch

        from relaxtune import torchvision_compat

        torchvision_compat.install()  # transformers imports torchvision when installed; its extension may not load
        import transformers

        self.torch, self.device = torch, device
        wanted = getattr(torch, dtype)
        major, minor = (int(v) for v in transformers.__version__.split(".")[:2])
        key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # the keyword's name before 4.56
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), **{key: wanted})
        self.model = model.to(device=device, dtype=wanted).eval()
        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        # the output projection of the last position only, as generate does (and relaxtune's prefill)
        taken = inspect.signature(self.model.forward).parameters
        keep = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in taken), None)
        self.last_only = {keep: 1} if keep else {}
        self.cache = static_cache(self.model, capacity) if mode == "reduce-overhead" else None
        if mode == "eager":
            self.forward = self.model
        elif mode == "default":
            self.forward = torch.compile(self.model)
        else:
            self.forward = torch.compile(self.model.forward, mode="reduce-overhead", fullgraph=True)

    def _call(self, ids, position: int, cache):
        torch = self.torch
        tokens = torch.tensor([ids], device=self.device)
        extra = dict(self.last_only)
        if self.cache is None:
            return self.forward(input_ids=tokens, past_key_values=cache, use_cache=True, **extra)
        where = torch.arange(position, position + len(ids), device=self.device)
        return self.forward(input_ids=tokens, past_key_values=self.cache, cache_position=where, use_cache=True, **extra)

    def _run(self, ids, tokens):
        """(seconds of the prefill of `ids`, seconds of the decode steps of `tokens`)."""
        torch = self.torch
        with torch.no_grad():
            if self.cache is not None:
                self.cache.reset()
            self.sync()
            start = time.perf_counter()
            out = self._call(ids, 0, None)
            self.sync()
            prefilled = time.perf_counter()
            cache = out.past_key_values if self.cache is None else None
            for i, token in enumerate(tokens):
                out = self._call([token], len(ids) + i, cache)
                cache = out.past_key_values if self.cache is None else None
            self.sync()
            return prefilled - start, time.perf_counter() - prefilled

    def prefill(self, ids) -> float:
        return self._run(ids, [])[0]

    def decode(self, ids, tokens) -> float:
        return self._run(ids, tokens)[1]

    def logits(self, ids, prompt: int) -> np.ndarray:
        torch = self.torch
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=False)
        return out.logits[0, prompt - 1 :].float().cpu().numpy()

    def greedy(self, ids, steps: int) -> list[int]:
        torch = self.torch
        new = []
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=True)
            for _ in range(steps):
                token = int(out.logits[0, -1].argmax())
                new.append(token)
                out = self.model(
                    input_ids=torch.tensor([[token]], device=self.device),
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
        return new


def agreement(candidate: np.ndarray, reference: np.ndarray) -> dict:
    """Next-token argmax agreement and logit error of `candidate` against `reference` (steps x vocab)."""
    same = candidate.argmax(-1) == reference.argmax(-1)
    scale = float(np.abs(reference).max())
    top2 = np.sort(reference, axis=-1)[:, -2:]
    return {
        "argmax_agree": int(same.sum()),
        "steps": int(same.size),
        "max_abs_err": round(float(np.abs(candidate - reference).max()), 5),
        "rel_err": round(float(np.abs(candidate - reference).max()) / max(scale, 1e-6), 6),
        "smallest_top2_gap": round(float((top2[:, 1] - top2[:, 0]).min()), 5),
    }


def first_difference(a: list[int], b: list[int]) -> int:
    """The index of the first token where two greedy continuations differ (their length if none)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
