"""The English corpus of the built-in models: Python 3.11's documentation, as Debian ships it.

Why this corpus: it is English prose (tutorial, FAQ, HOWTOs, library and language reference),
it is licensed for redistribution (the PSF License Agreement, stated in the package's
`usr/share/doc/python3.11-doc/copyright` and in the docs' own `license.rst.txt`: "Python
software and documentation are licensed under the PSF License Agreement"), and any machine
gets it from the Debian archive with `apt-get download python3.11-doc` (no root needed).

The package's HTML build carries the Sphinx sources (`_sources/**/*.rst.txt`). This module
reads them straight from the .deb (a plain `ar` archive holding a tar, so no dpkg-deb is
needed), turns each reST file into prose paragraphs (markup, code, tables and directives
removed by fixed rules) and splits the documents, whole, into a training and a held-out set.
Every step is deterministic: same .deb, same text.
"""

from __future__ import annotations

import hashlib
import io
import re
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "python3.11-doc"
# The version the shipped models were trained on; another version still works, but gives a
# slightly different corpus (the script says so).
PACKAGE_VERSION = "3.11.2-6+deb12u8"
DEFAULT_CACHE = Path.home() / ".cache" / "cann-recipes-infer" / "corpus"
SOURCES = "./usr/share/doc/python3.11/html/_sources/"
COPYRIGHT = "./usr/share/doc/python3.11-doc/copyright"
PSF_LICENSE = "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2"  # heading of the licence text in COPYRIGHT
# Sections left out: legal text and tables of contents (about, bugs, contents, copyright,
# license, includes), release notes that are mostly names and issue numbers (whatsnew) and
# the deprecated distutils manual (duplicates distributing/ and install/).
EXCLUDED = ("about", "bugs", "contents", "copyright", "license", "includes", "whatsnew", "distutils")
# Held-out documents: every EVAL_EVERY-th non-empty document in sorted path order, starting
# at EVAL_OFFSET. A stride (not "the last N") so the held-out text samples every section; the
# offset was chosen (of the 50) for a held-out text of tens of KB (~58 KB, 1.1%) that
# includes a tutorial chapter.
EVAL_EVERY = 50
EVAL_OFFSET = 34
# A paragraph is kept only if it looks like prose: at least MIN_WORDS words, at least
# MIN_ALPHA of its non-space characters letters, and ending like a sentence.
MIN_WORDS = 6
MIN_ALPHA = 0.75
SENTENCE_END = (".", "!", "?", ":", ")", '"', "'")

# Directives whose body is prose (admonitions, API descriptions, version notes): the
# directive line goes, the indented body stays. Any other directive is dropped with its body.
KEEP_BODY = {
    "note", "warning", "seealso", "impl-detail", "attention", "caution", "important", "tip", "hint", "admonition",
    "versionadded", "versionchanged", "deprecated", "deprecated-removed", "glossary", "describe",
    "function", "method", "attribute", "data", "class", "exception", "decorator", "decoratormethod",
    "classmethod", "staticmethod", "coroutinemethod", "coroutinefunction", "abstractmethod", "opcode",
    "cmdoption", "envvar", "pdbcommand", "c:function", "c:member", "c:type", "c:var", "c:macro",
}  # fmt: skip
# Admonitions whose argument on the directive line is already the first sentence.
ARG_IS_TEXT = {"note", "warning", "impl-detail", "attention", "caution", "important", "tip", "hint"}

DIRECTIVE = re.compile(r"^\.\.\s+([\w:-]+)::\s*(.*)$")
SECTION_RULE = re.compile(r"^([=\-~^*#\"'`+:._])\1{2,}\s*$")  # a line of one repeated punctuation mark
TABLE_LINE = re.compile(r"^(\+[-=+]+\+?|\|.*|=+(\s+=+)+)\s*$")  # grid rows and simple-table rules
FIELD = re.compile(r"^:[\w -]+:(\s|$)")  # ":synopsis: ...", ":noindex:"
BULLET = re.compile(r"^([-*+•]|#\.|\d+\.|\(?[a-z0-9]\))\s+")
ROLE = re.compile(r":(?:[\w-]+:)*([\w-]+):`([^`]*)`")
LINK = re.compile(r"`([^`<]*?)\s*<[^`>]*>`__?")  # `text <target>`_
NAMED_REF = re.compile(r"`([^`]+)`__?")  # `name`_ and plain `interpreted`
FOOTNOTE_REF = re.compile(r"\s*\[[\w#*.-]*\]_")  # footnote and citation references
LITERAL = re.compile(r"``(.+?)``")
STRONG = re.compile(r"\*\*(.+?)\*\*")
EMPHASIS = re.compile(r"(?<![\w*])\*(?!\s)(.+?)(?<!\s)\*(?![\w*])")
SUBSTITUTION = re.compile(r"\|([\w -]+)\|")


