"""Per-GPU tuned tables: knobs measured best on one GPU model, by `cunorm tune`.

Dispatch looks, in order, at the user's table for this GPU (written by
`cunorm tune` to the user cache folder: $CUNORM_CACHE_DIR, else
$XDG_CACHE_HOME/cunorm, else ~/.cache/cunorm), the table shipped for this GPU
model (cunorm/shipped_tables/*.json), the sm_90 literal in tuned.py, and the
heuristic (`cunorm.heuristic`); `cunorm.dispatch.choose` does the looking. A table is JSON:

    {"format": 1, "gpu": {"name": "NVIDIA H200", "cc": 90, "sms": 132},
     "cunorm": "0.1.0", "cuda": 13000,
     "entries": [{"backward": false, "rms": false, "residual": false, "n": 4096,
                  "input_bytes": 2, "general": false, "knobs": {"warps_n": 4, ...},
                  "fraction_of_copy": 0.89, "spread": [0.88, 0.90], "ms": 0.104}]}

A user table that cannot be read, is for another GPU or was measured with
another cunorm version (whose kernels may differ) is ignored with one warning.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import warnings
from pathlib import Path

from .traits import KNOB_DEFAULTS, KNOBS

FORMAT = 1
ENV_DIR = "CUNORM_CACHE_DIR"
SHIPPED_DIR = Path(__file__).resolve().parent / "shipped_tables"


class TableError(ValueError):
    """A table file that cannot be used (unreadable, malformed, another GPU or version)."""


@dataclasses.dataclass(frozen=True)
class GPU:
    """What a table is measured for: the device's name, compute capability and SM count."""

    name: str
    cc: int
    sms: int

    @classmethod
    def of_device(cls, device_id: int) -> "GPU":
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(device_id)
        name = props["name"]
        return cls(name.decode() if isinstance(name, bytes) else str(name), 10 * props["major"] + props["minor"],
                   props["multiProcessorCount"])

    def slug(self) -> str:
        return f"{re.sub(r'[^a-z0-9]+', '-', self.name.lower()).strip('-')}-sm{self.cc}-{self.sms}sms"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Key:
    """What an entry serves: direction, op, residual, hidden size, input element bytes, and whether
    it is for the general kernel's rows beside an aligned size."""

    backward: bool
    rms: bool
    residual: bool
    n: int
    input_bytes: int
    general: bool = False


_KEY_FIELDS = tuple(f.name for f in dataclasses.fields(Key))


@dataclasses.dataclass
class Table:
    gpu: GPU
    cunorm: str
    cuda: int
    entries: dict  # Key -> {"knobs": {knob: value}, and what was measured}
    origin: str = "user table"  # what dispatch and explain call it

    def knobs(self, key: Key) -> dict | None:
        entry = self.entries.get(key)
        return None if entry is None else dict(entry["knobs"])

    def put(self, key: Key, knobs: dict, **measured):
        self.entries[key] = {"knobs": dict(knobs), **measured}

    def merge(self, measured: "Table", kept) -> None:
        """A run's results into this table: each key `measured` holds takes its entry where `kept` (keys
        whose entry beat dispatch without tables) has it, and leaves this table where not; the rest stay.
        A table has one cunorm version (its entries' kernels), so the run must share it; the CUDA version
        becomes the run's."""
        if measured.cunorm != self.cunorm:
            raise TableError(f"cannot merge a run of cunorm {measured.cunorm} into a table of {self.cunorm}: "
                             "its other entries were measured with other kernels (tune them again)")
        for key, entry in measured.entries.items():
            if key in kept:
                self.entries[key] = entry
            else:
                self.entries.pop(key, None)
        self.cuda = measured.cuda

    def to_json(self) -> str:
        entries = [{**dataclasses.asdict(k), **v} for k, v in sorted(self.entries.items(), key=lambda kv: (
            kv[0].backward, kv[0].rms, kv[0].residual, kv[0].input_bytes, kv[0].general, kv[0].n))]
        return json.dumps({"format": FORMAT, "gpu": self.gpu.as_dict(), "cunorm": self.cunorm, "cuda": self.cuda,
                           "entries": entries}, indent=1)

    @classmethod
    def from_json(cls, text: str, origin: str = "user table") -> "Table":
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise TableError(f"format {raw.get('format')!r}, expected {FORMAT}")
            gpu = GPU(**raw["gpu"])
            entries = {}
            for e in raw["entries"]:
                key = Key(**{k: e[k] for k in _KEY_FIELDS if k in e})
                _check_types(key, e["knobs"])
                entries[key] = {k: v for k, v in e.items() if k not in _KEY_FIELDS}
            return cls(gpu, str(raw["cunorm"]), int(raw["cuda"]), entries, origin)
        except TableError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise TableError(f"malformed table ({type(e).__name__}: {e})") from None


