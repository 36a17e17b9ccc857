"""Writes chat_tiny_{train,validation}.jsonl: OpenAI-style chat conversations about the synthetic
SQuAD world (the data of examples/chat_lora_tiny.yaml; also a sample of the chat JSONL format).

    python examples/data/make_chat_tiny.py

Each conversation gives notes (a synthetic SQuAD paragraph) and asks two or three questions; the
assistant answers with the sentence of the notes that holds the answer.
"""

import json
import os

from hybridtrain.data import synthetic_squad

SYSTEM = "Answer each question about the notes with the sentence of the notes that answers it."


def _sentence(context: str, start: int) -> str:
    a = context.rfind(". ", 0, start)
    a = 0 if a < 0 else a + 2
    b = context.find(".", start)
    return context[a:b + 1]


def conversations(num_questions: int, seed: int) -> list[dict]:
    out = []
    for art in synthetic_squad(num_questions, seed)["data"]:
        for par in art["paragraphs"]:
            ctx, msgs = par["context"], [{"role": "system", "content": SYSTEM}]
            for i, qa in enumerate(par["qas"]):
                q = qa["question"] if i else f"Notes: {ctx}\nQuestion: {qa['question']}"
                msgs += [{"role": "user", "content": q},
                         {"role": "assistant", "content": _sentence(ctx, qa["answers"][0]["answer_start"])}]
            out.append({"messages": msgs})
    return out


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    for name, n, seed in (("train", 640, 0), ("validation", 64, 1)):
        path = os.path.join(here, f"chat_tiny_{name}.jsonl")
        with open(path, "w") as f:
            for conv in conversations(n, seed):
                f.write(json.dumps(conv, ensure_ascii=False) + "\n")
        print(path)
