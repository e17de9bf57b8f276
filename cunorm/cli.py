"""The `cunorm` command: check (the correctness checker), info, list, bench, tune.

One style throughout: `--json` is a flag that prints JSON to stdout; a file is
asked for with `--output FILE`. Exit codes: 0 pass, 1 fail, 2 usage, 3 no GPU."""
from __future__ import annotations

import json
import sys

import click
import numpy as np

from . import dispatch, dtypes
from .dispatch import measured
from .bench import BENCH_SIZES, DELTA_HEAD_DIMS
from .tune import (OPS as TUNE_OPS, RESIDUAL as TUNE_RESIDUAL, ROUNDS as TUNE_ROUNDS, SHAPES as TUNE_SHAPES,
                   SIZES as TUNE_SIZES)

EXIT_FAIL, EXIT_NO_GPU = 1, 3
OP_NAMES = {"fwd": "layer_norm", "bwd": "layer_norm_backward", "rms": "rms_norm", "rms-bwd": "rms_norm_backward",
            "delta": "attention_delta"}


def _csv(kind):
    def parse(ctx, param, value):
        if value is None:
            return None
        try:
            return tuple(kind(v) for v in value.split(",") if v.strip())
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return parse


def _dtype_list(value: str) -> str:
    try:
        return dtypes.name_of(value.strip())
    except ValueError:
        raise ValueError(f"unknown dtype {value!r}; expected fp32, fp16 or bf16") from None


