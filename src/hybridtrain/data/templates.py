"""The one place chat templates are rendered: errors name the template and the record.

::

    apply_template(tokenizer, messages, where="data.jsonl line 3", origin=None, **kwargs)
    template_origin(tokenizer, chat_template=None, chat_template_path=None) -> str

``apply_template`` is ``tokenizer.apply_chat_template(messages, **kwargs)``; a template that does
not parse, or that stops on a record (``raise_exception(...)``, an undefined variable), raises a
:class:`~hybridtrain.data.io.ChatFormatError` naming the template (its file, or the tokenizer
folder it came from), the record being rendered and the template's own message.
"""

from __future__ import annotations

import os

from .io import ChatFormatError

__all__ = ["apply_template", "template_origin"]


def template_origin(tokenizer, chat_template: str | None = None,
                    chat_template_path: str | os.PathLike | None = None) -> str:
    """Where the template in use comes from, as the user knows it."""
    if chat_template_path:
        return f"the chat template {os.path.expanduser(str(chat_template_path))}"
    if chat_template and chat_template != getattr(tokenizer, "chat_template", None):
        return "the chat template given as dataset.chat_template"
    folder = str(getattr(tokenizer, "name_or_path", "") or "")
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        if folder and os.path.isfile(os.path.join(folder, name)):
            return f"the chat template of the tokenizer ({os.path.join(folder, name)})"
    return f"the chat template of the tokenizer {folder!r}" if folder else \
        "the tokenizer's chat template"


def apply_template(tokenizer, messages, where: str = "", origin: str | None = None, **kwargs):
    """``tokenizer.apply_chat_template(messages, **kwargs)`` with the template's errors as a
    :class:`ChatFormatError` naming ``origin`` (default: :func:`template_origin`) and ``where``."""
    import jinja2

    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except jinja2.TemplateSyntaxError as e:
        origin = origin or template_origin(tokenizer, kwargs.get("chat_template"))
        raise ChatFormatError(
            f"{origin} does not parse: line {e.lineno}: {e.message}"
            + (f" (while rendering {where})" if where else "")
            + "; fix the template's Jinja syntax") from None
    except jinja2.TemplateError as e:
        origin = origin or template_origin(tokenizer, kwargs.get("chat_template"))
        raise ChatFormatError(
            f"{where or 'a conversation'}: {origin} stopped on this record: "
            f"{e.message or type(e).__name__}; fix the record or the template") from None
