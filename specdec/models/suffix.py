"""The suffix draft (`--draft suffix`): a draft without a model, which proposes the continuation of
the session's last tokens where they occurred before in its own prompt and output.

Each session keeps a `SuffixIndex` of its committed tokens: every context of 1 .. MAX_ORDER + 1
tokens that was followed by a token, with how often it was and where it last was. Appending a token
registers the contexts that end just before it (O(MAX_ORDER) = O(1) a token, by rolling hashes); a
round walks forward from the longest context (up to MAX_ORDER) of the history's end that occurred
before (prompt lookup decoding and llama.cpp's n-gram drafts do the same walk over a shorter
context), and follows that earlier text on as a copy while no longer context occurs elsewhere. Where
several occurrences are as long, the walk starts at the one nearest past where the target last took
a candidate (`SuffixIndex.nearest`): an edit returns its source in order.

A candidate's acceptance estimate comes from the match's statistics: how long the copy it continues
is and how often it followed its context (`MatchStats`), calibrated online on what the target made
of the draft's earlier walks (shared by the draft's sessions: rates by bucket, no tokens). The
estimates stand where an acceptance head's would (`MatchHead`), so the SpecDec++ rule and the step's
budget price and stop a suffix round as any draft's (specdec/proposers.py `SuffixProposer`).

Its q is one-hot: the candidate is a function of the history. Sampled verification then accepts
y with probability min(1, p(y) / 1) = p(y) and on a rejection draws from norm(max(0, p - q)), p
without y: the target's distribution, as for any draft (specdec/verification.py).
"""

from __future__ import annotations

import bisect
import random
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from specdec.errors import ModelSourceError
from specdec.models.runtime import DraftRole, Feed, PassOutputs

SUFFIX = "suffix"  # the draft source that names it (--draft suffix, --also-draft NAME=suffix)
FUSED = SUFFIX + "+"  # "suffix+SOURCE": the suffix draft fused with the model draft SOURCE (proposers.py `FusedProposer`)
MAX_ORDER = 16  # the longest context matched, in tokens
MAX_RUN = 64  # the longest copy a walk's estimates tell apart, in tokens
NEAR = 256  # how far past where its last copy was followed a walk looks for its source first, in tokens
# The cache of earlier responses (`SuffixDraft.remember`), opted into per request and kept per
# API key (services/auth.py `cache_scope`): at most this many tokens of each key's responses
# (~2 KB a token in the index), for at most this many keys, the least recently used dropped first.
CACHE_TOKENS = 1 << 15
CACHE_SCOPES = 8

_MODULUS = (1 << 61) - 1  # a Mersenne prime: contexts' hashes collide with probability ~1e-18
_BASE = random.Random(20261205).randrange(1 << 40, _MODULUS)
_POWERS = [pow(_BASE, k, _MODULUS) for k in range(MAX_ORDER + 2)]
# (a token hashes as its id + 1: a leading id 0 would otherwise hash a context as its shorter tail)
_POSITION_BITS = 32  # a table entry packs (count << 32) | the position of the last continuation
_POSITION_MASK = (1 << _POSITION_BITS) - 1


def is_suffix_draft(source: str) -> bool:
    return source == SUFFIX


def fused_with(source: str) -> str | None:
    """The model draft a fused source ("suffix+SOURCE") names, or None where it names no fused draft."""
    if not source.startswith(FUSED):
        return None
    model = source[len(FUSED):]
    if not model or is_suffix_draft(model) or model.startswith(FUSED):
        raise ModelSourceError(f"draft {source!r}: a fused draft is suffix+SOURCE, SOURCE a model draft")
    return model


@dataclass
class Match:
    """The longest context of a sequence's end that was followed before, and what followed it last."""

    order: int  # the context's length in tokens
    token: int  # the token that followed it last: the candidate
    frequency: float  # of the times the context was followed, the share followed by `token`
    position: int = 0  # where the candidate is in the index's tokens
    pair: int = field(default=0, compare=False)  # the hash of the context followed by `token` (`follow`)


