#!/usr/bin/env python
"""Build the offline evaluation tasks of evaluation/tasks/alice/ from the text of Alice's Adventures in Wonderland.

    python scripts/make_alice_tasks.py alice29.txt evaluation/tasks/alice

alice29.txt is Lewis Carroll's book (1865, public domain) as the Canterbury corpus ships it (the Millennium Fulcrum
Edition 2.9, plain text; in Brotli's source distribution as tests/testdata/alice29.txt). Deterministic: the same
input gives the same files. Three tasks, each with a validation split (the few-shot examples) and a test split:

    alice_lastword   LAMBADA's form: a paragraph of 30-120 words; predict its last word (3+ letters)
    alice_choice     HellaSwag's form: a sentence, and four candidate next sentences of which one is the book's
                     (the other three: sentences of similar length from other chapters, chosen by a seeded RNG)
    alice_pages      rolling perplexity: the book cut into pages of about 1,500 characters, paragraph aligned
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

VALIDATION = 16  # items of each task kept for few-shot examples


def chapters(text: str) -> list[list[str]]:
    """The book's chapters, each a list of paragraphs (lines joined, whitespace collapsed, `quotes' made 'quotes')."""
    body = text[text.index("CHAPTER I"):text.rindex("THE END")]
    parts = re.split(r"\n\s*CHAPTER [IVXL]+\s*\n", "\n" + body)
    result = []
    for part in parts:
        paragraphs = [re.sub(r"\s+", " ", p).strip().replace("`", "'") for p in re.split(r"\n\s*\n", part)]
        paragraphs = [p for p in paragraphs if p and not p.isupper() and len(p.split()) > 3]
        if paragraphs:
            result.append(paragraphs[1:] if len(paragraphs[0].split()) < 8 else paragraphs)  # the chapter's title
    return result


def last_word_items(book: list[list[str]]) -> list[dict]:
    items = []
    for paragraph in (p for chapter in book for p in chapter):
        text = paragraph.rstrip(" .,;:!?'\"-)(")
        words = text.split(" ")
        if 30 <= len(words) <= 120 and re.fullmatch(r"[A-Za-z]{3,}", words[-1]):
            items.append({"text": text})
    return items


def sentences(paragraph: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+(?=[A-Z'])", paragraph) if s.strip()]


def choice_items(book: list[list[str]], rng: random.Random) -> list[dict]:
    by_chapter = [[s for p in chapter for s in sentences(p) if 6 <= len(s.split()) <= 40] for chapter in book]
    items = []
    for number, chapter in enumerate(book):
        for paragraph in chapter:
            parts = sentences(paragraph)
            for first, second in zip(parts, parts[1:], strict=False):
                if not (6 <= len(first.split()) <= 40 and 6 <= len(second.split()) <= 40):
                    continue
                length = len(second.split())
                pool = [s for other, ss in enumerate(by_chapter) if other != number for s in ss
                        if abs(len(s.split()) - length) <= max(2, length // 2)]
                endings = rng.sample(pool, 3) + [second]
                rng.shuffle(endings)
                items.append({"ctx": first, "endings": endings, "label": endings.index(second)})
    return items


def page_items(book: list[list[str]], size: int = 1500) -> list[dict]:
    pages = []
    for chapter in book:
        page: list[str] = []
        for paragraph in chapter:
            page.append(paragraph)
            if sum(len(p) for p in page) >= size:
                pages.append({"page": "\n\n".join(page)})
                page = []
        if page:
            pages.append({"page": "\n\n".join(page)})
    return pages


def write(folder: Path, name: str, items: list[dict], validation: int = VALIDATION) -> None:
    for split, part in (("validation", items[:validation]), ("test", items[validation:])):
        with open(folder / f"{name}_{split}.jsonl", "w", encoding="utf-8") as out:
            for item in part:
                out.write(json.dumps(item, ensure_ascii=False) + "\n")
    print(f"{name}: {validation} validation, {len(items) - validation} test")


def main(argv: list[str]) -> int:
    source, folder = Path(argv[0]), Path(argv[1])
    book = chapters(source.read_text(encoding="latin-1"))
    rng = random.Random(1865)
    write(folder, "alice_lastword", last_word_items(book))
    write(folder, "alice_choice", choice_items(book, rng)[:216])
    write(folder, "alice_pages", page_items(book), validation=4)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
