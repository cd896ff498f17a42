"""Reads the collectives out of a compiled XLA program, so tests (and users) can check what a step communicates.

Usage::

    text = jax.jit(step).lower(*args).compile().as_text()
    for c in collectives(text, mesh): print(c)
    summary(collectives(text, mesh))  # {(op, axes, phase, elements): executions}

Each collective is mapped to the mesh axes its device groups span (``{'model'}``, ``{'data'}``) and counted once
per execution: an op inside a ``while`` body (``nnx.scan`` over layers) counts its trip count times (XLA's
``known_trip_count``, else read from the loop: ``loops``).
Tuple-shaped collectives (several operands combined by XLA) yield one entry per operand; an asynchronous start's
operands and results are one. A ``ragged-all-to-all`` yields its operand, the most it sends (what it moves is known
only when it runs), not its receive buffer. Collectives over groups of one device (a ``shard_map`` reducing over a
mesh axis of size 1) move nothing and are left out.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

import numpy as np
from jax.sharding import Mesh

COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                  "collective-broadcast", "ragged-all-to-all")

_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_SHAPE = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
_CALLEES = re.compile(r"\b(?:body|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One operand of one collective instruction."""

    op: str  # e.g. 'all-reduce' (async '-start' forms are folded in)
    dtype: str
    shape: tuple[int, ...]  # the result shape of this operand, per device
    axes: frozenset[str]  # mesh axes spanned by the device groups
    executions: int  # times it runs per call of the program (loop trip counts multiplied)
    phase: str  # 'backward' if JAX's transpose produced it, else 'forward'
    instruction: str
    group_size: int = 1  # devices per replica group (1 for collective-permute)
    cyclic: bool = False  # a collective-permute whose every target also sends (a ring; a shift along a line is not)
    op_name: str = ""  # JAX's name for the op that made it (its named scopes, ``transpose(..)`` in the backward)

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def shard_elements(self) -> int:
        """One device's piece: an all-gather's input (its result / group size), a reduce-scatter's result; for
        other ops the result."""
        return self.elements // self.group_size if self.op == "all-gather" else self.elements


