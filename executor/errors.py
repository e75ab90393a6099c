"""The project's error contract: what is the user's to fix, and how a command reports it.

Why one base class: a command must turn bad input or an impossible request into one line and
exit code 2, yet a bug must keep its traceback. Catching ValueError (as the CLI once did) hides
bugs that happen to raise it. Every error a user can cause derives from `RecipeError`, each
module keeps its own subclass (ConfigError, PlatformError, ScopeError, ...), and `run_command`
is the one net every entry point (infer.sh, the tools) runs its `main` in.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

EXIT_USAGE = 2  # bad input or impossible request (one line on stderr)
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGTERM, as shells report SIGINT


class RecipeError(Exception):
    """Bad input or an impossible request; the message is one line naming the key or file."""


def run_command(main: Callable[[list[str]], int], argv: Sequence[str]) -> int:
    """Run a command's `main`: its own errors become `error: ...` + exit 2, Ctrl-C exit 130.

    Anything else propagates with its traceback: it is a bug, not a message for the user."""
    try:
        return main(list(argv))
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
