"""Per-prompt records on disk, so an interrupted `specdec bench` picks up where it stopped.

`records.jsonl` holds one JSON object per finished generation, appended and flushed as soon as it
exists; its key is (policy spec, temperature, prompt index). `run.json` holds the settings every
record depends on (models, formats, head, token budget, prompt set, seed, threads); a rerun with
other settings in the same directory is refused instead of mixing incomparable records.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from specdec.errors import SpecDecError
from specdec.files import write_atomically
from specdec.metrics import RequestStats

RECORDS_FILE, RUN_FILE = "records.jsonl", "run.json"

RecordKey = tuple[str, str, int]  # (spec key, temperature as %g, prompt index)


def temperature_key(temperature: float) -> str:
    return f"{temperature:g}"


def record_key(spec: str, temperature: float, prompt: int) -> RecordKey:
    return (spec, temperature_key(temperature), prompt)


def divergence_key(spec: str, prompt: int) -> str:
    """A greedy output's entry in notes.json's `divergences` (runner.first_divergence)."""
    return f"{spec}#{prompt}"


class RecordStore:
    """The records of one output directory: load what is there, append what is new."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.path = self.directory / RECORDS_FILE
        self.records: dict[RecordKey, dict] = {}
        if self.path.is_file():
            self._load()

    def _load(self) -> None:
        text = self.path.read_text(encoding="utf-8")
        torn = not text.endswith("\n") and bool(text)
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short when a run was killed mid-write
                print(f"warning: {self.path}:{number}: unreadable record skipped (it will be redone)", file=sys.stderr)
                torn = True
                continue
            self.records[record_key(record["spec"], record["temperature"], record["prompt"])] = record
        if torn:  # rewritten whole, so that the next record does not go on the end of a cut one
            self._rewrite()

    def _rewrite(self) -> None:
        write_atomically(self.path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in self.records.values()))

    def __contains__(self, key: RecordKey) -> bool:
        return key in self.records

    def __len__(self) -> int:
        return len(self.records)

    def get(self, key: RecordKey) -> dict | None:
        return self.records.get(key)

    def append(self, record: dict) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(record, separators=(",", ":")) + "\n")
            out.flush()
        self.records[record_key(record["spec"], record["temperature"], record["prompt"])] = record

    def drop_incomplete_prompts(self) -> list[RecordKey]:
        """Drop the records of prompts that fewer specs finished than the most complete prompt at
        their temperature (the prompt in flight when a run was stopped), and rewrite the file, so a
        run resumed on another machine redoes each prompt whole. Returns (temperature, prompt) of
        those dropped."""
        per_prompt = Counter((t, prompt) for _, t, prompt in self.records)
        full = Counter()
        for (t, _), count in per_prompt.items():
            full[t] = max(full[t], count)
        dropped = sorted(key for key, count in per_prompt.items() if count < full[key[0]])
        self.records = {k: r for k, r in self.records.items() if (k[1], k[2]) not in dropped}
        self._rewrite()
        return dropped

    def check_settings(self, settings: dict, added: dict | None = None) -> None:
        """Record the run's settings, or refuse when the directory holds records made with others.
        `added`: settings newer than some runs, with the value a run.json without them was made with."""
        run_file = self.directory / RUN_FILE
        if run_file.is_file():
            stored = {**(added or {}), **read_json(run_file)}
            changed = {k: (stored.get(k), v) for k, v in settings.items() if stored.get(k) != v}
            if changed and self.records:
                name, (before, now) = next(iter(changed.items()))
                raise SpecDecError(
                    f"{self.directory} holds records made with {name}={before!r}, not {now!r}; "
                    "pass another --out (or the same settings to resume)")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_atomically(run_file, json.dumps(settings, indent=1, sort_keys=True) + "\n")
        except OSError as exc:
            raise SpecDecError(f"--out {self.directory}: {exc.strerror or exc}") from None


def read_json(path: Path) -> dict:
    """A run's JSON file (run.json, notes.json), or a one-line error where it does not parse (one
    cut short by a run killed while writing it, before these were written atomically)."""
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        found = None
    if not isinstance(found, dict):
        raise SpecDecError(f"{path} is not a JSON object (cut short?): delete it to go on with this run's "
                           "settings, or pass another --out")
    return found


def stats_from_dict(data: dict) -> RequestStats:
    """The inverse of RequestStats.to_dict for the counted fields (rates are derived again)."""
    stats = RequestStats()
    for name in ("generated_tokens", "draft_forward_passes", "target_forward_passes", "rounds", "draft_tokens",
                 "accepted_tokens", "discarded_tokens", "draft_time_s", "target_time_s", "wall_time_s",
                 "transport_time_s", "transport_bytes"):
        setattr(stats, name, data.get(name, 0))
    stats.drafted_per_position = list(data.get("drafted_per_position", []))
    stats.accepted_per_position = list(data.get("accepted_per_position", []))
    stats.k_histogram = Counter({int(k): v for k, v in data.get("k_histogram", {}).items()})
    return stats
