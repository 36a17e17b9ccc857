"""The ``_target_`` allow-list: which callables a recipe may call.

YAML must not become arbitrary code execution. Two checks, both against the recipe's prefixes
(``DEFAULT_ALLOWED_PREFIXES`` plus what the user added explicitly: a top-level
``allowed_target_prefixes: [mypkg.]`` in the recipe, ``--allowed_target_prefixes=[mypkg.]``, or
``load_config(..., allowed_target_prefixes=[...])``):

* at load time, before anything is imported (:func:`check_target`), the dotted name must lie
  under an allowed prefix and must not name a code-loading entry point (``CODE_LOADING``:
  ``torch.load``, ``torch.hub``, ``torch.utils.cpp_extension``, ...) unless the user listed
  that entry point, or a prefix inside it, explicitly (``torch.`` does not count for
  ``torch.hub.load``; ``torch.hub.`` does);
* every segment of the dotted name is public: a segment starting with ``_`` (``__builtins__``,
  ``__globals__``, ``_private``) is refused, so a path cannot hop through a module's globals;
* at resolution (:func:`hybridtrain.config.instantiate.resolve_target`), the object is reached
  only through real module imports and classes (an attribute that is itself a module, as in
  ``torch.serialization.os.system``, or an instance on the way, as in ``pkg.logger.info``, is
  refused); it must be a class, a function or a method that says where it is defined (a bound
  builtin method such as ``{}.get`` does not, and is refused); and the module that *defines* it
  (``__module__``, and that of every class on the way) must pass the same check:
  ``hybridtrain.cli.system`` is refused if ``cli`` imported ``os.system``.
"""

from __future__ import annotations

from typing import Any, Iterable

from hybridtrain.config.errors import ConfigError

__all__ = ["DEFAULT_ALLOWED_PREFIXES", "CODE_LOADING", "normalize_prefixes", "is_target_allowed",
           "check_target", "check_defining_module", "private_segment", "CODE_LOADING_OPTIONS",
           "check_code_loading_option"]

# what recipes need: the package itself, torch modules and optimizers / LR schedules
DEFAULT_ALLOWED_PREFIXES: tuple[str, ...] = ("hybridtrain.", "torch.nn.", "torch.optim.")

# entry points that load or compile code from a path, a pickle or the network (or write files
# that would); refused unless the user lists them (or a prefix inside them) explicitly
CODE_LOADING: tuple[str, ...] = (
    "torch.load", "torch.jit.", "torch.hub.", "torch.package.", "torch.utils.cpp_extension.",
    "torch.compile", "torch._dynamo.", "torch._inductor.", "torch.export.load",
    "torch.serialization.", "torch.ops.load_library", "torch.classes.load_library",
    "torch.utils.model_zoo.",
    "transformers.dynamic_module_utils.", "transformers.AutoModel", "transformers.AutoConfig",
    "transformers.AutoTokenizer", "transformers.AutoProcessor", "transformers.pipeline",
    "transformers.models.auto.", "datasets.load_dataset", "datasets.load.",
    # hybridtrain's own: commands and recipes load other recipes (with their own allow-lists),
    # fileio writes any bytes to any path (a .pth file in site-packages runs at the next start)
    "hybridtrain.cli.", "hybridtrain.config.", "hybridtrain.recipes.", "hybridtrain.fileio.",
)


# keyword options of dependencies that make them run code from a folder or a pickle, with the
# only value a recipe may give them: loading code is the user's explicit act, never a recipe's
CODE_LOADING_OPTIONS: dict[str, bool] = {
    "trust_remote_code": False,  # transformers / datasets: run the Python files of a folder
    "allow_pickle": False,       # numpy.load
    "weights_only": True,        # torch.load
}


def check_code_loading_option(key: Any, value: Any, key_path: str, where: str) -> None:
    """Raise ``ConfigError`` when a recipe key ``key`` switches on code loading."""
    safe = CODE_LOADING_OPTIONS.get(key) if isinstance(key, str) else None
    if safe is None or value is None or value is safe:
        return
    raise ConfigError(
        f"'{key_path}: {value!r}' ({where}) is refused: it would let a dependency run Python "
        "code from a model, tokenizer or data folder (or a pickle). hybridtrain never loads code "
        f"from files a recipe names; remove the key (or set it to {safe}). To use a model or "
        "tokenizer that needs its own code, convert it to a standard Hugging Face folder "
        "(config.json, tokenizer.json); see docs/safety.md")


