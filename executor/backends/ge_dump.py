"""The GE graph torchair dumps as pbtxt, parsed into plain Python (for the GE check).

torchair writes `node { name op input* attr { key value { s: <AttrDef text> } } }`, each attribute
value being the text form of its AttrDef protobuf message quoted as a Python bytes literal. We
parse the node structure line by line and each attribute with torchair's own AttrDef class, so
types (string, int, float, list) come back as torchair set them. Used by executor.backends.ge_offline
and tools/ge_check.py; importing it needs no torchair (only `parse_pbtxt` does, lazily).
"""

from __future__ import annotations

import ast
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SK_ATTRS = ("_super_kernel_scope", "_super_kernel_options")  # what torchair stamps on scoped GE ops


@dataclass
class GeNode:
    name: str
    type: str
    inputs: list[str]
    attrs: dict[str, Any]  # "_super_kernel_scope": "layer_0_attn", "epsilon": 1e-06, ...

    @property
    def scope(self) -> str | None:
        return self.attrs.get("_super_kernel_scope")

    @property
    def scope_options(self) -> str | None:
        return self.attrs.get("_super_kernel_options")


@dataclass
class GeGraph:
    name: str  # "dynamo_original_graph_0", "dynamo_optimized_graph_0"
    path: Path
    nodes: list[GeNode]

    def by_scope(self) -> dict[str | None, list[GeNode]]:
        """Nodes grouped by `_super_kernel_scope` (None = outside every scope), graph order."""
        groups: dict[str | None, list[GeNode]] = {}
        for node in self.nodes:
            groups.setdefault(node.scope, []).append(node)
        return groups

    def types(self) -> set[str]:
        return {n.type for n in self.nodes}


def _attr_value(attr) -> Any:
    """A torchair AttrDef message as a plain Python value."""
    kind = attr.WhichOneof("value")
    if kind in ("s", "bt"):
        return getattr(attr, kind).decode(errors="replace")
    if kind in ("i", "f", "b", "dt"):
        return getattr(attr, kind)
    if kind == "list":
        lv = attr.list
        for name in ("s", "i", "f", "b", "dt"):
            values = list(getattr(lv, name))
            if values:
                return [v.decode(errors="replace") if isinstance(v, bytes) else v for v in values]
        return []
    return str(attr).strip()


def parse_pbtxt(path: Path) -> GeGraph:
    """Parse torchair's pbtxt dump (`node { name op input* attr { key value { s: <AttrDef text> } } }`).

    torchair writes every attribute value as the text form of its AttrDef message, quoted as a
    Python bytes literal; we decode that literal and parse it with torchair's own AttrDef class,
    so types (string, int, float, list) come back as they were set."""
    from google.protobuf import text_format

    attr_def = importlib.import_module("torchair._ge_concrete_graph.ge_ir_pb2").AttrDef
    nodes: list[GeNode] = []
    node: GeNode | None = None
    key = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line == "node {":
            node = GeNode("", "", [], {})
            nodes.append(node)
        elif node is None or line in ("}", "attr {", "value {"):
            continue
        elif line.startswith("name: "):
            node.name = ast.literal_eval(line[6:])
        elif line.startswith("op: "):
            node.type = ast.literal_eval(line[4:])
        elif line.startswith("input: "):
            node.inputs.append(ast.literal_eval(line[7:]))
        elif line.startswith("key: "):
            key = ast.literal_eval(line[5:])
        elif line.startswith("s: ") and key is not None:
            text = ast.literal_eval("b" + line[3:]).decode(errors="replace")
            if not key.startswith(("[i]", "[o]")):  # tensor descriptors: not needed here
                msg = attr_def()
                text_format.Parse(text, msg)
                node.attrs[key] = _attr_value(msg)
            key = None
    return GeGraph(path.name.split("_rank_")[0], path, nodes)
