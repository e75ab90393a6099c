"""Tokenizer support for the inference executor.

Why this module exists
----------------------
The executor must run fully offline and must not depend on ``transformers`` at
runtime (it is only a *test* dependency).  Every Qwen checkpoint ships a
HuggingFace ``tokenizer.json``, which the small, fast ``tokenizers`` library can
load on its own, so this module wraps that library behind a tiny API
(:class:`Tokenizer`) with the few things the executor needs: ``encode`` without
special tokens, ``decode`` that drops special tokens, ``vocab_size`` and the
end-of-sequence id used to stop generation.

The repository also carries a *built-in* byte-level BPE tokenizer
(``configs/tokenizer/tokenizer.json``, 512 tokens, special token
``<|endoftext|>``) trained on a small hand-written English corpus.  It lets tests,
demos and benchmarks run on tiny randomly initialised checkpoints without
downloading anything.  :func:`train_builtin_tokenizer` rebuilds it
deterministically; ``python configs/tokenizer/make_tokenizer.py`` rewrites the
file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from executor.errors import RecipeError
from executor.paths import CONFIGS_DIR

if TYPE_CHECKING:  # pragma: no cover
    import tokenizers

__all__ = [
    "BUILTIN_CORPUS",
    "BUILTIN_TOKENIZER",
    "ENDOFTEXT",
    "Tokenizer",
    "TokenizerError",
    "train_builtin_tokenizer",
]

#: The tokenizer.json of the built-in byte-level BPE tokenizer (vocab 512).
BUILTIN_TOKENIZER = CONFIGS_DIR / "tokenizer" / "tokenizer.json"
#: The corpus the built-in tokenizer is trained on.
BUILTIN_CORPUS = CONFIGS_DIR / "tokenizer" / "corpus.txt"
#: The special end-of-text token of the built-in tokenizer.
ENDOFTEXT = "<|endoftext|>"

TOKENIZER_FILE = "tokenizer.json"

# Special tokens that mark the end of a sequence, most preferred first.  Used
# only when no sibling generation_config.json / config.json names an eos id.
_EOS_CANDIDATES = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>", "<eos>")


class TokenizerError(RecipeError):
    """A tokenizer could not be found, read or built."""


def _first_id(value) -> int | None:
    """``eos_token_id`` in HF configs is an int, a list of ints, or null."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, int) and not isinstance(item, bool):
                return item
    return None


def _all_ids(value) -> tuple[int, ...]:
    if isinstance(value, bool):
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


def _read_json(path: Path) -> dict | None:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class Tokenizer:
    """Thin wrapper over a HuggingFace `tokenizers` tokenizer.json."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        eos_token_id: int | None = None,
        path: Path | None = None,
        eos_token_ids: Sequence[int] | None = None,
    ):
        self._tok = tokenizer
        self.path = path
        if eos_token_id is None:
            eos_token_id = self._eos_from_special_tokens()
        #: The id that ends generation (None if the tokenizer has none).
        self.eos_token_id: int | None = eos_token_id
        ids = tuple(eos_token_ids) if eos_token_ids else ()
        if eos_token_id is not None and eos_token_id not in ids:
            ids = (eos_token_id,) + ids
        #: Every id that ends generation (e.g. Qwen instruct: <|im_end|>, <|endoftext|>).
        self.eos_token_ids: tuple[int, ...] = ids

    # -- construction -------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Tokenizer:
        """Load ``path`` (a tokenizer.json, or a directory that contains one).

        The eos id is taken, in order of preference, from a sibling
        ``generation_config.json``, ``config.json`` (``eos_token_id``; a list
        means its first entry), ``tokenizer_config.json`` (``eos_token``), and
        finally from the tokenizer's own special tokens.
        """
        p = Path(path)
        file = p / TOKENIZER_FILE if p.is_dir() else p
        if not file.is_file():
            raise TokenizerError(f"tokenizer not found: {file}")
        try:
            import tokenizers
        except ImportError as exc:  # pragma: no cover - declared dependency
            raise TokenizerError("the 'tokenizers' package is required") from exc
        try:
            tok = tokenizers.Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise TokenizerError(f"cannot read tokenizer {file}: {exc}") from exc

        eos_id: int | None = None
        eos_ids: tuple[int, ...] = ()
        folder = file.parent
        for name in ("generation_config.json", "config.json"):
            data = _read_json(folder / name)
            if data is None:
                continue
            value = data.get("eos_token_id")
            if value is None and isinstance(data.get("text_config"), dict):
                value = data["text_config"].get("eos_token_id")
            eos_id = _first_id(value)
            if eos_id is not None:
                eos_ids = _all_ids(value)
                break
        if eos_id is None:
            data = _read_json(folder / "tokenizer_config.json")
            token = data.get("eos_token") if data else None
            if isinstance(token, dict):  # serialized AddedToken
                token = token.get("content")
            if isinstance(token, str):
                eos_id = tok.token_to_id(token)
        return cls(tok, eos_token_id=eos_id, path=file, eos_token_ids=eos_ids)

    @classmethod
    def builtin(cls) -> Tokenizer:
        """The repository's built-in 512-token byte-level BPE tokenizer."""
        return cls.from_file(BUILTIN_TOKENIZER)

    # -- API ----------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no special tokens (BOS/EOS) are added."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, leaving out special tokens."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        """Number of tokens, added/special tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._tok

    def __repr__(self) -> str:
        return f"Tokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size}, eos_token_id={self.eos_token_id})"

    # -- helpers ------------------------------------------------------------
    def _eos_from_special_tokens(self) -> int | None:
        special: dict[str, int] = {}
        try:
            decoder = self._tok.get_added_tokens_decoder()
        except AttributeError:  # pragma: no cover - very old tokenizers
            decoder = {}
        for token_id, added in decoder.items():
            if getattr(added, "special", False):
                special[added.content] = token_id
        for name in _EOS_CANDIDATES:
            if name in special:
                return special[name]
        for name in _EOS_CANDIDATES:  # present, but not flagged special
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        return None


def train_builtin_tokenizer(
    corpus_path: str | os.PathLike = BUILTIN_CORPUS, vocab_size: int = 512
) -> tokenizers.Tokenizer:
    """Train the built-in byte-level BPE tokenizer on ``corpus_path``.

    ByteLevel pre-tokenizer and decoder (so ``decode(encode(text)) == text`` for
    any text), all 256 byte symbols in the base alphabet (so nothing is ever
    unknown), and ``<|endoftext|>`` as the single special token, placed last
    (id ``vocab_size - 1``) as in Qwen vocabularies.  Training is
    deterministic: the same corpus gives the same vocabulary and merges.
    """
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as HFTokenizer

    corpus = Path(corpus_path)
    if not corpus.is_file():
        raise TokenizerError(f"tokenizer corpus not found: {corpus}")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise TokenizerError(f"vocab_size must be at least {len(alphabet) + 1}, got {vocab_size}")

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # one slot left for <|endoftext|>
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=alphabet,
    )
    text = corpus.read_text(encoding="utf-8")
    tok.train_from_iterator(text.splitlines(), trainer=trainer)
    tok.add_special_tokens([AddedToken(ENDOFTEXT, special=True, normalized=False)])
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise TokenizerError(f"corpus {corpus} is too small for vocab_size={vocab_size} (trained {got} tokens)")
    return tok
