"""HTML building blocks of the report page: tables, rows and cells, every text escaped.

A cell's text comes from logs, which are anyone's input: each helper escapes what it is given,
except ``td``, whose caller passes HTML it built from escaped parts.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from compare.render import xml_safe


def table(table_id: str, columns: Sequence[str], rows: Sequence[str]) -> str:
    head = "".join(f"<th>{escape(column)}</th>" for column in columns)
    attrs = f' id="{escape(table_id)}"' if table_id else ""
    return f"<table{attrs}><tr>{head}</tr>\n" + "\n".join(rows) + "</table>"


def tr(*cells: str, row_id: str = "", row_class: str = "") -> str:
    """A row of ``cells`` (``<td>`` elements). Pure."""
    attrs = f' id="{escape(row_id)}"' if row_id else ""
    attrs += f' class="{escape(row_class)}"' if row_class else ""
    return f"<tr{attrs}>{''.join(cells)}</tr>"


def td(inner: str) -> str:
    """A cell holding ``inner``, HTML the caller escaped. Pure."""
    return f"<td>{inner}</td>"


def num(value: object) -> str:
    """A right-aligned number cell. Pure."""
    return f'<td class="n">{escape(value)}</td>'


def code(text: str) -> str:
    """A cell holding ``text`` as code. Pure."""
    return f"<td><code>{escape(text)}</code></td>"


def escape(text: object) -> str:
    """``text`` as HTML text or an attribute value: markup escaped, and each character XML
    cannot hold written as its escape (the page stays well-formed). Pure."""
    return html.escape(xml_safe(str(text)), quote=True)
