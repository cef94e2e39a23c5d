"""Pass 3: remove what the rewrite left dead — the GQA expansions of k/v, the 4-D masks
built for SDPA, cache concatenations — with fx's dead-code elimination, made safe for
torch-level graphs: fx treats a `call_method` or a plain Python function as pure, so an
in-place method (`x.masked_fill_(...)`, whose result is often unused), `torch.relu_`,
`operator.iadd` or `inplace=True` are kept here explicitly."""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

_OPERATOR_IN_PLACE = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
                      operator.irshift, operator.imatmul}


def _in_place(name: str) -> bool:
    return name.endswith("_") and not name.endswith("__")


def has_side_effect(node: Node) -> bool:
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_method":
        return _in_place(node.target)
    if node.op == "call_function":
        target = node.target
        if target in _OPERATOR_IN_PLACE:
            return True
        torch_callable = getattr(target, "__objclass__", None) is torch._C.TensorBase or \
            getattr(target, "__module__", None) == "torch"
        if torch_callable and _in_place(getattr(target, "__name__", "")):
            return True
    return node.is_impure()


def remove_dead(gm: GraphModule) -> int:
    """Erase every node without users and without side effects; returns how many."""
    before = len(gm.graph.nodes)
    gm.graph.eliminate_dead_code(is_impure_node=has_side_effect)
    gm.recompile()
    return before - len(gm.graph.nodes)