class SuffixIndex:
    """A session's committed tokens and every context of 1 .. MAX_ORDER + 1 tokens among them that
    was followed by a token: its hash -> how often, and where its last continuation is."""

    def __init__(self):
        self.tokens: list[int] = []
        self._table: dict[int, int] = {}
        # where each document starts: no context reaches before its document's start, and no copy
        # runs on past its document's end
        self._starts = [0]
        # the contexts each document but the last ends with (hash -> how many): a candidate that
        # ends a document was not followed by a token, yet it followed its context (`_followed`)
        self._ends: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def add_document(self, tokens: list[int]) -> None:
        """`tokens` as a text of their own: no context spans the end of the one before and them."""
        seq, end, start = self.tokens, len(self.tokens), self._starts[-1]
        if end > start:  # the document before ends here
            h = 0
            for n in range(1, min(MAX_ORDER + 1, end - start) + 1):
                h = (h + (seq[end - n] + 1) * _POWERS[n - 1]) % _MODULUS
                self._ends[h] = self._ends.get(h, 0) + 1
            self._starts.append(end)
        self.extend(tokens)

    def documents(self) -> list[list[int]]:
        """Its documents' tokens, in order."""
        bounds = self._starts + [len(self.tokens)]
        return [self.tokens[start:end] for start, end in zip(bounds, bounds[1:]) if end > start]

    def start_of(self, position: int) -> int:
        """Where the document holding `position` starts."""
        return self._starts[bisect.bisect_right(self._starts, position) - 1]

    def goes_on(self, position: int) -> bool:
        """Whether the token after `position` continues its document (a copy may go on to it)."""
        return position + 1 < len(self.tokens) and self.start_of(position + 1) <= position

    def extend(self, tokens: list[int]) -> None:
        table, seq, floor = self._table, self.tokens, self._starts[-1]
        for token in tokens:
            position = len(seq)  # the contexts ending at position - 1 are followed by `token`
            h = 0  # (contexts one longer than matched are kept too: how often a match was followed by its candidate)
            for n in range(1, min(MAX_ORDER + 1, position - floor) + 1):
                h = (h + (seq[position - n] + 1) * _POWERS[n - 1]) % _MODULUS
                table[h] = (((table.get(h, 0) >> _POSITION_BITS) + 1) << _POSITION_BITS) | position
            seq.append(token)

    def sync(self, history: list[int]) -> None:
        """Hold exactly `history`: appended where it extends what is held, else built again (a
        committed token taken back: a rebuilt session)."""
        held = len(self.tokens)
        if len(history) < held or history[:held] != self.tokens:
            self.tokens, self._table, self._starts, self._ends = [], {}, [0], {}
            held = 0
        self.extend(history[held:])

    def match(self, tail: list[int]) -> Match | None:
        """The longest context ending `tail` (its last MAX_ORDER tokens at most) that was followed
        before, or None where not even its last token was."""
        table, h, found, order = self._table, 0, 0, 0
        for n in range(1, min(MAX_ORDER, len(tail)) + 1):
            h = (h + (tail[-n] + 1) * _POWERS[n - 1]) % _MODULUS
            entry = table.get(h)
            if entry is None:  # a context not followed before: no longer one was either
                break
            found, order, context = entry, n, h
        if not order:
            return None
        return self._followed(context, order, found & _POSITION_MASK, found >> _POSITION_BITS)

    def follow(self, tail: list[int], order: int, position: int, after: Match | None = None) -> Match:
        """The token at `position` as the candidate after `tail`'s last `order` tokens, which the
        tokens before `position` end with: a copy followed on, or an occurrence other than the last.
        `after`: the candidate `tail` ends with, where its context and it are at least `order`
        tokens (a copy going on): the context's hash is theirs less its oldest tokens."""
        if after is not None and after.order + 1 >= order:
            h = after.pair
            for n in range(order + 1, after.order + 2):
                h = (h - (tail[-n] + 1) * _POWERS[n - 1]) % _MODULUS
        else:
            h = 0
            for n in range(1, order + 1):
                h = (h + (tail[-n] + 1) * _POWERS[n - 1]) % _MODULUS
        return self._followed(h, order, position, self._table.get(h, 0) >> _POSITION_BITS)

    def _followed(self, context: int, order: int, position: int, followed: int) -> Match:
        seq = self.tokens
        token = seq[position]
        # how often the context was followed by the token: the times the two were followed in turn,
        # the documents they end, and the sequence's end if they end it (nothing followed them there)
        pair = (token + 1 + _BASE * context) % _MODULUS
        last = self._table.get(context, 0) & _POSITION_MASK  # where the context was last followed
        extended = (self._table.get(pair, 0) >> _POSITION_BITS) + self._ends.get(pair, 0) + (
            last == len(seq) - 1 and seq[last] == token)
        return Match(order, token, min(1.0, extended / followed) if followed else 0.0, position, pair)

    def nearest(self, sequence: list[int], start: int) -> tuple[int | None, int]:
        """Where a copy of `sequence`'s end goes on within NEAR tokens from `start`: the position
        nearest `start` after the longest run equal to its end (`run`), and that run; (None, 0)
        where none of them follows its last token. An edit copies its source in order, so the
        source's next occurrence after the last copy is the likely one, not the text's last."""
        seq, last, best, where = self.tokens, sequence[-1], 0, None
        i, stop = max(start, 1) - 1, min(start + NEAR, len(seq)) - 1  # seq[i] == last, the candidate seq[i + 1]
        while i < stop:
            try:
                i = seq.index(last, i, stop)
            except ValueError:
                break
            if (length := self.run(sequence, [], i + 1)) > best:
                best, where = length, i + 1
            i += 1
        return where, best

    def run(self, sequence: list[int], drafted: list[int], position: int, cap: int = MAX_RUN) -> int:
        """How many tokens before `position` equal the end of `sequence` + `drafted`, up to `cap`:
        the length of the copy a walk follows, past the longest context the table matches."""
        tail, seq, length = (sequence[-cap:] + drafted)[-cap:], self.tokens, 0
        most = min(len(tail), position - self.start_of(position))  # within the candidate's document
        while length < most and seq[position - 1 - length] == tail[-1 - length]:
            length += 1
        return length


