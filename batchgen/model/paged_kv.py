"""The KV page layout and the only code that reads or writes it.

One tensor per tier holds every page::

    kv_pages[page, layer, kv, slot, kv_head, head_dim]      kv: 0 = K, 1 = V

A page is outermost, so one page of every layer is one contiguous chunk (a
host <-> GPU copy of a page is a single slice). A sequence's page table
``page_ids`` maps its token positions to slots:

    positions                     | page            | slot
    ------------------------------+-----------------+--------------
    [0, page_size)                | page_ids[0]     | p
    [page_size, 2 * page_size)    | page_ids[1]     | p - page_size
    p                             | page_ids[p // page_size] | p % page_size
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from batchgen.config import ModelConfig, pages_needed

K_INDEX, V_INDEX = 0, 1


def kv_page_shape(config: ModelConfig, page_size: int, num_pages: int) -> tuple[int, ...]:
    """Shape of a tier's page tensor: ``[num_pages, num_layers, 2, page_size, num_kv_heads,
    head_dim]``."""
    return (num_pages, config.num_layers, 2, page_size, config.num_kv_heads, config.head_dim)


@dataclass(frozen=True, slots=True)
class KVSlots:
    """Where a set of token positions lives: two index tensors of the same shape."""

    page_index: Tensor  # page of each position (an entry of the page table)
    slot_index: Tensor  # slot of each position inside its page


def page_table_tensor(page_ids: Sequence[int], device: torch.device) -> Tensor:
    """A page table as an int64 tensor on ``device``."""
    return torch.as_tensor(page_ids, dtype=torch.int64, device=device)


def locate_slots(page_table: Tensor, positions: Tensor, page_size: int) -> KVSlots:
    """Slots of ``positions`` [..., T] given ``page_table`` [..., num_table_pages] (same leading
    dims).

    Pure; positions must lie inside the pages the table covers.
    """
    return KVSlots(page_table.gather(-1, positions // page_size), positions % page_size)


def gather_pages(kv_pages: Tensor, page_ids: Tensor, layer: int) -> tuple[Tensor, Tensor]:
    """K and V of one layer of whole pages ``page_ids`` [n], each ``[n * page_size, num_kv_heads,
    head_dim]``: slot s of ``page_ids[i]`` is row ``i * page_size + s``, unwritten slots included.

    Pure read: returns fresh tensors. A page of one layer's K (or V) is one contiguous block, so
    this copies blocks, not slots.
    """
    num_kv_heads, head_dim = kv_pages.shape[4:]
    k, v = (
        kv_pages[:, layer, kv].index_select(0, page_ids).view(-1, num_kv_heads, head_dim)
        for kv in (K_INDEX, V_INDEX)
    )
    return k, v


def slot_rows(kv_pages: Tensor, page_table: Tensor, positions: Tensor) -> Tensor:
    """Where the K and V of positions ``positions`` [B, T] of the page tables ``page_table``
    [B, pages] live: ``[num_layers, 2, B, kv_heads, T]`` rows of ``kv_pages`` seen as rows of
    ``head_dim`` (``gather_slots`` reads a layer's). Pure."""
    _, num_layers, _, page_size, num_kv_heads, _ = kv_pages.shape
    device = page_table.device
    pages = page_table.gather(1, positions // page_size)
    slots = (pages * (num_layers * 2 * page_size) + positions % page_size) * num_kv_heads
    # layer l, K or V, kv head h: (2 * l + kv) * page_size * num_kv_heads + h rows further on
    layer_kv = torch.arange(num_layers * 2, device=device).view(num_layers, 2, 1, 1, 1)
    heads = torch.arange(num_kv_heads, device=device).view(1, 1, 1, num_kv_heads, 1)
    offsets = layer_kv * (page_size * num_kv_heads) + heads
    return slots[None, None, :, None, :] + offsets


def gather_slots(kv_pages: Tensor, rows: Tensor, out: Tensor) -> Tensor:
    """K and V at ``rows`` [2, B, kv_heads, T] (a layer of ``slot_rows``) into ``out``, returned as
    ``[2, B, kv_heads, T, head_dim]``: each (row, kv head) one contiguous matrix of keys, as
    attention reads it best (a view of whole pages strides over the other heads). Reads
    ``kv_pages``; mutates ``out`` (``rows.numel() * head_dim`` elements of the pages' dtype, so
    one buffer serves every layer)."""
    head_dim = kv_pages.shape[-1]
    flat = out[: rows.numel() * head_dim].view(-1, head_dim)
    torch.index_select(kv_pages.view(-1, head_dim), 0, rows.view(-1), out=flat)
    return flat.view(*rows.shape, head_dim)


def gather_kv(
    kv_pages: Tensor, page_ids: Sequence[int], num_tokens: int, layer: int
) -> tuple[Tensor, Tensor]:
    """K and V of positions ``[0, num_tokens)`` of one layer, each ``[num_tokens, num_kv_heads,
    head_dim]``.

    Pure read of ``kv_pages``.
    """
    page_size = kv_pages.shape[3]
    num_pages = _check_covered(page_ids, num_tokens, page_size)
    table = page_table_tensor(page_ids[:num_pages], kv_pages.device)
    k, v = gather_pages(kv_pages, table, layer)
    return k[:num_tokens], v[:num_tokens]


def write_kv(kv_pages: Tensor, page_ids: Sequence[int], start_pos: int, new_kv: Tensor) -> None:
    """Write ``new_kv`` [num_layers, 2, n, num_kv_heads, head_dim] into positions ``[start_pos,
    start_pos + n)``.

    Mutates ``kv_pages`` at exactly those n slots of every layer, nothing else.
    ``new_kv`` is converted to the pages' dtype and device.
    """
    write_kvs(kv_pages, [(page_ids, start_pos, new_kv)])


def write_kvs(kv_pages: Tensor, writes: Sequence[tuple[Sequence[int], int, Tensor]]) -> None:
    """Each ``(page_ids, start_pos, new_kv)`` of ``writes`` as ``write_kv`` does it, in one write.

    Mutates ``kv_pages`` at exactly the written slots; the writes must not share a slot.
    """
    page_size, device = kv_pages.shape[3], kv_pages.device
    tables, table_starts, starts, lengths = [], [], [], []
    for page_ids, start_pos, new_kv in writes:
        _check_covered(page_ids, start_pos + new_kv.shape[2], page_size)
        table_starts.append(len(tables))
        tables.extend(page_ids)
        starts.append(start_pos)
        lengths.append(new_kv.shape[2])
    num_slots = sum(lengths)
    lengths_tensor = torch.tensor(lengths, device=device)
    # position in the concatenated page tables, i.e. its table's first slot plus its position
    first_slots = torch.tensor(table_starts, device=device) * page_size + torch.tensor(
        starts, device=device
    )
    row_starts = torch.tensor([0, *itertools.accumulate(lengths)][:-1], device=device)
    flat_positions = torch.arange(num_slots, device=device) + (
        first_slots - row_starts
    ).repeat_interleave(lengths_tensor, output_size=num_slots)
    slots = locate_slots(page_table_tensor(tables, device), flat_positions, page_size)
    new_kvs = torch.cat([new_kv for _, _, new_kv in writes], dim=2)
    # Advanced indices on dims 0 and 3 put the token dim first: [n, layers, 2, heads, dim].
    kv_pages[slots.page_index, :, :, slots.slot_index] = new_kvs.permute(2, 0, 1, 3, 4).to(
        device=device, dtype=kv_pages.dtype
    )


def _check_covered(page_ids: Sequence[int], num_positions: int, page_size: int) -> int:
    """The number of pages that hold ``num_positions`` positions; ValueError if ``page_ids`` has
    fewer. Pure."""
    num_needed = pages_needed(num_positions, page_size)
    if len(page_ids) < num_needed:
        raise ValueError(
            f"page table of {len(page_ids)} pages covers {len(page_ids) * page_size} positions; "
            f"{num_positions} positions need {num_needed} pages of {page_size}"
        )
    return num_needed
