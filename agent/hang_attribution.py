"""Who broke the job: one reason from every rank's stack at a hang verdict (pure).

Input: a :class:`RankStack` per rank of the round (what its agent read of
its dump, its step, how long ago it last made progress); output: one line
that names the rank and the place to look. The rules, in order:

1. No rank answered: "no rank's stack could be read".
2. Every rank answered and all wait in the same collective: "all N ranks
   wait in all_reduce (step S): likely a network or peer problem; the last
   to enter was rank R (node n)" (all at one place outside a collective:
   "all N ranks are in <place> (step S)"). The last to enter is the rank that
   enqueued the collective last by torch's flight recorder where it runs,
   else the rank that made progress most recently (its step ended last); it
   is left out when neither is known.
3. Otherwise the majority is the largest group of ranks doing the same thing
   (waiting in one collective, or else at one place; of groups as large, one
   waiting in a collective); the ranks outside it are
   the odd ones out, named with their node and place (a rank that did not
   answer is "frozen: stopped, or stuck in the kernel"): "rank 5 (node c) is
   in train.py:88 in next_batch while the 7 others wait in all_reduce (step
   1234)". With no majority (every rank elsewhere), each rank's place is listed.

At most :data:`MAX_NAMED` odd ranks are named; the rest are counted.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass

from elastic.records import cap_text

MAX_NAMED = 3
MAX_ATTRIBUTION_CHARS = 600


@dataclass(frozen=True)
class RankStack:
    """What one rank was doing when its agent asked (``dumped`` False: it did
    not answer). ``place`` is its innermost user frame, ``collective`` the
    ``torch.distributed`` call it was in ("" if none), ``progress_age_s`` how
    long before the dump it last made progress (-1: never, or not known)."""

    rank: int
    node_id: str
    dumped: bool
    place: str = ""
    collective: str = ""
    step: int = -1
    progress_age_s: float = -1.0
    # When it entered the collective in flight (wall clock, ns, from torch's
    # flight recorder; 0: not known).
    entered_ns: int = 0

    def doing(self) -> str:
        """What the rank does, as a group key: its collective, else its place."""
        if not self.dumped:
            return ""
        return f"wait in {self.collective}" if self.collective else f"are in {self.place}"

    def where(self) -> str:
        if not self.dumped:
            return "did not answer (frozen: stopped, or stuck in the kernel)"
        if self.collective:
            return f"waits in {self.collective} ({self.place})"
        return f"is in {self.place}"


class HangKind(enum.StrEnum):
    """Which rule named the culprit: the ``kind`` label of
    ``elasticd_hang_attributions`` (:mod:`agent.metrics`), bounded."""

    RANK_ELSEWHERE = "rank_elsewhere"  # odd ranks out, each at its place or collective
    RANK_FROZEN = "rank_frozen"  # an odd rank out did not answer (stopped, in the kernel)
    ALL_IN_COLLECTIVE = "all_in_collective"  # a network or peer problem
    ALL_AT_ONE_PLACE = "all_at_one_place"
    SCATTERED = "scattered"  # each rank elsewhere
    NO_STACKS = "no_stacks"  # nothing to compare


@dataclass(frozen=True)
class Attribution:
    """The one line that names who broke the job, and the rule that wrote it."""

    reason: str
    kind: HangKind


def attribute(ranks: list[RankStack]) -> Attribution:
    """The attribution of the module's rules for ``ranks`` (any order; none:
    an empty reason)."""
    reason, kind = _attribution(sorted(ranks, key=lambda r: r.rank))
    return Attribution(cap_text(reason, MAX_ATTRIBUTION_CHARS), kind)


def _attribution(ranks: list[RankStack]) -> tuple[str, HangKind]:
    answered = [r for r in ranks if r.dumped]
    if not answered:
        return (f"no rank's stack could be read ({len(ranks)} asked)" if ranks else "",
                HangKind.NO_STACKS)
    groups = Counter(r.doing() for r in answered)
    # The largest group; of groups as large, one waiting in a collective (its
    # ranks wait for the others: they are where a healthy rank would be).
    doing, size = max(groups.items(), key=lambda g: (g[1], g[0].startswith("wait in")))
    if len(ranks) == 1:
        only = ranks[0]
        return (f"rank {only.rank} (node {only.node_id}) {only.where()}{_step_of(ranks)}",
                HangKind.RANK_ELSEWHERE)
    if size == len(ranks):
        if answered[0].collective:
            return _all_in(answered), HangKind.ALL_IN_COLLECTIVE
        return f"all {len(ranks)} ranks {doing}{_step_of(ranks)}", HangKind.ALL_AT_ONE_PLACE
    if size == 1 and not doing.startswith("wait in"):
        listed = "; ".join(f"rank {r.rank} (node {r.node_id}) {r.where()}" for r in ranks)
        return f"the ranks are each elsewhere: {listed}", HangKind.SCATTERED
    majority = [r for r in answered if r.doing() == doing]
    odd = [r for r in ranks if r not in majority]
    kind = HangKind.RANK_FROZEN if any(not r.dumped for r in odd) else HangKind.RANK_ELSEWHERE
    return _odd_ones(odd, majority, doing), kind


def _step_of(ranks: list[RankStack]) -> str:
    step = max((r.step for r in ranks), default=-1)
    return f" (step {step})" if step >= 0 else ""


def _all_in(ranks: list[RankStack]) -> str:
    collective = ranks[0].collective
    line = (f"all {len(ranks)} ranks wait in {collective}{_step_of(ranks)}: likely a network "
            "or peer problem")
    entered = [r for r in ranks if r.entered_ns > 0]
    known = [r for r in ranks if r.progress_age_s >= 0]
    if entered:
        last = max(entered, key=lambda r: (r.entered_ns, -r.rank))
    elif known:
        last = min(known, key=lambda r: (r.progress_age_s, r.rank))
    if entered or known:
        line += f"; the last to enter was rank {last.rank} (node {last.node_id})"
    return line


def _odd_ones(odd: list[RankStack], majority: list[RankStack], doing: str) -> str:
    named = "; ".join(f"rank {r.rank} (node {r.node_id}) {r.where()}" for r in odd[:MAX_NAMED])
    more = f"; and {len(odd) - MAX_NAMED} more ranks elsewhere" if len(odd) > MAX_NAMED else ""
    others = "the other rank" if len(majority) == 1 else f"the {len(majority)} others"
    verb = doing.replace("are in", "is in") if len(majority) == 1 else doing
    verb = verb.replace("wait in", "waits in") if len(majority) == 1 else verb
    return f"{named}{more} while {others} {verb}{_step_of(majority)}"