def _arch(value: str) -> int:
    from .compiler import arch_number

    try:
        return arch_number(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def gpu_missing(command: str, as_json: bool, hint: str = "") -> bool:
    """Whether there is no GPU; if so, says so (also as JSON on stdout with --json)."""
    if gpu_count():
        return False
    if as_json:
        print(json.dumps({"error": "no CUDA GPU found", "exit": EXIT_NO_GPU}))
    print(f"{command}: no CUDA GPU found" + (f" ({hint})" if hint else ""), file=sys.stderr)
    return True


def _gpu_of_arch(arch: int):
    """This machine's first GPU model (for its tuned tables) when it is of `arch`, else None."""
    if gpu_count() < 1:
        return None
    from .compiler import device_arch, device_gpu

    return device_gpu(0) if device_arch(0) == arch else None


def gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no driver, no device, or no CuPy
        return 0


@click.group()
@click.version_option(package_name="cunorm")
def main():
    """cunorm: row-wise normalization kernels for CuPy."""


@main.command()
@click.option("--sizes", callback=_csv(int), help="Hidden sizes, comma-separated (default: the tuned table "
              "plus a heuristic sample).")
@click.option("--rows", callback=_csv(int), help="Row counts, comma-separated (default: 1,37,4096).")
@click.option("--dtypes", "dtype_names", callback=_csv(_dtype_list), help="Input dtypes: fp32,fp16,bf16 (default all).")
@click.option("--op", "ops", type=click.Choice(list(OP_NAMES)), multiple=True,
              help="Only these ops (repeatable): LayerNorm fwd/bwd, RMSNorm rms/rms-bwd, attention delta.")
@click.option("--sweep", "sweeps", type=click.Choice(["tuned", "general", "flags", "pairwise"]), multiple=True,
              help="Only these sweeps (repeatable; default all): tuned (the dispatch table and a heuristic "
                   "sample), general (any N, row layouts, weight layouts, dtype mixes, in place), flags "
                   "(RMSNorm, residual, zero-centered weights), pairwise (every tensor's dtype and layout "
                   "drawn independently, all pairs covered).")
@click.option("--seed", type=int, default=None, help="Random seed (default: fresh).")
@click.option("--compile-only", is_flag=True, help="Compile every variant with NVRTC (no GPU) and report "
              "registers and spills.")
@click.option("--arch", default="sm_90", show_default=True, help="Target architecture for --compile-only.")
@click.option("--source", "source_file", type=click.Path(exists=True, dir_okay=False),
              help="An edited copy of kernels/norm_fwd.cu or norm_bwd.cu to check in place of the shipped one "
                   "(the ops it serves).")
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON.")
def check(sizes, rows, dtype_names, ops, sweeps, seed, compile_only, arch, source_file, as_json):
    """Check the kernels against the float64 reference (exit 0: all pass, 1: a failure, 3: no GPU)."""
    from .check import OPS, SWEEPS, default_cases, source_ops

    op_names = tuple(OP_NAMES[o] for o in ops) or OPS
    source = None
    if source_file:
        with open(source_file) as f:
            source = f.read()
        try:
            served = source_ops(source)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--source") from None
        op_names = tuple(o for o in op_names if o in served) or served
    if sizes and min(sizes) < 1:
        raise click.BadParameter(f"hidden sizes must be >= 1, got {min(sizes)}", param_hint="--sizes")
    cases = default_cases(sizes, rows or (1, 37, 4096), dtype_names or dtypes.NAMES, op_names,
                          sweeps=sweeps or SWEEPS)
    if compile_only:
        sys.exit(_compile_only(cases, _arch(arch), as_json, source))
    if gpu_missing("cunorm check", as_json, "use --compile-only to check compilation without one"):
        sys.exit(EXIT_NO_GPU)
    from .check import precompile, run_case

    rng = np.random.default_rng(seed)
    precompile(cases, source=source)
    results = []
    with click.progressbar(cases, label="checking", file=sys.stderr) as bar:
        for case in bar:
            results += run_case(case, rng, source)
    failed = [r for r in results if not r.ok]
    if as_json:
        click.echo(json.dumps({"results": [r.as_dict() for r in results], "failed": len(failed)}, indent=1))
    else:
        click.echo(f"{'case':<100} {'output':<12} {'rel-L2':>10} {'tol':>8}  result")
        for r in results:
            click.echo(f"{r.case.label():<100} {r.output:<12} {r.error:>10.2e} {r.tolerance:>8.0e}  "
                       f"{'PASS' if r.ok else 'FAIL'}")
        click.echo(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    sys.exit(EXIT_FAIL if failed else 0)


def _compile_only(cases, arch, as_json, source=None) -> int:
    """Compiles every distinct variant the cases run on `arch` and says, of
    each, what happened: compiled clean, compiled with spills (a failure for a
    tuned entry; a heuristic last resort may spill), refused (dispatch has no
    legal traits there: not compiled, so not a pass), or failed to compile.
    Exit 1 when anything failed or nothing compiled."""
    from .check import case_kernels
    from .compiler import CompileError, compile_only

    rows, reports = [], {}

    def report_of(traits):  # compiled once, whether asked for by the spill fallback or by the loop
        if traits not in reports:
            try:
                reports[traits] = compile_only(traits, arch, source)
            except (CompileError, ValueError) as e:
                reports[traits] = e
        return reports[traits]

    def spills(traits) -> bool:
        report = report_of(traits)
        return not isinstance(report, Exception) and not report.clean

    variants = list(case_kernels(cases, arch, None if source is not None else spills))
    with click.progressbar(variants, label=f"compiling for sm_{arch}", file=sys.stderr) as bar:
        for traits, origin in bar:
            if isinstance(traits, ValueError):
                rows.append({"source": origin, "verdict": "refused", "error": str(traits)})
                continue
            row = {"label": traits.short(), "traits": traits.knobs(), "source": origin,
                   "kernels": sorted(traits.launches())}
            report = report_of(traits)
            if isinstance(report, Exception):
                rows.append({**row, "verdict": "failed", "error": str(report)})
                continue
            spills = not report.clean
            verdict = "clean" if not spills else "failed: a tuned entry spills" if measured(origin) else "spills"
            rows.append({**row, "verdict": verdict, "spills": spills,
                         "spill_bytes": sum(f.spill_stores + f.spill_loads for f in report.functions),
                         "functions": [f.__dict__ for f in report.functions]})
    count = lambda pred: sum(1 for r in rows if pred(r["verdict"]))  # noqa: E731
    summary = {"compiled": count(lambda v: v != "refused" and v != "failed"), "refused": count(lambda v: v == "refused"),
               "spilled": sum(1 for r in rows if r.get("spills")), "failed": count(lambda v: v.startswith("failed"))}
    failed = summary["failed"] > 0 or summary["compiled"] == 0
    if as_json:
        click.echo(json.dumps({"arch": arch, **summary, "ok": not failed, "variants": rows}, indent=1))
    else:
        click.echo(f"{'variant':<100} {'kernel':<24} {'regs':>4} {'stack':>5} {'spill':>5}  result")
        for r in rows:
            if r["verdict"] == "refused":
                click.echo(f"refused on sm_{arch} (not compiled): {r['error']}")
                continue
            label = f"{r['label']} ({r['source']})"
            if "functions" not in r:
                click.echo(f"{label:<100} FAILED {r['error'].splitlines()[0]}")
                continue
            for f in r["functions"]:
                spill = f["spill_stores"] + f["spill_loads"]
                clean = not spill and not f["stack_frame"]
                verdict = "ok" if clean else "FAIL (tuned entry spills)" if measured(r["source"]) else "spills"
                click.echo(f"{label:<100} {f['name']:<24} {f['registers']:>4} {f['stack_frame']:>5} {spill:>5}  "
                           f"{verdict}")
        click.echo(f"sm_{arch}: {summary['compiled']} compiled ({summary['spilled']} with spills), "
                   f"{summary['refused']} refused (not compiled), {summary['failed']} failed"
                   + ("; nothing compiled" if not summary["compiled"] else ""))
    return EXIT_FAIL if failed else 0


@main.command()
@click.option("--json", "as_json", is_flag=True)
def info(as_json):
    """Versions, GPU, NVRTC and architecture."""
    import platform

    from . import __version__
    from .source import kernel_dir

    out = {"cunorm": __version__, "python": platform.python_version(), "numpy": np.__version__,
           "kernels": str(kernel_dir())}
    cupy = None
    try:
        import cupy

        out["cupy"] = cupy.__version__
        from cupy_backends.cuda.libs import nvrtc

        out["nvrtc"] = ".".join(map(str, nvrtc.getVersion()))
    except Exception as e:  # report, don't fail: info is for bug reports
        out.setdefault("cupy", None)
        out["nvrtc"] = f"unavailable ({type(e).__name__}: {e})"
    out["gpus"] = []
    for i in range(gpu_count()):
        d = cupy.cuda.Device(i)
        props = cupy.cuda.runtime.getDeviceProperties(i)
        out["gpus"].append({"id": i, "name": props["name"].decode(), "arch": f"sm_{d.compute_capability}",
                            "sms": d.attributes["MultiProcessorCount"],
                            "memory_gib": round(props["totalGlobalMem"] / 2**30, 1)})
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return
    for k, v in out.items():
        if k != "gpus":
            click.echo(f"{k:<8} {v}")
    if not out["gpus"]:
        click.echo("gpu      none found")
    for g in out["gpus"]:
        click.echo(f"gpu {g['id']:<4} {g['name']} ({g['arch']}, {g['sms']} SMs, {g['memory_gib']} GiB)")


@main.command(name="list")
@click.option("--arch", default="sm_90", show_default=True, help="Architecture the dispatch is for.")
@click.option("--json", "as_json", is_flag=True)
def list_(arch, as_json):
    """The dispatch table: traits per hidden size, dtype and direction."""
    arch = _arch(arch)
    from .traits import MIN_ARCH

    if arch < MIN_ARCH:
        message = f"sm_{arch}: no kernel of this table runs there (the normalization kernels need sm_{MIN_ARCH} or newer)"
        click.echo(json.dumps({"arch": arch, "error": message, "rows": []}) if as_json else message)
        sys.exit(EXIT_FAIL)
    gpu = _gpu_of_arch(arch)
    from .tables import tables_for

    tables = [t.origin for t in tables_for(gpu)]
    rows = []
    for n in dispatch.TUNED_SIZES:
        for dt in dtypes.NAMES:
            for backward in (False, True):
                row = {"hidden_size": n, "dtype": dt, "op": "bwd" if backward else "fwd"}
                try:
                    t, source = dispatch.choose(hidden_size=n, input_dtype=dt, weight_dtype=dt, output_dtype=dt,
                                                backward=backward, arch=arch, gpu=gpu)
                except ValueError as e:
                    rows.append({**row, "source": "unsupported", "error": str(e)})
                    continue
                rows.append({**row, "source": source, **t.knobs(), "ldgs": t.ldgs,
                             "threads_per_cta": t.threads_per_cta})
    if as_json:
        click.echo(json.dumps({"arch": arch, "gpu": None if gpu is None else gpu.as_dict(), "tables": tables,
                               "rows": rows}, indent=1))
        return
    click.echo(f"# sm_{arch}" + ("" if gpu is None else f", {gpu.name}") + ": "
               + ("; ".join(tables) + ", then " if tables else "") + "the sm_90 literal (tuned.py), the heuristic")
    click.echo(f"{'N':>6} {'dtype':<9} {'op':<3} {'WARPS_M':>7} {'WARPS_N':>7} {'CTAS/ROW':>8} {'B/LDG':>5} "
               f"{'LDGS':>4} {'threads':>7}  source")
    for r in rows:
        if r["source"] == "unsupported":
            click.echo(f"{r['hidden_size']:>6} {r['dtype']:<9} {r['op']:<3} unsupported: {r['error']}")
            continue
        click.echo(f"{r['hidden_size']:>6} {r['dtype']:<9} {r['op']:<3} {r['warps_m']:>7} {r['warps_n']:>7} "
                   f"{r['ctas_per_row']:>8} {r['bytes_per_ldg']:>5} {r['ldgs']:>4} {r['threads_per_cta']:>7}  "
                   f"{r['source']}")


def _hidden_sizes(ctx, param, value):
    sizes = _csv(int)(ctx, param, value)
    if sizes and min(sizes) < 1:
        raise click.BadParameter(f"hidden sizes must be >= 1, got {min(sizes)}")
    return sizes


def _dtype(ctx, param, value):
    try:
        return None if value is None else _dtype_list(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


_BOOL_WORDS = {"1": True, "true": True, "0": False, "false": False}


def _traits_variants(ctx, param, values) -> dict:
    """--traits "warps_n=4,stages=3" (repeatable) as {label: knobs}, the label
    being the knobs spelled one way (booleans as 0/1), so that a repeat is one
    variant."""
    from .traits import KNOB_DEFAULTS

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


def _plot(results: dict, path: str):
    from .plot import plot_bandwidth

    try:
        plot_bandwidth(results, path)
    except (ImportError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"plot written to {path}", err=True)


@main.command()
@click.option("--sizes", default=",".join(map(str, BENCH_SIZES)), show_default=True, callback=_hidden_sizes,
              help="Hidden sizes, comma-separated ('' for none).")
@click.option("--head-dims", default=",".join(map(str, DELTA_HEAD_DIMS)), show_default=True, callback=_csv(int),
              help="attention_delta head dims, comma-separated ('' for none).")
@click.option("--dtype", default="bfloat16", show_default=True, callback=_dtype, help="Activations' dtype.")
@click.option("--weight-dtype", default=None, callback=_dtype, help="Weights' dtype (default: the activations').")
@click.option("--repeat", type=click.IntRange(min=1), default=20, show_default=True, help="Timed batches per case.")
@click.option("--no-extras", is_flag=True, help="Skip the strided-row and odd-size comparisons.")
@click.option("--host", is_flag=True, help="Per-call host time of every op (CuPy arrays, torch tensors, torch's own "
              "op) at the host shapes, instead of bandwidth.")
@click.option("--graph", is_flag=True, help="Bandwidth through the API beside CUDA-graph replay (torch tensors), "
              "instead of the bandwidth table.")
@click.option("--source", "source_file", type=click.Path(exists=True, dir_okay=False),
              help="An edited copy of kernels/norm_fwd.cu or norm_bwd.cu: a variant (\"edited\") timed beside the "
                   "shipped kernels (\"tuned\") at --sizes, for the direction it serves.")
@click.option("--traits", "traits", multiple=True, callback=_traits_variants, metavar="KNOB=V,...",
              help="Forced kernel traits, e.g. \"warps_n=4,stages=3\" (repeatable; knobs as in cunorm.Traits): a "
                   "variant timed beside the shipped dispatch (\"tuned\") at --sizes; skipped where illegal.")
@click.option("--rounds", type=click.IntRange(min=1), default=5, show_default=True,
              help="Interleaved rounds per case (with --source or --traits).")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False),
              help="Also draw fraction of copy against N to this .png or .svg file (needs cunorm[plot]).")
@click.option("--from-json", "from_json", type=click.Path(exists=True, dir_okay=False),
              help="Plot a saved run (what --output or --json wrote) to --plot instead of measuring; no GPU needed.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON (the table goes to stderr).")
@click.option("--output", type=click.Path(dir_okay=False), help="Also write the results as JSON to this file.")
@click.pass_context
def bench(ctx, sizes, head_dims, dtype, weight_dtype, repeat, no_extras, host, graph, source_file, traits, rounds,
          plot_file, from_json, as_json, output):
    """Bandwidth (fraction of a same-run copy) and per-call time; --source and --traits time kernel variants
    beside the shipped ones (exit 3: no GPU)."""
    from . import bench as b

    if host and graph:
        raise click.UsageError("--host and --graph are separate modes: give one")
    if (source_file or traits) and (host or graph):
        raise click.UsageError("--source and --traits time variants in the bandwidth sweep, not with --host or --graph")
    if plot_file:  # refused before the sweep, not after it
        from .plot import figure_class

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
        _plot(results, plot_file)
        return
    source = directions = None
    if source_file:
        with open(source_file) as f:
            source = f.read()
        directions = b.served_directions(source)
        if not directions:
            raise click.BadParameter(f"{source_file}: defines neither norm_fwd nor norm_bwd", param_hint="--source")
    if gpu_missing(ctx.command_path, as_json, "--from-json FILE --plot FILE plots a saved run without one"):
        sys.exit(EXIT_NO_GPU)
    out = sys.stderr if as_json else sys.stdout
    if source is not None or traits:
        results = b.compare(sizes, b.variants_of(source, traits), dtype, weight_dtype, rounds=rounds,
                            repeat=max(repeat // 2, 5), directions=directions or b.DIRECTIONS, out=out)
    elif host:
        results = b.run_host(dtype=dtype, repeat=max(repeat // 3, 5), out=out)
    elif graph:
        results = b.run_graph(dtype=dtype, out=out)
    else:
        results = b.run(sizes, dtype, weight_dtype, repeat, out=out, head_dims=head_dims, extras=not no_extras)
    if as_json:
        click.echo(json.dumps(results, indent=1))
    if output:
        with open(output, "w") as f:
            json.dump(results, f, indent=1)
    if plot_file:
        _plot(results, plot_file)


def _tune_ops(ctx, param, values) -> tuple:
    """--ops "fwd,bwd" --ops rms (comma-separated, repeatable) as OP names in order, once each; none: all."""
    names = [v.strip() for value in values for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in TUNE_OPS]
    if unknown:
        raise click.BadParameter(f"unknown op {unknown[0]!r}; expected some of {', '.join(TUNE_OPS)}")
    return tuple(dict.fromkeys(names)) or tuple(TUNE_OPS)


@main.command()
@click.option("--sizes", default=",".join(map(str, TUNE_SIZES)), show_default=True, callback=_hidden_sizes,
              help="Hidden sizes to tune, comma-separated. A size that is not whole 16-byte vectors fills the "
                   "entry for the general rows beside its aligned neighbour.")
@click.option("--ops", multiple=True, callback=_tune_ops, metavar="OP[,OP...]",
              help=f"Ops to tune: {', '.join(TUNE_OPS)} (LayerNorm and RMSNorm, forward and backward; "
                   f"comma-separated or repeatable; default all four).")
@click.option("--residual", type=click.Choice(list(TUNE_RESIDUAL)), default="no", show_default=True,
              help="Residual variants (forward with a residual, backward with dresidual): no (without), yes (with), "
                   "both.")
@click.option("--dtypes", "dtype_names", default="bf16", show_default=True, callback=_csv(_dtype_list),
              help="Input dtypes (fp32, fp16, bf16), comma-separated. Entries are keyed by element bytes: of "
                   "fp16 and bf16 the first named is measured, for both.")
@click.option("--budget", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
              help="Stop after this many seconds, keeping the keys finished (run again to go on).")
@click.option("--rounds", type=click.IntRange(min=1), default=TUNE_ROUNDS, show_default=True,
              help="Interleaved timing rounds of each key's finalists; the best median wins.")
@click.option("--output", type=click.Path(dir_okay=False),
              help="The table to write (default: this GPU's user table, in $CUNORM_CACHE_DIR or else "
                   "~/.cache/cunorm, which dispatch reads first).")
@click.option("--fresh", is_flag=True, help="Measure keys already in the table again (its other entries stay).")
@click.option("--warps-n", callback=_csv(int),
              help=f"WARPS_N values to try, comma-separated (default: {','.join(map(str, TUNE_SHAPES['warps_n']))}).")
@click.option("--json", "as_json", is_flag=True, help="Print each key's result as a JSON object on stdout, as it is "
              "saved (the rest goes to stderr).")
@click.pass_context
def tune(ctx, sizes, ops, residual, dtype_names, budget, rounds, output, fresh, warps_n, as_json):
    """Measure candidate traits per hidden size, op and dtype on this GPU and save the fastest that pass the
    float64 check to its tuned table, after every key (a rerun skips the keys done). Exit 1: a key without a
    passing candidate; 3: no GPU."""
    from . import tune as t

    if not sizes:
        raise click.BadParameter("give at least one hidden size", param_hint="--sizes")
    if not dtype_names:
        raise click.BadParameter("give at least one dtype", param_hint="--dtypes")
    if gpu_missing(ctx.command_path, as_json):
        sys.exit(EXIT_NO_GPU)
    summary = t.run(sizes, ops, TUNE_RESIDUAL[residual], dtype_names, output, rounds=rounds, budget=budget,
                    fresh=fresh, warps_n=warps_n, as_json=as_json, out=sys.stderr if as_json else sys.stdout)
    sys.exit(EXIT_FAIL if summary["failed"] else 0)


if __name__ == "__main__":
    main()
