"""What the rule processor remembers between batches about what it decided.

Two things, both bounded and both about one entity at one time (its ``entity_field`` and ``time_field``):

* **One path per entity window**: each window is remembered with how it was decided — by the model (a
  prediction) or without it (the window alone, at degradation L2/L3) — and a record of the same window on the
  other path is not decided again (a late prediction of a window decided at L2, say).
* **Repeats and cooldowns**: a rule fires on an entity window once (a duplicate is held back), and an action
  type fires on an entity at most once per cooldown of event time.

Nothing here reads a clock or a service: the processor asks and counts what was held back.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Literal

#: Entity windows remembered for one path per window (the oldest forgotten first).
DECIDED_MAX = 200_000

HeldBack = Literal["duplicate", "cooldown"]


class DecisionMemory:
    """The entity windows decided and the firings made, as the processor's batches left them."""

    def __init__(self, windows_max: int = DECIDED_MAX):
        self.windows_max = windows_max
        self._decided: OrderedDict[tuple[str, int], bool] = OrderedDict()  # entity window → decided by the model?
        self._last_fired: dict[tuple[str, str], int] = {}  # (entity, action) → time of the last firing
        self._fired_windows: dict[tuple[str, str], int] = {}  # (entity, rule) → time it last fired on

    @property
    def windows(self) -> int:
        """Entity windows remembered as decided."""
        return len(self._decided)

    def claim(self, windows: Iterable[tuple[str, int]], by_model: bool) -> tuple[list[int], int]:
        """The indexes of ``windows`` (entity, time) to decide on this path, each now remembered as decided on it,
        and how many were skipped as already decided on the other one."""
        decided, todo, skipped = self._decided, [], 0
        for i, key in enumerate(windows):
            before = decided.get(key)
            if before is not None and before != by_model:
                skipped += 1
                continue
            decided[key] = by_model
            todo.append(i)
        while len(decided) > self.windows_max:
            decided.popitem(last=False)
        return todo, skipped

    def held_back(self, rule: str, action: str, entity: str, end: int, cooldown_ms: int) -> HeldBack | None:
        """Why a firing of ``rule`` (of ``action``) on ``entity`` at ``end`` is held back, or ``None``: it fires,
        and is remembered."""
        if self._fired_windows.get((entity, rule)) == end:
            return "duplicate"
        last = self._last_fired.get((entity, action))
        if last is not None and 0 <= end - last < cooldown_ms:
            return "cooldown"
        self._last_fired[(entity, action)] = end
        self._fired_windows[(entity, rule)] = end
        return None


__all__ = ["DECIDED_MAX", "DecisionMemory", "HeldBack"]