# Match statistics -> the acceptance estimate: buckets of the copy's length (the matched context,
# and past it as far as the walk's text equals the text before the candidate: a long copy goes on)
# and of how often the candidate followed the context; each bucket's rate of acceptance, starting
# from a prior and learning from what the target made of the walks (`MatchStats.learn`).
LENGTH_BUCKETS = (1, 2, 3, 4, 6, 9, 13, 17, 33)  # lower bounds
FREQUENCY_BUCKETS = (0.0, 0.34, 0.67, 0.999)  # lower bounds: the last is "always followed by it"
PRIOR_WEIGHT = 4.0  # the prior counts as this many verified candidates
STATS_WINDOW = 2000.0  # a bucket's counts are halved past this many candidates: recent walks weigh most


def _bucket(value: float, bounds: tuple) -> int:
    return max(0, bisect.bisect_right(bounds, value) - 1)


def prior_acceptance(length: int, frequency: float) -> float:
    """Before anything is verified: as often as the context was followed by the candidate, and the
    more likely the longer the copy is (a single shared token says little)."""
    return frequency * length / (length + 1.0)


@dataclass
class MatchStats:
    """The acceptance rate of candidates by match bucket, greedy and sampled apart (a sampled
    target accepts a one-hot candidate with probability p(y), below its greedy rate)."""

    accepted: dict[tuple, float] = field(default_factory=dict)
    verified: dict[tuple, float] = field(default_factory=dict)

    @staticmethod
    def bucket(length: int, frequency: float, greedy: bool) -> tuple:
        return (greedy, _bucket(length, LENGTH_BUCKETS), _bucket(frequency, FREQUENCY_BUCKETS))

    def estimate(self, length: int, frequency: float, greedy: bool) -> float:
        """A candidate's acceptance: its copy's `length`, how often it followed its context."""
        return self.judge(length, frequency, greedy)[0]

    def judge(self, length: int, frequency: float, greedy: bool) -> tuple[float, tuple]:
        """The estimate and the bucket it was read from."""
        key = self.bucket(length, frequency, greedy)
        prior = prior_acceptance(length, frequency)
        return ((self.accepted.get(key, 0.0) + PRIOR_WEIGHT * prior)
                / (self.verified.get(key, 0.0) + PRIOR_WEIGHT)), key

    def learn(self, buckets: list[tuple], accepted: int, shown: int) -> None:
        """A walk's candidates' buckets, how many the target took and how many its tokens reached:
        those taken, and the first not taken where they reach it."""
        for j, key in enumerate(buckets[:min(accepted + 1, shown)]):
            self.verified[key] = self.verified.get(key, 0.0) + 1.0
            self.accepted[key] = self.accepted.get(key, 0.0) + (j < accepted)
            if self.verified[key] > STATS_WINDOW:
                self.verified[key] /= 2
                self.accepted[key] /= 2


class SuffixSession:
    """A session of the suffix draft: its index, and its last walk (to learn what became of it)."""

    def __init__(self):
        self.index = SuffixIndex()
        # The cache of earlier responses it reads and, when it ends, adds its response to
        # (`SuffixDraft.remember`), or None; and its prompt's length (its response comes after).
        self.scope: str | None = None
        self.prompt_length = 0
        self.round_start = 0  # the history's length the last walk started after
        self.walk: list[int] = []  # its candidates, proposed or not
        self.buckets: list[tuple] = []  # each candidate's match bucket
        self.positions: list[int | None] = []  # where each candidate is in the index (None: the shared one)
        self.cursor: int | None = None  # in the index, just past the last candidate the target took

    def learn(self, history: list[int], stats: MatchStats) -> None:
        """What the target made of the last walk, into the estimates and the cursor."""
        if (outcome := self.outcome(history)) is None:
            return
        stats.learn(self.buckets, *outcome)
        if outcome[0] and self.positions[outcome[0] - 1] is not None:
            self.cursor = self.positions[outcome[0] - 1] + 1

    def outcome(self, history: list[int]) -> tuple[int, int] | None:
        """What the target made of the last walk, proposed or not: (how many of its candidates the
        tokens committed since its start took before the first they did not, how many of its
        candidates they reach), or None where they tell nothing (no token committed since, or the
        history taken back before it). A one-hot candidate is accepted exactly when the target's
        token is it, greedy or sampled (with probability p(y) then), so what a round verified and
        what the target decoded plainly past it are the same evidence."""
        start = self.round_start
        if not self.walk or len(history) <= start or history[:start] != self.index.tokens[:start]:
            return None
        shown = history[start:start + len(self.walk)]
        accepted = 0
        for y, token in zip(self.walk, shown):
            if y != token:
                break
            accepted += 1
        return accepted, len(shown)


