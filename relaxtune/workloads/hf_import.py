"""Workloads from Hugging Face ``transformers`` models: ``hf:MODEL_TYPE`` (``hf:llama``, ``hf:gpt2``, ...).

The model is built from a tiny config with random weights (no download), or loaded from a local
directory with ``weights=DIR`` (``save_pretrained`` output; nothing is fetched). It is wrapped so
that ``forward(input_ids, attention_mask)`` returns one tensor (the logits, or the last hidden
state for ``head=base``), then exported by :func:`relaxtune.workloads.torch_import.from_module`
with symbolic batch ``b`` and sequence ``n``.

Fixes for what TVM's importer does not handle (all in the wrapper, none in TVM):

* ``attention_mask`` is an explicit second input (``int64``, ones by default). Without it the
  mask that ``transformers`` 5.x builds inside the graph imports as tensors of unknown shape
  (a ``cumsum``), which do not compile.
* ``head=base`` models with token types (BERT) get ``token_type_ids`` of zeros and
  ``position_ids = arange(n)`` computed in the wrapper, which is what ``transformers`` does by
  default; its own slice of a fixed-size position buffer imports with an unknown shape.
* If the model cannot be exported with a dynamic batch through SDPA (GPT-2's SDPA path fails in
  torch's decomposition), it is exported with ``attn=eager`` (the same matmul / softmax / matmul);
  if that fails too, the batch is fixed to 1 and only ``n`` stays symbolic (a warning).

Config keys (:data:`DEFAULTS`): ``hidden``, ``layers``, ``heads``, ``kv_heads`` (for models with
grouped-query attention), ``ffn``, ``vocab`` (mapped onto the family's own config names),
``max_seq`` (bound of ``n``, also the model's ``max_position_embeddings``), ``max_batch``,
``attn`` (``transformers``' ``attn_implementation``), ``head`` (``lm``: causal-LM logits,
``base``: last hidden state; default ``base`` for :data:`ENCODERS` and families without a causal-LM
head), ``weights``, ``seed``. Any
other key that the family's config class has (``rope_theta=5e5``) is passed on, converted to
the type of its default. Must run before: nothing (``transformers`` must be installed).
"""

from __future__ import annotations

import inspect
import logging
from typing import Mapping

from ..errors import UserError
from .base import TensorSpec, Workload
from .common import convert_config_value
from .torch_import import ExportError, from_module

logger = logging.getLogger(__name__)

DEFAULTS: dict[str, object] = {
    "hidden": 64,
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "ffn": 128,
    "vocab": 128,
    "max_seq": 128,
    "max_batch": 4,
    "attn": "sdpa",
    "head": "",
    "weights": "",
    "seed": 0,
}
ENCODERS = ("bert", "roberta")
# relaxtune key -> the standard transformers config attribute (families rename via attribute_map)
ARCH_KEYS = {
    "hidden": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "ffn": "intermediate_size",
    "vocab": "vocab_size",
    "max_seq": "max_position_embeddings",
}
ALIASES = {"intermediate_size": ("n_inner",)}  # GPT-2 names its MLP width n_inner


def _transformers():
    from ..torchvision_compat import install

    install()  # transformers imports torchvision when it is installed: without its C++ extension too
    try:
        import transformers
    except ImportError:
        raise UserError("hf: workloads need the transformers package: pip install transformers") from None
    return transformers


def _config_class(transformers, model_type: str):
    try:
        return type(transformers.AutoConfig.for_model(model_type))
    except ValueError:
        raise UserError(
            f"unknown Hugging Face model type {model_type!r}: use a transformers model_type such as llama, qwen2, "
            "mistral, gpt2, gpt_neox or bert"
        ) from None


def _has_causal_lm(transformers, config_class) -> bool:
    """Whether transformers has a causal-LM head for this family (encoders have none: `head=base`)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return config_class.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _attr_name(default_config, standard: str) -> str | None:
    """The family's name for a standard config attribute, or None when it has none."""
    mapped = type(default_config).attribute_map.get(standard, standard)
    for name in (mapped, *ALIASES.get(standard, ())):
        if name in default_config.to_dict() or hasattr(default_config, name):
            return name
    return None


def resolve(model_type: str, config: Mapping[str, object] | None, transformers) -> tuple[dict, dict]:
    """Split the config into relaxtune settings and keyword arguments for the family's config class."""
    cls = _config_class(transformers, model_type)
    default_config = cls()
    given = dict(config or {})
    settings, extra = dict(DEFAULTS), {}
    for key, value in given.items():
        if key in DEFAULTS:
            settings[key] = convert_config_value(key, value, DEFAULTS[key])
        elif key in default_config.to_dict():
            extra[key] = (
                convert_config_value(key, value, getattr(default_config, key))
                if getattr(default_config, key) is not None
                else value
            )
        else:
            raise UserError(
                f"unknown config key {key!r} for hf:{model_type}: valid keys are {', '.join(DEFAULTS)} "
                f"or an attribute of {cls.__name__}"
            )
    if settings["weights"] and set(given) & (set(ARCH_KEYS) - {"max_seq"}):
        raise UserError(
            f"config weights={settings['weights']} fixes the architecture: drop {sorted(set(given) & set(ARCH_KEYS))}"
        )
    if not settings["head"]:
        settings["head"] = "base" if model_type in ENCODERS or not _has_causal_lm(transformers, cls) else "lm"
    if settings["head"] not in ("lm", "base"):
        raise UserError(f"config head={settings['head']!r} is invalid: use lm (logits) or base (last hidden state)")
    for key in ("hidden", "layers", "heads", "ffn", "vocab", "max_seq", "max_batch"):
        if int(settings[key]) < 1:
            raise UserError(f"config {key}={settings[key]} is invalid: {key} must be > 0")
    kwargs = {}
    for key, standard in ARCH_KEYS.items():
        name = _attr_name(default_config, standard)
        if name is None:
            if key in given and key != "max_seq":  # max_seq stays the bound of n (ALiBi models have no table)
                raise UserError(
                    f"config key {key!r} does not apply to hf:{model_type} ({cls.__name__} has no {standard})"
                )
            continue
        kwargs[name] = int(settings[key])
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # GPT-2's 50256 is outside a tiny vocabulary
        token = getattr(default_config, key, None)
        if isinstance(token, int) and token >= int(settings["vocab"]):
            kwargs[key] = 0
    # a rotary width fixed for the family's real sizes (GPT-J's 64) cannot exceed a tiny head
    rotary = getattr(default_config, "rotary_dim", None)
    head_dim = int(settings["hidden"]) // int(settings["heads"])
    if isinstance(rotary, int) and rotary > head_dim and not settings["weights"]:
        kwargs["rotary_dim"] = head_dim
    kwargs.update(extra)
    return settings, kwargs


