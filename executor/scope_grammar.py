"""The SuperKernel scope vocabulary, without torch: the options grammar and the region kinds (the
built-in plans' names).

Why apart from executor.scope: the config's validation and every command's `--help` need them, and
executor.scope imports torch (its marker ops), ~2-3 s before a parser could even print its usage.
executor.scope re-exports all of it.
"""

from __future__ import annotations

from executor.errors import RecipeError

# --------------------------------------------------------------------------- options grammar
_BINARY = ("0", "1")
_AIC_AIV_RATIOS = ("1:0", "0:1", "1:1", "1:2")
# torchair passes these through to GE unparsed; we check them here so a typo fails early.
OPTIONS: dict[str, str] = {
    "feed-sync-all": "0 or 1",
    "stream-fusion": "0 or 1",
    "strict-scope-check": "bypass or abort",
    "dcci-before-kernel-start": "comma separated op types, e.g. GroupedMatmul,MoeGatingTopK",
    "dcci-after-kernel-end": "comma separated op types",
    "dcci-disable-on-kernel": "comma separated op types",
    "debug-aic-num": "positive integer",
    "debug-aiv-num": "positive integer",
}


class ScopeError(RecipeError):
    """A scope option/plan problem; one line naming the key and what is allowed."""


def parse_options(options: str, key: str = "superkernel.options") -> dict[str, str]:
    """Parse and validate `opt=val:opt=val` (list values comma separated)."""
    parsed: dict[str, str] = {}
    if not options:
        return parsed
    allowed = "; ".join(f"{k}={v}" for k, v in OPTIONS.items())
    for item in options.split(":"):
        if "=" not in item:
            raise ScopeError(f"{key}: {item!r} is not opt=val; allowed options: {allowed}")
        name, value = (s.strip() for s in item.split("=", 1))
        if name not in OPTIONS:
            raise ScopeError(f"{key}: unknown option {name!r}; allowed options: {allowed}")
        ok = True
        if name in ("feed-sync-all", "stream-fusion"):
            ok = value in _BINARY
        elif name == "strict-scope-check":
            ok = value in ("bypass", "abort")
        elif name.startswith("dcci-"):
            ok = all(part.strip().isascii() and part.strip().isidentifier() for part in value.split(","))
        elif name.startswith("debug-"):
            ok = value.isascii() and value.isdigit() and int(value) > 0  # "²".isdigit() is True
        if not ok:
            raise ScopeError(f"{key}: {name}={value!r} is not allowed; {name} takes {OPTIONS[name]}")
        parsed[name] = value
    if "debug-aic-num" in parsed and "debug-aiv-num" in parsed:
        aic, aiv = int(parsed["debug-aic-num"]), int(parsed["debug-aiv-num"])
        ratios = {tuple(map(int, r.split(":"))) for r in _AIC_AIV_RATIOS}
        if not any(aic * b == aiv * a for a, b in ratios):
            raise ScopeError(f"{key}: debug-aic-num:debug-aiv-num must be one of {', '.join(_AIC_AIV_RATIOS)}")
    return parsed


# --------------------------------------------------------------------------- region kinds
REGION_KINDS = ("attention", "mlp", "moe", "layer", "decoder")  # a built-in plan wraps every region of its kind
