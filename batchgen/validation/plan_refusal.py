"""One plan refusal of the catalog (``plan_refusals``): a malformed plan, the field its refusal
must name with its exact message, and the check that applies it to a fresh target."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from batchgen.kv.plan_checks import PlanRejected
from batchgen.kv.target import KvTarget
from batchgen.validation.plan_fixture import Application, make_target


@dataclass(frozen=True, slots=True)
class PlanRefusal:
    """One malformed plan: a stable id, what is wrong with it, and the refusal it must get."""

    id: str
    meaning: str
    apply: Application  # applies the plan to the target (PlanRejected when refused)
    field: str  # the field PlanRejected must name
    message: str  # what it must say after "field: "
    setup: Callable[[KvTarget], None] | None = None  # run on the fresh target first


def refusal(check_id, meaning, apply: Application, field, message, setup=None) -> PlanRefusal:
    """A refusal whose id is ``plan.`` + ``check_id``."""
    return PlanRefusal(f"plan.{check_id}", meaning, apply, field, message, setup)


def refusal_failure(check: PlanRefusal) -> str | None:
    """None when ``check``'s plan is refused naming its field with its message; else a line naming
    the check and what was accepted (or refused otherwise). Builds and mutates a target of its
    own."""
    target = make_target()
    if check.setup is not None:
        check.setup(target)
    try:
        check.apply(target)
    except PlanRejected as rejected:
        if rejected.field == check.field and str(rejected) == f"{check.field}: {check.message}":
            return None
        return (
            f"self-check {check.id}: {check.meaning} was refused as {rejected}, not as"
            f" {check.field}: {check.message}"
        )
    except Exception as error:  # refused, but not by the plan checks
        return (
            f"self-check {check.id}: {check.meaning} raised {type(error).__name__}: {error}"
            f" instead of PlanRejected naming {check.field}"
        )
    return f"self-check {check.id}: {check.meaning} was accepted; {check.field} must refuse it"
