"""The stand-in GPU the tier-A tests of `cunorm tune` and cunorm.tune run on (test_tune, test_tune_ranking,
test_table_ab): its calls report their own time (and advance a stand-in clock), its compiles report local
memory for planted knobs and its float64 check fails for planted knobs; the real code paths run around
them."""
import math

import pytest
from click.testing import CliRunner

from cunorm import bench, cli, compiler, search_space, tables, tune
from cunorm.compiler import Kernel

TUNE_OPTIONS = ("--sizes", "--ops", "--residual", "--dtypes", "--budget", "--rounds", "--output", "--fresh",
                "--warps-n", "--json")
GPU = tables.GPU("Stand-in GPU", 90, 132)
NBYTES, COPY = 10**9, 2e12  # the stand-in's bytes per call and copy bandwidth


def runner() -> CliRunner:
    """A runner whose result.stdout is stdout alone (click 8.1 mixes stderr in unless told not to)."""
    try:
        return CliRunner(mix_stderr=False)
    except TypeError:  # click 8.2+: always apart
        return CliRunner()


def fake_ms(knobs: dict) -> float:
    """The stand-in's milliseconds per call: fastest at WARPS_N=4, WARPS_M=2, one CTA a row, 16-byte loads
    and 3 stages, every knob weighing a little, so that candidates rarely tie."""
    return (1.0 + 0.1 * abs(math.log2(knobs["warps_n"]) - 2) + 0.05 * math.log2(knobs["ctas_per_row"])
            + 0.03 * abs(math.log2(knobs["warps_m"]) - 1) + 0.01 * (knobs["bytes_per_ldg"] != 16)
            + 0.003 * abs(knobs["stages"] - 3) + 0.0005 * knobs["stages"] + 0.001 * knobs["min_ctas_per_sm"]
            + 0.0003 * (not knobs["cache_weights"]) + 0.0001 * knobs["smem_accumulators"]
            + 0.00003 * (not knobs["recompute"]) + 0.00001 * (knobs.get("sum_chains", 1) - 1))


def frozen(knobs: dict) -> tuple:
    return tuple(sorted(knobs.items()))


def op_of(key: tables.Key) -> str:
    """The name bench.norm_cases gives the call a key is timed on."""
    return (f"{'rms_norm' if key.rms else 'layer_norm'}{'+residual' if key.residual else ''} "
            f"{'bwd' if key.backward else 'fwd'}")


class StandIn:
    """The stand-in GPU's state: the clock (a second per timed call), every timed call (op, N, dtype, knobs),
    every check (knobs), the planted knobs that spill or fail the check, and a size whose arrays are never
    made (the device is lost there)."""

    def __init__(self):
        self.now = 0.0
        self.ms = fake_ms  # (knobs) -> the call's milliseconds
        self.timed, self.checked = [], []
        self.spills = set()
        self.fails = lambda knobs: False
        self.lost_at = None

    def norm_cases(self, sizes, dtype, weight_dtype=None, ops=bench.PLAIN_OPS, directions=bench.DIRECTIONS,
                   native=False):
        for n in sizes:
            if n == self.lost_at:
                raise RuntimeError("the device is lost")
            for op in ops:
                for direction in directions:
                    def call(op=f"{op} {direction}", n=n, traits=None):
                        self.now += 1.0
                        self.timed.append((op, n, dtype, frozen(traits)))
                        return self.ms(traits)
                    yield bench.Case(f"{op} {direction}", n, NBYTES, call)

    def kernels_for(self, traits, device_id, source=None):
        local = 64 if frozen(traits.knobs()) in self.spills else 0
        return {"norm": Kernel(None, traits.threads_per_cta, 0, 1, GPU.sms, traits.ctas_per_row, GPU.sms, local)}

    def check_knobs(self, job, knobs):
        self.checked.append(frozen(knobs))
        return ["dx at 37 rows: rel-L2 1.0e-01 > 8e-03"] if self.fails(knobs) else []

    def timed_knobs(self, key: tables.Key, n: int, dtype: str) -> list:
        """The distinct knobs timed for a key, fastest first."""
        found = {k for op, m, d, k in self.timed if (op, m, d) == (op_of(key), n, dtype)}
        return sorted(found, key=lambda k: (fake_ms(dict(k)), k))


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """The stand-in GPU, its user table under tmp_path (CUNORM_CACHE_DIR)."""
    stand_in = StandIn()
    monkeypatch.setenv(tables.ENV_DIR, str(tmp_path / "cache"))
    monkeypatch.setattr(cli, "gpu_count", lambda: 1)
    monkeypatch.setattr(tune, "current_gpu", lambda: (0, 90, GPU))
    monkeypatch.setattr(tune, "clock", lambda: stand_in.now)
    monkeypatch.setattr(tune, "check_knobs", stand_in.check_knobs)
    monkeypatch.setattr(compiler, "kernels_for", stand_in.kernels_for)
    monkeypatch.setattr(compiler, "cuda_version", lambda: 12080)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: COPY)
    monkeypatch.setattr(bench, "median_ms", lambda fn, *args, **kwargs: fn())
    monkeypatch.setattr(bench, "norm_cases", stand_in.norm_cases)
    tables.forget()
    yield stand_in
    tables.forget()


def run_tune(*args):
    return runner().invoke(cli.main, ["tune", *args])


def saved(path=None) -> tables.Table:
    return tables.read(path or tables.user_path(GPU), GPU, "test")


def incumbent(n: int, op: str):
    """The traits that run the stand-in's call today (`op` a short name; `tune.what_runs`): here dispatch's pick."""
    backward, rms = search_space.OPS[op]
    return tune._incumbent(search_space.Job.of(n, "bfloat16", backward, rms), 90, GPU, 0)[0]


def seeds(n: int, op: str) -> list:
    """What a run adds to the stand-in's first round beside the candidates (take it before the run writes the
    user table): dispatch's pick and the other norm's (`tune.sibling_pick`), each also with pushed exchanges."""
    backward, rms = search_space.OPS[op]
    sibling = tune.sibling_pick(search_space.Job.of(n, "bfloat16", backward, rms), 90, GPU, 0)
    return [t for pick in (incumbent(n, op), sibling) if pick is not None
            for t in (pick, search_space.with_pushed_exchange(pick))]


def screenings(timed: set, shapes: set, ms=fake_ms) -> dict:
    """{knobs: how often screened} of the stand-in's timed knobs, `shapes` those of the first pass (the rest its
    extras): twice within SECOND_LOOK of the first pass's fastest, or for an extra of both passes' fastest."""
    first = min(ms(dict(k)) for k in timed & shapes)
    extras = min((ms(dict(k)) for k in timed - shapes), default=first)
    bar = {True: first * (1 + tune.SECOND_LOOK), False: min(first, extras) * (1 + tune.SECOND_LOOK)}
    return {k: 2 if ms(dict(k)) <= bar[k in shapes] else 1 for k in timed}


def measured_with(job, shapes: list, incumbent, rounds: int = 4) -> dict:
    """tune.measure's entry for `job` with dispatch's pick `incumbent` among `shapes`, as a run adds it."""
    shapes = shapes + [t for t in (incumbent,) if t not in shapes]
    return tune.measure(job, shapes, 0, 90, COPY, rounds, lambda _: None, print, incumbent=incumbent)
