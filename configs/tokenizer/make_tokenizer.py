"""Regenerate configs/tokenizer/tokenizer.json from corpus.txt.

    python configs/tokenizer/make_tokenizer.py

Training is deterministic, so re-running this leaves the file unchanged.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # repo root, for `executor`

from executor.tokenizer import BUILTIN_TOKENIZER, train_builtin_tokenizer  # noqa: E402


def main() -> None:
    tok = train_builtin_tokenizer(HERE / "corpus.txt", vocab_size=512)
    tok.save(str(BUILTIN_TOKENIZER), pretty=True)
    print(f"wrote {BUILTIN_TOKENIZER} (vocab {tok.get_vocab_size(with_added_tokens=True)})")


if __name__ == "__main__":
    main()
