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
        with self.path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut short when a run was killed mid-write
                    print(f"warning: {self.path}:{number}: unreadable record skipped (it will be redone)",
                          file=sys.stderr)
                    continue
                self.records[record_key(record["spec"], record["temperature"], record["prompt"])] = record

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
        with self.path.open("w", encoding="utf-8") as out:
            out.writelines(json.dumps(r, separators=(",", ":")) + "\n" for r in self.records.values())
        return dropped

    def check_settings(self, settings: dict, added: dict | None = None) -> None:
        """Record the run's settings, or refuse when the directory holds records made with others.
        `added`: settings newer than some runs, with the value a run.json without them was made with."""
        run_file = self.directory / RUN_FILE
        if run_file.is_file():
            stored = {**(added or {}), **json.loads(run_file.read_text())}
            changed = {k: (stored.get(k), v) for k, v in settings.items() if stored.get(k) != v}
            if changed and self.records:
                name, (before, now) = next(iter(changed.items()))
                raise SpecDecError(
                    f"{self.directory} holds records made with {name}={before!r}, not {now!r}; "
                    "pass another --out (or the same settings to resume)")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            run_file.write_text(json.dumps(settings, indent=1, sort_keys=True) + "\n")
        except OSError as exc:
            raise SpecDecError(f"--out {self.directory}: {exc.strerror or exc}") from None


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
