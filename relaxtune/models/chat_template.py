"""A model's chat template reduced, at compile time, to the text around one user message.

Chat templates are Jinja programs (``tokenizer.chat_template``). Rendering one needs Jinja, which the
deploy host need not have; `relaxtune generate --chat` wraps a single prompt, so the template is
rendered here once with a placeholder message and an assistant turn to follow
(``add_generation_prompt``), and the text before and after the placeholder is what the artifact
stores. A template that fails to render (or Jinja missing) leaves the artifact without one.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_PLACEHOLDER = "\x00relaxtune-prompt\x00"


def wrap_parts(template: str | None, special: dict[str, str]) -> tuple[str, str] | None:
    """(text before the user's message, text after it) for a one-message chat, or None."""
    if not template:
        return None
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        logger.warning("jinja2 is not installed: the artifact gets no chat template")
        return None

    def raise_exception(message):  # templates call it on conversations they refuse
        raise ValueError(message)

    try:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        text = env.from_string(template).render(
            messages=[{"role": "user", "content": _PLACEHOLDER}], add_generation_prompt=True, **special
        )
    except Exception as err:  # noqa: BLE001 (any template error: the artifact has no chat form, said so)
        logger.warning("the chat template does not render (%s: %s): the artifact gets none", type(err).__name__, err)
        return None
    if text.count(_PLACEHOLDER) != 1:
        logger.warning("the chat template does not show the user's message once: the artifact gets none")
        return None
    before, after = text.split(_PLACEHOLDER)
    return before, after