def _build_model(transformers, model_type: str, settings: dict, kwargs: dict):
    import torch

    auto = transformers.AutoModelForCausalLM if settings["head"] == "lm" else transformers.AutoModel
    attn = str(settings["attn"])
    if settings["weights"]:
        directory = str(settings["weights"])
        try:
            cfg = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
        except Exception as err:
            raise UserError(
                f"config weights={directory!r} is not a local transformers model directory ({type(err).__name__})"
            ) from None
        if cfg.model_type != model_type:
            raise UserError(f"config weights={directory!r} holds a {cfg.model_type} model, not hf:{model_type}")
        limit = getattr(cfg, "max_position_embeddings", None)
        if limit is not None and int(settings["max_seq"]) > int(limit):
            raise UserError(f"config max_seq={settings['max_seq']} exceeds the model's max_position_embeddings={limit}")
        model = auto.from_pretrained(directory, local_files_only=True, attn_implementation=attn)
    else:
        cfg = transformers.AutoConfig.for_model(model_type, attn_implementation=attn, **kwargs)
        with torch.random.fork_rng():
            torch.manual_seed(int(settings["seed"]))
            try:
                try:
                    model = auto.from_config(cfg)
                except ValueError as err:  # a family without an SDPA path (gemma2): its eager attention
                    if attn != "sdpa" or "attention implementation" not in str(err):
                        raise
                    logger.info("hf:%s has no sdpa attention; built with attn=eager", model_type)
                    cfg = transformers.AutoConfig.for_model(model_type, attn_implementation="eager", **kwargs)
                    model = auto.from_config(cfg)
            except ValueError as err:
                raise UserError(
                    f"hf:{model_type} cannot be built with {kwargs} and head={settings['head']}: "
                    f"{str(err).splitlines()[0]}"
                ) from None
    return model.float().eval()


def wrap(model, head: str):
    """``forward(input_ids, attention_mask) -> tensor`` around a transformers model (see module docstring)."""
    import torch

    accepted = inspect.signature(model.forward).parameters
    token_types = head == "base" and "token_type_ids" in accepted and getattr(model.config, "type_vocab_size", 0)
    positions = head == "base" and "position_ids" in accepted
    cache = "use_cache" in accepted

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            extra = {"use_cache": False} if cache else {}
            if token_types:
                extra["token_type_ids"] = torch.zeros_like(input_ids)
            if positions:
                extra["position_ids"] = torch.arange(input_ids.shape[1]).unsqueeze(0).expand(input_ids.shape[0], -1)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, **extra)
            return out.logits if head == "lm" else out.last_hidden_state

    return Wrapped().eval()


def load_hf(model_type: str, config: Mapping[str, object] | None = None, dtype: str | None = None) -> Workload:
    """Build the workload of ``hf:MODEL_TYPE`` (see the module docstring)."""
    if dtype not in (None, "float32"):
        raise UserError(f"dtype {dtype!r} is not supported for imported models: they run in float32")
    transformers = _transformers()
    settings, kwargs = resolve(model_type, config, transformers)
    model = _build_model(transformers, model_type, settings, kwargs)
    vocab = int(model.config.vocab_size)
    module = wrap(model, str(settings["head"]))
    name = f"hf-{model_type}"
    stored = {**settings, **kwargs, "model_type": model_type}
    seq = (1, int(settings["max_seq"]))
    if int(settings["max_batch"]) > 1:
        bounds = {"b": (1, int(settings["max_batch"])), "n": seq}
        try:
            return from_module(name, module, _inputs("b", vocab), bounds, stored)
        except ExportError as err:
            if settings["attn"] == "sdpa" and model.config._attn_implementation == "sdpa":
                # torch's SDPA decomposition rejects a dynamic batch for some families (GPT-2);
                # the eager attention is the same matmul / softmax / matmul and exports
                logger.info("%s: no dynamic batch with sdpa attention (%s); trying attn=eager", name, err)
                model.set_attn_implementation("eager")
                try:
                    return from_module(name, module, _inputs("b", vocab), bounds, {**stored, "attn": "eager"})
                except ExportError as again:
                    err = again
                model.set_attn_implementation("sdpa")
            logger.warning("%s: no dynamic batch (%s); exporting with batch 1", name, err)
    return from_module(name, module, _inputs(1, vocab), {"n": seq}, {**stored, "max_batch": 1})


def _inputs(batch: int | str, vocab: int) -> tuple[TensorSpec, ...]:
    return (
        TensorSpec("input_ids", (batch, "n"), "int64", "index", vocab),
        TensorSpec("attention_mask", (batch, "n"), "int64", "ones"),
    )
