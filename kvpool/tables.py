"""Terminal tables that fit the terminal: a table too wide for it leaves out its least needed columns.

Contract:
    * ``Col(head, justify, keep)``: one column; ``keep`` ranks how much it is needed (0: always shown;
      higher numbers are left out first when the table does not fit).
    * ``fitted(cols, rows, width, title, note)``: a Rich ``Table`` of ``rows`` (lists of cell strings,
      one per column; ``None`` ends a section) whose narrowest rendering fits ``width`` characters:
      columns are left out, highest ``keep`` first, until it does (or only ``keep`` 0 ones are left).
      Right-justified cells (numbers) and heads never wrap (a head may hold a line break);
      left-justified ones wrap at spaces. The caption names the left-out columns and ``note`` (where the full table
      is, e.g. the CSV).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.table import Table

#: A wrapping (left-justified) column is at least as wide as its longest cell, up to this.
MIN_TEXT_CHARS = 18


@dataclass(frozen=True)
class Col:
    head: str
    justify: str = "right"
    keep: int = 0


def _min_chars(c: Col, cells: list[str]) -> int:
    """A column's narrowest width: its longest cell and head line (right-justified), or its longest
    cell up to ``MIN_TEXT_CHARS`` (left-justified)."""
    if c.justify == "right":
        return max([*map(len, c.head.splitlines() or [""]), *map(len, cells)])
    head = max((len(w) for w in c.head.split()), default=0)
    return max(head, min(max(map(len, cells), default=0), MIN_TEXT_CHARS))


def _one_line(head: str) -> str:
    return head.replace("-\n", "").replace("/\n", "/").replace("\n", " ")


def _build(cols: Sequence[Col], rows: Sequence[Sequence[str] | None], idx: list[int], title: str,
           caption: str) -> tuple[Table, int]:
    """The table of columns ``idx`` and the width of its narrowest rendering."""
    t = Table(title=title or None, caption=caption or None, caption_justify="left")
    body = [r for r in rows if r is not None]
    need = 1
    for i in idx:
        c = cols[i]
        chars = _min_chars(c, [r[i] for r in body])
        need += chars + 3  # a space each side and a border
        t.add_column(c.head, justify=c.justify, overflow="fold", no_wrap=c.justify == "right", min_width=chars)
    for r in rows:
        if r is None:
            t.add_section()
        else:
            t.add_row(*[r[i] for i in idx])
    return t, need


def fitted(cols: Sequence[Col], rows: Sequence[Sequence[str] | None], width: int, title: str = "",
           note: str = "") -> Table:
    idx = list(range(len(cols)))
    dropped: list[str] = []
    droppable = sorted((i for i, c in enumerate(cols) if c.keep > 0), key=lambda i: (-cols[i].keep, -i))
    while _build(cols, rows, idx, title, "")[1] > width and droppable:
        i = droppable.pop(0)
        idx.remove(i)
        dropped.insert(0, _one_line(cols[i].head))
    caption = ""
    if dropped:
        caption = f"left out to fit {width} columns: {', '.join(dropped)}" + (f" ({note})" if note else "")
    return _build(cols, rows, idx, title, caption)[0]