def normalize_prefixes(prefixes: Iterable[str]) -> tuple[str, ...]:
    """``["mypkg", "torch."]`` -> ``("mypkg.", "torch.")`` (deduplicated, order kept)."""
    out: list[str] = []
    for p in prefixes:
        p = str(p).strip()
        p = p if p.endswith(".") else p + "."
        if p not in out:
            out.append(p)
    return tuple(out)


def _under(name: str, prefix: str) -> bool:
    """``name`` is ``prefix`` (a module-style ``a.b.``) or lies under it."""
    return name.startswith(prefix) or name == prefix[:-1]


def _code_loading_entry(name: str) -> str | None:
    for entry in CODE_LOADING:
        if entry.endswith("."):
            if _under(name, entry):
                return entry
        elif name == entry or name.startswith(entry + ".") or name.startswith(entry):
            # "torch.load" covers torch.load and torch.load_*; "transformers.AutoModel" covers
            # AutoModelForCausalLM and its methods
            return entry
    return None


def _explicitly_listed(name: str, entry: str, prefixes: tuple[str, ...]) -> bool:
    """The user allowed ``entry`` itself: a prefix at least as long as it covers ``name``."""
    return any(_under(name, p) and len(p.rstrip(".")) >= len(entry.rstrip("."))
               for p in prefixes)


def private_segment(name: str) -> str | None:
    """The first segment of a dotted ``name`` that is not a public identifier (``_x``,
    ``__builtins__``, ``<locals>``, empty), else ``None``."""
    for seg in name.split("."):
        if not seg.isidentifier() or seg.startswith("_"):
            return seg
    return None


def is_target_allowed(target: str, prefixes: Iterable[str]) -> bool:
    """Public, under an allowed prefix, and not a code-loading entry point the user did not
    list."""
    if private_segment(target) is not None:
        return False
    prefixes = normalize_prefixes(prefixes)
    if not any(_under(target, p) for p in prefixes):
        return False
    entry = _code_loading_entry(target)
    return entry is None or _explicitly_listed(target, entry, prefixes)


def _refusal(name: str, prefixes: tuple[str, ...], what: str) -> str:
    seg = private_segment(name)
    if seg is not None:
        return (f"{what} is not a public name: its segment '{seg}' is private or not an "
                "identifier. A recipe may name only public module-level classes, functions "
                "and their methods (no '_' segments, no hops through a module's globals)")
    entry = _code_loading_entry(name)
    if entry is not None and any(_under(name, p) for p in prefixes):
        allow = entry if entry.endswith(".") else entry + "."
        return (f"{what} is a code-loading entry point ({entry}): it runs code from a file, a "
                f"pickle or the network, so it is refused unless you list it explicitly, e.g. "
                f"`allowed_target_prefixes: [{allow}]` (a wider prefix such as "
                f"'{name.split('.')[0]}.' does not count)")
    top = name.split(".")[0]
    return (f"{what} is not allowed: a recipe may only name callables under "
            f"{', '.join(prefixes)}. If you trust '{top}', allow it explicitly with a top-level "
            f"recipe key `allowed_target_prefixes: [{top}.]`, the override "
            f"--allowed_target_prefixes=[{top}.], or "
            f"load_config(..., allowed_target_prefixes=['{top}.'])")


def check_target(target: Any, prefixes: Iterable[str], key_path: str, where: str) -> None:
    """Raise ``ConfigError`` unless ``target`` is a dotted name the allow-list accepts."""
    if not isinstance(target, str) or not target.strip() or " " in target.strip():
        raise ConfigError(f"'{key_path}' must be a dotted name like 'torch.optim.AdamW', "
                          f"got {target!r} ({where})")
    prefixes = normalize_prefixes(prefixes)
    if not is_target_allowed(target, prefixes):
        raise ConfigError(_refusal(target, prefixes,
                                   f"_target_ '{target}' at '{key_path}' ({where})"))


def check_defining_module(target: str, qualname: str, prefixes: Iterable[str]) -> None:
    """Raise ``ConfigError`` unless ``qualname`` (``module.Class.attr`` of the object ``target``
    resolved to) passes the allow-list too."""
    prefixes = normalize_prefixes(prefixes)
    if not is_target_allowed(qualname, prefixes):
        raise ConfigError(_refusal(qualname, prefixes,
                                   f"_target_ '{target}' resolves to '{qualname}', which"))