def _check_types(key: Key, knobs) -> None:
    """TableError unless the key's fields and the knobs have their types (a string or a float there would
    never match, or fail deep inside dispatch)."""
    def check(what: str, value, flag: bool):
        if (type(value) is not bool) if flag else (type(value) is not int or value < 0):
            raise TableError(f"entry {key}: {what} must be {'true or false' if flag else 'a whole number'}, "
                             f"got {value!r}")

    for f in dataclasses.fields(Key):
        check(f.name, getattr(key, f.name), f.type == "bool")
    if not isinstance(knobs, dict) or set(knobs) - set(KNOBS):
        raise TableError(f"entry {key}: knobs must be a mapping of {', '.join(KNOBS)}")
    for name, value in knobs.items():
        check(f"knob {name}", value, isinstance(KNOB_DEFAULTS[name], bool))


def user_dir() -> Path:
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cunorm"


def user_path(gpu: GPU) -> Path:
    return user_dir() / f"tuned-{gpu.slug()}.json"


def new_table(gpu: GPU) -> Table:
    from . import __version__
    from .compiler import cuda_version

    return Table(gpu, __version__, cuda_version(), {})


def save(table: Table, path: Path | None = None) -> Path:
    """Writes `table` (atomically: a reader never sees half a file) to `path`, by default the user's table for
    its GPU (the one dispatch reads), and drops the tables and choices cached so far."""
    path = Path(path or user_path(table.gpu))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(table.to_json())
    os.replace(tmp, path)
    forget()
    return path


def read(path: Path, gpu: GPU, origin: str) -> Table:
    """The table at `path` for `gpu`; TableError if it is not usable there."""
    from . import __version__

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise TableError(f"cannot read it ({e.strerror})") from None
    table = Table.from_json(text, origin)
    if table.gpu != gpu:
        raise TableError(f"it is for {table.gpu.name} (sm_{table.gpu.cc}, {table.gpu.sms} SMs), not this GPU")
    if table.cunorm != __version__:
        raise TableError(f"it was measured with cunorm {table.cunorm}, this is {__version__} (run cunorm tune again)")
    return table


_warned: set = set()


def _user_table(gpu: GPU) -> Table | None:
    try:
        path = user_path(gpu)
    except RuntimeError:  # no home folder to find and no $CUNORM_CACHE_DIR: no user table
        return None
    return _usable(path, gpu, f"user table {path}")


def _usable(path: Path, gpu: GPU, origin: str) -> Table | None:
    """The table at `path`, or None where there is none or it cannot be used (with one warning)."""
    try:
        if not path.exists():
            return None
    except OSError:  # an unreadable folder holds no table we can use
        return None
    try:
        return read(path, gpu, origin)
    except TableError as e:
        if path not in _warned:
            _warned.add(path)
            warnings.warn(f"cunorm: ignoring the tuned table {path}: {e}", RuntimeWarning, stacklevel=4)
        return None


def shipped_gpus() -> list:
    """The GPU models cunorm ships a table for, as their tables name them."""
    return [Table.from_json(p.read_text(), "shipped").gpu for p in sorted(SHIPPED_DIR.glob("tuned-*.json"))]


def _shipped_table(gpu: GPU) -> Table | None:
    """The table shipped for this GPU model (same name, compute capability and SM count)."""
    return _usable(SHIPPED_DIR / f"tuned-{gpu.slug()}.json", gpu, f"shipped {gpu.name} table")


@functools.lru_cache(maxsize=None)
def tables_for(gpu: GPU | None) -> tuple:
    """The tables dispatch consults for `gpu`, in order (cached until `forget`)."""
    if gpu is None:
        return ()
    return tuple(t for t in (_user_table(gpu), _shipped_table(gpu)) if t is not None)


def forget():
    """Drops the cached tables (and the plans chosen from them) so that a new table is read."""
    tables_for.cache_clear()
    from . import plan

    plan.forget_choices()
