"""A synthetic vision-language set: coloured shapes at positions, questions about colour,
shape and position, with text-only questions mixed in.

::

    write_synthetic_shapes(out_dir, n=1000, seed=0, text_only=0.2, style="llava") -> str

Writes ``out_dir/images/{i}.png`` (white canvases of a few sizes and aspect ratios, one shape)
and ``out_dir/data.jsonl``; returns the JSONL path. ``style``: ``llava`` (``image`` +
``conversations``) or ``openai`` (``messages`` with an image content part). Answers are one
word or two (``red``, ``circle``, ``top left``), so answer accuracy is easy to read off.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from .io import DataError, check_count

MAX_IMAGES = 1_000_000  # a typo of a few digits would otherwise draw images until the disk is full

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 60, 220),
           "yellow": (235, 200, 20)}
SHAPES = ("square", "circle", "triangle")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
SIZES = ((32, 32), (48, 32), (32, 48), (48, 48), (64, 32))
QUESTIONS = {
    "colour": ("What colour is the shape?", "colour"),
    "shape": ("What shape is in the picture?", "shape"),
    "position": ("Where is the shape?", "position"),
}


def _draw(path: Path, size, colour, shape, position, rng: random.Random) -> None:
    from PIL import Image, ImageDraw

    w, h = size
    im = Image.new("RGB", size, (255, 255, 255))
    d = ImageDraw.Draw(im)
    s = int(min(w, h) * rng.uniform(0.3, 0.42))
    x0 = rng.randint(1, w // 2 - s - 1) if "left" in position else rng.randint(w // 2 + 1, w - s - 1)
    y0 = rng.randint(1, h // 2 - s - 1) if "top" in position else rng.randint(h // 2 + 1, h - s - 1)
    box = (x0, y0, x0 + s, y0 + s)
    fill = COLOURS[colour]
    if shape == "square":
        d.rectangle(box, fill=fill)
    elif shape == "circle":
        d.ellipse(box, fill=fill)
    else:
        d.polygon([(x0 + s / 2, y0), (x0, y0 + s), (x0 + s, y0 + s)], fill=fill)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    im.save(tmp, format="PNG")
    os.replace(tmp, path)  # readers (other ranks already training) never see a partial file


def shapes_texts(n: int = 200, seed: int = 0) -> list[str]:
    """Texts covering the set's vocabulary (to train a tokenizer on)."""
    words = list(COLOURS) + list(SHAPES) + list(POSITIONS) + [q for q, _ in QUESTIONS.values()]
    words += [f"What number comes after {i}? {i + 1}" for i in range(30)]
    return words * max(1, n // len(words))


def write_synthetic_shapes(out_dir: str | os.PathLike, n: int = 1000, seed: int = 0,
                           text_only: float = 0.2, style: str = "llava") -> str:
    if style not in ("llava", "openai"):
        raise ValueError(f"style must be 'llava' or 'openai', got {style!r}")
    check_count(n, "write_synthetic_shapes n", MAX_IMAGES)
    if not 0 <= text_only <= 1:
        raise DataError(f"write_synthetic_shapes text_only={text_only!r}: give the share of "
                        "text-only records, from 0 to 1")
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        if rng.random() < text_only:
            k = rng.randint(0, 28)
            q, a = f"What number comes after {k}?", str(k + 1)
            lines.append({"messages": [{"role": "user", "content": q},
                                       {"role": "assistant", "content": a}]})
            continue
        facts = {"colour": rng.choice(list(COLOURS)), "shape": rng.choice(SHAPES),
                 "position": rng.choice(POSITIONS)}
        name = f"images/{i}.png"
        _draw(out / name, rng.choice(SIZES), facts["colour"], facts["shape"], facts["position"],
              rng)
        q, key = QUESTIONS[rng.choice(list(QUESTIONS))]
        if style == "llava":
            lines.append({"image": name, "conversations": [
                {"from": "human", "value": f"<image>\n{q}"},
                {"from": "gpt", "value": facts[key]}]})
        else:
            lines.append({"messages": [
                {"role": "user", "content": [{"type": "image", "image": name},
                                             {"type": "text", "text": "\n" + q}]},
                {"role": "assistant", "content": facts[key]}]})
    path = out / "data.jsonl"
    tmp = out / f".data.jsonl.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        for rec in lines:
            f.write(json.dumps(rec) + "\n")
    os.replace(tmp, path)
    return str(path)
