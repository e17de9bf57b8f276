"""The `cunorm` command's bench (bandwidth, per-call time, variants side by side, the plot) and tune (this GPU's table)."""
from __future__ import annotations

import json
import sys

import click

import cunorm.cli as cli

from ..bench import BENCH_OPS, BENCH_SIZES, DELTA_HEAD_DIMS
from ..search_space import OPS as TUNE_OPS, RESIDUAL as TUNE_RESIDUAL, SHAPES as TUNE_SHAPES, SIZES as TUNE_SIZES
from ..tune import ROUNDS as TUNE_ROUNDS


def _hidden_sizes(ctx, param, value):
    sizes = cli._csv(int)(ctx, param, value)
    if sizes and min(sizes) < 1:
        raise click.BadParameter(f"hidden sizes must be >= 1, got {min(sizes)}")
    return sizes


def _dtype(ctx, param, value):
    try:
        return None if value is None else cli._dtype_list(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


_BOOL_WORDS = {"1": True, "true": True, "0": False, "false": False}


def _traits_variants(ctx, param, values) -> dict:
    """--traits "warps_n=4,stages=3" (repeatable) as {label: knobs}, the label
    being the knobs spelled one way (booleans as 0/1), so that a repeat is one
    variant."""
    from ..traits import KNOB_DEFAULTS

    variants = {}
    for text in values:
        knobs = {}
        for item in text.split(","):
            name, sep, value = (part.strip() for part in item.partition("="))
            if not (name and sep and value):
                raise click.BadParameter(f"{text!r}: expected knob=value pairs separated by commas, "
                                         f"e.g. warps_n=4,stages=3")
            if name not in KNOB_DEFAULTS:
                raise click.BadParameter(f"unknown knob {name!r} in {text!r}; the knobs: {', '.join(KNOB_DEFAULTS)}")
            try:
                knobs[name] = (_BOOL_WORDS[value.lower()] if isinstance(KNOB_DEFAULTS[name], bool) else int(value))
            except (KeyError, ValueError):
                kind = "0 or 1" if isinstance(KNOB_DEFAULTS[name], bool) else "an integer"
                raise click.BadParameter(f"{name}={value}: expected {kind}") from None
        variants[",".join(f"{k}={int(v)}" for k, v in knobs.items())] = knobs
    return variants


def _op_names(choices, default=None):
    """An --ops callback: "fwd,bwd" --ops rms (comma-separated, repeatable) as names of `choices`, in order, once
    each; none given: `default` (None: all of them)."""
    def parse(ctx, param, values) -> tuple:
        names = [v.strip() for value in values for v in value.split(",") if v.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown:
            raise click.BadParameter(f"unknown op {unknown[0]!r}; expected some of {', '.join(choices)}")
        return tuple(dict.fromkeys(names)) or (tuple(choices) if default is None else default)
    return parse


def _plot(results: dict, path: str, saved: str | None = None):
    from ..plot import plot_bandwidth

    try:
        plot_bandwidth(results, path)
    except (ImportError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    except (KeyError, TypeError, AttributeError) as e:  # only a saved file can be malformed
        raise click.BadParameter(f"{saved}: not the results of cunorm bench ({type(e).__name__}: {e})",
                                 param_hint="--from-json") from None
    click.echo(f"plot written to {path}", err=True)


@cli.main.command()
@click.option("--sizes", default=",".join(map(str, BENCH_SIZES)), show_default=True, callback=_hidden_sizes,
              help="Hidden sizes, comma-separated ('' for none).")
@click.option("--head-dims", default=",".join(map(str, DELTA_HEAD_DIMS)), show_default=True, callback=cli._csv(int),
              help="attention_delta head dims, comma-separated ('' for none).")
@click.option("--ops", multiple=True, callback=_op_names(BENCH_OPS, default=()), metavar="OP[,OP...]",
              help=f"Ops to time: {', '.join(BENCH_OPS)} (comma-separated or repeatable; default: all, or with "
                   f"--source and --traits fwd, bwd, rms, rms-bwd).")
@click.option("--dtype", default="bfloat16", show_default=True, callback=_dtype, help="Activations' dtype.")
@click.option("--weight-dtype", default=None, callback=_dtype, help="Weights' dtype (default: the activations').")
@click.option("--repeat", type=click.IntRange(min=1), default=20, show_default=True, help="Timed batches per case.")
@click.option("--no-extras", is_flag=True, help="Skip the strided-row and odd-size comparisons.")
@click.option("--host", is_flag=True, help="Per-call host time of every op (CuPy arrays, torch tensors, torch's own "
              "op) at the host shapes, instead of bandwidth.")
@click.option("--kernel-time", is_flag=True, help="Time the kernels alone (calls queued while a spinning kernel "
              "holds the stream), not per call through the API: for the bandwidth sweep and --traits/--source.")
@click.option("--graph", is_flag=True, help="Bandwidth through the API beside CUDA-graph replay (torch tensors), "
              "instead of the bandwidth table.")
@click.option("--source", "source_file", type=click.Path(exists=True, dir_okay=False),
              help="An edited copy of kernels/norm_fwd.cu or norm_bwd.cu: a variant (\"edited\") timed beside the "
                   "shipped kernels (\"tuned\") at --sizes, for the direction it serves.")
@click.option("--traits", "traits", multiple=True, callback=_traits_variants, metavar="KNOB=V,...",
              help="Forced kernel traits, e.g. \"warps_n=4,stages=3\" (repeatable; knobs as in cunorm.Traits): a "
                   "variant timed beside the shipped dispatch (\"tuned\") at --sizes; skipped where illegal.")
@click.option("--rounds", type=click.IntRange(min=1),
              help="Rounds: of each case, interleaved, with --source or --traits (default 5); else of the whole "
                   "bandwidth sweep (default 1), each row then the median [min, max] of its rounds.")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False),
              help="Also draw fraction of copy against N to this .png or .svg file (needs cunorm[plot]).")
@click.option("--from-json", "from_json", type=click.Path(exists=True, dir_okay=False),
              help="Plot a saved run (what --output or --json wrote) to --plot instead of measuring; no GPU needed.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON (the table goes to stderr).")
@click.option("--output", type=click.Path(dir_okay=False), help="Also write the results as JSON to this file.")
@click.pass_context
def bench(ctx, sizes, head_dims, ops, dtype, weight_dtype, repeat, no_extras, host, kernel_time, graph, source_file,
          traits, rounds, plot_file, from_json, as_json, output):
    """Bandwidth (fraction of a same-run copy) and per-call time; --source and --traits time kernel variants
    beside the shipped ones (exit 3: no GPU)."""
    from .. import bench as b

    if host and graph:
        raise click.UsageError("--host and --graph are separate modes: give one")
    if kernel_time and (host or graph):
        raise click.UsageError("--kernel-time times the bandwidth sweep and variants, not --host or --graph")
    if (source_file or traits) and (host or graph):
        raise click.UsageError("--source and --traits time variants in the bandwidth sweep, not with --host or --graph")
    if rounds and (host or graph):
        raise click.UsageError("--rounds repeats the bandwidth sweep or the variants, not --host or --graph")
    if ops and (host or graph):
        raise click.UsageError("--ops picks the bandwidth sweep's ops, not --host's or --graph's")
    if ops == ("delta",) and (source_file or traits):
        raise click.UsageError("--source and --traits vary the norm kernels: give a norm op in --ops")
    if plot_file:  # refused before the sweep, not after it
        from ..plot import figure_class

        if host:
            raise click.BadParameter("--host measures time per call: no bandwidth to plot", param_hint="--plot")
        try:
            figure_class(plot_file)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--plot") from None
        except ImportError as e:
            raise click.ClickException(str(e)) from None
    if from_json:
        if not plot_file:
            raise click.UsageError("--from-json plots a saved run: give --plot FILE")
        try:
            with open(from_json) as f:
                results = json.load(f)
        except json.JSONDecodeError as e:
            raise click.BadParameter(f"{from_json}: not JSON ({e})", param_hint="--from-json") from None
        if not isinstance(results, dict):
            raise click.BadParameter(f"{from_json}: not the results of cunorm bench", param_hint="--from-json")
        _plot(results, plot_file, from_json)
        return
    source = directions = None
    if source_file:
        with open(source_file) as f:
            source = f.read()
        directions = b.served_directions(source)
        if not directions:
            raise click.BadParameter(f"{source_file}: defines neither norm_fwd nor norm_bwd", param_hint="--source")
        if ops and not any(d in directions for _, d in b.op_pairs(ops)):
            raise click.UsageError(f"--source {source_file} serves {'/'.join(directions)} only: --ops "
                                   f"{','.join(ops)} leaves nothing to time")
    if cli.gpu_missing(ctx.command_path, as_json, "--from-json FILE --plot FILE plots a saved run without one"):
        sys.exit(cli.EXIT_NO_GPU)
    out = sys.stderr if as_json else sys.stdout
    if source is not None or traits:
        given = {k: v for k, v in (("rounds", rounds), ("ops", ops)) if v}  # else compare's defaults
        results = b.compare(sizes, b.variants_of(source, traits), dtype, weight_dtype, repeat=max(repeat // 2, 5),
                            directions=directions or b.DIRECTIONS, out=out,
                            timing="kernel" if kernel_time else "api", **given)
    elif host:
        results = b.run_host(dtype=dtype, repeat=max(repeat // 3, 5), out=out)
    elif graph:
        results = b.run_graph(dtype=dtype, out=out)
    else:
        results = b.run(sizes, dtype, weight_dtype, repeat, out=out, head_dims=head_dims, extras=not no_extras,
                        ops=ops or None, timing="kernel" if kernel_time else "api", rounds=rounds or 1)
    if as_json:
        click.echo(json.dumps(results, indent=1))
    if output:
        with open(output, "w") as f:
            json.dump(results, f, indent=1)
    if plot_file:
        _plot(results, plot_file)


@cli.main.command()
@click.option("--sizes", default=",".join(map(str, TUNE_SIZES)), show_default=True, callback=_hidden_sizes,
              help="Hidden sizes to tune, comma-separated. A size that is not whole 16-byte vectors fills the "
                   "entry for the general rows beside its aligned neighbour.")
@click.option("--ops", multiple=True, callback=_op_names(TUNE_OPS), metavar="OP[,OP...]",
              help=f"Ops to tune: {', '.join(TUNE_OPS)} (LayerNorm and RMSNorm, forward and backward; "
                   f"comma-separated or repeatable; default all four).")
@click.option("--residual", type=click.Choice(list(TUNE_RESIDUAL)), default="no", show_default=True,
              help="Residual variants (forward with a residual, backward with dresidual): no (without), yes (with), "
                   "both.")
@click.option("--dtypes", "dtype_names", default="bf16", show_default=True, callback=cli._csv(cli._dtype_list),
              help="Input dtypes (fp32, fp16, bf16), comma-separated. Entries are keyed by element bytes: of "
                   "fp16 and bf16 the first named is measured, for both.")
@click.option("--budget", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
              help="Stop after this many seconds, keeping the keys finished (run again to go on).")
@click.option("--rounds", type=click.IntRange(min=1), default=TUNE_ROUNDS, show_default=True,
              help="Interleaved timing rounds of each key's finalists; the best median wins.")
@click.option("--output", type=click.Path(dir_okay=False),
              help="The table to write (default: this GPU's user table, which dispatch reads first, in "
                   "$CUNORM_CACHE_DIR, else $XDG_CACHE_HOME/cunorm or ~/.cache/cunorm).")
@click.option("--fresh", is_flag=True, help="Measure keys already in the table again (its other entries stay).")
@click.option("--warps-n", callback=cli._csv(int),
              help=f"WARPS_N values to try, comma-separated (default: {','.join(map(str, TUNE_SHAPES['warps_n']))}, and "
                   f"for a backward the others that split its row into whole loads a thread).")
@click.option("--json", "as_json", is_flag=True, help="Print each key's result as a JSON object on stdout, as it is "
              "saved (the rest goes to stderr).")
@click.pass_context
def tune(ctx, sizes, ops, residual, dtype_names, budget, rounds, output, fresh, warps_n, as_json):
    """Measure candidate traits per hidden size, op and dtype on this GPU and save the fastest that pass the
    float64 check to its tuned table, after every key (a rerun skips the keys done). Exit 1: a key without a
    passing candidate; 3: no GPU."""
    from .. import tune as t

    if not sizes:
        raise click.BadParameter("give at least one hidden size", param_hint="--sizes")
    if not dtype_names:
        raise click.BadParameter("give at least one dtype", param_hint="--dtypes")
    if cli.gpu_missing(ctx.command_path, as_json):
        sys.exit(cli.EXIT_NO_GPU)
    summary = t.run(sizes, ops, TUNE_RESIDUAL[residual], dtype_names, output, rounds=rounds, budget=budget,
                    fresh=fresh, warps_n=warps_n, as_json=as_json, out=sys.stderr if as_json else sys.stdout)
    sys.exit(cli.EXIT_FAIL if summary["failed"] else 0)
