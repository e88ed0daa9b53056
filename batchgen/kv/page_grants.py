"""What a page pool refuses: shared by a pool and compare mode's forks of it.

A grant is (owner, the page ids it is given). A pool takes a plan's grants only when every id is
an int, in range, free and named once across them all (:func:`check_grants`); otherwise nothing
is taken and :class:`PageOwnershipError` names the first refused grant.
"""

from __future__ import annotations

from collections.abc import Sequence


class OutOfPages(RuntimeError):
    """An allocation asked for more pages than the pool has free."""


class PageOwnershipError(ValueError):
    """Pages named for an owner are not free, unknown, or owned twice.

    ``reason`` says which (the message without the pool's name), ``index`` is the refused grant's
    position in the grants given, ``page_id`` the first bad id in it.
    """

    def __init__(self, pool_name: str, reason: str, index: int, page_id: int, part: str = "new"):
        super().__init__(f"{pool_name}: {reason}")
        self.reason = reason
        self.index = index
        self.page_id = page_id
        self.part = part  # which ids of the grant: "new" pages, or cached pages "shared"


Grants = Sequence[tuple[str, Sequence[int]]]  # (owner, the page ids it is given), in order


def refused_grant(pool, grants: Grants) -> PageOwnershipError | None:
    """The error naming the first grant whose ids are not all in range, free in ``pool``, and named
    once (within it, or by an earlier grant); None when every grant is good. Pure."""
    earlier: set[int] = set()
    for index, (_, page_ids) in enumerate(grants):
        not_int = next((page_id for page_id in page_ids if type(page_id) is not int), None)
        if not_int is not None:
            return PageOwnershipError(
                pool.name, f"page id {not_int!r} is not an int", index, not_int
            )
        if len(set(page_ids)) != len(page_ids):
            duplicate = next(p for i, p in enumerate(page_ids) if p in page_ids[:i])
            return PageOwnershipError(
                pool.name, f"page ids {list(page_ids)} name a page twice", index, duplicate
            )
        for page_id in page_ids:
            if not 0 <= page_id < pool.num_pages:
                return PageOwnershipError(
                    pool.name,
                    f"page {page_id} is out of range [0, {pool.num_pages})",
                    index,
                    page_id,
                )
            if page_id in earlier:
                return PageOwnershipError(
                    pool.name, f"page {page_id} is granted twice", index, page_id
                )
            if not pool.is_free(page_id):
                return PageOwnershipError(pool.name, f"page {page_id} is not free", index, page_id)
        earlier.update(page_ids)
    return None


def check_grants(pool, grants: Grants) -> None:
    """Raise the error of :func:`refused_grant` unless every grant is good. Pure."""
    error = refused_grant(pool, grants)
    if error is not None:
        raise error


def check_can_allocate(pool, n: int) -> None:
    """ValueError for a negative ``n``, OutOfPages when ``pool`` has fewer than ``n`` pages free.
    Pure."""
    if n < 0:
        raise ValueError(f"{pool.name}: cannot allocate {n} pages")
    if n > pool.num_free:
        raise OutOfPages(f"{pool.name}: {n} pages requested, {pool.num_free} free")


def refused_share(pool, grants: Grants) -> PageOwnershipError | None:
    """The error naming the first share grant whose ids are not all ints in range, pages with a
    digest (held, or a free cache entry), named once within it, and not held by its owner yet;
    None when every one is good. Pure."""
    for index, (uuid, page_ids) in enumerate(grants):
        held = set(pool.pages_of(uuid))
        for i, page_id in enumerate(page_ids):
            if type(page_id) is not int:
                reason = f"page id {page_id!r} is not an int"
            elif not 0 <= page_id < pool.num_pages:
                reason = f"page {page_id} is out of range [0, {pool.num_pages})"
            elif pool.digest_of(page_id) is None:
                reason = f"page {page_id} holds no cached prefix (it has no digest)"
            elif page_id in held or page_id in page_ids[:i]:
                reason = f"page {page_id} would be named twice in {uuid}'s page table"
            else:
                continue
            return PageOwnershipError(pool.name, reason, index, page_id, part="shared")
    return None


def check_shares(pool, grants: Grants) -> None:
    """Raise the error of :func:`refused_share` unless every share grant is good. Pure."""
    error = refused_share(pool, grants)
    if error is not None:
        raise error


SharedGrants = Sequence[tuple[str, Sequence[int], Sequence[int]]]  # (owner, shared ids, new ids)


def check_shared_grants(pool, grants: SharedGrants) -> None:
    """Raise the first :class:`PageOwnershipError` of ``grants`` (owner, cached page ids to share,
    new page ids): shares as :func:`refused_share` checks them, new ids as :func:`refused_grant`
    does, and no new id among the pages shared. Pure."""
    check_shares(pool, [(uuid, shared) for uuid, shared, _ in grants])
    new_grants = [(uuid, new) for uuid, _, new in grants]
    check_grants(pool, new_grants)
    shared_ids = {page_id for _, shared, _ in grants for page_id in shared}
    for index, (_, new) in enumerate(new_grants):
        for page_id in new:
            if page_id in shared_ids:
                reason = f"page {page_id} is granted new and shared as a cached page"
                raise PageOwnershipError(pool.name, reason, index, page_id)