class CorpusError(Exception):
    """The corpus cannot be fetched or read; the message is one line saying what to do."""


@dataclass(frozen=True)
class Corpus:
    """Cleaned documents, split whole into training and held-out text."""

    train: list[tuple[str, str]]  # (document name, text)
    held_out: list[tuple[str, str]]
    deb: Path
    deb_sha256: str
    version: str

    @staticmethod
    def join(docs: list[tuple[str, str]]) -> str:
        """One string for a set of documents: paragraphs one per line, documents apart by a blank line."""
        return "\n\n".join(text for _, text in docs) + "\n"


def fetch_deb(cache: Path = DEFAULT_CACHE) -> Path:
    """The python3.11-doc .deb in `cache`, downloaded with `apt-get download` if absent."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"{PACKAGE}_*_all.deb"))
    if found:
        return found[-1]
    try:
        proc = subprocess.run(["apt-get", "download", PACKAGE], cwd=cache, capture_output=True, text=True)
    except FileNotFoundError:
        proc = None
    found = sorted(cache.glob(f"{PACKAGE}_*_all.deb"))
    if proc is None or proc.returncode != 0 or not found:
        why = "apt-get not found" if proc is None else (proc.stderr.strip().splitlines() or ["no .deb written"])[-1]
        raise CorpusError(
            f"cannot fetch the corpus: `apt-get download {PACKAGE}` failed ({why}); "
            f"put {PACKAGE}_*_all.deb in {cache} or pass --deb FILE"
        )
    return found[-1]


def _deb_data_tar(deb: Path) -> tarfile.TarFile:
    """The data.tar.* member of a .deb (an `ar` archive: 8-byte magic, then 60-byte headers)."""
    raw = deb.read_bytes()
    if not raw.startswith(b"!<arch>\n"):
        raise CorpusError(f"{deb}: not a .deb file (no ar header)")
    pos = 8
    while pos + 60 <= len(raw):
        name = raw[pos : pos + 16].decode().strip().rstrip("/")
        size = int(raw[pos + 48 : pos + 58].decode().strip())
        body = raw[pos + 60 : pos + 60 + size]
        if name.startswith("data.tar"):
            return tarfile.open(fileobj=io.BytesIO(body), mode="r:*")
        pos += 60 + size + (size % 2)  # members are 2-byte aligned
    raise CorpusError(f"{deb}: no data.tar member")


def read_sources(deb: Path) -> tuple[dict[str, str], dict[str, str]]:
    """{document name: reST source} of the included sections, and the legal texts
    {"copyright": Debian's copyright file, "notice": the docs' copyright page}."""
    sources: dict[str, str] = {}
    legal: dict[str, str] = {}
    with _deb_data_tar(deb) as tar:
        for member in tar:
            if member.name == COPYRIGHT:
                legal["copyright"] = tar.extractfile(member).read().decode("utf-8")
            if not (member.isfile() and member.name.startswith(SOURCES) and member.name.endswith(".rst.txt")):
                continue
            name = member.name[len(SOURCES) : -len(".rst.txt")]
            if name == "copyright":
                legal["notice"] = tar.extractfile(member).read().decode("utf-8")
            if name.split("/")[0] not in EXCLUDED:
                sources[name] = tar.extractfile(member).read().decode("utf-8")
    if not sources or PSF_LICENSE not in legal.get("copyright", "") or "notice" not in legal:
        raise CorpusError(f"{deb}: no Sphinx sources or no PSF licence text; is it {PACKAGE}?")
    return dict(sorted(sources.items())), legal


def license_text(legal: dict[str, str]) -> str:
    """What the PSF License Agreement asks a derivative work to carry: PSF's copyright notice,
    the License Agreement itself (both verbatim from the package) and a summary of the changes."""
    paragraphs = [" ".join(p.split()) for p in legal["notice"].split("\n\n")]
    notice = [p for p in paragraphs if p.startswith("Copyright ©")]
    body = legal["copyright"]
    start = body.index(PSF_LICENSE)
    end = body.index("Agreement.", body.index("8. By copying", start)) + len("Agreement.")
    return (
        "The corpus of this model (and eval.txt, a part of it) is derived from the Python 3.11\n"
        f"documentation as shipped in Debian's {PACKAGE} package, licensed under the PSF License Agreement.\n\n"
        + "\n".join(notice)
        + "\n\nSummary of the changes made (clause 3): the reST sources of the documentation, all sections\n"
        f"but {', '.join(EXCLUDED)},\n"
        "were reduced to prose paragraphs: markup, code examples, tables and most directives\n"
        "removed, short or non-sentence paragraphs dropped (tools/builtin_corpus.py).\n"
        "The model weights were trained on that text.\n\n"
        f"The License Agreement, verbatim from usr/share/doc/{PACKAGE}/copyright:\n\n" + body[start:end] + "\n"
    )


def inline(text: str) -> str:
    """reST inline markup -> plain text, as Sphinx would render the words."""

    def role(m: re.Match) -> str:
        kind, body = m.group(1), m.group(2)
        title = re.match(r"^(.*?)\s*<[^<>]*>$", body, re.S)
        if title and title.group(1):
            return title.group(1)
        if kind.lower() in ("pep", "rfc"):
            return f"{kind.upper()} {body.split('#')[0]}"
        body = body.lstrip("!")
        if body.startswith("~"):
            body = body[1:].split(".")[-1]
        return body

    text = ROLE.sub(role, text)
    text = FOOTNOTE_REF.sub("", text)
    text = LITERAL.sub(r"\1", text)
    text = LINK.sub(r"\1", text)
    text = NAMED_REF.sub(r"\1", text)
    text = STRONG.sub(r"\1", text)
    text = EMPHASIS.sub(r"\1", text)
    text = SUBSTITUTION.sub(r"\1", text)
    text = text.replace("\\ ", "").replace("\\", "")
    return re.sub(r"\s+", " ", text).strip()


def is_prose(paragraph: str) -> bool:
    letters = sum(c.isalpha() for c in paragraph)
    chars = sum(not c.isspace() for c in paragraph)
    return len(paragraph.split()) >= MIN_WORDS and letters >= MIN_ALPHA * chars and paragraph.endswith(SENTENCE_END)


def rst_to_paragraphs(source: str) -> list[str]:
    """Prose paragraphs of one reST document (see the module docstring for what goes)."""
    paragraphs: list[str] = []
    current: list[str] = []
    skip_deeper: int | None = None  # skipping a block: lines indented deeper than this, and blanks
    skip_to_blank = False  # skipping a doctest block up to the next blank line
    body_indent = 0  # where the text of the current paragraph starts (after a bullet)

    def flush() -> None:
        if current:
            paragraphs.append(inline(" ".join(current)))
            current.clear()

    for line in source.expandtabs(8).splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if skip_to_blank:
            if stripped:
                continue
            skip_to_blank = False
        if skip_deeper is not None:
            if not stripped or indent > skip_deeper:
                continue
            skip_deeper = None
        if not stripped:
            flush()
            continue
        if stripped == ".." or stripped.startswith(".. "):  # directive, comment, target, substitution
            flush()
            m = DIRECTIVE.match(stripped)
            if m and m.group(1) in KEEP_BODY:
                if m.group(1) in ARG_IS_TEXT and m.group(2):
                    current.append(m.group(2))
                    body_indent = indent
            else:
                skip_deeper = indent
            continue
        if stripped.startswith(">>>"):
            flush()
            skip_to_blank = True
            continue
        if SECTION_RULE.match(stripped):  # under/overline: the title before it goes too
            current.clear()
            continue
        if TABLE_LINE.match(stripped) or FIELD.match(stripped):
            flush()
            continue
        bullet = BULLET.match(stripped)
        if bullet:
            flush()
            stripped = stripped[bullet.end() :]
            body_indent = indent + bullet.end()
        elif current and len(current) == 1 and indent > body_indent:  # definition list: a term, then its text
            flush()
            body_indent = indent
        elif not current:
            body_indent = indent
        if stripped.endswith("::"):  # a literal block follows
            text = stripped[:-2].rstrip()
            if text:
                current.append(text + (":" if not stripped.endswith(" ::") else ""))
            flush()
            skip_deeper = indent
            continue
        current.append(stripped)
    flush()
    return [p for p in paragraphs if is_prose(p)]


def load_corpus(deb: Path | None = None, cache: Path = DEFAULT_CACHE) -> tuple[Corpus, str]:
    """The cleaned, split corpus and the licence text to ship with anything derived from it."""
    deb = deb or fetch_deb(cache)
    if not deb.is_file():
        raise CorpusError(f"{deb}: file not found")
    version = deb.name.split("_")[1] if deb.name.count("_") == 2 else "unknown"
    sources, legal = read_sources(deb)
    docs = [(name, "\n".join(rst_to_paragraphs(source))) for name, source in sources.items()]
    docs = [(name, text) for name, text in docs if text]
    train = [doc for i, doc in enumerate(docs) if i % EVAL_EVERY != EVAL_OFFSET]
    held_out = [doc for i, doc in enumerate(docs) if i % EVAL_EVERY == EVAL_OFFSET]
    sha = hashlib.sha256(deb.read_bytes()).hexdigest()
    return Corpus(train=train, held_out=held_out, deb=deb, deb_sha256=sha, version=version), license_text(legal)