@dataclass
class MatchHeadConfig:
    """What the policies read of a head's config."""

    judges_current: bool = True  # an estimate judges the candidate just drafted
    threshold: float | None = None  # no h of its own: specdec++ takes its default


class MatchHead:
    """The suffix draft's estimates where a policy reads a head: every step comes with its
    estimate (`DraftStep.judged`), so the head itself is never run."""

    config = MatchHeadConfig()

    def to(self, device) -> MatchHead:
        return self


class SuffixDraft(DraftRole):
    """The suffix draft where the rounds read a draft: sessions (`SuffixSession`) and the shared
    vocabulary, no passes (specdec/proposers.py `SuffixProposer` drafts)."""

    kind = "suffix"
    identity = name = SUFFIX
    forward_passes = 0
    model_free = True

    def __init__(self, vocab_size: int | None):
        """`vocab_size`: the target's rows, the width of its one-hot q's; None: unsized, as a served
        replica builds it (builder.py `SuffixDraftBackend.draft`: it reads nothing of the target) until
        the first call naming the target's width fits it (`fit_vocabulary`, workers.py `DraftWorker.fit`,
        which refuses a call naming none meanwhile). Nothing else it does reads the width: its walks
        and the start-up probe's are greedy, without q."""
        self._vocab_size = vocab_size
        self.stats = MatchStats()
        # scope -> the index of its earlier responses, the least recently used scope first
        self.cache: OrderedDict[str, SuffixIndex] = OrderedDict()

    def shared(self, scope: str | None) -> SuffixIndex | None:
        """The earlier responses of `scope` (None: the session reads none)."""
        index = self.cache.get(scope) if scope is not None else None
        if index is not None:
            self.cache.move_to_end(scope)
        return index

    def remember(self, scope: str, response: list[int]) -> None:
        """A session that ended adds its response to its scope's earlier responses: the most recent
        CACHE_TOKENS of each of the CACHE_SCOPES scopes used last are kept, each response a
        document of its own."""
        if not response:
            return
        index = self.cache.get(scope)
        if index is None:
            index = self.cache[scope] = SuffixIndex()
            while len(self.cache) > CACHE_SCOPES:
                self.cache.popitem(last=False)
        response = response[-(CACHE_TOKENS // 2):]
        if len(index) + len(response) > CACHE_TOKENS:  # built again from the newest responses, up to half
            kept, total = [], 0
            for document in reversed(index.documents()):
                if total + len(document) > CACHE_TOKENS // 2:
                    break
                kept.append(document)
                total += len(document)
            index = self.cache[scope] = SuffixIndex()
            for document in reversed(kept):
                index.add_document(document)
        index.add_document(response)
        self.cache.move_to_end(scope)

    @property
    def vocab_size(self) -> int | None:
        return self._vocab_size

    def fit_vocabulary(self, target_rows: int, tokens: int) -> None:
        """Its q (one-hot on a candidate, which its histories hold: an id the target has) at the
        target's width: the plain suffix draft's width (built unsized), or fused with a model draft
        fitted to a target of other rows (DraftRole.fit_vocabulary)."""
        self._vocab_size = target_rows

    @property
    def hidden_size(self) -> int:
        return 0

    @property
    def max_context(self) -> int:
        return 1 << 31  # no limit of its own: the target's holds

    def new_session(self) -> SuffixSession:
        return SuffixSession()

    def rollback(self, session: SuffixSession, length: int) -> None:
        if length < len(session.index):
            session.index.sync(session.index.tokens[:length])

    def _forward(self, feeds: list[Feed]) -> PassOutputs:
        raise NotImplementedError("the suffix draft runs no passes")

    def one_hot(self, token: int, device: torch.device | None = None) -> torch.Tensor:
        """q of a candidate, where a sampled verification reads it (on `device`: a fused draft's
        candidates' q all on the model's)."""
        q = torch.zeros(self._vocab_size, device=device)
        q[token] = 1.0
        return q