def _parse_groups(text: str, num_devices: int) -> list[list[int]]:
    """Device groups from any replica_groups syntax XLA prints."""
    m = re.match(r"\s*mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}", text)
    if m:  # mesh['axis_0'=2,'axis_1'=4][, device_ids=([dims]T(perm))] {'axis_1'}: groups vary along listed axes
        sizes = [(k.strip().strip("'"), int(v)) for k, v in (a.split("=") for a in m.group(1).split(","))]
        names = [n for n, _ in sizes]
        over = [names.index(a.strip().strip("'")) for a in m.group(4).split(",") if a.strip()]
        ids = np.arange(math.prod(s for _, s in sizes))
        if m.group(2):  # devices laid over the mesh in a permuted iota order
            ids = ids.reshape([int(d) for d in m.group(2).split(",")])
            if m.group(3):
                ids = np.transpose(ids, [int(p) for p in m.group(3).split(",")])
        ids = ids.reshape([s for _, s in sizes])
        keep = [i for i in range(len(names)) if i not in over]
        ids = np.transpose(ids, keep + over).reshape(-1, math.prod(sizes[i][1] for i in over) if over else 1)
        return ids.tolist()
    m = re.match(r"\s*\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if m:  # iota form [G,S]<=[dims]T(perm)
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = np.transpose(ids, [int(p) for p in m.group(4).split(",")])
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    m = re.match(r"\s*\{(\{[\d,\s]*\}(?:\s*,\s*\{[\d,\s]*\})*)?\}", text)
    if m:  # explicit {{0,1},{2,3}}; {} means all devices
        if not m.group(1):
            return [list(range(num_devices))]
        return [[int(i) for i in g.split(",") if i.strip()] for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
    raise ValueError(f"unrecognised replica_groups syntax: {text[:80]!r}")


def _axes_of(groups: list[list[int]], mesh: Mesh) -> frozenset[str]:
    """The mesh axes along which the members of the groups differ."""
    shape = tuple(mesh.devices.shape)
    varying = set()
    for g in groups:
        coords = np.array([np.unravel_index(d, shape) for d in g])
        varying |= {mesh.axis_names[i] for i in range(len(shape)) if len(set(coords[:, i])) > 1}
    return frozenset(varying)


def _pairs_axes(text: str, mesh: Mesh) -> frozenset[str]:
    pairs = [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", text)]
    return _axes_of(pairs, mesh)


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    comps, current, entry = {}, None, None
    for line in hlo.splitlines():
        header = _COMP_HEADER.match(line)
        if header:
            current = header.group(2)
            comps[current] = []
            if header.group(1):
                entry = current
        elif line.strip() == "}":
            current = None
        elif current is not None:
            comps[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation found: pass the text of a compiled HLO module")
    return comps, entry


_INDUCTION = re.compile(r'"known_induction_variable":\{"tuple_index":"(\d+)"\}')
_CONSTANT = re.compile(r"constant\((-?\d+)\)")


def _defining(lines: list[str], name: str) -> str | None:
    """The instruction of ``lines`` that defines ``%name``."""
    return next((line for line in lines if (m := _INSTR.match(line)) and m.group(2) == name), None)


def _counted_trip(comps: dict[str, list[str]], caller: list[str], line: str) -> int | None:
    """The trip count of a while loop XLA left without one (what double buffering peels off: the first iteration,
    or the rest of an accumulation loop; the training step's accumulation loop, whose bound is hidden from XLA):
    where its condition is ``i < N``, ``N`` a constant or an element of the loop's tuple that starts at a constant
    and that the body passes through unchanged, the induction variable starts at a constant and the body adds 1 to
    it, ``N - start`` (with XLA's induction variable at most one trip needs no step); None where any of that cannot
    be read."""
    index, cond = _INDUCTION.search(line), re.search(r"\bcondition=%?([\w.\-]+)", line)
    init, body = re.search(r"while\(%?([\w.\-]+)\)", line), re.search(r"\bbody=%?([\w.\-]+)", line)
    if not (cond and init and body and cond.group(1) in comps):
        return None
    carried = _carried_bound(comps, cond.group(1))
    if index:
        k, bound = int(index.group(1)), _compared_bound(comps, cond.group(1))
    elif carried:
        k, bound = carried[0], None
    else:
        return None
    if bound is None and carried and carried[0] == k and _kept(comps.get(body.group(1), []), carried[1]):
        bound = _start(caller, init.group(1), carried[1])
    start = _start(caller, init.group(1), k)
    if bound is None or start is None:
        return None
    if bound - start <= (1 if index else 0):
        return max(bound - start, 0)
    return bound - start if _adds_one(comps, comps.get(body.group(1), []), k) else None


def _root(lines: list[str]) -> str:
    return next((x for x in lines if x.lstrip().startswith("ROOT")), "")


def _compared_bound(comps: dict[str, list[str]], cond: str) -> int | None:
    """``N`` of a condition computation whose root is (a fusion of) ``compare(i, constant(N)), direction=LT``."""
    root = _root(comps[cond])
    callee = _CALLEES.search(root)
    where = comps.get(callee.group(1), []) if callee else comps[cond]
    constants = [int(c.group(1)) for x in where if " constant(" in x and (c := _CONSTANT.search(x))]
    compare = _root(where)
    return constants[0] if " compare(" in compare and "direction=LT" in compare and len(constants) == 1 else None


def _carried_bound(comps: dict[str, list[str]], cond: str) -> tuple[int, int] | None:
    """(k, j) of a condition computation whose root is (a fusion of) ``compare(a, b), direction=LT`` of its
    parameter's elements ``a`` = k and ``b`` = j: a loop that carries its bound."""
    lines = comps[cond]
    root = _root(lines)
    callee = _CALLEES.search(root)
    compare = _root(comps.get(callee.group(1), [])) if callee else root
    args = re.search(r"\s(?:fusion|compare)\(([^)]*)\)", root)
    if not (args and " compare(" in compare and "direction=LT" in compare):
        return None
    names = [a.strip().lstrip("%") for a in args.group(1).split(",")]
    if callee:  # the fusion's operands in the order its compare reads its parameters
        inner = comps.get(callee.group(1), [])
        order = re.search(r"compare\(([^)]*)\)", compare)
        numbers = [re.search(r"parameter\((\d+)\)", _defining(inner, a.strip().lstrip("%")) or "")
                   for a in (order.group(1).split(",") if order else [])]
        if len(numbers) != 2 or not all(numbers):
            return None
        names = [names[int(n.group(1))] for n in numbers if int(n.group(1)) < len(names)]
    elements = [_element(lines, _defining(lines, n) or "") for n in names]
    if len(elements) != 2 or None in elements:
        return None
    return elements[0], elements[1]


def _kept(body: list[str], j: int) -> bool:
    """Whether ``body``'s root tuple passes its parameter's element ``j`` through unchanged."""
    operands = re.search(r"\btuple\((.*?)\)", _root(body))
    names = operands.group(1).split(",") if operands else []
    return j < len(names) and _element(body, _defining(body, names[j].strip().lstrip("%")) or "") == j


def _element(lines: list[str], defined: str) -> int | None:
    """k where the instruction ``defined`` is ``get-tuple-element(p), index=k`` of ``lines``' parameter ``p``."""
    read = re.search(r"get-tuple-element\(%?([\w.\-]+)\).*?\bindex=(\d+)", defined)
    if not read or " parameter(0)" not in (_defining(lines, read.group(1)) or ""):
        return None
    return int(read.group(2))


def _start(caller: list[str], init: str, k: int) -> int | None:
    """The constant the while's init tuple ``init`` holds at index ``k`` (through copies), None otherwise."""
    operands = re.search(r"\btuple\((.*?)\)", _defining(caller, init) or "")
    if not operands:
        return None
    name = operands.group(1).split(",")[k].strip().lstrip("%")
    for _ in range(4):
        defined = _defining(caller, name) or ""
        if " constant(" in defined and (value := _CONSTANT.search(defined)):
            return int(value.group(1))
        copied = re.search(r"\bcopy\(%?([\w.\-]+)\)", defined)
        if not copied:
            return None
        name = copied.group(1)
    return None


def _uncopied(lines: list[str], name: str) -> str:
    """The instruction that defines ``%name``, through copies."""
    defined = _defining(lines, name) or ""
    for _ in range(4):
        copied = re.search(r"\bcopy\(%?([\w.\-]+)\)", defined)
        if not copied:
            break
        defined = _defining(lines, copied.group(1)) or ""
    return defined


def _adds_one(comps: dict[str, list[str]], body: list[str], k: int) -> bool:
    """Whether ``body``'s root tuple holds at index ``k`` its parameter's element ``k`` (through copies) plus 1: an
    ``add``, or a fusion of one with the 1 inside it or as its other operand."""
    operands = re.search(r"\btuple\((.*?)\)", _root(body))
    if not operands:
        return False
    update = _defining(body, operands.group(1).split(",")[k].strip().lstrip("%")) or ""
    args = re.search(r"\s(?:add|fusion)\(([^)]*)\)", update)
    if not args:
        return False
    names = [a.strip().lstrip("%") for a in args.group(1).split(",")]
    reads_k = any(_element(body, _uncopied(body, n)) == k for n in names)
    if " fusion(" in update:
        callee = _CALLEES.search(update)
        where = comps.get(callee.group(1), []) if callee else []
        inside = [x for x in where if " constant(1)" in x]  # the 1 fused in, or passed as the other operand
        outside = [n for n in names if " constant(1)" in (_defining(body, n) or "")]
        added = re.search(r"\sadd\(([^)]*)\)", _root(where))
        summands = [_defining(where, a.strip().lstrip("%")) or "" for a in added.group(1).split(",")] if added else []
        plain = len(summands) == 2 and all(" parameter(" in x or " constant(1)" in x for x in summands)
        one = (len(names), len(inside), len(outside)) in ((1, 1, 0), (2, 0, 1))
        return reads_k and plain and one
    return reads_k and any(" constant(1)" in (_defining(body, n) or "") for n in names)


@dataclasses.dataclass(frozen=True)
class Loop:
    """One ``while`` loop of a compiled program."""

    computation: str  # the computation the loop is in
    body: str  # its body's
    trips: int | None  # its trip count (XLA's, else read from the loop); None where neither says
    top: bool  # in the program's ENTRY computation


def loops(hlo: str) -> list[Loop]:
    """The ``while`` loops of a compiled HLO module's text, in the order of its text."""
    comps, entry = _computations(hlo)
    out = []
    for name, lines in comps.items():
        for line in lines:
            instr = _INSTR.match(line)
            if instr and instr.group(4) == "while":
                trip = _TRIP.search(line)
                out.append(Loop(name, re.search(r"\bbody=%?([\w.\-]+)", line).group(1),
                                int(trip.group(1)) if trip else _counted_trip(comps, lines, line), name == entry))
    return out


def _multiplicities(comps: dict[str, list[str]], entry: str) -> dict[str, int]:
    """How often each computation runs per program call (while bodies times their trip counts: XLA's, else
    ``_counted_trip``'s)."""
    mult: dict[str, int] = collections.defaultdict(int)

    def visit(name: str, times: int) -> None:
        mult[name] += times
        for line in comps.get(name, []):
            instr = _INSTR.match(line)
            if not instr:
                continue
            opcode = instr.group(4)
            if opcode == "while":
                trip = _TRIP.search(line)
                count = int(trip.group(1)) if trip else _counted_trip(comps, comps[name], line)
                if count is None:
                    raise ValueError(f"while loop without a known trip count: {line.strip()[:120]}")
                body = re.search(r"\bbody=%?([\w.\-]+)", line).group(1)
                visit(body, times * count)
            elif opcode in ("call", "conditional", "async-start") or opcode.endswith("-start"):
                callees = _CALLEES.findall(line)
                branches = _BRANCHES.search(line)
                if branches:
                    callees += [b.strip().lstrip("%") for b in branches.group(1).split(",")]
                for callee in callees:
                    if callee in comps and not _is_reduction(comps[callee]):
                        visit(callee, times)

    visit(entry, 1)
    return mult


def _shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """Each (dtype, dims) an instruction's printed shape holds, in order."""
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _SHAPE.findall(text)]


def _is_reduction(lines: list[str]) -> bool:
    return len(lines) <= 4  # the to_apply of a collective: a scalar add/max, no collectives inside


def collectives(hlo: str, mesh: Mesh) -> list[Collective]:
    """Every collective operand in a compiled HLO module, with its mesh axes and executions per call."""
    comps, entry = _computations(hlo)
    mult = _multiplicities(comps, entry)
    n = mesh.devices.size
    out = []
    for comp, lines in comps.items():
        if not mult.get(comp):
            continue
        for line in lines:
            instr = _INSTR.match(line)
            if not instr:
                continue
            opcode = instr.group(4)
            base = opcode.removesuffix("-start")
            if base not in COLLECTIVE_OPS:
                continue
            shapes = _shapes(instr.group(3))
            if opcode.endswith("-start") and base in ("all-gather", "collective-permute", "all-to-all") \
                    and len(shapes) > 1:
                shapes = shapes[len(shapes) // 2:]  # (operands..., results...): keep the results
            if base == "ragged-all-to-all":  # what may leave: the operand, not the receive buffer nor the offsets
                if opcode.endswith("-start"):
                    shapes = shapes[:1]
                else:  # its operand's shape, from the instruction that defines it
                    first = re.match(r"\s*%?([\w.\-]+)", instr.group(5))
                    sent = _INSTR.match(_defining(lines, first.group(1)) or "") if first else None
                    shapes = (_shapes(sent.group(3)) if sent else shapes)[:1]
            group_size, cyclic = 1, False
            if base == "collective-permute":
                pairs = re.search(r"source_target_pairs=(\{[^ ]*\})", line)
                axes = _pairs_axes(pairs.group(1), mesh) if pairs else frozenset()
                if pairs:
                    ends = re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))
                    cyclic = {a for a, _ in ends} == {b for _, b in ends}
            else:
                text = re.search(r"replica_groups=(.*)", line)
                groups = _parse_groups(text.group(1), n) if text else [list(range(n))]
                group_size = len(groups[0])
                if group_size == 1:
                    continue
                axes = _axes_of(groups, mesh)
            op_name = _OP_NAME.search(line)
            name = op_name.group(1) if op_name else ""
            phase = "backward" if "transpose(" in name else "forward"
            for dt, shape in shapes:
                out.append(Collective(base, dt, shape, axes, mult[comp], phase, instr.group(2), group_size, cyclic,
                                      name))
    return out


def summary(colls: list[Collective]) -> dict[tuple[str, tuple[str, ...], str, int], int]:
    """``{(op, sorted axes, phase, elements): executions}`` summed over operands."""
    out: dict = collections.Counter()
    for c in colls:
        out[(c.op, tuple(sorted(c.axes)), c.phase, c.elements)] += c.executions
    return dict(out)


def format_table(colls: list[Collective]) -> str:
    """A human-readable table of the summary, largest first."""
    rows = sorted(summary(colls).items(), key=lambda kv: -kv[0][3] * kv[1])
    lines = [f"{'op':<20}{'axes':<16}{'phase':<10}{'elements':>12}{'runs':>7}"]
    lines += [f"{op:<20}{','.join(axes) or '-':<16}{phase:<10}{el:>12}{runs:>7}"
              for (op, axes, phase, el), runs in rows]
    return "\n".join(lines)
