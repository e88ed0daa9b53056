"""The KV page layout and the only code that reads or writes it.

One tensor per tier holds every page::

    kv_pages[page, layer, kv, kv_head, slot, head_dim]      kv: 0 = K, 1 = V

A page is outermost, so one page of every layer is one contiguous chunk (a
host <-> GPU copy of a page is a single slice); a slot is inside the kv head,
so one page of one kv head's keys is one contiguous ``[page_size, head_dim]``
block, in the order attention reads keys (a decode gathers blocks, not rows).
A sequence's page table ``page_ids`` maps its token positions to slots:

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

import numpy as np
import torch
from torch import Tensor

from batchgen.config import ModelConfig, pages_needed

K_INDEX, V_INDEX = 0, 1


def kv_page_shape(config: ModelConfig, page_size: int, num_pages: int) -> tuple[int, ...]:
    """Shape of a tier's page tensor: ``[num_pages, num_layers, 2, num_kv_heads, page_size,
    head_dim]``."""
    return (num_pages, config.num_layers, 2, config.num_kv_heads, page_size, config.head_dim)


def page_size_of(kv_pages: Tensor) -> int:
    """Slots per page of a tier's page tensor. Pure."""
    return kv_pages.shape[4]


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

    Pure read: returns fresh tensors.
    """
    num_kv_heads, head_dim = kv_pages.shape[3], kv_pages.shape[5]
    k, v = (
        kv_pages[:, layer, kv]
        .index_select(0, page_ids)
        .transpose(1, 2)
        .reshape(-1, num_kv_heads, head_dim)
        for kv in (K_INDEX, V_INDEX)
    )
    return k, v


def block_rows(kv_pages: Tensor, page_table: Tensor) -> Tensor:
    """Where the K and V blocks of the page tables ``page_table`` [B, P] live: ``[num_layers, 2,
    B, kv_heads, P]`` rows of ``kv_pages`` seen as rows of one ``[page_size, head_dim]`` block
    (``gather_blocks`` reads a layer's). Pure."""
    _, num_layers, _, num_kv_heads = kv_pages.shape[:4]
    device = page_table.device
    blocks_per_page = num_layers * 2 * num_kv_heads
    # layer l, K or V, kv head h: (2 * l + kv) * kv_heads + h blocks into the page
    layer_kv = torch.arange(num_layers * 2, device=device).view(num_layers, 2, 1, 1, 1)
    heads = torch.arange(num_kv_heads, device=device).view(1, 1, 1, num_kv_heads, 1)
    offsets = layer_kv * num_kv_heads + heads
    return (page_table * blocks_per_page)[None, None, :, None, :] + offsets


def gather_blocks(kv_pages: Tensor, rows: Tensor, out: Tensor) -> Tensor:
    """K and V blocks at ``rows`` [2, B, kv_heads, P] (a layer of ``block_rows``) into ``out``,
    returned as ``[2, B, kv_heads, P * page_size, head_dim]``: each (row, kv head) one contiguous
    matrix of keys, key t at position t of the row's page table, as attention reads it best.
    Reads ``kv_pages``; mutates ``out`` (``rows.numel() * page_size * head_dim`` elements of the
    pages' dtype, so one buffer serves every layer)."""
    block = page_size_of(kv_pages) * kv_pages.shape[5]
    flat = out[: rows.numel() * block].view(-1, block)
    torch.index_select(kv_pages.view(-1, block), 0, rows.view(-1), out=flat)
    return flat.view(*rows.shape[:3], -1, kv_pages.shape[5])


def gather_kv(
    kv_pages: Tensor, page_ids: Sequence[int], num_tokens: int, layer: int
) -> tuple[Tensor, Tensor]:
    """K and V of positions ``[0, num_tokens)`` of one layer, each ``[num_tokens, num_kv_heads,
    head_dim]``.

    Pure read of ``kv_pages``.
    """
    page_size = page_size_of(kv_pages)
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
    """Each ``(page_ids, start_pos, new_kv)`` of ``writes`` as ``write_kv`` does it, in one write:
    float32 or bfloat16 pages on a CPU by ``kv_write_kernel``, others by one indexed assignment.

    Mutates ``kv_pages`` at exactly the written slots; the writes must not share a slot.
    """
    page_size = page_size_of(kv_pages)
    tables, table_starts, starts, lengths = [], [], [], []
    for page_ids, start_pos, new_kv in writes:
        _check_covered(page_ids, start_pos + new_kv.shape[2], page_size)
        table_starts.append(len(tables))
        tables.extend(page_ids)
        starts.append(start_pos)
        lengths.append(new_kv.shape[2])
    new_kvs = torch.cat([new_kv for _, _, new_kv in writes], dim=2)
    if kv_pages.device.type == "cpu" and kv_pages.dtype in (torch.float32, torch.bfloat16):
        # imported here: numba loads only where pages are float32 or bfloat16 on a CPU
        from batchgen.model.kv_write_kernel import write_runs

        runs = (np.array(values, dtype=np.int64) for values in (tables, table_starts, starts))
        new_kvs = new_kvs.to(device="cpu", dtype=kv_pages.dtype)
        pages = kv_pages
        if kv_pages.dtype == torch.bfloat16:  # numpy has none: both go as their bits
            pages, new_kvs = kv_pages.view(torch.int16), new_kvs.view(torch.int16)
        write_runs(pages.numpy(), new_kvs.numpy(), *runs, np.array(lengths, dtype=np.int64))
    else:
        _write_indexed(kv_pages, new_kvs, tables, table_starts, starts, lengths)


def _write_indexed(
    kv_pages: Tensor,
    new_kvs: Tensor,
    tables: list[int],
    table_starts: list[int],
    starts: list[int],
    lengths: list[int],
) -> None:
    """``kv_write_kernel.write_runs``'s writes as one advanced-index assignment of torch's, on any
    device and dtype. Mutates ``kv_pages`` at exactly those slots."""
    page_size, device, num_slots = page_size_of(kv_pages), kv_pages.device, sum(lengths)
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
    # Advanced indices on dims 0 and 4 put the token dim first: [n, layers, 2, heads, dim].
    kv_pages[slots.page_index, :, :, :, slots.slot_index] = new_kvs.permute(2, 0, 1, 3, 4).to(
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
