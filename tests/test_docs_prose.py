"""The manual (README.md and docs/*.md) is plain prose: its sentences have a natural length, neither a list of
fragments nor run-on paragraphs.

How a sentence is counted:

- Prose is every paragraph and every list item, outside fenced code blocks. Headings, table rows, admonition and
  HTML lines, mkdocstrings directives (``::: module.name``) and lines that are a link alone are not prose, and
  each ends the paragraph before it. A list item starts a paragraph of its own.
- A paragraph splits into sentences after a ``.``, ``!`` or ``?`` followed by white space and a capital letter,
  a digit, a backtick, a quote, a parenthesis, an asterisk or a bracket. The abbreviations "e.g.", "i.e.",
  "et al.", "etc.", "vs.", "cf.", "Fig.", "Eq.", "App.", "Sec." and "No." end no sentence.
- A sentence's length is its number of white-space separated words; a code span or a link counts as the words
  it is written with.

The median over all the sentences of all the pages must lie in 11-25 words: the range of the manuals of
comparable projects (torchgeo, timm, litgpt: 14-25), with room below for short instructions.
"""

import re
import statistics

from helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ABBREVIATIONS = re.compile(r"\b(?:e\.g|i\.e|et al|etc|vs|cf|Fig|Eq|App|Sec|No)\.")
NOT_PROSE = ("#", "|", "!!!", "<", ":::")
LINK_ALONE = re.compile(r"(?:[-*+]\s+)?\[[^\]]*\]\([^)]*\)[.,;:]?")
LIST_ITEM = re.compile(r"(?:[-*+]|\d+\.)\s+")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9`'\"(*\[])")


def paragraphs(text: str) -> list[str]:
    """The prose paragraphs and list items of a page, each joined into one line."""
    text = re.sub(r"^\s*```.*?^\s*```[ \t]*$", "", text, flags=re.S | re.M)
    found, current = [], []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(NOT_PROSE) or LINK_ALONE.fullmatch(line):
            found.append(" ".join(current))
            current = []
            continue
        item = LIST_ITEM.match(line)
        if item:
            found.append(" ".join(current))
            current = [line[item.end() :]]
        else:
            current.append(line)
    found.append(" ".join(current))
    return [paragraph for paragraph in found if paragraph]


def sentences(paragraph: str) -> list[str]:
    protected = ABBREVIATIONS.sub(lambda m: m.group(0).replace(".", "\0"), paragraph)
    return [part.replace("\0", ".") for part in SENTENCE_END.split(protected) if part.strip()]


def sentence_lengths(text: str) -> list[int]:
    return [len(sentence.split()) for paragraph in paragraphs(text) for sentence in sentences(paragraph)]


def test_the_counting_follows_the_definition():
    page = (
        "# A heading is no sentence\n\nOne short sentence here. And e.g. this one goes on, as `x.y` does.\n"
        "- A list item is a paragraph\n  that goes on.\n\n| a | table row |\n\n```bash\nnot prose. At all.\n```\n"
        "[a link alone](page.md)\n::: robust_lightning.load_model\n"
    )
    assert paragraphs(page) == [
        "One short sentence here. And e.g. this one goes on, as `x.y` does.",
        "A list item is a paragraph that goes on.",
    ]
    assert sentence_lengths(page) == [4, 9, 9]


def test_the_manuals_sentences_have_a_natural_length():
    lengths = {page.relative_to(REPO): sentence_lengths(page.read_text()) for page in PAGES}
    median = statistics.median(length for page in lengths.values() for length in page)
    per_page = ", ".join(f"{page}: {statistics.median(n):g}" for page, n in lengths.items() if n)
    assert 11 <= median <= 25, f"median sentence length {median:g} words (per page: {per_page})"
